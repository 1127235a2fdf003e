"""A plan is never worse than a baseline solved on the same mesh in the same cost model: a
feasible baseline is a feasible point of the search, so when the search returns worse (an ILP
stopped at its time limit, O2's segments solved apart) the baseline's choice is kept."""

from __future__ import annotations

import numpy as np
from helpers import inp, make_model, tensor
from onnx import helper

from parc.cluster import parse_devices
from parc.ir.importer import from_model
from parc.passes.spmd import mesh_search as search_mod
from parc.passes.spmd.search import _no_worse_than_baselines, plan_graph
from parc.solver import Solution


def _sol(choice, cost, lower=0.5):
    return Solution(np.asarray(choice), cost, lower, (cost - lower) / cost, "time_limit", 1.0, "ilp")


def test_a_cheaper_feasible_baseline_replaces_the_search():
    got = _no_worse_than_baselines(_sol([0, 0], 2.0), {}, {
        "a": {"step_time_s": 1.5, "feasible": True, "choice": np.array([1, 1])},
        "b": {"step_time_s": 1.2, "feasible": True, "choice": np.array([2, 1])},
        "c": {"step_time_s": 0.9, "feasible": False, "choice": np.array([3, 3])}})  # over memory: not an option
    assert got.cost == 1.2 and list(got.choice) == [2, 1] and got.method == "baseline:b"
    assert got.lower_bound == 0.5 and abs(got.gap - (1.2 - 0.5) / 1.2) < 1e-12


def test_the_search_is_kept_when_no_baseline_beats_it():
    sol = _sol([0, 0], 1.0)
    assert _no_worse_than_baselines(sol, {}, {"a": {"step_time_s": 1.0, "feasible": True, "choice": [1, 1]}}) is sol


def test_a_baseline_against_the_hints_pins_is_not_taken():
    sol = _sol([0, 0], 2.0)
    rec = {"step_time_s": 1.0, "feasible": True, "choice": np.array([1, 1])}
    assert _no_worse_than_baselines(sol, {0: (0,)}, {"a": rec}) is sol
    assert _no_worse_than_baselines(sol, {0: (0, 1)}, {"a": rec}).cost == 1.0


def test_no_plan_on_a_mesh_but_a_feasible_baseline_gives_one():
    got = _no_worse_than_baselines("mesh (4,): out of memory", {}, {
        "a": {"step_time_s": 3.0, "feasible": True, "choice": np.array([1])}})
    assert isinstance(got, Solution) and got.cost == 3.0
    assert got.gap == float("inf") and got.status == "heuristic"  # nothing bounds it


def test_plan_graph_never_returns_worse_than_its_baselines(monkeypatch):
    """The search made to return the dearest choice it can: the plan is the best baseline's."""
    n = helper.make_node
    rng = np.random.default_rng(0)
    model = make_model([n("MatMul", ["x", "w1"], ["h"], name="fc1"), n("Relu", ["h"], ["a"], name="act"),
                        n("MatMul", ["a", "w2"], ["y"], name="fc2")],
                       [inp("x", [64, 256])], [inp("y", [64, 256])],
                       [tensor("w1", rng.standard_normal((256, 512)).astype(np.float32)),
                        tensor("w2", rng.standard_normal((512, 256)).astype(np.float32))])
    graph = from_model(model)
    cluster = parse_devices("4xa100-80g")
    honest = plan_graph(graph, cluster, jobs=1, max_mesh_dims=1)
    real_solve = search_mod.solve

    def bad_solve(problem, level, options, start=None):
        sol = real_solve(problem, level, options, start)
        if problem.pins:  # a baseline: solve it honestly
            return sol
        worst = np.array([int(np.argmax(c)) for c in problem.comp])
        return Solution(worst, problem.cost(worst), sol.lower_bound, 1.0, "time_limit", sol.time_s, "ilp")

    monkeypatch.setattr(search_mod, "solve", bad_solve)
    plan = plan_graph(graph, cluster, jobs=1, max_mesh_dims=1)
    doc = plan.to_json()
    feasible = [b["step_time_s"] for b in doc["baselines"].values() if b.get("feasible")]
    assert feasible and doc["predicted"]["step_time_s"] <= min(feasible) * (1 + 1e-9)
    assert plan.best.solution.method.startswith("baseline:")
    assert honest.best.solution.cost <= doc["predicted"]["step_time_s"] * (1 + 1e-9)
    assert all("choice" not in b for b in doc["baselines"].values())
