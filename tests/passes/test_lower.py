"""The lowering's products, checked directly: valid modules on local shapes, shape inputs
rewritten, mean shares scaled, weight shards, microbatch tasks; and the programs run (as threads)
to the single-device result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from parc.plandir.taskgraph import load_taskgraph
from tests.helpers import parc

ort = pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("lower")
    assert parc("models", "build", "gpt-tiny", "--set", "batch=4", "-o", str(d / "m.onnx")).returncode == 0
    assert parc("grad", str(d / "m.onnx"), "--optimizer", "sgd", "--lr", "0.05", "-o", str(d / "t.onnx")).returncode == 0
    (d / "tp.yaml").write_text("default: split\n")
    (d / "dp.yaml").write_text("default: replicate\n")
    return d


def _plan(step: Path, name: str, *args: str) -> Path:
    out = step / name
    res = parc("plan", str(step / "t.onnx"), "--devices", "4xa100-80g", "--mesh-dims", "1", "--jobs", "1",
               "-o", str(out), *args)
    assert res.returncode == 0, res.stderr
    return out


def _modules(plan: Path, rank: int) -> list[onnx.ModelProto]:
    return [onnx.load(str(p)) for p in sorted((plan / f"rank_{rank}").glob("m*.onnx"))]


def test_modules_are_valid_onnx_on_local_shapes(step):
    plan = _plan(step, "tp", "--hints", str(step / "tp.yaml"))
    for r in range(4):
        for m in _modules(plan, r):
            onnx.checker.check_model(m, full_check=True)
    # a tensor-parallel Reshape gets the local shape: a shape constant no Reshape of the source has
    from parc.ir import importer

    graph = importer.load(str(step / "t.onnx"))
    whole = {tuple(n.outputs[0].shape) for n in graph.nodes if n.op_type == "Reshape"}
    reshapes = [(n, {t.name: numpy_helper.to_array(t) for t in m.graph.initializer})
                for m in _modules(plan, 0) for n in m.graph.node if n.op_type == "Reshape"]
    local = {tuple(init[n.input[1]].tolist()) for n, init in reshapes if n.input[1] in init}
    assert local - whole, (local, whole)


def test_mean_loss_is_scaled_by_the_share(step):
    plan = _plan(step, "dp", "--hints", str(step / "dp.yaml"))
    nodes = [(n, m) for m in _modules(plan, 0) for n in m.graph.node if n.op_type == "Mul" and n.output[0] == "loss"]
    assert nodes, "the data-parallel loss is a mean over a split batch: its local value is scaled"
    n, m = nodes[0]
    share = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}[n.input[1]]
    assert float(share) == pytest.approx(0.25)


def test_weight_shards_hold_only_the_rank_s_piece(step):
    dp = _plan(step, "dp2", "--hints", str(step / "dp.yaml"))
    tp = _plan(step, "tp2", "--hints", str(step / "tp.yaml"))
    size = {p: (p / "rank_0" / "weights.bin").stat().st_size for p in (dp, tp)}
    assert size[tp] < 0.6 * size[dp], size
    program = json.loads((tp / "rank_1" / "program.json").read_text())
    split = [r for r in program["residents"] if r["kind"] == "state" and r["local"] != r["shape"]]
    assert split


def test_no_programs_writes_the_plan_and_a_stage_level_task_graph(step):
    out = _plan(step, "bare", "--no-programs")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "model.sharded.onnx", "plan.json",
                                                     "taskgraph.json"]
    assert load_taskgraph(out / "taskgraph.json").granularity == "stage"


def test_microbatch_task_graph_runs_forward_backward_per_microbatch(step):
    plan = _plan(step, "micro", "--micro-batches", "4", "--hints", str(step / "dp.yaml"))
    g = load_taskgraph(plan / "taskgraph.json")
    assert g.micro_batches == 4
    order = [g.tasks[t] for t in g.order[0]]
    micro = [t for t in order if t["kind"] == "compute" and t.get("phase") == "micro"]
    apply = [t for t in order if t["kind"] == "compute" and t.get("phase") == "apply"]
    assert {t["micro_batch"] for t in micro} == {0, 1, 2, 3} and apply
    assert max(order.index(t) for t in micro) < min(order.index(t) for t in apply)


def test_threads_match_onnxruntime_on_one_device(step):
    """The in-process runner (threads, shared-memory collectives) gives the source's result."""
    from parc.exec.data import data_inputs, synthetic
    from parc.exec.threads import run_threads
    from parc.plandir import load_program

    plan = step / "tp"
    if not plan.exists():
        plan = _plan(step, "tp", "--hints", str(step / "tp.yaml"))
    batch = synthetic(data_inputs(load_program(plan, 0)), 0, 0)
    got, _ = run_threads(plan, [batch])
    model = onnx.load(str(step / "t.onnx"))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, batch)))
    np.testing.assert_allclose(got[0]["loss"], want["loss"], rtol=1e-5)


