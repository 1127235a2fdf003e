"""The SPMD cost model on one mesh: strategies from op rules, a solvable Problem, sane choices."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from parc.autodiff import OptimizerConfig, make_training_step
from parc.cluster import enumerate_meshes, parse_devices
from parc.ir import load
from parc.models import build_model
from parc.passes.spmd.costs import build
from parc.passes.spmd.strategies import node_strategies
from parc.solver import solve


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "gpt.onnx"
    graph = load(build_model("gpt-tiny", path, {"batch": "32", "hidden": "256", "seq": "64", "heads": "4"}))
    make_training_step(graph, OptimizerConfig("adamw"))
    return graph


def test_matmul_strategies_follow_its_rule(step):
    mm = next(n for n in step.nodes if n.op_type == "MatMul")
    labels = {s.labels[0] for s in node_strategies(mm, (4,))}
    assert None in labels and len(labels) >= 3
    partial = [s for s in node_strategies(mm, (4,)) if s.labels[0] == "k"]
    assert partial and "P(sum)" in str(partial[0].outputs[0])


def test_plan_on_four_devices_is_data_parallel_and_beats_replication(step):
    cluster = parse_devices("4xa100-80g")
    mesh = enumerate_meshes(cluster)[0]
    model = build(step, mesh, cluster)
    solution = solve(model.problem, "O3")
    replicated = model.problem.cost(np.zeros(model.problem.n, dtype=np.int64))
    assert solution.cost < replicated
    chosen = Counter(str(model.strategies[i][solution.choice[model.node_index(i)]])
                     for i, n in enumerate(step.nodes)
                     if n.op_type == "MatMul" and n.meta["parc.phase"] == "forward")
    assert chosen.most_common(1)[0][0] == "b0"  # the batch label: data parallelism


def test_gpt_medium_training_on_8_a100_is_data_parallel(tmp_path):
    """Issue 4's quality bar: a small model with ample memory plans as data parallel."""
    graph = load(build_model("gpt-medium", tmp_path / "m.onnx", {"batch": "32"}))
    make_training_step(graph, OptimizerConfig("adamw"))
    cluster = parse_devices("8xa100-80g")
    mesh = enumerate_meshes(cluster, max_dims=1)[0]
    model = build(graph, mesh, cluster)
    solution = solve(model.problem.with_budget(80 * 2**30), "O3")
    chosen = Counter(str(model.strategies[i][solution.choice[model.node_index(i)]])
                     for i, n in enumerate(graph.nodes)
                     if n.op_type == "MatMul" and n.meta["parc.phase"] == "forward")
    assert chosen == Counter({"b0": 144})
