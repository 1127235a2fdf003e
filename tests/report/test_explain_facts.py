"""`explain` as a pure function on hand-made plans: 2-D mesh, edge cases, renderers."""

from __future__ import annotations

import copy
import json

import pytest

from parc.cluster.devices import DEVICES
from parc.errors import PlanFormatError
from parc.plandir import Plan
from parc.report import PLAN_FORMAT, check_plan, render
from parc.report import explain as explain_plan


def explain(doc: dict, where: str = "plan.json"):
    """The report of a plan.json document."""
    return explain_plan(Plan.from_json(doc, where), where)


def tiny_plan() -> dict:
    """A plan.json a 2x2 mesh over two nodes could have: every key the report reads."""
    link = {"bandwidth": 3e11, "latency": 3.4e-6, "name": "nvlink3"}
    net = {"bandwidth": 1.25e10, "latency": 1.4e-5, "name": "net-100g"}
    return {
        "format_version": PLAN_FORMAT,
        "model": {"path": "/models/<tiny>.onnx", "sha256": "0" * 64},
        "cluster": {"device_types": {"a100-80g": DEVICES["a100-80g"].to_json()}, "inter_link": net,
                    "nodes": [{"devices": ["a100-80g"] * 2, "intra_link": link, "nics": 1}] * 2},
        "mesh": {"shape": [2, 2], "devices": [0, 1, 2, 3], "links": [net, link], "spans_nodes": [True, False]},
        "stages": [{"id": 0, "devices": [0, 1, 2, 3], "mesh": [2, 2], "device_types": ["a100-80g"], "nodes": 6,
                    "step_time_s": 0.010, "memory_bytes_per_device": 3 * 2**30, "parameters": 1024}],
        "schedule": {"kind": "1f1b", "micro_batches": 1},
        "step": {"loss": "loss", "data": ["x"], "parameters": {
            "h.0.fc.weight": {"gradient": "h.0.fc.weight.grad", "new": "h.0.fc.weight.new",
                              "state": {"h.0.fc.weight.exp_avg": "h.0.fc.weight.exp_avg.new"}},
            "h.0.ln.weight": {"gradient": None, "new": "h.0.ln.weight.new", "state": {}}}},
        "phases": {"h.0.fc.matmul.grad.MatMul_0": "backward", "h.0.fc.weight.update.Mul_0": "optimizer"},
        "predicted": {"step_time_s": 0.010, "compute_s": 0.008, "comm_s": 0.002,
                      "memory_bytes_per_device": [3 * 2**30] * 4, "memory_budget_bytes": 4 * 2**30},
        "specs": {"x": "S(0)R", "h.0.fc.weight": "RS(1)", "h.0.fc.weight.new": "RS(1)",
                  "h.0.fc.weight.exp_avg": "RS(1)", "h.0.fc.weight.exp_avg.new": "RS(1)",
                  "h.0.ln.weight": "RR", "h.0.ln.weight.new": "S(0)R",
                  "h.0.fc.matmul": "S(0)S(2)", "h.0.proj.matmul": "S(0)P(sum)"},
        "strategies": {"h.0.fc.matmul": "b0xn", "h.0.proj.matmul": "b0xk", "h.0.fc.matmul.grad.MatMul_0": "b0xn",
                       "h.0.fc.weight.update.Mul_0": "-xd1", "h.0.ln.norm": "d0x-", "head.gemm": "-x-"},
        "communication": [
            {"value": "h.0.proj.matmul", "consumer": "h.0.ln.norm", "from": "S(0)P(sum)", "to": "S(0)R",
             "collectives": [{"kind": "all_reduce", "axis": 1, "bytes_per_device": 3000.0}], "time_s": 0.0015},
            {"value": "h.0.ln.norm", "consumer": "head.gemm", "from": "S(0)R", "to": "RR",
             "collectives": [{"kind": "all_gather", "axis": 0, "bytes_per_device": 1000.0},
                             {"kind": "all_to_all", "axis": 1, "bytes_per_device": 3000.0}], "time_s": 0.0004},
        ],
        "solver": {"level": "O3", "time_s": 2.5, "gap": 0.0, "status": "optimal", "nodes": 9,
                   "meshes": [{"shape": [4], "feasible": False},
                              {"shape": [2, 2], "feasible": True, "step_time_s": 0.010, "gap": 0.0}]},
        "baselines": {"data-parallel": {"step_time_s": None, "memory_bytes_per_device": None, "feasible": False},
                      "zero-3": {"step_time_s": 0.012, "memory_bytes_per_device": 5 * 2**30, "feasible": False},
                      "slow": {"step_time_s": 0.015, "memory_bytes_per_device": 2 * 2**30, "feasible": True}},
    }


