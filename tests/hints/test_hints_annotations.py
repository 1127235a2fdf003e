"""ONNX multi-device annotations: parc layouts written as ShardingSpecProto and read back as pins."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from parc.errors import UsageError
from parc.hints import AnnotationError, annotate, decode, encode, read_annotations, write_sharded_model
from parc.hints.annotations import MESH_KEY, UNEXPRESSED_KEY, device_blocks
from parc.sharding import R, ShardSpec, Split


def proto(device, dims, groups=None, name="x") -> onnx.ShardingSpecProto:
    p = onnx.ShardingSpecProto(tensor_name=name, device=device)
    for key, devices in (groups or {}).items():
        p.index_to_device_group_map.add(key=key, value=devices)
    for axis, shards in dims:
        p.sharded_dim.add(axis=axis).simple_sharding.add(num_shards=shards)
    return p


def layout(p: onnx.ShardingSpecProto):
    return (list(p.device), {e.key: list(e.value) for e in p.index_to_device_group_map},
            [(d.axis, [s.num_shards for s in d.simple_sharding]) for d in p.sharded_dim])


# -- the proposal's own examples (onnx/docs/proposals/ONNXMultiDeviceProposal.md) ---------------

def test_split_on_one_axis_of_a_1d_mesh_lists_the_devices_in_order():
    assert layout(encode("x", ShardSpec("S(0)"), (2,), (2, 2))) == ([0, 1], {}, [(0, [2])])
    assert layout(encode("x", ShardSpec("S(1)"), (2,), (2, 2))) == ([0, 1], {}, [(1, [2])])
    assert decode(proto([0, 1], [(1, 2)]), (2,)) == ShardSpec("S(1)")


def test_replicated_is_one_group_of_every_device():
    assert layout(encode("x", ShardSpec("R"), (2,), (2, 2))) == ([-1], {-1: [0, 1]}, [])
    assert decode(proto([-1], [], {-1: [0, 1]}), (2,)) == ShardSpec("R")


def test_split_and_broadcast_is_a_2d_mesh_layout():
    # device = [-1, -2], device_map = {-1: [0, 1], -2: [2, 3]}, axis 0 in 2 shards
    p = proto([-1, -2], [(0, 2)], {-1: [0, 1], -2: [2, 3]})
    assert decode(p, (2, 2)) == ShardSpec("S(0)R")
    assert layout(encode("x", ShardSpec("S(0)R"), (2, 2))) == layout(p)
    assert decode(proto([-1, -2], [(0, 2)], {-1: [0, 2], -2: [1, 3]}), (2, 2)) == ShardSpec("RS(0)")


def test_both_axes_split_over_four_devices():
    p = proto([0, 1, 2, 3], [(0, 2), (1, 2)])
    assert decode(p, (2, 2)) == ShardSpec("S(0)S(1)")
    assert decode(proto([0, 2, 1, 3], [(0, 2), (1, 2)]), (2, 2)) == ShardSpec("S(1)S(0)")
    # the order of the sharded_dim entries decides the shard numbering, not the layout
    assert decode(proto([0, 1, 2, 3], [(1, 2), (0, 2)]), (2, 2)) == ShardSpec("S(1)S(0)")


def test_nested_split_of_one_dim_is_one_contiguous_split():
    assert layout(encode("x", ShardSpec("S(0)S(0)"), (2, 4), (16, 3))) == (list(range(8)), {}, [(0, [8])])
    assert decode(proto(list(range(8)), [(0, 8)]), (2, 4)) == ShardSpec("S(0)S(0)")
    assert decode(proto(list(range(8)), [(0, 8)]), (8,)) == ShardSpec("S(0)")


def test_negative_axes_need_the_rank():
    assert decode(proto([0, 1], [(-1, 2)]), (2,), rank=3) == ShardSpec("S(2)")
    with pytest.raises(AnnotationError, match="negative axis -1 on a tensor of unknown rank"):
        decode(proto([0, 1], [(-1, 2)]), (2,))


@pytest.mark.parametrize("p, mesh, what", [
    (proto([1, 0], [(0, 2)]), (2,), "no R/S(d) layout of mesh 2"),
    (proto([0, 1], [(0, 2)]), (4,), "not each of the 4 devices once"),
    (proto([0, 0], [(0, 2)]), (2,), "not each of the 2 devices once"),
    (proto([0, 1, 2, 3], [(0, 2)]), (4,), "make 2 shards but 4 devices"),
    (proto([-1, -2], [(0, 2)], {-1: [0, 1], -2: [2, 3]}), (4,), "no R/S(d) layout of mesh 4"),
    (proto([0, 1], [(0, 2), (0, 1)]), (2,), "repeated"),
    (proto([0, 1], [(5, 2)]), (2,), "out of range"),
])
def test_layouts_parc_cannot_read_are_refused_by_name(p, mesh, what):
    with pytest.raises(AnnotationError, match="sharding_spec x") as e:
        decode(p, mesh, rank=2)
    assert what in str(e.value)


def test_fused_axes_are_refused():
    p = proto([0, 1, 2, 3], [])
    dim = p.sharded_dim.add(axis=0)
    dim.simple_sharding.add(num_shards=2)
    dim.simple_sharding.add(num_shards=2)
    with pytest.raises(AnnotationError, match="2 simple_sharding entries"):
        decode(p, (4,))


@pytest.mark.parametrize("spec, why", [("P(sum)", "partial"), ("S(0,2)", "contiguous even"),
                                       ("S(0,[1,7])", "contiguous even")])
def test_layouts_onnx_cannot_express_are_refused(spec, why):
    with pytest.raises(AnnotationError, match=why):
        encode("x", ShardSpec(spec), (2,), (8, 4))


def test_a_strided_split_that_is_contiguous_is_expressed():
    assert layout(encode("x", ShardSpec("S(0,4)"), (2,), (8, 4))) == ([0, 1], {}, [(0, [2])])


@st.composite
def spec_on_mesh(draw):
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    rank = draw(st.integers(1, 3))
    axes = [draw(st.sampled_from([R, *(Split(d) for d in range(rank))])) for _ in mesh]
    shape = [6**3] * rank  # divisible by any nesting of sizes <= 3 on <= 3 axes
    return ShardSpec(tuple(axes)), mesh, tuple(shape)


@settings(max_examples=150, deadline=None)
@given(spec_on_mesh())
def test_round_trip_gives_the_canonical_spec(case):
    spec, mesh, shape = case
    p = encode("x", spec, mesh, shape)
    assert decode(p, mesh, len(shape)) == spec.canonical(shape, mesh)
    blocks = device_blocks(spec, mesh)
    assert len({b for b in blocks}) == len(p.device)  # one device or group per distinct shard


# -- whole models ---------------------------------------------------------------------------------

def mlp_model() -> onnx.ModelProto:
    w1 = numpy_helper.from_array(np.ones((8, 16), np.float32), "w1")
    w2 = numpy_helper.from_array(np.ones((16, 8), np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
             helper.make_node("Relu", ["h"], ["a"], name="act"),
             helper.make_node("MatMul", ["a", "w2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], [w1, w2],
                              value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, [4, 16]),
                                          helper.make_tensor_value_info("a", TensorProto.FLOAT, [4, 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


MEGATRON = {"x": "S(0)", "w1": "S(1)", "h": "S(1)", "a": "S(1)", "w2": "S(0)", "y": "P(sum)"}


def pins(hints) -> dict[str, str]:
    return {p.tensor: str(p.spec) for p in hints.pins}


def test_annotate_then_read_gives_the_plan_back():
    model = mlp_model()
    annotated = annotate(model, MEGATRON, (4,))
    onnx.checker.check_model(annotated)
    assert annotated.ir_version >= 10 and not len(model.configuration)  # the input is left alone
    assert [(c.name, c.num_devices) for c in annotated.configuration] == [("parc", 4)]
    fc1 = annotated.graph.node[0].device_configurations[0]
    assert fc1.configuration_id == "parc"
    assert sorted(s.tensor_name for s in fc1.sharding_spec) == ["h", "w1", "x"]
    meta = {p.key: p.value for p in annotated.metadata_props}
    assert meta[MESH_KEY] == "4" and json.loads(meta[UNEXPRESSED_KEY]) == {"y": "P(sum)"}
    back = read_annotations(annotated)
    assert pins(back) == {k: v for k, v in MEGATRON.items() if k != "y"}
    assert all(p.mesh == (4,) and not p.required for p in back.pins)
    assert read_annotations(annotated).pins[0].where.startswith("mlp: node ")


@pytest.mark.parametrize("mesh, specs", [
    ((2, 2), {"x": "S(0)R", "w1": "RS(1)", "h": "S(0)S(1)", "a": "S(0)S(1)", "w2": "RS(0)", "y": "RR"}),
    ((2, 2), {"x": "RS(0)", "w1": "S(1)S(1)", "h": "S(1)S(1)", "a": "S(1)S(0)", "w2": "S(0)S(1)", "y": "S(1)S(0)"}),
    ((4, 1), {"x": "S(0)R", "w1": "RR", "h": "S(1)R", "a": "S(1)S(0)", "w2": "S(0)R", "y": "S(0)R"}),
])
def test_2d_meshes_round_trip_through_the_mesh_metadata(mesh, specs):
    annotated = annotate(mlp_model(), specs, mesh)
    onnx.checker.check_model(annotated)
    want = {k: str(ShardSpec(v).canonical((4, 8) if k in "xy" else (8, 16) if k == "w1" else (16, 8)
                                           if k == "w2" else (4, 16), mesh)) for k, v in specs.items()}
    assert pins(read_annotations(annotated)) == want
    assert pins(read_annotations(annotated, mesh_shape=mesh)) == want


def test_shapes_let_a_contiguous_strided_split_be_written():
    model = mlp_model()
    del model.graph.value_info[:]
    meta = {p.key: p.value for p in annotate(model, {"h": "S(1,4)"}, (4,)).metadata_props}
    assert json.loads(meta[UNEXPRESSED_KEY]) == {"h": "S(1,4)"}  # no shape: a strided split
    annotated = annotate(model, {"h": "S(1,4)"}, (4,), shapes={"h": (4, 16)})
    assert UNEXPRESSED_KEY not in {p.key for p in annotated.metadata_props}
    assert pins(read_annotations(annotated)) == {"h": "S(1)"}


def test_annotate_replaces_its_own_configuration_and_keeps_others():
    model = mlp_model()
    model.configuration.add(name="other", num_devices=2)
    model.graph.node[1].device_configurations.add(configuration_id="other")
    twice = annotate(annotate(model, MEGATRON, (4,)), {"x": "R"}, (2,))
    assert sorted((c.name, c.num_devices) for c in twice.configuration) == [("other", 2), ("parc", 2)]
    assert [len(n.device_configurations) for n in twice.graph.node] == [1, 1, 0]
    assert UNEXPRESSED_KEY not in {p.key for p in twice.metadata_props}
    assert pins(read_annotations(twice, configuration="parc")) == {"x": "R"}
    with pytest.raises(AnnotationError, match="2 device configurations"):
        read_annotations(twice)
    with pytest.raises(AnnotationError, match="no device configuration named 'nope'"):
        read_annotations(twice, configuration="nope")


def test_a_model_without_annotations_gives_no_hints(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    hints = read_annotations(path)
    assert hints.empty and hints.source == str(path)


def test_one_configuration_of_n_devices_is_a_1d_mesh():
    model = mlp_model()
    model.configuration.add(name="tp", num_devices=2)
    n = model.graph.node[0].device_configurations.add(configuration_id="tp")
    n.sharding_spec.extend([proto([0, 1], [(1, 2)], name="w1"), proto([-1], [], {-1: [0, 1]}, name="x"),
                            proto([0, 1], [(-1, 2)], name="h")])
    assert pins(read_annotations(model)) == {"w1": "S(1)", "x": "R", "h": "S(1)"}
    with pytest.raises(AnnotationError, match="mesh 2x2 has 4 devices, configuration 'tp' has 2"):
        read_annotations(model, mesh_shape=(2, 2))


def test_unreadable_annotations_are_refused(tmp_path):
    model = mlp_model()
    model.graph.node[0].device_configurations.add(configuration_id="tp")
    with pytest.raises(AnnotationError, match="node fc1 has device_configurations but the model declares no"):
        read_annotations(model)
    model.configuration.add(name="cfg", num_devices=2)
    with pytest.raises(AnnotationError, match="configuration_id 'tp' names no device configuration"):
        read_annotations(model)
    model.graph.node[0].device_configurations[0].configuration_id = "cfg"
    model.graph.node[0].device_configurations[0].sharding_spec.append(proto([0, 1], [(0, 2)], name="a"))
    with pytest.raises(AnnotationError, match="sharding_spec a: names no input or output of the node"):
        read_annotations(model)
    path = tmp_path / "bad.onnx"
    path.write_bytes(b"not a model")
    with pytest.raises(UsageError, match="cannot read the ONNX file"):
        read_annotations(path)


def test_the_producer_annotation_wins_and_disagreeing_consumers_leave_a_tensor_free(caplog):
    model = mlp_model()
    model.configuration.add(name="cfg", num_devices=2)
    fc1 = model.graph.node[0].device_configurations.add(configuration_id="cfg", pipeline_stage=0)
    fc1.sharding_spec.extend([proto([0, 1], [(1, 2)], name="h"), proto([-1], [], {-1: [0, 1]}, name="w1")])
    act = model.graph.node[1].device_configurations.add(configuration_id="cfg")
    act.sharding_spec.append(proto([0, 1], [(0, 2)], name="h"))  # a reshard at the consumer
    assert pins(read_annotations(model)) == {"h": "S(1)", "w1": "R"}

    relu = [helper.make_node("Relu", ["x"], [f"y{i}"], name=f"r{i}") for i in (1, 2)]
    graph = helper.make_graph(relu, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [4, 8]) for i in (1, 2)])
    two = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    two.configuration.add(name="cfg", num_devices=2)
    for node, spec in zip(two.graph.node, (proto([0, 1], [(0, 2)]), proto([-1], [], {-1: [0, 1]}))):
        spec.tensor_name = "x"
        node.device_configurations.add(configuration_id="cfg").sharding_spec.append(spec)
    with caplog.at_level(logging.WARNING, logger="parc.hints"):
        pins(read_annotations(model))
        assert pins(read_annotations(two)) == {}
    messages = " | ".join(r.getMessage() for r in caplog.records)
    assert "1 pipeline_stage annotations ignored" in messages
    assert "x is annotated R and S(0) by its consumers; left to the search" in messages


def test_write_sharded_model_keeps_inline_weights(tmp_path):
    src = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), src)
    out = write_sharded_model(src, MEGATRON, (4,), tmp_path / "model.sharded.onnx")
    onnx.checker.check_model(str(out))
    assert [t.name for t in onnx.load(str(out)).graph.initializer] == ["w1", "w2"]
    assert pins(read_annotations(out)) == {k: v for k, v in MEGATRON.items() if k != "y"}


def test_write_sharded_model_reads_external_weights_only_when_asked(tmp_path):
    src = tmp_path / "src" / "mlp.onnx"
    src.parent.mkdir()
    onnx.save(mlp_model(), src, save_as_external_data=True, location="mlp.data", size_threshold=0)
    plan = tmp_path / "plan"
    plan.mkdir()
    light = write_sharded_model(src, MEGATRON, (4,), plan / "model.sharded.onnx")
    onnx.checker.check_model(str(light))
    model = onnx.load(str(light))
    assert not model.graph.initializer and [i.name for i in model.graph.input] == ["x", "w1", "w2"]
    assert sorted(p.name for p in plan.iterdir()) == ["model.sharded.onnx"]
    assert pins(read_annotations(light)) == {k: v for k, v in MEGATRON.items() if k != "y"}

    heavy = write_sharded_model(src, MEGATRON, (4,), plan / "model.sharded.onnx", weights=True)
    onnx.checker.check_model(str(heavy))
    loaded = onnx.load(str(heavy))  # small tensors inline, others in model.sharded.onnx.data
    assert [numpy_helper.to_array(t).shape for t in loaded.graph.initializer] == [(8, 16), (16, 8)]
    assert all((numpy_helper.to_array(t) == 1).all() for t in loaded.graph.initializer)
    assert pins(read_annotations(heavy)) == {k: v for k, v in MEGATRON.items() if k != "y"}

    # the source already parsed (as `parc plan` hands it over) is written the same and left as it is
    parsed = onnx.load(str(src), load_external_data=False)
    before = parsed.SerializeToString()
    again = write_sharded_model(src, MEGATRON, (4,), plan / "again.onnx", model=parsed)
    fresh = write_sharded_model(src, MEGATRON, (4,), plan / "fresh.onnx")
    assert onnx.load(str(again)) == onnx.load(str(fresh)) and parsed.SerializeToString() == before


def test_tensors_in_one_layout_share_its_devices_not_their_protos():
    """encode's device part is computed once per layout (cached); each tensor still gets its
    own proto, name and dim sizes, and changing one does not change the next."""
    a = encode("a", ShardSpec("S(0)S(1)"), (4, 2), (8, 6))
    a.device[0] = 99
    b = encode("b", ShardSpec("S(0)S(1)"), (4, 2), (12, 4))
    assert b.tensor_name == "b" and list(b.device) == list(range(8))
    assert [(s.axis, s.simple_sharding[0].dim_value, s.simple_sharding[0].num_shards) for s in b.sharded_dim] == \
        [(0, 12, 4), (1, 4, 2)]
