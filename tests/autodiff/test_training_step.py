"""The structure of a training step (gpt-tiny): `parc.state`, phases, names, the trained set,
and its split into compute-gradients and apply-gradients programs (what microbatching needs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from parc.autodiff import OptimizerConfig, make_training_step
from parc.errors import UsageError
from parc.ir import Graph, load, to_onnx
from parc.models import build_model
from parc.ops import verify
from tests.autodiff.split_step import SPLIT_KEY, split_step

OPTIMIZERS = [OptimizerConfig("sgd"), OptimizerConfig("momentum", weight_decay=0.01),
              OptimizerConfig("adam", weight_decay=0.01), OptimizerConfig("adamw", weight_decay=0.01)]
IDS = [c.name for c in OPTIMIZERS]
DATA = ("input_ids", "labels")
VOCAB = 128


@pytest.fixture(scope="module")
def forward(tmp_path_factory) -> Path:
    return build_model("gpt-tiny", tmp_path_factory.mktemp("gpt_tiny") / "gpt-tiny.onnx")


def step_of(path: Path, cfg: OptimizerConfig, **kw) -> tuple[Graph, dict, onnx.ModelProto]:
    graph = load(path)
    make_training_step(graph, cfg, **kw)
    return graph, json.loads(graph.metadata["parc.state"]), to_onnx(graph)


def meta(node: onnx.NodeProto) -> dict[str, str]:
    return {p.key: p.value for p in node.metadata_props}


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in extra)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def batch(size: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, (size, 16), dtype=np.int64)
    return {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=IDS)
def test_state_metadata_is_consistent(forward, cfg):
    source = load(forward)
    graph, record, model = step_of(forward, cfg)
    assert set(record) == {"bindings", "params", "grads", "optimizer", "loss", "step"}
    assert record["optimizer"] == cfg.to_json()
    assert record["loss"] == "loss"
    assert record["step"] == ("parc.step" if cfg.uses_step else None)
    inputs = {i.name for i in model.graph.input}
    outputs = [o.name for o in model.graph.output]
    inits = {t.name: t for t in model.graph.initializer}
    for out, inp in record["bindings"].items():
        assert out in outputs, out
        assert inp in inputs and inp in inits, inp  # fed each step, with its initial value
    assert outputs[0] == "loss" and sorted(outputs[1:]) == sorted(record["bindings"])
    assert inputs == {*DATA, *record["bindings"].values()}
    # Every parameter, by its source name, its initial value unchanged; its state, zeros.
    assert record["params"] == [v.name for v in source.params()]
    produced = {o for n in model.graph.node for o in n.output}
    for p in record["params"]:
        want = source.constants[p].const.numpy()
        np.testing.assert_array_equal(onnx.numpy_helper.to_array(inits[p]), want)
        assert record["bindings"][f"{p}.new"] == p
        assert record["grads"][p] == f"{p}.grad" and f"{p}.grad" in produced
        for k in cfg.state_names:
            assert record["bindings"][f"{p}.{k}.new"] == f"{p}.{k}"
            state = onnx.numpy_helper.to_array(inits[f"{p}.{k}"])
            assert state.shape == want.shape and not state.any()
    if cfg.uses_step:
        assert record["bindings"]["parc.step.next"] == "parc.step"
        assert onnx.numpy_helper.to_array(inits["parc.step"]).dtype == np.int64


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=IDS)
def test_phases_and_forward_links(forward, cfg):
    _, record, model = step_of(forward, cfg)
    phases = {n.name: meta(n).get("parc.phase") for n in model.graph.node}
    assert set(phases.values()) == {"forward", "backward", "optimizer"}, [k for k, v in phases.items() if v is None]
    forward_nodes = {name for name, ph in phases.items() if ph == "forward"}
    for n in model.graph.node:
        m = meta(n)
        if m["parc.phase"] == "backward":
            assert m.get("parc.forward") in forward_nodes, (n.name, m)
        if m["parc.phase"] == "optimizer" and "parc.param" in m:
            assert m["parc.param"] in record["params"]


def test_checker_and_default_domain_only(forward):
    _, _, model = step_of(forward, OptimizerConfig("adamw", weight_decay=0.01))
    onnx.checker.check_model(model, full_check=True)
    assert {n.domain for n in model.graph.node} <= {"", "ai.onnx"}
    assert {o.domain for o in model.opset_import} <= {"", "ai.onnx"}


def test_params_narrows_the_trained_set(forward):
    _, record, model = step_of(forward, OptimizerConfig("momentum"), params=r"^h\.0\.")
    assert record["params"] and all(p.startswith("h.0.") for p in record["params"])
    _assert_only_trained(record, model, forward)


def test_frozen_params_are_not_updated(forward):
    _, record, model = step_of(forward, OptimizerConfig("adamw"), frozen=r"^wte\.|ln_")
    assert not any(re.search(r"^wte\.|ln_", p) for p in record["params"])
    _assert_only_trained(record, model, forward)
    frozen = [v.name for v in load(forward).params() if v.name not in record["params"]]
    assert "wte.weight" in frozen
    out = run(model, batch())
    assert np.isfinite(out["loss"])


def test_params_and_frozen_together(forward):
    _, record, model = step_of(forward, OptimizerConfig("sgd"), params=r"^h\.1\.", frozen=r"bias$")
    assert record["params"] and all(p.startswith("h.1.") and not p.endswith("bias") for p in record["params"])
    _assert_only_trained(record, model, forward)


def _assert_only_trained(record: dict, model: onnx.ModelProto, forward: Path) -> None:
    """Trained parameters are inputs with new values; the others are plain initializers."""
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    inits = {t.name for t in model.graph.initializer}
    for v in load(forward).params():
        trained = v.name in record["params"]
        assert (v.name in inputs) == trained, v.name
        assert (f"{v.name}.new" in outputs) == trained, v.name
        assert (v.name in record["grads"]) == trained, v.name
        assert v.name in inits or not v.uses, v.name  # frozen: still there, as a constant


# -- compute-gradients / apply-gradients -------------------------------------------------------


def _initials(model: onnx.ModelProto, names) -> dict[str, np.ndarray]:
    inits = {t.name: t for t in model.graph.initializer}
    return {n: onnx.numpy_helper.to_array(inits[n]) for n in names}


def _random_state(model: onnx.ModelProto, record: dict) -> dict[str, np.ndarray]:
    """Parameters as initialised, optimizer state random (positive where it must be), step 5."""
    rng = np.random.default_rng(7)
    state = _initials(model, record["bindings"].values())
    for name, v in state.items():
        if name == "parc.step":
            state[name] = np.array(5, np.int64)
        elif name not in record["params"]:
            r = rng.standard_normal(v.shape).astype(v.dtype) * 1e-2
            state[name] = np.abs(r) * 1e-2 if name.endswith("exp_avg_sq") else r
    return state


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=IDS)
def test_split_signatures(forward, cfg):
    graph, record, _ = step_of(forward, cfg)
    compute, apply = split_step(graph)
    verify(compute)
    verify(apply)
    grads = [record["grads"][p] for p in record["params"]]
    assert [v.name for v in compute.inputs] == list(DATA)
    assert [v.name for v in compute.input_constants] == record["params"]
    assert [v.name for v in compute.outputs] == ["loss", *grads]
    assert [v.name for v in apply.inputs] == grads
    fed = set(record["bindings"].values())
    assert {v.name for v in apply.input_constants} == fed
    assert [v.name for v in apply.outputs] == [v.name for v in graph.outputs][1:]
    assert {n.meta["parc.phase"] for n in compute.nodes} == {"forward", "backward"}
    assert {n.meta["parc.phase"] for n in apply.nodes} == {"optimizer"}
    assert len(compute.nodes) + len(apply.nodes) == len(graph.nodes)
    assert json.loads(compute.metadata[SPLIT_KEY])["part"] == "compute"
    assert json.loads(apply.metadata[SPLIT_KEY])["bindings"] == record["bindings"]
    assert "parc.state" not in compute.metadata and "parc.state" not in apply.metadata
    onnx.checker.check_model(to_onnx(compute))
    onnx.checker.check_model(to_onnx(apply))
    assert "parc.state" in graph.metadata and len(graph.nodes) == len(compute.nodes) + len(apply.nodes)


@pytest.mark.parametrize("cfg", OPTIMIZERS, ids=IDS)
def test_split_in_sequence_equals_whole_step(forward, cfg):
    graph, record, model = step_of(forward, cfg)
    compute, apply = split_step(graph)
    state, data = _random_state(model, record), batch()
    whole = run(model, {**data, **state})
    grads = run(to_onnx(compute), {**data, **{p: state[p] for p in record["params"]}})
    new = run(to_onnx(apply), {**{g: grads[g] for g in record["grads"].values()}, **state})
    assert set(new) == set(whole) - {"loss"}
    np.testing.assert_allclose(grads["loss"], whole["loss"], rtol=1e-6)
    for name, v in new.items():
        np.testing.assert_allclose(v, whole[name], rtol=1e-6, atol=1e-9, err_msg=name)


def test_microbatches_sum_to_the_full_batch_step(forward, tmp_path):
    """Two batch-1 compute runs, gradients averaged, one apply: the batch-2 step (the loss is a
    mean over equally many tokens per sequence, so the full batch's gradient is the mean)."""
    cfg = OptimizerConfig("adamw", weight_decay=0.01)
    graph, record, model = step_of(forward, cfg)
    small, small_record, _ = step_of(build_model("gpt-tiny", tmp_path / "b1.onnx", {"batch": 1}), cfg)
    assert small_record["params"] == record["params"]
    compute, _ = split_step(small)
    _, apply = split_step(graph)
    state, data = _random_state(model, record), batch(2, seed=3)
    whole = run(model, {**data, **state})
    params = {p: state[p] for p in record["params"]}
    halves = [run(to_onnx(compute), {**{k: v[i:i + 1] for k, v in data.items()}, **params}) for i in (0, 1)]
    mean = {g: (halves[0][g] + halves[1][g]) / 2 for g in record["grads"].values()}
    new = run(to_onnx(apply), {**mean, **state})
    np.testing.assert_allclose((halves[0]["loss"] + halves[1]["loss"]) / 2, whole["loss"], rtol=1e-5)
    grads_whole = run(model, {**data, **state}, extra=tuple(record["grads"].values()))
    for p, g in record["grads"].items():
        np.testing.assert_allclose(mean[g], grads_whole[g], rtol=1e-4, atol=1e-7, err_msg=g)
        np.testing.assert_allclose(new[f"{p}.new"], whole[f"{p}.new"], rtol=1e-5, atol=1e-7, err_msg=p)


def test_split_needs_a_training_step(forward):
    with pytest.raises(UsageError, match="not a training step"):
        split_step(load(forward))


def test_a_masked_mean_loss_is_split_into_a_sum_over_a_count(tmp_path, monkeypatch):
    """bert-tiny's masked-LM loss (SoftmaxCrossEntropyLoss, ignore_index, mean) becomes its sum
    over the labels not ignored divided by their count, so the batch can be split; the loss and
    every gradient equal those of the step built from the op as it was."""
    import parc.autodiff.step as step_module
    from parc.ir.state import step_state

    path = build_model("bert-tiny", tmp_path / "bert.onnx")
    cfg = OptimizerConfig("sgd")
    graph, _, split = step_of(path, cfg)
    assert [n.op_type for n in graph.nodes if n.name.startswith("loss.softmax_cross_entropy.")][:6] == \
        ["SoftmaxCrossEntropyLoss", "Equal", "Not", "Cast", "ReduceSum", "Div"]
    sce = next(n for n in graph.nodes if n.op_type == "SoftmaxCrossEntropyLoss")
    assert sce.attr("reduction") == "sum"
    monkeypatch.setattr(step_module, "split_masked_means", lambda g: 0)
    plain_graph, _, plain = step_of(path, cfg)
    assert any(n.op_type == "SoftmaxCrossEntropyLoss" and n.attr("reduction", "mean") == "mean"
               for n in plain_graph.nodes)
    rng = np.random.default_rng(0)
    feeds = {}
    for v in onnx.load(str(path)).graph.input:
        shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
        feeds[v.name] = rng.integers(0, 2 if "type" in v.name else 64, size=shape).astype(np.int64)
    labels = next(k for k in feeds if "label" in k)
    feeds[labels][0, :5] = -100  # some ignored positions
    ignore = next(n for n in plain_graph.nodes if n.op_type == "SoftmaxCrossEntropyLoss").attr("ignore_index")
    feeds[labels][feeds[labels] == -100] = ignore
    grads = tuple(step_state(graph.metadata).grads.values())
    got, want = run(split, feeds, grads), run(plain, feeds, grads)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    for g in grads:
        np.testing.assert_allclose(got[g], want[g], rtol=1e-5, atol=1e-7)


def _backward_reads(graph: Graph) -> set[str]:
    """Forward values a backward node reads (what the step keeps for the backward pass)."""
    forward = {id(n) for n in graph.nodes if n.meta.get("parc.phase") == "forward"}
    return {v.name for n in graph.nodes if n.meta.get("parc.phase") == "backward"
            for v in n.inputs if v is not None and v.producer is not None and id(v.producer) in forward}


def test_recompute_keeps_only_gelus_input_and_changes_no_value(forward):
    """GELU as gpt-tiny writes it, 0.5 * (x * (1 + erf(x / sqrt 2))): without recomputation the
    backward pass keeps x, x / sqrt 2, 1 + erf(...) and the output; with it only x, and the
    step's outputs are equal to the bit."""
    cfg = OptimizerConfig("adamw", weight_decay=0.01)
    plain, _, plain_model = step_of(forward, cfg, recompute=False)
    graph, _, model = step_of(forward, cfg)
    gelu = {"h.0.mlp.gelu.div", "h.0.mlp.gelu.add", "h.0.mlp.gelu.half"}
    assert gelu <= _backward_reads(plain)
    kept = _backward_reads(graph)
    assert not gelu & kept and "h.0.mlp.fc.add" in kept
    copies = [n for n in graph.nodes if n.name.startswith("h.0.mlp.gelu.") and ".recompute" in n.name]
    assert copies and all(n.meta["parc.phase"] == "backward" and n.meta["parc.forward"] in
                          {m.name for m in plain.nodes} for n in copies)
    verify(graph)
    feeds = batch()
    want, got = run(plain_model, feeds), run(model, feeds)
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_recompute_stops_at_a_value_that_is_not_elementwise(forward):
    """A matmul's output is never recomputed (only elementwise cones), and a value the backward
    pass keeps anyway is a leaf: each recomputing node sits before a backward reader."""
    graph, _, _ = step_of(forward, OptimizerConfig("sgd"))
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    for n in graph.nodes:
        if ".recompute" not in n.name:
            continue
        assert n.op_type not in ("MatMul", "Gemm", "Softmax", "LayerNormalization")
        readers = [m for v in n.outputs for m, _ in v.uses]
        assert readers and all(position[id(m)] > position[id(n)] for m in readers)


def test_recompute_does_not_walk_a_long_elementwise_chain(tmp_path):
    """A kept value at the end of 3,000 elementwise nodes nobody else keeps: its cone is larger
    than MAX_CONE, found without walking the chain (the walk was recursive: Python's recursion
    limit), and the value is kept."""
    import onnx as onnx_
    from onnx import TensorProto, helper, numpy_helper

    chain = [helper.make_node("Mul", ["x", "w"], ["h0"])]
    chain += [helper.make_node("Neg", [f"h{i}"], [f"h{i + 1}"]) for i in range(3000)]
    chain += [helper.make_node("Mul", ["h3000", "h3000"], ["y"]), helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    graph = helper.make_graph(chain, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [numpy_helper.from_array(np.ones(4, np.float32), "w")])
    path = tmp_path / "chain.onnx"
    onnx_.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    g = load(path)
    make_training_step(g, OptimizerConfig("sgd"))
    assert "h3000" in _backward_reads(g) and not any(".recompute" in n.name for n in g.nodes)
