"""The library entry point: `parc.plan`, `parc.simulate`, `parc.verify` and `PlanOptions`, and the
CLI as a thin layer over them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import parc as run_parc

import parc
from parc.cluster import parse_devices
from parc.errors import InfeasiblePlanError, UsageError


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    path = tmp_path_factory.mktemp("api") / "gpt.train.onnx"
    res = run_parc("models", "build", "gpt-tiny", "--train", "momentum", "-o", str(path))
    assert res.returncode == 0, res.stderr
    return path


def _decisions(doc: dict) -> dict:
    """What a plan decided (not how long the search took)."""
    return {k: doc[k] for k in ("mesh", "specs", "strategies", "predicted", "baselines")}


def test_plan_from_python_is_what_the_cli_writes(step, tmp_path):
    planned = parc.plan(step, "4xa100-80g", parc.PlanOptions(pipeline="off", jobs=1))
    assert isinstance(planned, parc.Planned) and planned.stages == 0
    assert planned.step_time_s == planned.doc["predicted"]["step_time_s"] > 0
    path = planned.write(tmp_path / "lib")
    assert path == tmp_path / "lib" / "plan.json"
    lib = json.loads(path.read_text())
    res = run_parc("plan", str(step), "--devices", "4xa100-80g", "--pipeline", "off", "--jobs", "1",
                   "-o", str(tmp_path / "cli"))
    assert res.returncode == 0, res.stderr
    cli = json.loads((tmp_path / "cli" / "plan.json").read_text())
    assert _decisions(lib) == _decisions(cli)
    assert lib["simulation"]["step_time_s"] == cli["simulation"]["step_time_s"]
    assert {p.name for p in (tmp_path / "lib").iterdir()} == {p.name for p in (tmp_path / "cli").iterdir()}


def test_simulate_takes_a_planned_or_a_plan_directory(step, tmp_path):
    planned = parc.plan(step, parse_devices("2x2xa100-80g"), parc.PlanOptions(pipeline=2, jobs=1))
    assert planned.stages == 2 and len(planned.doc["stages"]) == 2
    before = parc.simulate(planned)  # one simulated rank per stage, nothing written
    assert len(before.ranks) == 2 and before.step_time_s > 0
    planned.write(tmp_path / "pp", programs=False)
    written = parc.simulate(tmp_path / "pp")
    assert written.step_time_s == pytest.approx(before.step_time_s)
    assert planned.doc["simulation"]["step_time_s"] == pytest.approx(before.step_time_s)


def test_verify_from_python(step, tmp_path):
    planned = parc.plan(step, "2xa100-80g", parc.PlanOptions(pipeline="off", jobs=1))
    planned.write(tmp_path / "plan")
    result = parc.verify(tmp_path / "plan", steps=2)
    assert result.ok and result.steps == 2 and result.ranks == 2
    assert result.tensors and all(row["ok"] for row in result.tensors)
    assert result.to_json()["ok"] is True


@pytest.mark.parametrize("kwargs, flag", [
    ({"pipeline": 1}, "--pipeline 1"), ({"pipeline": "sideways"}, "--pipeline sideways"),
    ({"mesh_dims": 4}, "--mesh-dims 4"), ({"time_limit": 0}, "--time-limit 0"),
    ({"memory_limit_gib": -1.0}, "--mem-limit -1.0"), ({"micro_batches": 0}, "--micro-batches 0"),
    ({"jobs": 0}, "--jobs 0"), ({"dims": {"batch": 0}}, "--dim batch=0"), ({"level": "O1"}, "level 'O1'"),
    ({"pipeline_tolerance": -0.5}, "-0.5"),
])
def test_bad_options_name_the_flag(kwargs, flag):
    with pytest.raises(UsageError, match=flag.replace("-", r"\-").replace(".", r"\.")):
        parc.PlanOptions(**kwargs)


def test_options_are_frozen_and_parse_the_pipeline():
    options = parc.PlanOptions(pipeline="AUTO", dims={"batch": 8})
    assert options.stages == -1 and parc.PlanOptions(pipeline="off").stages == 0
    assert parc.PlanOptions(pipeline="4").stages == 4 == parc.PlanOptions(pipeline=4).stages
    assert parc.PlanOptions(memory_limit_gib=2).memory_budget == 2 * 2**30
    with pytest.raises(AttributeError):
        options.level = "O2"  # type: ignore[misc]


def test_a_plan_that_does_not_fit_raises(step):
    with pytest.raises(InfeasiblePlanError):
        parc.plan(step, "2xa100-80g", parc.PlanOptions(pipeline="off", memory_limit_gib=1e-4, jobs=1))


def test_importing_the_executor_loads_no_planner():
    """A rank imports parc.exec: the root package's lazy entry points must not pull the planner in."""
    code = ("import sys, parc, parc.exec.runner, parc.exec.stepsim, parc.plandir\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('parc.passes', 'parc.solver', 'parc.api')))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert callable(parc.plan) and parc.plan is parc.api.plan


def test_the_python_api_page_runs(tmp_path, monkeypatch):
    """docs/python-api.md's example, as written, in a fresh directory."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "python-api.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("predicted step ") and lines[1].startswith("simulated ")
    assert lines[2].startswith("verified ")
    assert (tmp_path / "plan" / "plan.json").is_file()
