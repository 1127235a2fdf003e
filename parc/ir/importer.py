"""ONNX -> IR: read a model, upgrade its opset, inline functions, bind symbolic dims, build the graph.

Static shapes and constant shape computation come from the `fold_shapes` pass (`parc.ir.shapes`), which `load`
runs: after `load`, every value has a static shape and dtype and no value depends on `Shape`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import google.protobuf.message
import numpy as np
import onnx
from onnx import defs, numpy_helper

from parc.errors import OnnxImportError, UnboundDimError, UnsupportedOpError, UsageError
from parc.ir.dtypes import DType
from parc.ir.graph import Graph, Node, Value
from parc.ir.params import mark_params
from parc.ir.shapes import fold_shapes
from parc.ir.tensor import TensorData

MIN_OPSET = 13


def read_model(path: str | Path) -> onnx.ModelProto:
    """Parse an ONNX file without loading external weights; one-line errors for bad files."""
    path = Path(path)
    if not path.exists():
        raise OnnxImportError(f"{path}: no such file")
    if not path.is_file():
        raise OnnxImportError(f"{path}: not a file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (google.protobuf.message.DecodeError, RuntimeWarning, ValueError, UnicodeDecodeError) as e:
        raise OnnxImportError(f"{path}: not a readable ONNX model (truncated or not ONNX: "
                              f"{type(e).__name__})") from None
    except OSError as e:
        raise OnnxImportError(f"{path}: cannot read: {e.strerror or e}") from None
    if model.ir_version <= 0 or not model.HasField("graph") or not model.opset_import:
        raise OnnxImportError(f"{path}: not an ONNX model (no graph, IR version or opset)")
    _check_text(model.graph, path)
    return model


def _check_text(graph: onnx.GraphProto, path: Path, where: str = "") -> None:
    """Every name and op type of the graph (subgraphs too) is text. ONNX's strings must be UTF-8,
    but protobuf hands invalid ones over as bytes (a damaged file), which would surface later as
    a name nothing defines or an internal error."""
    def bad(what: str, s) -> OnnxImportError:
        shown = s.decode("utf-8", "replace")
        return OnnxImportError(f"{path}: {where}{what} {shown!r} is not valid UTF-8 text (the file is damaged)")

    for kind, items in (("initializer", graph.initializer), ("input", graph.input), ("output", graph.output),
                        ("value_info", graph.value_info)):
        for x in items:
            if not isinstance(x.name, str):
                raise bad(kind, x.name)
    for k, n in enumerate(graph.node):
        label = n.name if isinstance(n.name, str) and n.name else f"#{k}"
        if not isinstance(n.name, str):
            raise bad(f"node #{k}: name", n.name)
        for what, s in (("op_type", n.op_type), ("domain", n.domain), *(("input", s) for s in n.input),
                        *(("output", s) for s in n.output), *(("attribute", a.name) for a in n.attribute)):
            if not isinstance(s, str):
                raise bad(f"node '{label}': {what}", s)
        for a in n.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _check_text(g, path, f"{where}node '{label}', attribute '{a.name}': ")


def metadata(props: Iterable[onnx.StringStringEntryProto]) -> dict[str, str]:
    """Metadata entries as a dict of text. An entry that is not valid UTF-8 (protobuf hands it
    over as bytes; one flipped byte in an export) is kept byte for byte as surrogate escapes,
    which the exporter writes back unchanged: parc does not read other tools' metadata."""
    def text(s: str | bytes) -> str:
        return s if isinstance(s, str) else s.decode("utf-8", "surrogateescape")
    return {text(p.key): text(p.value) for p in props}


def normalize(model: onnx.ModelProto, source: str = "model") -> onnx.ModelProto:
    """Upgrade opsets below 13 and inline local functions."""
    version = opset_version(model)
    newest = defs.onnx_opset_version()
    if version > newest:
        raise OnnxImportError(f"{source}: opset {version} is newer than the installed onnx "
                              f"knows ({newest}); upgrade the onnx package")
    if version < MIN_OPSET:
        from onnx import version_converter
        try:
            model = _with_initializers_as_inputs(model, lambda m: version_converter.convert_version(m, MIN_OPSET))
        except Exception as e:
            raise OnnxImportError(f"{source}: cannot upgrade opset {version} to {MIN_OPSET}: "
                                  f"{str(e).splitlines()[0]}") from None
    if len(model.functions):
        import onnx.inliner
        model = onnx.inliner.inline_local_functions(model)
    return model