def test_facts_of_a_2d_plan():
    r = explain(tiny_plan(), "p/plan.json")
    s = r.summary
    assert (s.devices, s.nodes, s.device_types) == (4, 2, {"a100-80g": 4})
    assert "net-100g across" in s.cluster
    assert [a.link for a in s.mesh_axes] == ["net-100g", "nvlink3"] and s.mesh_axes[0].spans_nodes
    assert [(m.shape, m.feasible, m.chosen) for m in s.meshes] == [([4], False, False), ([2, 2], True, True)]
    assert r.step.comm_fraction == pytest.approx(0.2)
    groups = {g.scope: g for g in r.groups}
    assert set(groups) == {"h.0.fc", "h.0.proj", "h.0.ln", "head"}
    fc = groups["h.0.fc"]
    assert fc.phases == {"forward": 1, "backward": 1, "optimizer": 1}
    assert fc.strategy == "data parallel (batch split) on axis 0, column-split (n) on axis 1"
    assert (fc.strategy_nodes, fc.optimizer_strategy) == (2, "sharded update (dim 1) on axis 1")
    assert groups["h.0.proj"].strategy == "data parallel (batch split) on axis 0, partial sum (k) on axis 1"
    assert groups["head"].strategy == "replicated" and groups["head"].optimizer_strategy is None
    p = r.parameters
    assert [q.name for q in p.items] == ["h.0.fc.weight", "h.0.ln.weight"]
    assert (p.count, p.sharded, p.replicated, p.state_tensors, p.state_sharded, p.relaid) == (2, 1, 1, 1, 1, 1)
    assert p.sharded_bytes is None  # this plan records no tensor sizes


def test_communication_splits_an_edges_time_by_bytes():
    c = explain(tiny_plan()).communication
    assert (c.edges, c.collectives, c.bytes_per_device) == (2, 3, 7000.0)
    assert c.time_s == pytest.approx(0.0019) and c.unitemized_s == pytest.approx(0.0001)
    kinds = {k.key: k for k in c.by_kind}
    assert kinds["all_reduce"].time_s == pytest.approx(0.0015)
    assert kinds["all_gather"].time_s == pytest.approx(0.0001) and kinds["all_to_all"].time_s == pytest.approx(0.0003)
    axes = {a.key: a for a in c.by_axis}
    assert (axes["0"].count, axes["1"].count) == (1, 2)
    assert [e.value for e in c.top_edges] == ["h.0.proj.matmul", "h.0.ln.norm"]


def test_why_names_infeasible_baselines_and_slower_meshes():
    why = "\n".join(explain(tiny_plan()).why)
    assert "communication is 20.0% of the predicted step" in why
    assert "baseline data-parallel is infeasible: no layout around its pins fits the 4.00 GiB budget" in why
    assert "baseline zero-3 is infeasible: it needs 5.00 GiB per device > budget 4.00 GiB" in why
    assert "baseline slow is predicted 50.0% slower than the plan" in why
    assert "mesh (4,) does not fit the memory budget" in why
    assert "the plan shards 1 of 2 parameters that data parallel replicates (h.0.fc.weight)" in why
    assert "e.g. h.0.ln.weight: S(0)R -> RR" in why


