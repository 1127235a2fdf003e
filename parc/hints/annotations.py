"""ONNX multi-device annotations (IR 10) <-> parc layouts: read them as pins, write a plan as them.

The ONNX fields: `ModelProto.configuration` (DeviceConfigurationProto: name, num_devices) and
`NodeProto.device_configurations` (NodeDeviceConfigurationProto: configuration_id,
sharding_spec, pipeline_stage), each ShardingSpecProto naming one input or output of its node
(tensor_name), the devices holding its shards in shard order (device; a key of
index_to_device_group_map stands for a group of devices holding the same shard) and its split
axes (sharded_dim: axis, simple_sharding: num_shards). Shards are contiguous even blocks,
numbered row-major over the sharded_dim entries in the order listed.

parc's layout on a mesh maps to that exactly when every mesh axis is R or a contiguous even
S(d) (no strides, no uneven sizes, no partial values): device p of the mesh (row-major) holds,
of each dim d, the block whose index is the mixed-radix number of p's coordinates on the axes
splitting d (outer axis first, as nested splits cut), out of the product of those axes' sizes.
Devices holding the same blocks form a group. Reading inverts this on a given mesh: the one
R/S(d)-per-axis layout whose device blocks are the annotation's; any other annotation (devices
in another order, a tensor on a subset of the devices, fused axes) is refused by name.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

import onnx

from parc.errors import UsageError
from parc.hints.file import Hints, Pin, mesh_text
from parc.sharding import R, Replicated, ShardSpec, ShardSpecError, Split

log = logging.getLogger("parc.hints")

CONFIGURATION = "parc"  # the DeviceConfigurationProto name `annotate` writes
MESH_KEY = "parc.mesh"  # metadata: the mesh shape the annotations were written for, e.g. "2x4"
UNEXPRESSED_KEY = "parc.unexpressed"  # metadata: JSON {tensor: spec} ONNX cannot express
MIN_IR_VERSION = 10  # the multi-device fields' IR version

Blocks = tuple[tuple[int, int, int], ...]  # per split dim: (dim, block index, number of blocks)


class AnnotationError(UsageError):
    """An ONNX multi-device annotation parc cannot read, or a layout ONNX cannot express."""


def device_blocks(spec: ShardSpec, mesh_shape: tuple[int, ...]) -> list[Blocks]:
    """Per device (row-major mesh position), the block of each split dim it holds."""
    by_dim: dict[int, list[int]] = {}
    for k, (a, m) in enumerate(zip(spec, mesh_shape)):
        if isinstance(a, Split) and m > 1:
            by_dim.setdefault(a.dim, []).append(k)
    out = []
    for coords in itertools.product(*(range(m) for m in mesh_shape)):
        blocks = []
        for d in sorted(by_dim):
            b = 0
            for k in by_dim[d]:
                b = b * mesh_shape[k] + coords[k]
            blocks.append((d, b, math.prod(mesh_shape[k] for k in by_dim[d])))
        out.append(tuple(blocks))
    return out


def encode(name: str, spec: ShardSpec, mesh_shape: tuple[int, ...],
           shape: tuple[int, ...] | None = None) -> onnx.ShardingSpecProto:
    """The ShardingSpecProto of `name` laid out as `spec`; AnnotationError if ONNX cannot say it."""
    mesh_shape = tuple(mesh_shape)
    if len(spec) != len(mesh_shape):
        raise AnnotationError(f"{name}: {spec} has {len(spec)} axis specs for mesh {mesh_text(mesh_shape)}")
    if shape is not None:
        try:
            spec = spec.canonical(shape, mesh_shape)
        except ShardSpecError as e:
            raise AnnotationError(f"{name}: {e}") from None
    for a, m in zip(spec, mesh_shape):
        if m == 1 or isinstance(a, Replicated):
            continue
        if not isinstance(a, Split):
            raise AnnotationError(f"{name}: {spec}: ONNX sharding has no partial values")
        if a.stride is not None or a.sizes is not None:
            raise AnnotationError(f"{name}: {spec}: ONNX sharding has only contiguous even blocks")
    proto = onnx.ShardingSpecProto()
    devices, dims = _devices(spec, mesh_shape)
    proto.CopyFrom(devices)
    proto.tensor_name = name
    for d, ns in dims:
        simple = proto.sharded_dim.add(axis=d).simple_sharding.add(num_shards=ns)
        if shape is not None:
            simple.dim_value = shape[d]
    return proto


@lru_cache(maxsize=1024)
def _devices(spec: ShardSpec, mesh_shape: tuple[int, ...]) -> tuple[onnx.ShardingSpecProto, tuple]:
    """encode's device part of `spec` (the same for every tensor in that layout: a model's
    tensors share a few dozen, and each costs a pass over every device of the mesh), and
    its split dims with their shard counts."""
    blocks = device_blocks(spec, mesh_shape)
    dims = tuple((d, ns) for d, _, ns in blocks[0])
    groups: dict[int, list[int]] = {}
    for p, held in enumerate(blocks):
        s = 0
        for _, b, ns in held:
            s = s * ns + b
        groups.setdefault(s, []).append(p)
    proto = onnx.ShardingSpecProto()
    shards = [groups[s] for s in range(len(groups))]
    if all(len(g) == 1 for g in shards):
        proto.device.extend(g[0] for g in shards)
    else:
        for s, g in enumerate(shards):
            proto.device.append(-(s + 1))
            proto.index_to_device_group_map.add(key=-(s + 1), value=g)
    return proto, dims


def decode(proto: onnx.ShardingSpecProto, mesh_shape: tuple[int, ...], rank: int | None = None,
           where: str = "") -> ShardSpec:
    """The parc layout a ShardingSpecProto describes on `mesh_shape` (see the module docstring)."""
    mesh_shape = tuple(mesh_shape)
    where = where or f"sharding_spec {proto.tensor_name}"
    n = math.prod(mesh_shape)
    group_of = {e.key: list(e.value) for e in proto.index_to_device_group_map}
    groups = [group_of.get(v, [v]) for v in proto.device]
    held = sorted(d for g in groups for d in g)
    if held != list(range(n)):
        raise AnnotationError(f"{where}: devices {held} are not each of the {n} devices once: parc reads "
                              f"tensors held by every device of the configuration")
    dims: list[tuple[int, int]] = []
    for sd in proto.sharded_dim:
        if len(sd.simple_sharding) != 1:
            raise AnnotationError(f"{where}: axis {sd.axis}: {len(sd.simple_sharding)} simple_sharding entries "
                                  f"(fused axes) are not supported; give one")
        axis, ns = sd.axis, sd.simple_sharding[0].num_shards
        if axis < 0:
            if rank is None:
                raise AnnotationError(f"{where}: negative axis {axis} on a tensor of unknown rank")
            axis += rank
        if axis < 0 or (rank is not None and axis >= rank) or ns < 1 or axis in (d for d, _ in dims):
            raise AnnotationError(f"{where}: sharded_dim axis {sd.axis} with {ns} shards is out of range, "
                                  f"repeated or empty")
        dims.append((axis, ns))
    if math.prod(ns for _, ns in dims) != len(groups):
        raise AnnotationError(f"{where}: the sharded dims make {math.prod(ns for _, ns in dims)} shards "
                              f"but {len(groups)} devices or groups are listed")
    want: list[Blocks] = [()] * n
    for s, g in enumerate(groups):
        index = []
        for _, ns in reversed(dims):
            s, b = divmod(s, ns)
            index.append(b)
        blocks = tuple(sorted((d, b, ns) for (d, ns), b in zip(dims, reversed(index)) if ns > 1))
        for dev in g:
            want[dev] = blocks
    split_dims = sorted(d for d, ns in dims if ns > 1)
    options = [[R, *(Split(d) for d in split_dims)] if m > 1 else [R] for m in mesh_shape]
    for axes in itertools.product(*options):
        spec = ShardSpec(axes)
        if device_blocks(spec, mesh_shape) == want:
            return spec
    shown = ", ".join(f"axis {d}: {ns} shards" for d, ns in dims) or "no split axes"
    raise AnnotationError(f"{where}: devices {list(proto.device)} ({shown}) are no R/S(d) layout of mesh "
                          f"{mesh_text(mesh_shape)}: parc reads contiguous blocks held in the mesh's row-major "
                          f"device order")


def annotate(model: onnx.ModelProto, specs: Mapping[str, str | ShardSpec], mesh_shape: tuple[int, ...], *,
             shapes: Mapping[str, tuple[int, ...]] | None = None,
             configuration: str = CONFIGURATION) -> onnx.ModelProto:
    """A copy of `model` whose nodes carry `specs` (a plan's per-value layouts) as ONNX annotations.

    A value produced by a node is annotated as that node's output; a graph input or initializer
    as an input of each node reading it (ONNX cannot annotate model inputs). Layouts ONNX cannot
    express (partial, strided, uneven) are listed in the `parc.unexpressed` metadata instead.
    `shapes` (tensor -> static shape, e.g. from the planned IR) adds to those the model states:
    with a shape, a strided split that is contiguous is written as the plain split it is.
    """
    mesh_shape = tuple(int(m) for m in mesh_shape)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    shapes = {**static_shapes(out), **{k: tuple(v) for k, v in (shapes or {}).items()}}
    produced = {name for node in g.node for name in node.output if name}
    encoded: dict[str, onnx.ShardingSpecProto] = {}
    unexpressed: dict[str, str] = {}
    for name in sorted(set(specs) & (produced | {t for node in g.node for t in node.input if t})):
        spec = specs[name] if isinstance(specs[name], ShardSpec) else ShardSpec.parse(str(specs[name]))
        try:
            encoded[name] = encode(name, spec, mesh_shape, shapes.get(name))
        except AnnotationError:
            unexpressed[name] = str(spec)
    kept = [c for c in out.configuration if c.name != configuration]
    del out.configuration[:]
    out.configuration.extend(kept)
    out.configuration.add(name=configuration, num_devices=math.prod(mesh_shape))
    for node in g.node:
        others = [c for c in node.device_configurations if c.configuration_id != configuration]
        del node.device_configurations[:]
        node.device_configurations.extend(others)
        mine = [encoded[t] for t in node.output if t in encoded]
        mine += [encoded[t] for t in dict.fromkeys(node.input) if t in encoded and t not in produced]
        if mine:
            node.device_configurations.add(configuration_id=configuration, sharding_spec=mine)
    _set_metadata(out, MESH_KEY, mesh_text(mesh_shape))
    _set_metadata(out, UNEXPRESSED_KEY, json.dumps(unexpressed, sort_keys=True) if unexpressed else None)
    out.ir_version = max(out.ir_version, MIN_IR_VERSION)
    log.info("annotated %d tensors for mesh %s (%d layouts ONNX cannot express)", len(encoded),
             mesh_text(mesh_shape), len(unexpressed))
    return out


def read_annotations(model: onnx.ModelProto | str | Path, *, mesh_shape: tuple[int, ...] | None = None,
                     configuration: str | None = None, source: str | None = None) -> Hints:
    """The model's multi-device annotations as pins (empty Hints when it has none).

    The mesh is `mesh_shape`, else the `parc.mesh` metadata `annotate` writes, else 1-D over the
    configuration's num_devices. A tensor's pin is its producer's output annotation, else its
    consumers' input annotations when they agree (otherwise it is left free, with a warning).
    `source`: what messages call the model (default: its path, or its graph's name).
    """
    source = source or (str(model) if isinstance(model, str | Path) else (model.graph.name or "model"))
    if isinstance(model, str | Path):
        try:
            model = onnx.load(str(model), load_external_data=False)
        except Exception as e:  # protobuf decode errors have no common base
            raise UsageError(f"{source}: cannot read the ONNX file ({e})") from None
    configs = {c.name: c for c in model.configuration}
    annotated = [n for n in model.graph.node if len(n.device_configurations)]
    if not configs:
        if annotated:
            raise AnnotationError(f"{source}: node {annotated[0].name or annotated[0].op_type} has "
                                  f"device_configurations but the model declares no configuration")
        return Hints(source=source)
    if configuration is None and len(configs) > 1:
        raise AnnotationError(f"{source}: {len(configs)} device configurations ({', '.join(configs)}); "
                              f"parc reads one")
    config = configs.get(configuration) if configuration is not None else next(iter(configs.values()))
    if config is None:
        raise AnnotationError(f"{source}: no device configuration named {configuration!r} "
                              f"(found {', '.join(configs)})")
    mesh = _read_mesh(model, config, mesh_shape, source)
    shapes = static_shapes(model)
    outputs: dict[str, tuple[ShardSpec, str]] = {}
    inputs: dict[str, list[tuple[ShardSpec, str]]] = {}
    stages = 0
    for node in annotated:
        label = node.name or node.op_type
        for dc in node.device_configurations:
            if dc.configuration_id not in configs:
                raise AnnotationError(f"{source}: node {label}: configuration_id {dc.configuration_id!r} "
                                      f"names no device configuration")
            if dc.configuration_id != config.name:
                continue
            stages += dc.HasField("pipeline_stage")
            for sp in dc.sharding_spec:
                where = f"{source}: node {label}: sharding_spec {sp.tensor_name}"
                shape = shapes.get(sp.tensor_name)
                spec = decode(sp, mesh, len(shape) if shape is not None else None, where)
                if sp.tensor_name in node.output:
                    outputs[sp.tensor_name] = (spec, where)
                elif sp.tensor_name in node.input:
                    inputs.setdefault(sp.tensor_name, []).append((spec, where))
                else:
                    raise AnnotationError(f"{where}: names no input or output of the node")
    if stages:
        log.warning("%s: %d pipeline_stage annotations ignored (parc chooses stages itself)", source, stages)
    pins = [Pin(t, spec, where, mesh, required=False) for t, (spec, where) in outputs.items()]
    for t, asked in inputs.items():
        if t in outputs:
            continue
        if len({spec for spec, _ in asked}) > 1:
            log.warning("%s: %s is annotated %s by its consumers; left to the search", source, t,
                        " and ".join(sorted({str(s) for s, _ in asked})))
            continue
        pins.append(Pin(t, asked[0][0], asked[0][1], mesh, required=False))
    return Hints(pins=tuple(sorted(pins, key=lambda p: p.tensor)), source=source)


def write_sharded_model(model_path: str | Path, specs: Mapping[str, str | ShardSpec], mesh_shape: tuple[int, ...],
                        out_path: str | Path, *, shapes: Mapping[str, tuple[int, ...]] | None = None,
                        weights: bool = False, model: onnx.ModelProto | None = None) -> Path:
    """Write the model at `model_path` annotated with `specs` to `out_path` (PLAN_DIR/model.sharded.onnx).

    Weights stored inline stay inline. Weights stored as external data are never read unless
    `weights`: then they are copied to `<out name>.data` beside `out_path`; otherwise those
    initializers become graph inputs of the same name, type and shape (the plan's structure
    without a second copy of a large model's weights). `model`: the file already parsed (without
    its external data; left as it is), so that a large model is not read twice.
    """
    out_path = Path(out_path)
    if model is None:
        model = onnx.load(str(model_path), load_external_data=False)
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    sharded = annotate(model, specs, mesh_shape, shapes=shapes)  # a copy: external weights are handled on it
    if external and weights:
        onnx.load_external_data_for_model(sharded, str(Path(model_path).parent))
    elif external:
        _initializers_to_inputs(sharded, set(external))
    if external and weights:
        onnx.save_model(sharded, str(out_path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=f"{out_path.name}.data", size_threshold=1024)
    else:
        onnx.save_model(sharded, str(out_path))
    return out_path


def _initializers_to_inputs(model: onnx.ModelProto, names: set[str]) -> None:
    g = model.graph
    listed = {i.name for i in g.input}
    kept = [t for t in g.initializer if t.name not in names]
    for t in g.initializer:
        if t.name in names and t.name not in listed:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del g.initializer[:]
    g.initializer.extend(kept)


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Tensor shapes the model states (initializers, inputs, outputs, value_info) fully static."""
    g = model.graph
    out = {t.name: tuple(int(d) for d in t.dims) for t in g.initializer}
    for vi in [*g.input, *g.output, *g.value_info]:
        t = vi.type.tensor_type
        if vi.name in out or not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if all(d is not None for d in dims):
            out[vi.name] = tuple(int(d) for d in dims)  # type: ignore[arg-type]
    return out


def _read_mesh(model: onnx.ModelProto, config: onnx.DeviceConfigurationProto, mesh_shape: tuple[int, ...] | None,
               source: str) -> tuple[int, ...]:
    n = config.num_devices
    if n < 1:
        raise AnnotationError(f"{source}: configuration {config.name!r}: num_devices {n} must be >= 1")
    if mesh_shape is None:
        meta = {p.key: p.value for p in model.metadata_props}.get(MESH_KEY)
        try:
            stated = tuple(int(m) for m in meta.split("x")) if meta else None
        except ValueError:
            stated = None
        mesh_shape = stated if stated and math.prod(stated) == n and min(stated) >= 1 else (n,)
    mesh_shape = tuple(int(m) for m in mesh_shape)
    if math.prod(mesh_shape) != n:
        raise AnnotationError(f"{source}: mesh {mesh_text(mesh_shape)} has {math.prod(mesh_shape)} devices, "
                              f"configuration {config.name!r} has {n}")
    return mesh_shape


def _set_metadata(model: onnx.ModelProto, key: str, value: str | None) -> None:
    kept = [p for p in model.metadata_props if p.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if value is not None:
        model.metadata_props.add(key=key, value=value)
