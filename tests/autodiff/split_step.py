"""Split a training step into compute-gradients and apply-gradients programs (a test helper:
the lowering cuts a step by phase itself).

Microbatching runs the first on each microbatch, sums (or averages) the gradients, and runs the
second once. The cut follows each node's `parc.phase`: forward and backward nodes compute the
loss and the gradients; optimizer nodes apply them. The two programs exchange only the
gradients, by the names `parc.state` gives them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from parc.autodiff.context import PHASE
from parc.errors import UsageError, VerifyError
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import STATE_KEY

SPLIT_KEY = "parc.split"  # model metadata of each part: {"part": "compute" | "apply", ...}


def split_step(graph: Graph) -> tuple[Graph, Graph]:
    """The (compute, apply) programs of a training step; the step itself is left as it is.

    compute: inputs = data + trained parameters; outputs = loss + one gradient per parameter.
    apply: inputs = the gradients + parameters + optimizer state (+ step counter); outputs =
    the step's other outputs (new parameters, new state, next step), which `parc.state`'s
    bindings feed back as before. Parameters and state stay initializers listed as inputs.
    """
    if STATE_KEY not in graph.metadata:
        raise UsageError(f"graph '{graph.name}' is not a training step (no {STATE_KEY} metadata)")
    record = json.loads(graph.metadata[STATE_KEY])
    phases = {"forward": [], "backward": [], "optimizer": []}
    for n in graph.nodes:
        phase = n.meta.get(PHASE)
        if phase not in phases:
            raise VerifyError(f"node '{n.label}' has {PHASE} {phase!r}; expected forward, backward or optimizer")
        phases[phase].append(n)
    compute_nodes = phases["forward"] + phases["backward"]
    apply_nodes = phases["optimizer"]
    by_name = {v.name: v for v in graph.values()}
    loss = by_name[record["loss"]]
    grads = [by_name[record["grads"][p]] for p in record["params"]]

    computed = {id(v) for n in compute_nodes for v in n.outputs}
    inside = {id(v) for n in apply_nodes for v in n.outputs} | {id(g) for g in grads}
    for n in apply_nodes:  # the optimizer sees the forward and backward only through gradients
        for v in n.inputs:
            if v is not None and id(v) in computed and id(v) not in inside:
                raise VerifyError(f"optimizer node '{n.label}' reads '{v.name}', which is computed "
                                  f"by the forward or backward pass but is not a gradient")
    for n in compute_nodes:
        for v in n.inputs:
            if v is not None and v.producer is not None and v.producer.meta.get(PHASE) == "optimizer":
                raise VerifyError(f"node '{n.label}' reads '{v.name}' of the optimizer")

    fed = graph.input_constants
    compute = _extract(graph, "compute", compute_nodes, graph.inputs, _read_by(compute_nodes, fed),
                       [loss, *grads])
    apply = _extract(graph, "apply", apply_nodes, grads, _read_by(apply_nodes, fed),
                     [v for v in graph.outputs if v is not loss])
    compute.metadata[SPLIT_KEY] = json.dumps({"part": "compute", "loss": loss.name,
                                              "grads": record["grads"]}, sort_keys=True)
    apply.metadata[SPLIT_KEY] = json.dumps({"part": "apply", "grads": record["grads"],
                                            "bindings": record["bindings"], "step": record["step"]},
                                           sort_keys=True)
    return compute, apply


def _read_by(nodes: list[Node], values: Iterable[Value]) -> list[Value]:
    read = {id(v) for n in nodes for v in n.inputs if v is not None}
    return [v for v in values if id(v) in read]


def _extract(graph: Graph, part: str, nodes: list[Node], inputs: Iterable[Value],
             input_constants: list[Value], outputs: list[Value]) -> Graph:
    """A new graph of copies of `nodes`: `inputs` become plain graph inputs, `input_constants`
    initializers listed as inputs, other constants they read plain initializers. Tensor data is
    shared, not copied (external weights stay where they are)."""
    new = Graph(f"{graph.name}.{part}", graph.opset)
    new.metadata = {k: v for k, v in graph.metadata.items() if k != STATE_KEY}
    copies: dict[int, Value] = {}
    for v in inputs:
        assert v.dtype is not None and v.shape is not None, v.name
        copies[id(v)] = new.add_input(v.name, v.dtype, v.shape)
    for v in input_constants:
        copies[id(v)] = c = new.add_constant(v.const, v.name, is_param=v.is_param)  # type: ignore[arg-type]
        new.input_constants.append(c)

    def copy(v: Value | None) -> Value | None:
        if v is None:
            return None
        if id(v) not in copies:
            if v.const is None:
                raise VerifyError(f"'{v.name}' is read by the {part} part but neither made nor fed there")
            copies[id(v)] = new.add_constant(v.const, v.name, is_param=v.is_param)
        return copies[id(v)]

    for n in nodes:
        outs = [Value(v.name, v.dtype, v.shape) for v in n.outputs]
        for v in outs:
            new.names.claim(v.name)
        new.names.claim(n.name)
        new.nodes.append(Node(n.op_type, [copy(v) for v in n.inputs], outs, n.attrs, n.name, n.domain, n.meta))
        copies.update((id(a), b) for a, b in zip(n.outputs, outs))
    new.outputs = [copy(v) for v in outputs]  # type: ignore[misc]
    return new