def test_why_says_how_far_any_mesh_can_beat_the_plan():
    """A mesh whose proven bound is above the plan cannot win, however far its own plan is from
    its optimum; the solver's sentence gives the gap over every mesh tried, and the chosen mesh's
    own when that differs."""
    plan = tiny_plan()
    plan["solver"].update(gap=0.004, gap_over_meshes=0.01, status="heuristic", level="O2",
                          meshes=[{"shape": [4], "feasible": True, "step_time_s": 0.014, "gap": 0.25,
                                   "lower_bound_s": 0.0105},
                                  {"shape": [2, 2], "feasible": True, "step_time_s": 0.010, "gap": 0.004,
                                   "lower_bound_s": 0.00996},
                                  {"shape": [1, 4], "feasible": True, "step_time_s": 0.012, "gap": 0.2,
                                   "lower_bound_s": 0.0099}])
    why = "\n".join(explain(plan).why)
    assert ("mesh (4,) was predicted 14.000 ms, 40.0% slower than (2, 2); no plan on it is faster than "
            "10.500 ms (proven), so it cannot win") in why
    assert "mesh (1, 4) was predicted 12.000 ms, 20.0% slower than (2, 2) (solver gap 20%)" in why
    assert ("the solver (O2) proves that no plan on any mesh tried is more than 1% faster than this one "
            "in the cost model (on its own mesh: 0.4%)") in why


def test_optional_keys_may_be_absent():
    plan = tiny_plan()
    for key in ("communication", "baselines", "solver", "model", "step", "phases"):
        del plan[key]
    r = explain(plan)
    assert not r.communication.recorded and r.baselines == [] and r.summary.meshes == []
    assert r.parameters.count == 0  # not a training step: no parameters to show
    assert r.summary.devices == 4
    for fmt in ("text", "md", "html", "json"):
        assert render(r, fmt)


def test_parameter_bytes_come_from_an_optional_tensors_key():
    plan = tiny_plan()
    plan["tensors"] = {"h.0.fc.weight": {"shape": [32, 32], "dtype": "float", "bytes": 4096, "role": "parameter"},
                       "h.0.ln.weight": {"shape": [256], "dtype": "float", "bytes": 1024, "role": "parameter"}}
    p = explain(plan).parameters
    assert (p.sharded_bytes, p.replicated_bytes) == (4096, 1024)
    assert "parameters (4.00 KiB) that data parallel replicates" in "\n".join(explain(plan).why)


def test_renderers_escape_names():
    r = explain(tiny_plan(), "p/plan.json")
    page = render(r, "html")
    assert page.startswith("<!DOCTYPE html>") and "&lt;tiny&gt;" in page and "<tiny>" not in page
    assert "<script" not in page and "http" not in page and "<link" not in page
    assert "/models/\\<tiny>.onnx" in render(r, "md")
    doc = json.loads(render(r, "json"))
    assert doc["format"] == "parc.explain/1" and doc["model"] == "/models/<tiny>.onnx"


