"""A deterministic text form of the IR, for humans, golden tests and --dump-after."""

from __future__ import annotations

from parc.ir.graph import Graph, Value


def _type(v: Value) -> str:
    shape = "x".join(map(str, v.shape)) if v.shape is not None else "?"
    return f"{v.dtype or '?'}[{shape}]"


def _attr(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return "[" + ",".join(_attr(x) for x in value) + "]"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"tensor<{value.dtype}{list(value.shape)}>"  # type: ignore[attr-defined]
    return repr(value) if isinstance(value, str) else str(value)


def print_graph(graph: Graph, *, max_constants: int = 20) -> str:
    """The graph as text: inputs, constants (parameters marked), nodes in order, outputs."""
    opsets = ", ".join(f"{d or 'ai.onnx'}:{v}" for d, v in sorted(graph.opset.items()))
    lines = [f"graph {graph.name} (opset {opsets})"]
    for v in graph.inputs:
        lines.append(f"  input  %{v.name}: {_type(v)}")
    consts = list(graph.constants.values())
    for v in consts[:max_constants]:
        kind = "param" if v.is_param else "const"
        extra = ""
        if not v.is_param and v.const is not None and v.const.size <= 8 and not v.const.is_external:
            extra = " = " + str(v.const.numpy().tolist())
        lines.append(f"  {kind}  %{v.name}: {_type(v)}{extra}")
    if len(consts) > max_constants:
        lines.append(f"  ... {len(consts) - max_constants} more constants")
    for n in graph.nodes:
        outs = ", ".join(f"%{v.name}: {_type(v)}" for v in n.outputs)
        ins = ", ".join(f"%{v.name}" if v is not None else "_" for v in n.inputs)
        attrs = ", ".join(f"{k}={_attr(n.attr(k))}" for k in sorted(n.attrs))
        op = f"{n.domain}.{n.op_type}" if n.domain else n.op_type
        lines.append(f"  {outs} = {op}({ins}){' {' + attrs + '}' if attrs else ''}  # {n.name}")
    lines.append("  return " + ", ".join(f"%{v.name}" for v in graph.outputs))
    return "\n".join(lines) + "\n"