def test_microbatch_slices_and_first_flag_of_values_whole_along_time(tmp_path):
    """A constant whole along time that a microbatch needs a slice of gets per-microbatch Slice
    bounds; one added once to a sum over microbatches is kept by microbatch 0 only (the 0/1
    flag). Lowered by hand on 2 microbatches x 1 device and run: the same y and loss."""
    from onnx import TensorProto, helper

    from parc.exec.threads import run_threads
    from parc.ir.importer import from_model
    from parc.passes.emit import write_programs_for
    from parc.passes.spmd.strategies import node_strategies
    from parc.sharding import ShardSpec

    rng = np.random.default_rng(0)
    c = rng.standard_normal((4, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    s = np.array(0.75, np.float32)
    inits = [numpy_helper.from_array(c, "c"), numpy_helper.from_array(w, "w"), numpy_helper.from_array(s, "s")]
    nodes = [helper.make_node("Add", ["x", "c"], ["y"], name="add_c"),
             helper.make_node("Mul", ["x", "w"], ["m"], name="mul_w"),
             helper.make_node("ReduceSum", ["m"], ["r"], name="sum", keepdims=0),
             helper.make_node("Add", ["r", "s"], ["loss"], name="add_s")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3]),
                           helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], initializer=inits)
    graph = from_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    mesh = (2, 1)  # 2 microbatches (the time axis) x 1 device

    def batch_split(node):  # the strategy splitting the batch over microbatches
        return next(st for st in node_strategies(node, mesh) if str(st.inputs[0]) == "S(0)R")

    by = {n.name: n for n in graph.nodes}
    plus = next(st for st in node_strategies(by["add_s"], mesh, first=("+",)) if st.labels[1] is None)
    strategies = [batch_split(by["add_c"]), batch_split(by["mul_w"]), batch_split(by["sum"]), plus]
    assert str(strategies[0].inputs[1]) == "S(0)R" and str(strategies[3].inputs[1]) == "P(sum)R"
    rep, split = ShardSpec.parse("RR"), ShardSpec.parse("S(0)R")
    specs = {"x": split, "c": rep, "w": rep, "s": rep}
    write_programs_for(graph, mesh, strategies, specs, 2, tmp_path)
    text = b"".join(p.read_bytes() for p in (tmp_path / "rank_0").glob("m*.onnx"))
    assert b"parc.mb.start" in text and b"parc.mb.first" in text
    x = rng.standard_normal((4, 3)).astype(np.float32)
    got, _ = run_threads(tmp_path, [{"x": x}])
    np.testing.assert_allclose(got[0]["y"], x + c, rtol=1e-6)
    np.testing.assert_allclose(got[0]["loss"], (x * w).sum() + s, rtol=1e-5)


