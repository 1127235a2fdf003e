"""IR -> ONNX: a ModelProto that computes what the graph computes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.errors import UsageError
from parc.ir.graph import Graph, Node, Value
from parc.ir.tensor import TensorData

PARC_PRODUCER = "parc"


def value_info(v: Value) -> onnx.ValueInfoProto:
    assert v.dtype is not None, v.name
    return helper.make_tensor_value_info(v.name, v.dtype.onnx_type,
                                         list(v.shape) if v.shape is not None else None)


def node_proto(node: Node) -> onnx.NodeProto:
    proto = helper.make_node(node.op_type, [v.name if v else "" for v in node.inputs],
                             [v.name for v in node.outputs], name=node.name, domain=node.domain)
    proto.attribute.extend(node.attrs[k] for k in sorted(node.attrs))
    proto.metadata_props.extend(metadata_entry(k, node.meta[k]) for k in sorted(node.meta))
    return proto


def metadata_entry(key: str, value: str) -> onnx.StringStringEntryProto:
    """One metadata entry. Text holding surrogate escapes (bytes that were not valid UTF-8 in
    the imported file, see `importer.metadata`) is written back as those bytes, which protobuf's
    setters refuse but its parser keeps."""
    try:
        return onnx.StringStringEntryProto(key=key, value=value)
    except UnicodeEncodeError:
        entry = onnx.StringStringEntryProto()
        entry.ParseFromString(_wire_bytes(1, key) + _wire_bytes(2, value))
        return entry


def _wire_bytes(field: int, text: str) -> bytes:
    """A length-delimited protobuf field holding `text`'s original bytes."""
    data = text.encode("utf-8", "surrogateescape")
    head, n = bytearray([field << 3 | 2]), len(data)
    while n >= 0x80:
        head.append(n & 0x7F | 0x80)
        n >>= 7
    head.append(n)
    return bytes(head) + data


def tensor_proto(v: Value, external: dict[str, tuple[str, int]] | None = None) -> onnx.TensorProto:
    """The constant as a TensorProto; external data is referenced (`external`: name->(file, offset))."""
    data = v.const
    assert data is not None
    if external is not None and v.name in external:
        location, offset = external[v.name]
        t = onnx.TensorProto(name=v.name, data_type=data.dtype.onnx_type, dims=list(data.shape))
        t.data_location = onnx.TensorProto.EXTERNAL
        for key, val in (("location", location), ("offset", str(offset)), ("length", str(data.nbytes))):
            t.external_data.add(key=key, value=val)
        return t
    if data.proto is not None and data.proto.name == v.name and \
            data.proto.data_location != onnx.TensorProto.EXTERNAL:
        return data.proto
    return numpy_helper.from_array(np.asarray(data.numpy()), v.name)


def external_layout(graph: Graph, data_file: str, min_bytes: int) -> dict[str, tuple[str, int]]:
    """Where each constant of at least `min_bytes` lives in `data_file` (64-byte aligned)."""
    layout, offset = {}, 0
    for v in graph.constants.values():
        if v.const is not None and v.const.nbytes >= min_bytes:
            layout[v.name] = (data_file, offset)
            offset += -(-v.const.nbytes // 64) * 64
    return layout


def to_onnx(graph: Graph, *, external: dict[str, tuple[str, int]] | None = None,
            ir_version: int | None = None) -> onnx.ModelProto:
    """Build a ModelProto; constants named in `external` are referenced, not embedded."""
    g = helper.make_graph(
        [node_proto(n) for n in graph.nodes], graph.name,
        [value_info(v) for v in (*graph.inputs, *graph.input_constants)],
        [value_info(v) for v in graph.outputs],
        initializer=[tensor_proto(v, external) for v in graph.constants.values()],
        value_info=[value_info(v) for n in graph.nodes for v in n.outputs
                    if v.name and v.dtype is not None and v not in graph.outputs],
    )
    opsets = [helper.make_opsetid(d, ver) for d, ver in sorted(graph.opset.items())]
    if ir_version is None:  # the lowest IR that carries these opsets (onnxruntime reads older IRs)
        ir_version = max(8, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    model = helper.make_model(g, opset_imports=opsets, producer_name=PARC_PRODUCER,
                              ir_version=ir_version)
    model.metadata_props.extend(metadata_entry(k, graph.metadata[k]) for k in sorted(graph.metadata))
    return model


def check_output_file(path: Path) -> None:
    """An ONNX file (and its `.data` beside it) is written to a temporary file and renamed over
    `path`: a device or pipe there (`-o /dev/null`) would be replaced by a file, a directory
    refused with a traceback. UsageError (one line) when either exists and is not a file."""
    for target in (path, path.parent / (path.name + ".data")):
        if target.exists() and not target.is_file():
            raise UsageError(f"-o {path}: {target} exists and is not a regular file; expected a file path")


def save(graph: Graph, path: str | Path, *, external_min_bytes: int = 1 << 20,
         external_total_bytes: int = 1 << 30) -> Path:
    """Write the graph as ONNX, atomically (temp file + rename).

    When constants of at least `external_min_bytes` add up to `external_total_bytes` or more
    (protobuf's 2 GB limit is near), they go to `<name>.data` beside the model, copied from
    their source a chunk at a time with zero runs left sparse.
    """
    path = Path(path)
    check_output_file(path)
    big = [v for v in graph.constants.values() if v.const is not None and v.const.nbytes >= external_min_bytes]
    tmp_model = path.parent / (path.name + ".tmp")
    if not big or sum(v.const.nbytes for v in big) < external_total_bytes:  # type: ignore[union-attr]
        onnx.save(to_onnx(graph), tmp_model)
        tmp_model.replace(path)
        return path
    data_name = path.name + ".data"
    layout = external_layout(graph, data_name, external_min_bytes)
    tmp_data = path.parent / (data_name + ".tmp")
    with open(tmp_data, "wb") as f:
        end = 0
        for v in big:
            data, offset = v.const, layout[v.name][1]
            assert data is not None
            if data.zeros:
                pass  # a hole reads as zeros
            elif data.is_external:
                _copy_sparse(data, f, offset)
            else:
                f.seek(offset)
                flat = np.ascontiguousarray(data.numpy()).reshape(-1)
                for chunk in np.array_split(flat, max(1, flat.nbytes >> 26)):
                    if chunk.any():
                        f.write(chunk.tobytes())
                    else:
                        f.seek(chunk.nbytes, 1)
            end = max(end, offset + data.nbytes)
        f.truncate(end)
    onnx.save(to_onnx(graph, external=layout), tmp_model)
    tmp_data.replace(path.parent / data_name)
    tmp_model.replace(path)
    return path


def _copy_sparse(data: TensorData, out: BinaryIO, offset: int) -> None:
    """Copy an external tensor's bytes, only the regions of its file that hold data (files
    made by `parc models build` are sparse: reading their holes would read gigabytes of zeros)."""
    assert data.path is not None
    start = data.offset
    end = start + data.nbytes
    with open(data.path, "rb") as src:
        fd, pos = src.fileno(), start
        while pos < end:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            if pos >= end:
                break
            stop = min(os.lseek(fd, pos, os.SEEK_HOLE), end)
            src.seek(pos)
            out.seek(offset + pos - start)
            while pos < stop:
                chunk = src.read(min(stop - pos, 1 << 26))
                out.write(chunk)
                pos += len(chunk)
