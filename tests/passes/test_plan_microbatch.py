"""--micro-batches: a training step planned as M microbatches with gradient accumulation."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_error, parc

from parc.cluster import parse_devices
from parc.ir import importer
from parc.passes.spmd.costs import build, micro_layout
from parc.passes.spmd.search import plan_graph
from parc.sharding import ShardSpec
from parc.solver import solve


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro") / "gpt.train.onnx"
    res = parc("models", "build", "gpt-tiny", "--set", "batch=16", "--set", "hidden=128", "--set", "seq=32",
               "--train", "adamw", "-o", str(path))
    assert res.returncode == 0, res.stderr
    return path


def test_layout_splits_data_on_batch_and_runs_the_optimizer_once(step):
    graph = importer.load(str(step), {})
    micro = micro_layout(graph, parse_devices("2xa100-80g"), 4)
    for pos, n in enumerate(graph.nodes):
        if n.meta.get("parc.phase") == "optimizer":
            assert micro.labels[pos] is None, n.name
    data = {v.name for v in graph.inputs if not v.is_const}
    sources = build(graph, None, parse_devices("2xa100-80g"), micro).sources
    for v, spec in zip(sources, micro.sources):
        assert str(spec) == ("S(0)" if v.name in data else "R"), v.name


def test_microbatches_cut_activation_memory_and_charge_compute_per_microbatch(step):
    graph = importer.load(str(step), {})
    cluster = parse_devices("2xa100-80g")
    whole = plan_graph(graph, cluster, max_mesh_dims=1, jobs=1)
    micro = plan_graph(graph, cluster, max_mesh_dims=1, jobs=1, micro_batches=4)
    params = sum(v.nbytes for v in graph.constants.values() if v.is_const)
    assert micro.best.memory_bytes < whole.best.memory_bytes
    assert micro.best.memory_bytes >= params / 2  # the state is still there, split at most 2 ways
    assert micro.best.compute_s > whole.best.compute_s  # 4 x the launch floors of a small step
    doc = micro.to_json()
    assert doc["micro_batches"]["count"] == 4
    assert doc["micro_batches"]["specs"]["input_ids"] == "S(0)"
    assert {len(ShardSpec(spec).axes) for spec in doc["specs"].values()} == {1}  # device axes only
    kinds = {c["kind"] for e in doc["communication"] for c in e["collectives"]}
    assert "accumulate" in kinds  # gradients summed over the microbatches, once per step
    for e in doc["communication"]:
        for c in e["collectives"]:
            assert (c["axis"] == "microbatch") == (c["kind"] == "accumulate")


def test_the_plan_cost_is_the_problem_cost(step):
    graph = importer.load(str(step), {})
    cluster = parse_devices("2xa100-80g")
    plan = plan_graph(graph, cluster, max_mesh_dims=1, jobs=1, micro_batches=2)
    p, x = plan.best.model.problem, plan.best.solution.choice
    assert plan.best.solution.cost == pytest.approx(p.cost(x))
    assert solve(p, "O2").cost == pytest.approx(plan.best.solution.cost, rel=2e-4)  # both within the MIP gap
    for name in ("data-parallel", "zero-3"):
        assert plan.best.solution.cost <= plan.baselines[name]["step_time_s"] * (1 + 1e-9)


def test_gradients_are_summed_over_the_microbatches_before_they_are_reduced(step, tmp_path):
    # on a flat mesh, every gradient's reduction over the devices runs once per step, after the
    # microbatches' sum: none in a microbatch (a bias gradient's, read by a Reshape, ran in each)
    res = parc("plan", str(step), "--devices", "2xcpu", "--micro-batches", "4", "-o", str(tmp_path / "p"))
    assert res.returncode == 0, res.stderr
    tasks = json.loads((tmp_path / "p" / "taskgraph.json").read_text())["tasks"]
    reductions = [t for t in tasks if t["kind"] == "collective" and t["op"] in ("all_reduce", "reduce_scatter")]
    assert reductions and {t["phase"] for t in reductions} == {"apply"}


def test_cli_writes_microbatches_and_rejects_bad_counts(step, tmp_path):
    res = parc("plan", str(step), "--devices", "2xa100-80g", "--micro-batches", "2", "-o", str(tmp_path / "p"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert doc["micro_batches"]["count"] == 2 and doc["mesh"]["shape"] == [2]
    assert_one_line_error(parc("plan", str(step), "--devices", "2xa100-80g", "--micro-batches", "0",
                               "-o", str(tmp_path / "q")), "--micro-batches 0")
    assert_one_line_error(parc("plan", str(step), "--devices", "2xa100-80g", "--micro-batches", "5",
                               "-o", str(tmp_path / "q")), "not divisible into 5 microbatches")
    assert_one_line_error(parc("plan", str(step), "--devices", "2xa100-80g", "--mesh-dims", "4",
                               "-o", str(tmp_path / "q")), "--mesh-dims 4")


def test_a_graph_that_needs_several_microbatches_at_once_is_refused():
    """Batch statistics (a mean over the batch feeding a nonlinear op) cannot be computed one
    microbatch at a time."""
    from helpers import inp, make_model
    from onnx import helper

    from parc.errors import UsageError
    from parc.ir.importer import from_model

    model = make_model([helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
                        helper.make_node("Relu", ["m"], ["y"])],
                       [inp("x", [8, 4])], [inp("y", [1, 4])], opset=17)
    with pytest.raises(UsageError, match=r"--micro-batches 4: node '.*' needs values of several microbatches"):
        micro_layout(from_model(model), parse_devices("2xa100-80g"), 4)


def test_the_refusal_names_the_node_that_cannot_split_the_batch():
    """A class-weighted mean loss (its denominator is the weights of the labels present, not
    equal shares) has no split along the batch: the message names it, not a node upstream
    whose edge the search first finds forbidden."""
    import numpy as np
    from helpers import inp, make_model
    from onnx import helper, numpy_helper

    from parc.errors import UsageError
    from parc.ir.importer import from_model

    model = make_model([helper.make_node("Relu", ["x"], ["h"]),
                        helper.make_node("SoftmaxCrossEntropyLoss", ["h", "t", "w"], ["loss"])],
                       [inp("x", [8, 4]), inp("t", [8], 7)], [inp("loss", [])], opset=17)
    model.graph.initializer.append(numpy_helper.from_array(np.ones(4, np.float32), "w"))
    with pytest.raises(UsageError, match=r"node '.*' \(SoftmaxCrossEntropyLoss\) cannot run on part of the batch"):
        micro_layout(from_model(model), parse_devices("2xa100-80g"), 2)


def test_the_forbidden_price_is_above_every_allowed_plan_and_no_more_than_it_needs(step):
    """A forbidden time-axis move costs FORBIDDEN_SCALE times the dearest plan without one
    (every node's and edge's dearest allowed entry), however large the compute: a GPT-175B-like
    step priced on one H100 has single matmuls of 3,800 s, which a fixed 1e3 s read as 'cannot
    be split into microbatches'. And no more: a fixed 1e3 s on a small model left the LP's
    bound above a plan it had not found (test_a_masked_mean_reads_its_labels_whole...)."""
    import numpy as np

    import parc.passes.spmd.costs as costs
    from parc.passes.spmd.costs import Micro

    graph = importer.load(str(step), {})
    model = build(graph, None, parse_devices("2xa100-80g"), Micro(4))  # the layout not yet decided
    p = model.problem
    forbidden = [m for m in p.comm if (m >= model.forbidden).any()]
    assert forbidden and all(np.isfinite(m).all() for m in p.comm)  # priced, not inf
    allowed = [m[m < model.forbidden] for m in p.comm]
    dearest = sum(float(c.max()) for c in p.comp) + sum(float(a.max()) for a in allowed if a.size)
    assert model.forbidden == pytest.approx(costs.FORBIDDEN_SCALE * dearest, rel=1e-9)
    assert solve(p, "O2").cost < model.forbidden


@pytest.fixture(scope="module")
def bert_step(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro-bert") / "bert.train.onnx"
    res = parc("models", "build", "bert-tiny", "--set", "batch=4", "--train", "adamw", "-o", str(path))
    assert res.returncode == 0, res.stderr
    return path


def test_a_masked_mean_reads_its_labels_whole_and_the_model_still_splits(bert_step):
    """BERT's MLM loss is a mean over the labels not ignored: its count needs every
    microbatch's labels, which are all at hand when the step starts, so the labels are read
    whole and the count computed in each microbatch; the model itself runs on the piece.
    (With a fixed 1e3 s price on forbidden moves, the LP's tolerances made the search read
    every input whole here: each microbatch computing the whole batch.)"""
    graph = importer.load(str(bert_step), {})
    cluster = parse_devices("2xa100-80g")
    micro = micro_layout(graph, cluster, 2)
    sources = dict(zip((v.name for v in build(graph, None, cluster, micro).sources), micro.sources))
    assert str(sources["labels"]) == "R" and str(sources["input_ids"]) == "S(0)"
    label = {n.name: micro.labels[pos] for pos, n in enumerate(graph.nodes)}
    forward = [n.name for n in graph.nodes if n.meta.get("parc.phase") == "forward"]
    assert label["labels.flatten"] is None  # the count's cone, whole
    whole = [name for name in forward if label[name] is None and not name.startswith(("labels", "loss"))]
    assert whole == ["embeddings.token_type.gather"], whole  # a parameter's row, no batch dim
    model = build(graph, None, cluster, micro)
    assert model.forbidden < 1.0  # priced against this model's costs, not a fixed 1e3 s
    assert solve(model.problem, "O3").cost < model.forbidden


@pytest.mark.parametrize("elem", [7, 1])  # int64, float
def test_only_integer_data_may_be_read_whole(elem):
    """Only integer data (labels, ids, masks) may be read whole: a float input is the model's
    work, and one needed whole means the step cannot run as microbatches."""
    from helpers import inp, make_model
    from onnx import helper

    from parc.errors import UsageError
    from parc.ir.importer import from_model

    model = make_model([helper.make_node("Cast", ["t"], ["f"], to=1),
                        helper.make_node("ReduceSum", ["f"], ["n"], keepdims=0),
                        helper.make_node("Mul", ["x", "n"], ["y"])],
                       [inp("x", [8, 4]), inp("t", [8], elem)], [inp("y", [8, 4])], opset=17)
    graph = from_model(model)
    if elem == 1:
        with pytest.raises(UsageError, match="cannot be split into microbatches"):
            micro_layout(graph, parse_devices("2xa100-80g"), 2)
        return
    micro = micro_layout(graph, parse_devices("2xa100-80g"), 2)
    sources = build(graph, None, parse_devices("2xa100-80g"), micro).sources
    assert {v.name: str(s) for v, s in zip(sources, micro.sources)} == {"x": "S(0)", "t": "R"}
