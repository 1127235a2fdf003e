"""Recompute cheap elementwise values in the backward pass instead of keeping them.

Reverse-mode autodiff keeps every forward value a gradient rule reads until the backward pass
reaches it. For an elementwise chain that is most of the chain: GELU exported as
`0.5 * x * (1 + erf(x / sqrt 2))` leaves `x / sqrt 2`, `1 + erf(...)` and the product alive, each
as large as the MLP's hidden layer (in gpt-medium, 128 MiB a layer at batch 8 for each, 9 GiB
over its 24 layers; what recomputing saves: docs/training.md), where PyTorch's GELU keeps `x`
alone. A decomposed layer norm or SiLU does the same.

`recompute_elementwise` rewrites the training step: a kept value whose producer is an elementwise
op, and whose inputs are constants, graph inputs, values kept anyway, or values this pass
recomputes in turn (a cone of at most `MAX_CONE` nodes), is recomputed from those inputs right
before each backward node that reads it. The forward value is then freed after its last forward
reader. The recomputed nodes belong to their reader (`parc.forward` is the reader's: a pipeline
stage or a mesh's coarsening puts them where the reader runs, so a value recomputed across a
stage boundary is recomputed in the later stage from inputs sent forward). They are elementwise
trees, which the array engine fuses into the backward's own kernels (`parc.exec.engines.fusion`):
on a GPU they cost reading the kept input, usually less than reading the kept values they replace.
A parameter is never a leaf: a reader in another pipeline stage would need its own copy of it.
The values are the same to the bit: the same ops on the same inputs.
"""

from __future__ import annotations

from parc.ir.graph import Graph, Node, Value
from parc.ir.state import FORWARD_OF, PHASE
from parc.ops.fusion import OPS

RECOMPUTED_OPS = frozenset(OPS) | {"Cast"}  # the elementwise ops the array engine fuses, and Cast
MAX_CONE = 8  # nodes recomputed for one kept value, at most


def recompute_elementwise(graph: Graph) -> int:
    """Recompute the cheap elementwise values the backward pass reads (see the module
    docstring); nodes must carry `parc.phase`. Returns how many kept values were replaced."""
    forward = {id(n) for n in graph.nodes if n.meta.get(PHASE) == "forward"}

    def backward_readers(v: Value) -> list[Node]:
        readers = {id(n): n for n, _ in v.uses if n.meta.get(PHASE) == "backward"}
        return list(readers.values())

    def from_forward(v: Value | None) -> bool:
        return v is not None and v.producer is not None and id(v.producer) in forward

    outputs = {id(v) for v in graph.outputs}
    kept = [v for n in graph.nodes if id(n) in forward for v in n.outputs if backward_readers(v)]
    kept_ids = {id(v) for v in kept}
    recomputed: set[int] = set()

    def cone(v: Value, room: int = MAX_CONE) -> list[Node] | None:
        """The nodes that recompute v from values kept anyway (in order), at most `room` of
        them, or None (the search stops as soon as the cone would be larger: an elementwise chain
        thousands of nodes long is not walked)."""
        n = v.producer
        if (room < 1 or n is None or n.op_type not in RECOMPUTED_OPS or n.domain not in ("", "ai.onnx")
                or len(n.outputs) != 1 or id(v) in outputs):
            return None
        nodes: list[Node] = []
        for u in dict.fromkeys(u for u in n.inputs if u is not None):
            if u.is_param:
                return None  # a parameter lives with its stage: a reader in another would need it sent
            if not from_forward(u) or (id(u) in kept_ids and id(u) not in recomputed):
                continue  # a constant, a graph input, or a value the backward pass keeps anyway
            sub = cone(u, room - 1 - len(nodes))
            if sub is None:
                return None
            nodes.extend(m for m in sub if all(m is not k for k in nodes))
        nodes.append(n)
        return nodes if len(nodes) <= room else None

    before: dict[int, list[Node]] = {}  # backward node -> the recomputing nodes to run first
    for v in kept:  # in forward order: a value's inputs are decided before it
        nodes = cone(v)
        if nodes is None:
            continue
        recomputed.add(id(v))
        for reader in backward_readers(v):
            copies: dict[int, Value] = {}
            for n in nodes:
                ins = [copies.get(id(u), u) if u is not None else None for u in n.inputs]
                out = n.outputs[0]
                name = graph.names.fresh(f"{out.name}.recomputed")
                copy = Node(n.op_type, ins, [Value(name, out.dtype, out.shape)], n.attrs,
                            graph.names.fresh(f"{n.name}.recompute"), n.domain,
                            {PHASE: "backward", FORWARD_OF: reader.meta.get(FORWARD_OF, n.name)})
                copies[id(out)] = copy.outputs[0]
                before.setdefault(id(reader), []).append(copy)
            for i, u in enumerate(reader.inputs):
                if u is v:
                    reader.set_input(i, copies[id(v)])
    if before:
        graph.nodes = [m for n in graph.nodes for m in (*before.get(id(n), ()), n)]
    return len(recomputed)
