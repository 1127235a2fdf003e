"""`parc explain` end to end on a real plan: every format, JSON against plan.json, bad input."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_error, parc


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    """A gpt-tiny AdamW step (batch 32, hidden 256, seq 64) planned on 2 A100s."""
    root = tmp_path_factory.mktemp("explain")
    res = parc("models", "build", "gpt-tiny", "--set", "batch=32", "--set", "hidden=256", "--set", "seq=64",
               "--train", "adamw", "-o", str(root / "step.onnx"))
    assert res.returncode == 0, res.stderr
    res = parc("plan", str(root / "step.onnx"), "--devices", "2xa100-80g", "-o", str(root / "plan"))
    assert res.returncode == 0, res.stderr
    return root / "plan"


@pytest.fixture(scope="module")
def plan(plan_dir):
    return json.loads((plan_dir / "plan.json").read_text())


@pytest.fixture(scope="module")
def report(plan_dir):
    res = parc("explain", str(plan_dir), "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("fmt, start, needles", [
    ("text", "parc explain: ", ["Summary", "Strategy per op group", "Parameter layouts", "Communication",
                                "Memory", "Against baselines", "Why"]),
    ("md", "# parc explain: ", ["## Summary", "## Why", "| scope |", "| --- |"]),
    ("html", "<!DOCTYPE html>", ["<style>", "<table>", "<h2>Why</h2>", "</html>"]),
    ("json", "{", ['"format": "parc.explain/1"']),
])
def test_each_format_renders(plan_dir, fmt, start, needles):
    res = parc("explain", str(plan_dir), "--format", fmt)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(start)
    for needle in needles:
        assert needle in res.stdout, needle
    assert "\x1b[" not in res.stdout  # piped: no colour codes
    if fmt == "html":
        assert "<script" not in res.stdout and "src=" not in res.stdout and "<link" not in res.stdout


def test_text_says_what_was_chosen_and_why(plan_dir, plan):
    text = parc("explain", str(plan_dir)).stdout
    assert "2 x a100-80g in 1 node" in text
    assert "(2,)" in text and "chosen" in text
    assert "data parallel (batch split) on axis 0" in text
    for scope in ("embed", "h.0.attn", "h.0.mlp", "h.1.attn", "lm_head"):
        assert f"| {scope} " in text, scope
    top = max(plan["communication"], key=lambda e: e["time_s"])
    assert top["collectives"][0]["kind"] in text and "top 10 edges by time" in text
    assert "% of the 80.00 GiB budget" in text and "[" in text
    assert "- communication is " in text and "% of the predicted step" in text
    # beside the search's estimate, the step `parc simulate` gives (plan.json's simulation)
    sim = plan["simulation"]["step_time_s"] * 1e3
    assert f"simulated step  {sim:.3f} ms (the task graph replayed, as parc simulate: communication exposed" in text
    for name in plan["baselines"]:
        assert f"baseline {name} is predicted" in text
    assert all(len(line) <= 140 for line in text.splitlines())


def test_json_keys_and_totals_match_plan(report, plan):
    assert set(report) >= {"format", "plan", "format_version", "model", "summary", "step", "groups",
                           "strategy_mix", "parameters", "communication", "memory", "baselines", "why"}
    assert report["format_version"] == plan["format_version"]
    assert report["summary"]["mesh_shape"] == plan["mesh"]["shape"]
    assert report["summary"]["solver_level"] == plan["solver"]["level"]
    assert [m["shape"] for m in report["summary"]["meshes"]] == [m["shape"] for m in plan["solver"]["meshes"]]
    pred = plan["predicted"]
    assert report["step"]["step_time_s"] == pred["step_time_s"]
    assert report["step"]["comm_fraction"] == pytest.approx(pred["comm_s"] / pred["step_time_s"])

    edges = plan["communication"]
    c = report["communication"]
    assert c["edges"] == len(edges) > 0
    assert c["collectives"] == sum(len(e["collectives"]) for e in edges)
    assert c["bytes_per_device"] == pytest.approx(sum(k["bytes_per_device"] for e in edges for k in e["collectives"]))
    assert c["time_s"] == pytest.approx(sum(e["time_s"] for e in edges))
    assert c["unitemized_s"] == pytest.approx(pred["comm_s"] - c["time_s"])
    for table in ("by_kind", "by_axis"):
        assert sum(s["count"] for s in c[table]) == c["collectives"]
        assert sum(s["bytes_per_device"] for s in c[table]) == pytest.approx(c["bytes_per_device"])
        assert sum(s["time_s"] for s in c[table]) == pytest.approx(c["time_s"])
    kinds = {k["kind"] for e in edges for k in e["collectives"]}
    assert {s["key"] for s in c["by_kind"]} == kinds
    times = [e["time_s"] for e in c["top_edges"]]
    assert len(times) == min(10, len(edges)) and times == sorted(times, reverse=True)
    assert times[0] == max(e["time_s"] for e in edges)

    assert sum(g["nodes"] for g in report["groups"]) == len(plan["strategies"])
    assert sum(n for mix in report["strategy_mix"].values() for n in mix.values()) == len(plan["strategies"])
    p = report["parameters"]
    specs = plan["specs"]
    assert p["count"] == len(p["items"]) == p["replicated"] + p["sharded"] > 0
    for q in p["items"]:
        assert q["spec"] == specs[q["name"]] and q["new_spec"] == specs[q["name"] + ".new"]
        assert q["sharded"] == (q["spec"] != "R")
        assert all(s.startswith(q["name"] + ".") for s in q["state"])

    m = report["memory"]
    assert m["max_bytes"] == max(pred["memory_bytes_per_device"])
    assert m["budget_bytes"] == pred["memory_budget_bytes"]
    assert {b["name"] for b in report["baselines"]} == set(plan["baselines"])
    for b in report["baselines"]:
        assert b["time_ratio"] == pytest.approx(plan["baselines"][b["name"]]["step_time_s"] / pred["step_time_s"])
    assert report["why"] and all(isinstance(s, str) for s in report["why"])


def test_output_file_is_written_whole(plan_dir, tmp_path):
    out = tmp_path / "report.md"
    out.write_text("old")
    res = parc("explain", str(plan_dir), "--format", "md", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert out.read_text() == parc("explain", str(plan_dir), "--format", "md").stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]  # no temporary left behind


def test_refuses_to_overwrite_plan_json(plan_dir):
    before = (plan_dir / "plan.json").read_bytes()
    res = parc("explain", str(plan_dir), "--format", "json", "-o", str(plan_dir / "plan.json"))
    assert_one_line_error(res, "refusing to overwrite", "plan.json")
    assert (plan_dir / "plan.json").read_bytes() == before


def test_bad_plan_directories_are_one_line(tmp_path):
    assert_one_line_error(parc("explain", str(tmp_path / "missing")), "no such plan directory")
    assert_one_line_error(parc("explain", str(tmp_path)), "no plan.json")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "plan.json").write_text('{"format_version": 1,')
    assert_one_line_error(parc("explain", str(bad)), "not valid JSON", "line 1")
    (bad / "plan.json").write_text('{"format_version": 7}')
    assert_one_line_error(parc("explain", str(bad)), "unknown format_version 7")
    (bad / "plan.json").write_text('{"format_version": 1, "mesh": {"shape": [2]}}')
    assert_one_line_error(parc("explain", str(bad)), "a plan of format 1, written by an older parc: plan the model again")
    (bad / "plan.json").write_text('{"format_version": 3, "mesh": {"shape": [2]}}')
    assert_one_line_error(parc("explain", str(bad)), "missing key 'cluster'")
    from parc.cluster import parse_devices

    (bad / "plan.json").write_text(json.dumps({
        "format_version": 3, "cluster": parse_devices("2xa100-80g").to_json(), "mesh": {"shape": [2]},
        "stages": [{"id": 0, "devices": [0, 1], "mesh": [2], "device_types": ["a100-80g"], "nodes": 0,
                    "step_time_s": 1.0, "memory_bytes_per_device": 1.0, "parameters": 0}],
        "schedule": {"kind": "1f1b", "micro_batches": 1}, "specs": {}, "strategies": {}, "communication": ["x"],
        "predicted": {"step_time_s": 1.0, "compute_s": 1.0, "comm_s": 0.0, "memory_bytes_per_device": [1.0],
                      "memory_budget_bytes": 2.0}}))
    assert_one_line_error(parc("explain", str(bad)), "malformed plan")


def test_bad_flags_are_one_line(plan_dir, tmp_path):
    assert_one_line_error(parc("explain", str(plan_dir), "--format", "pdf"), "pdf")
    assert_one_line_error(parc("explain", str(plan_dir), "-o", str(tmp_path / "nowhere" / "r.txt")),
                          "does not exist")