def _with_initializers_as_inputs(model: onnx.ModelProto, fn) -> onnx.ModelProto:
    """Run `fn` with initializers also listed as graph inputs (the version converter needs it)."""
    listed = {i.name for i in model.graph.input}
    extra = [t for t in model.graph.initializer if t.name not in listed]
    if not extra:
        return fn(model)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in extra)
    out = fn(m)
    drop = {t.name for t in extra}
    keep = [i for i in out.graph.input if i.name not in drop]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    return out


def opset_version(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    return MIN_OPSET


def symbolic_dims(model: onnx.ModelProto) -> list[str]:
    """Names of the symbolic dims of the graph's data inputs, in order of appearance."""
    init = {t.name for t in model.graph.initializer}
    names: list[str] = []
    for inp in model.graph.input:
        if inp.name in init:
            continue
        for i, d in enumerate(inp.type.tensor_type.shape.dim):
            name = d.dim_param if d.HasField("dim_param") else (
                "" if d.HasField("dim_value") else f"{inp.name}[{i}]")
            if name and name not in names:
                names.append(name)
    return names


@dataclass
class ImportOptions:
    dims: dict[str, int]
    base_dir: Path | None = None
    source: str = "model"


def parse_dims(items: tuple[str, ...] | list[str]) -> dict[str, int]:
    """`NAME=VALUE` strings (from --dim) to a dict; a bad item raises UsageError."""
    dims: dict[str, int] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value.strip().isdigit() or int(value) <= 0:
            raise UsageError(f"--dim {item!r}: expected NAME=VALUE with a positive integer VALUE")
        dims[name.strip()] = int(value)
    return dims


def build_graph(model: onnx.ModelProto, opts: ImportOptions) -> Graph:
    """Translate the (normalized) ModelProto into IR with bound input shapes.

    Node output shapes are left for `fold_shapes` to infer.
    """
    g = model.graph
    # a damaged name (not UTF-8) shown with U+FFFD: it is a label, and rank files' names derive from it
    name = g.name if isinstance(g.name, str) else g.name.decode("utf-8", "replace")
    graph = Graph(name or "main", {o.domain or "": o.version for o in model.opset_import})
    graph.metadata = metadata(model.metadata_props)
    src = opts.source

    wanted = symbolic_dims(model)
    unknown = sorted(set(opts.dims) - set(wanted))
    if unknown:
        known = ", ".join(wanted) or "none"
        raise UsageError(f"--dim {unknown[0]}: {src} has no symbolic dim of that name "
                         f"(its symbolic dims: {known})")
    unbound = [d for d in wanted if d not in opts.dims]
    if unbound:
        raise UnboundDimError(unbound, f"{src}: symbolic dims {', '.join(unbound)} are unbound; "
                              f"give each with --dim NAME=VALUE")

    scope: dict[str, Value] = {}
    kinds = _torch_input_kinds(g)
    for t in g.initializer:
        data = TensorData.from_proto(t, opts.base_dir)
        is_param = data.dtype.is_float and len(data.shape) >= 1 and kinds.get(t.name, "PARAMETER") == "PARAMETER"
        scope[t.name] = graph.add_constant(data, t.name, is_param=is_param)
    for inp in g.input:
        if inp.name in scope:  # an initializer listed as an input: a constant fed anew each run
            if scope[inp.name].is_const:
                graph.input_constants.append(scope[inp.name])
            continue
        tt = inp.type.tensor_type
        if not inp.type.HasField("tensor_type"):
            raise OnnxImportError(f"{src}: input '{inp.name}' is not a tensor (sequences, maps and "
                                  f"optionals are not supported)")
        shape = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value"):
                shape.append(int(d.dim_value))
            else:
                shape.append(opts.dims[d.dim_param if d.HasField("dim_param") else f"{inp.name}[{i}]"])
        scope[inp.name] = graph.add_input(inp.name, DType(tt.elem_type), tuple(shape))

    declared = {vi.name: vi for vi in (*g.value_info, *g.output)}
    for proto in g.node:
        if proto.op_type == "Constant" and proto.domain in ("", "ai.onnx"):
            scope[proto.output[0]] = graph.add_constant(_constant_data(proto, src), proto.output[0])
            continue
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in proto.attribute):
            raise UnsupportedOpError(f"{src}: node '{proto.name or proto.op_type}' ({proto.op_type}) "
                                     f"has a subgraph; control flow is not supported (export "
                                     f"with static shapes so the exporter unrolls it)")
        node = Node(proto.op_type, [], [], {a.name: a for a in proto.attribute},
                    proto.name, proto.domain, metadata(proto.metadata_props))
        names = list(proto.output)
        while names and not names[-1]:
            names.pop()  # trailing omitted optional outputs
        for name in names:
            v = Value(name)  # "" marks an omitted optional output
            graph.names.claim(v.name)
            if name in declared:
                v.dtype, v.shape = _declared_type(declared[name])
            v.producer, v.index = node, len(node.outputs)
            node.outputs.append(v)
            if name:
                if name in scope:
                    raise OnnxImportError(f"{src}: value '{name}' is defined twice (node "
                                          f"'{proto.name or proto.op_type}')")
                scope[name] = v
        graph.nodes.append(node)
        if proto.name:
            graph.names.claim(proto.name)

    # Wire inputs after all outputs exist, so unsorted graphs import and cycles are caught.
    for node, proto in zip(graph.nodes, [p for p in g.node if not _is_constant(p)]):
        for name in proto.input:
            if not name:
                node.inputs.append(None)
                continue
            if name not in scope:
                raise OnnxImportError(f"{src}: node '{proto.name or proto.op_type}' ({proto.op_type}) "
                                      f"reads '{name}', which no node, graph input or initializer "
                                      f"defines")
            v = scope[name]
            v.uses.append((node, len(node.inputs)))
            node.inputs.append(v)
    for out in g.output:
        if out.name not in scope:
            raise OnnxImportError(f"{src}: graph output '{out.name}' is not defined")
        graph.outputs.append(scope[out.name])
    for n in graph.nodes:
        if not n.name:
            n.name = graph.names.fresh(n.op_type)
    graph.toposort()
    return graph


