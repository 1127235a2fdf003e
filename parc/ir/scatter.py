"""Reducing ScatterNDs rewritten as the ScatterElements they equal, on ONNX protos.

onnxruntime's CPU ScatterND with a reduction adds duplicate indices from several threads without
atomics (onnxruntime issues #18048, #23396), so a model holding one (an embedding's gradient) can
come out wrong on more than one intra-op thread; its ScatterElements is exact on any thread count.
`parc plan` writes every rank's modules rewritten (`parc.passes.emit`), so a plan directory runs
correctly on plain onnxruntime; a model parc did not emit (`parc verify`'s source, `parc
profile`'s benchmarks) is rewritten before its session is made. A node this cannot rewrite is left
as it is, and `racy_scatter` still finds it: its model must run on one intra-op thread.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx
from onnx import helper


def _reducing_scatter(node: onnx.NodeProto) -> bool:
    return node.op_type == "ScatterND" and node.domain in ("", "ai.onnx") and \
        next((a.s for a in node.attribute if a.name == "reduction"), b"none") != b"none"


def racy_scatter(graph: onnx.GraphProto) -> bool:
    """Whether a graph (or a subgraph of it) holds a ScatterND with a reduction: onnxruntime's CPU
    kernel races on duplicate indices when it runs on more than one thread."""
    for node in graph.node:
        if _reducing_scatter(node):
            return True
        for a in node.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            if any(racy_scatter(g) for g in subs):
                return True
    return False


def scatter_as_elements(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with its top-level reducing ScatterNDs that index one leading dim (indices
    [..., 1]: an embedding's gradient) as ScatterElements along dim 0 of the flattened tensors:

        data [V, T...] -> [V, prod T]; indices [L..., 1] -> [prod L, 1], expanded to the updates'
        [prod L, prod T]; the result reshaped to data's shape.

    The same sum (the same reduction of the same elements). `model` is never changed: the result
    is a copy, or `model` itself where it holds no reducing ScatterND. The expanded indices are
    int64 at the updates' size, twice a float32 update's bytes while the node runs (an embedding
    gradient of 8192 x 1024: 64 MiB), which the predicted peak does not count. Nodes whose index
    depth (`_index_depth`) is not a known 1 are left as they are (`racy_scatter` still finds them)."""
    if not any(_reducing_scatter(n) for n in model.graph.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    try:  # the indices' shapes (a module lists only its inputs' and outputs')
        graph = onnx.shape_inference.infer_shapes(out).graph
    except Exception:  # noqa: BLE001 (a model onnx cannot infer: the nodes stay, on one thread)
        pass
    known = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
             for v in (*graph.value_info, *graph.input, *graph.output) if v.type.tensor_type.HasField("shape")}
    known.update({t.name: list(t.dims) for t in graph.initializer})  # constant indices (folded position ids)
    nodes = []
    for k, node in enumerate(out.graph.node):
        if not _reducing_scatter(node) or _index_depth(node, known) != 1:
            nodes.append(node)
            continue
        q = len(known[node.input[1]])
        data, ind, upd = node.input[:3]
        reduction = next(a.s for a in node.attribute if a.name == "reduction").decode()
        t = f"{node.name or 'scatter'}.as_elements{k}"
        nodes += [helper.make_node("Flatten", [data], [f"{t}.data"], axis=1),
                  helper.make_node("Flatten", [upd], [f"{t}.upd"], axis=q - 1),
                  helper.make_node("Flatten", [ind], [f"{t}.idx1"], axis=q - 1),
                  helper.make_node("Shape", [f"{t}.upd"], [f"{t}.shape"]),
                  helper.make_node("Expand", [f"{t}.idx1", f"{t}.shape"], [f"{t}.idx"]),
                  helper.make_node("ScatterElements", [f"{t}.data", f"{t}.idx", f"{t}.upd"], [f"{t}.out"],
                                   axis=0, reduction=reduction),
                  helper.make_node("Shape", [data], [f"{t}.data_shape"]),
                  helper.make_node("Reshape", [f"{t}.out", f"{t}.data_shape"], [node.output[0]], name=node.name)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _index_depth(node: onnx.NodeProto, known: Mapping[str, list]) -> int | None:
    """The k of a ScatterND's indices [..., k]: their last dim where it is known, else from the
    ranks (updates = indices[:-1] + data[k:], so k = rank(indices) - 1 + rank(data) -
    rank(updates): a microbatch's slice of the indices has unknown dims but a known rank)."""
    data, idx, upd = (known.get(name) for name in node.input[:3])
    if not idx:
        return None
    if idx[-1] is not None:
        return idx[-1]
    return len(idx) - 1 + len(data) - len(upd) if data is not None and upd is not None else None
