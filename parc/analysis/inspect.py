"""`parc inspect`: what a model is made of and what it costs, as a stable JSON-able report."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from parc.errors import UnboundDimError
from parc.ir import importer
from parc.ir.graph import Graph, Value
from parc.ir.liveness import graph_peak
from parc.ir.params import mark_params
from parc.ir.shapes import shape_dependent_values
from parc.ir.state import FORWARD, PHASE, phase, step_state
from parc.ops import get_rule
from parc.ops.base import output_elements

# Keys scripts rely on; keep them stable (docs/inspect.md).
STABLE_KEYS = ("parameters", "parameter_bytes", "flops_forward", "flops_step",
               "activation_bytes_peak", "ops", "replicate_only_ops", "unbound_dims",
               "shape_dependent_values")


def parameter_values(graph: Graph) -> list[Value]:
    """Parameters: those a training graph's parc.state names, else float initializers."""
    state = step_state(graph.metadata)
    if state is not None:
        names = set(state.params)
        return [v for v in graph.values() if v.name in names]
    return graph.params()


def node_flops(graph: Graph) -> tuple[int, int | None]:
    """(forward FLOPs, whole-step FLOPs or None when the graph has no phases)."""
    forward = total = 0
    phased = any(PHASE in n.meta for n in graph.nodes)
    for n in graph.nodes:
        rule = get_rule(n)
        f = rule.flops(n) if rule is not None else output_elements(n)
        total += f
        if phase(n) == FORWARD:
            forward += f
    return forward, (total if phased else None)


def activation_peak(graph: Graph) -> int:
    """Peak bytes of live non-constant values when nodes run in graph order.

    `parc.ir.liveness.graph_peak` with inspect's rules: the graph's inputs count (from the
    first node), a node output nothing reads does not, and every graph output stays to the end,
    a training step's new parameters and state included."""
    return graph_peak(graph, inputs=True, unread_outputs=False, bound_in_place=False).nbytes


def inspect_graph(graph: Graph) -> dict[str, Any]:
    """The report for an imported graph."""
    params = parameter_values(graph)
    fwd, step = node_flops(graph)
    ops = Counter(n.op_type if not n.domain else f"{n.domain}.{n.op_type}" for n in graph.nodes)
    no_rule = sorted({n.op_type for n in graph.nodes if get_rule(n) is None})
    phases = Counter(phase(n) for n in graph.nodes if PHASE in n.meta)
    names = {v.name for v in params}
    state = [v for v in graph.input_constants if v.name not in names]
    record = step_state(graph.metadata)
    training = record is not None
    return {
        "model": graph.name,
        "opset": graph.opset.get("", graph.opset.get("ai.onnx")),
        "nodes": len(graph.nodes),
        "inputs": [{"name": v.name, "dtype": str(v.dtype), "shape": list(v.shape or ())} for v in graph.inputs],
        "outputs": [{"name": v.name, "dtype": str(v.dtype), "shape": list(v.shape or ())} for v in graph.outputs],
        "training": training,
        "phases": dict(sorted(phases.items())),
        "parameters": sum(v.size for v in params),
        "parameter_bytes": sum(v.nbytes for v in params),
        "parameter_tensors": len(params),
        "gradient_bytes": sum(v.nbytes for v in params) if training else None,
        "optimizer_state_bytes": sum(v.nbytes for v in state) if training else None,
        "optimizer": record.optimizer if record is not None else None,
        "flops_forward": fwd,
        "flops_step": step,
        "activation_bytes_peak": activation_peak(graph),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "replicate_only_ops": no_rule,
        "unbound_dims": [],
        "shape_dependent_values": shape_dependent_values(graph),
    }


def inspect_file(path: str | Path, dims: dict[str, int] | None = None) -> dict[str, Any]:
    """Import and report; with unbound symbolic dims, report what needs no shapes and list them."""
    path = Path(path)
    try:
        graph = importer.load(path, dims)
    except UnboundDimError as e:
        return _unbound_report(path, e.dims)
    report = inspect_graph(graph)
    report["model"] = str(path)
    return report


def _unbound_report(path: Path, unbound: list[str]) -> dict[str, Any]:
    """A partial report of a model whose dims are unbound: structure, parameters and ops.

    The graph is built with every symbolic dim set to a placeholder 1 and not folded; only
    what does not depend on shapes is reported.
    """
    model = importer.normalize(importer.read_model(path), str(path))
    placeholders = {d: 1 for d in importer.symbolic_dims(model)}
    graph = importer.build_graph(model, importer.ImportOptions(placeholders, path.parent, str(path)))
    mark_params(graph)
    params = parameter_values(graph)
    ops = Counter(n.op_type if not n.domain else f"{n.domain}.{n.op_type}" for n in graph.nodes)
    declared = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
                for vi in (*model.graph.input, *model.graph.output)
                if vi.type.tensor_type.HasField("shape")}
    return {
        "model": str(path), "opset": importer.opset_version(model), "nodes": len(graph.nodes),
        "inputs": [{"name": v.name, "dtype": str(v.dtype), "shape": declared.get(v.name)}
                   for v in graph.inputs],
        "outputs": [{"name": v.name, "dtype": str(v.dtype), "shape": declared.get(v.name)}
                    for v in graph.outputs],
        "training": False, "phases": {},
        "parameters": sum(v.size for v in params),
        "parameter_bytes": sum(v.nbytes for v in params),
        "parameter_tensors": len(params),
        "flops_forward": None, "flops_step": None, "activation_bytes_peak": None,
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "replicate_only_ops": sorted({n.op_type for n in graph.nodes if get_rule(n) is None}),
        "unbound_dims": unbound,
        "shape_dependent_values": shape_dependent_values(graph),
    }
