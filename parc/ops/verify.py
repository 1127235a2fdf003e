"""Valid IR with op rules: the IR verifier's checks, then each node's sharding rule against its
shapes (a rule's label sizes must agree wherever the label appears)."""

from __future__ import annotations

from parc.errors import ParcError, VerifyError
from parc.ir.graph import Graph
from parc.ir.verifier import verify as verify_ir
from parc.ops.base import sharding_rule


def verify(graph: Graph, *, types: bool = True) -> None:
    """Raise VerifyError on the first broken invariant of the IR (`parc.ir.verify`) or, with
    `types`, of a node's sharding rule."""
    verify_ir(graph, types=types)
    if not types:
        return
    for node in graph.nodes:
        try:
            rule = sharding_rule(node)
        except ParcError as e:
            raise VerifyError(str(e)) from None
        if rule is not None:
            rule.check(node)