def test_small_gradients_run_in_buckets_and_the_step_is_unchanged(step):
    """Data parallel on a 2 x 2 mesh of PCIe GPUs (buckets pay along both axes: 11.4 us of
    latency per member against copying 1 MiB twice at 600 GB/s): every gradient is P(sum) along both axes, so
    its all-reduce is two collectives, and the second reads the first's result. The small ones
    run as one bucket per axis (the second bucket reads the first's pieces); the step's new
    parameters are the single-device step's."""
    from parc.cluster.cost import BUCKET_MEMBER_BYTES, GRAD_BUCKET_BYTES
    from parc.exec.data import data_inputs, synthetic
    from parc.exec.threads import run_threads
    from parc.ir.state import step_state
    from parc.plandir import load_program

    out = step / "dp2d"
    # a 2-axis pin: 2-D meshes only; the attention cores (which read no parameter, so `default`
    # leaves them free) split along both axes too, else at batch 4 the search computes them
    # replicated along one (their kernels take no longer than a launch)
    cores = "".join(f"  h.{i}.attn.merge_heads: S(0)S(0)\n" for i in range(2))
    (step / "dp2d.yaml").write_text("default: replicate\npins:\n  wte.weight: RR\n" + cores)
    res = parc("plan", str(step / "t.onnx"), "--devices", "4xa10-24g", "--jobs", "1", "--hints", str(step / "dp2d.yaml"),
               "-o", str(out))
    assert res.returncode == 0, res.stderr
    g = load_taskgraph(out / "taskgraph.json")
    assert g.mesh == (2, 2)
    model = onnx.load(str(step / "t.onnx"))
    grads = set(step_state({p.key: p.value for p in model.metadata_props}).grads.values())
    syncs = [g.tasks[t] for t in g.order[0] if g.tasks[t]["kind"] == "collective" and g.tasks[t]["op"] == "all_reduce"]
    buckets = [t for t in syncs if t["tensor"].startswith("grad bucket: ")]
    assert {t["axis"] for t in buckets} == {0, 1}
    for b in buckets:
        members = b["tensor"].removeprefix("grad bucket: ").split(", ")
        assert set(members) <= grads and len(members) > 1
        assert b["step"]["bytes_per_device"] <= GRAD_BUCKET_BYTES
    small = {t["tensor"] for t in syncs if t["step"]["bytes_per_device"] <= BUCKET_MEMBER_BYTES} & grads
    assert not small, f"small gradients synchronised alone: {sorted(small)}"
    along = {a: {b["tensor"] for b in buckets if b["axis"] == a} for a in (0, 1)}
    assert along[0] == along[1]  # each axis-1 bucket reduces the pieces of an axis-0 bucket
    # a member goes into a bucket through a reshape and comes out through another, unless it is
    # 1-D already (the biases and norm scales): those go in and come out as they are
    rank = {i.name: len(i.dims) for i in model.graph.initializer}
    param = {grad: name for name, grad in step_state({p.key: p.value for p in model.metadata_props}).grads.items()}
    members = [m for b in buckets for m in b["tensor"].removeprefix("grad bucket: ").split(", ")]
    assert any(rank[param[m]] == 1 for m in members) and any(rank[param[m]] > 1 for m in members)
    views = [n for m in _modules(out, 0) for n in m.graph.node if "bucket_flat" in n.name or "bucket_unflat" in n.name]
    assert len(views) == sum(2 for m in members if rank[param[m]] > 1)
    batch = synthetic(data_inputs(load_program(out, 0)), 0, 0)
    got, _ = run_threads(out, [batch])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, batch)))
    assert set(want) <= set(got[0])
    for name, value in want.items():
        np.testing.assert_allclose(got[0][name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_work_on_sources_alone_runs_in_its_readers_module(tmp_path):
    """An AdamW update's `beta * state` (computed from sources alone, so ready in module 0) runs
    in the module of the update that reads it, not written out in module 0 and held all step;
    a weight's moment updates and the parameter update land in one module."""
    path = tmp_path / "adam.onnx"
    assert parc("models", "build", "gpt-tiny", "--set", "batch=4", "--train", "adamw", "-o", str(path)).returncode == 0
    out = tmp_path / "plan"
    res = parc("plan", str(path), "--devices", "2xa100-80g", "--jobs", "1", "-o", str(out))
    assert res.returncode == 0, res.stderr
    where, outputs = {}, set()
    for k, m in enumerate(_modules(out, 0)):
        outputs |= {o.name for o in m.graph.output} if k == 0 else set()
        for n in m.graph.node:
            where[n.name] = k
    scaled = [n for n in where if n.endswith(".update.Mul_0")]
    assert scaled, "no AdamW update in the modules"
    for name in scaled:
        add = name[: -len("Mul_0")] + "Add_0"
        assert where[name] == where[add], (name, where[name], where[add])
    assert any(where[name] > 0 for name in scaled)  # updates after a collective, their scaling with them
    assert not any(o.endswith(".update.mul_0") for o in outputs)  # nothing of the kind leaves module 0