@pytest.mark.parametrize("edit, message", [
    (lambda p: p.pop("specs"), "missing key 'specs'"),
    (lambda p: p["predicted"].pop("step_time_s"), "missing key 'predicted.step_time_s'"),
    (lambda p: p.__setitem__("format_version", 99), "unknown format_version 99"),
    (lambda p: p.__setitem__("communication", {}), "key 'communication' should be a list"),
    (lambda p: p["predicted"].__setitem__("comm_s", True), "key 'predicted.comm_s' should be a number"),
    (lambda p: p["mesh"].__setitem__("shape", []), "mesh.shape should be a list of positive ints"),
])
def test_check_plan_names_the_broken_key(edit, message):
    plan = copy.deepcopy(tiny_plan())
    edit(plan)
    with pytest.raises(PlanFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_plan(plan)


def test_a_calibrated_links_call_cost_and_handoff_are_shown():
    plan = tiny_plan()
    plan["mesh"]["links"][1] = {"bandwidth": 1.2e9, "latency": 1.9e-5, "name": "shm", "call": 2.4e-4, "handoff": 1e-3}
    r = explain(plan, "p/plan.json")
    assert (r.summary.mesh_axes[1].call, r.summary.mesh_axes[1].handoff) == (2.4e-4, 1e-3)
    assert r.summary.mesh_axes[0].call is None
    text = " ".join(render(r, "text").split())  # the summary wraps its lines
    assert "over shm (1.2 GB/s, 19 us, 240 us a call, 1000 us handoff)" in text
    assert "over net-100g (12.5 GB/s, 14 us)" in text
    plan["mesh"]["links"][1]["step_ratio"] = 2.8
    text = " ".join(render(explain(plan, "p/plan.json"), "text").split())
    assert "1000 us handoff; collectives x2.80 (the calibration's step_ratio))" in text


def test_a_calibrated_step_ratio_is_shown_beside_the_devices():
    plan = copy.deepcopy(tiny_plan())
    assert "step_ratio" not in " ".join(render(explain(plan, "p/plan.json"), "text").split())
    plan["cluster"]["device_types"]["a100-80g"] = {**DEVICES["a100-80g"].to_json(), "step_ratio": 1.164}
    text = " ".join(render(explain(plan, "p/plan.json"), "text").split())
    assert "node times x1.16 (the calibration's step_ratio)" in text


def test_a_links_collective_kinds_with_figures_of_their_own_are_shown():
    plan = tiny_plan()
    plan["mesh"]["links"][1] = {"bandwidth": 4e9, "latency": 5e-6, "name": "shm",
                                "kinds": {"reduce_scatter": [2.5e-5, 1.9e9], "all_gather": [1e-5, 2.3e9]}}
    r = explain(plan, "p/plan.json")
    assert r.summary.mesh_axes[1].kinds == {"reduce_scatter": [2.5e-5, 1.9e9], "all_gather": [1e-5, 2.3e9]}
    text = " ".join(render(r, "text").split())
    assert "over shm (4 GB/s, 5 us; all-gather 2.3 GB/s, 10 us; reduce-scatter 1.9 GB/s, 25 us)" in text


def test_the_summary_tables_the_mesh_axes_with_their_links_and_device_groups():
    """Each axis of the chosen mesh is a row: its size, link, whether it crosses nodes and the
    device groups a collective along it runs among; the meshes-tried table labels every column."""
    r = explain(tiny_plan(), "p/plan.json")
    assert [a.groups for a in r.summary.mesh_axes] == [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]
    lines = render(r, "text").splitlines()
    assert any(line.split() == "| 0 | 2 | net-100g | yes | {0,2} {1,3} |".split() for line in lines)
    assert any(line.split() == "| 1 | 2 | nvlink3 | no | {0,1} {2,3} |".split() for line in lines)
    assert any(line.split() == "| mesh tried | feasible | step time | gap | chosen |".split() for line in lines)
    plan = tiny_plan()
    plan["mesh"] = {"shape": [2, 8], "devices": list(range(16)), "links": plan["mesh"]["links"]}
    axes = explain(plan).summary.mesh_axes
    assert axes[1].groups == [list(range(8)), list(range(8, 16))]
    text = render(explain(plan), "text")
    assert "{0-7} {8-15}" in text and "{0,8} {1,9} {2,10} {3,11} ... (8 groups)" in text
    del plan["mesh"]["devices"]  # unknown: the sizes and links are still shown
    rows = [line.split() for line in render(explain(plan), "text").splitlines()]
    assert "| 1 | 8 | nvlink3 | - | - |".split() in rows