TORCH_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"


def _torch_input_kinds(g: onnx.GraphProto) -> dict[str, str]:
    """torch.export's kind of each initializer (PARAMETER, BUFFER, CONSTANT_TENSOR), which the
    dynamo exporter writes into value_info metadata. Buffers (rotary frequencies, BatchNorm
    statistics) are read like weights but are not trained, so they are not parameters."""
    return {vi.name: p.value for vi in g.value_info for p in vi.metadata_props if p.key == TORCH_INPUT_KIND}


def _is_constant(proto: onnx.NodeProto) -> bool:
    return proto.op_type == "Constant" and proto.domain in ("", "ai.onnx")


def _declared_type(vi: onnx.ValueInfoProto) -> tuple[DType | None, tuple[int, ...] | None]:
    tt = vi.type.tensor_type
    dtype = DType(tt.elem_type) if tt.elem_type else None
    if not tt.HasField("shape") or any(not d.HasField("dim_value") for d in tt.shape.dim):
        return dtype, None
    return dtype, tuple(int(d.dim_value) for d in tt.shape.dim)


def _constant_data(proto: onnx.NodeProto, src: str) -> TensorData:
    attr = proto.attribute[0] if proto.attribute else None
    if attr is None:
        raise OnnxImportError(f"{src}: Constant node '{proto.name}' has no value")
    if attr.name == "value":
        return TensorData.from_array(numpy_helper.to_array(attr.t))
    value = onnx.helper.get_attribute_value(attr)
    kinds = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64,
             "value_ints": np.int64}
    if attr.name in kinds:
        return TensorData.from_array(np.array(value, dtype=kinds[attr.name]))
    raise OnnxImportError(f"{src}: Constant node '{proto.name}': attribute {attr.name} is not "
                          f"supported")


def load(path: str | Path, dims: dict[str, int] | None = None, *, fold: bool = True) -> Graph:
    """Import an ONNX file into IR with static shapes and folded shape computation."""
    path = Path(path)
    model = normalize(read_model(path), str(path))
    graph = build_graph(model, ImportOptions(dims or {}, path.parent, str(path)))
    mark_params(graph)
    if fold:
        fold_shapes(graph)
    return graph


def from_model(model: onnx.ModelProto, dims: dict[str, int] | None = None, *,
               base_dir: Path | None = None, fold: bool = True, source: str = "model") -> Graph:
    """Import an in-memory ModelProto (see `load`)."""
    model = normalize(model, source)
    graph = build_graph(model, ImportOptions(dims or {}, base_dir, source))
    mark_params(graph)
    if fold:
        fold_shapes(graph)
    return graph
