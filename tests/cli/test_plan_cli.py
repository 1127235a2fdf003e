"""`parc plan` end to end on a small training step (the first cut of the SPMD planner)."""

from __future__ import annotations

import json

import pytest
from helpers import parc

from parc.ir import importer
from parc.ir.state import OPTIMIZER, phase
from parc.sharding import ShardSpec


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "gpt.train.onnx"
    res = parc("models", "build", "gpt-tiny", "--set", "batch=32", "--set", "hidden=256", "--set", "seq=64",
               "--train", "adamw", "-o", str(path))
    assert res.returncode == 0, res.stderr
    return path


def test_plan_writes_stable_keys_and_beats_baselines(step, tmp_path):
    res = parc("plan", str(step), "--devices", "2xa100-80g", "-o", str(tmp_path / "plan"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert doc["mesh"]["shape"] == [2]
    for key in ("step_time_s", "compute_s", "comm_s", "memory_bytes_per_device"):
        assert key in doc["predicted"]
    assert set(doc["solver"]) >= {"level", "time_s", "gap"}
    assert doc["solver"]["level"] == "O3"
    for name in ("data-parallel", "zero-3"):
        base = doc["baselines"][name]
        assert set(base) >= {"step_time_s", "memory_bytes_per_device", "feasible"}
        assert doc["predicted"]["step_time_s"] <= base["step_time_s"] * (1 + 1e-9)
    # every value's layout is a spec of the 1-axis mesh; the work is divided (most nodes split)
    assert all(len(ShardSpec.parse(spec)) == 1 for spec in doc["specs"].values())
    graph = importer.load(str(step), {})
    work = [n.name for n in graph.nodes if phase(n) != OPTIMIZER]  # the optimizer may run whole
    split = [name for name in work if doc["strategies"][name] != "-"]
    assert len(split) > len(work) / 2, (len(split), len(work))


def test_unknown_device_type_is_one_line(step, tmp_path):
    res = parc("plan", str(step), "--devices", "2xfoo", "-o", str(tmp_path / "p"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "foo" in res.stderr and "a100-80g" in res.stderr


def test_infeasible_memory_names_tensors_and_budget(step, tmp_path):
    res = parc("plan", str(step), "--devices", "2xa100-80g", "--mem-limit", "0.0001", "-o", str(tmp_path / "p"))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "no mesh fits" in res.stderr and "qkv.weight" in res.stderr


def test_time_limit_keeps_the_best_plan_with_its_gap(step, tmp_path):
    res = parc("plan", str(step), "--devices", "4xa100-80g", "--time-limit", "2", "-o", str(tmp_path / "p"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert [m["shape"] for m in doc["solver"]["meshes"]] == [[4], [2, 2]]
    assert all(m["gap"] >= 0 for m in doc["solver"]["meshes"])
    # every mesh's bound is below its plan; the plan's gap over the meshes is their least bound's
    meshes = doc["solver"]["meshes"]
    assert all(m["lower_bound_s"] <= m["step_time_s"] * (1 + 1e-9) for m in meshes)
    cost = doc["predicted"]["step_time_s"]
    least = min(cost, *(m["lower_bound_s"] for m in meshes))
    assert doc["solver"]["gap_over_meshes"] == pytest.approx((cost - least) / cost, abs=1e-12)
    assert doc["solver"]["gap_over_meshes"] >= doc["solver"]["gap"] - 1e-12
    megatron = doc["baselines"]["megatron-tp2"]  # Megatron TP=2 x DP=2 on the 2x2 mesh
    assert megatron["mesh"] == [2, 2] and megatron["step_time_s"] > 0
    assert parc("plan", str(step), "--devices", "2xa100-80g", "--time-limit", "0", "-o",
                str(tmp_path / "q")).returncode == 2


def test_split_hint_gives_megatron_mlp_and_an_annotated_model(step, tmp_path):
    import onnx

    hints = tmp_path / "hints.yaml"
    hints.write_text('scopes:\n  - match: "h\\\\.[0-9]+\\\\.mlp\\\\."\n    split: 2\n')
    res = parc("plan", str(step), "--devices", "2xa100-80g", "--hints", str(hints), "-o", str(tmp_path / "p"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    # Whale split on the MLP: the first matmul column-parallel; the second splits its weight too,
    # row-parallel (Megatron) or column-parallel: on this small model (NVLink, 256 wide) the two
    # cost within 0.1% of each other, so either may win
    assert doc["strategies"]["h.0.mlp.fc.matmul"] == "n"
    assert doc["strategies"]["h.0.mlp.proj.matmul"] in ("k", "n")
    assert doc["hints"] is not None
    onnx.checker.check_model(str(tmp_path / "p" / "model.sharded.onnx"))


def test_hint_no_mesh_can_satisfy_is_one_line(step, tmp_path):
    hints = tmp_path / "hints.yaml"
    hints.write_text('scopes:\n  - match: "mlp"\n    split: 3\n')
    res = parc("plan", str(step), "--devices", "2xa100-80g", "--hints", str(hints), "-o", str(tmp_path / "p"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "no mesh satisfies the hints" in res.stderr


def test_a_calibration_measured_on_another_models_shapes_is_warned_about(step, tmp_path):
    """A file from `parc profile --model` names the models it was measured on; planning another
    model with it says so (one line, the plan still written), planning that model does not."""
    from parc.plandir.manifest import sha256_file

    def plan_with(sha: str):
        calib = tmp_path / "calib.yaml"
        calib.write_text(f"fitted_on:\n  - {{file: resnet.train.onnx, sha256: '{sha}'}}\n"
                         "devices:\n  cpu: {fp32_tflops: 0.2, bandwidth_gbs: 30}\n")
        return parc("plan", str(step), "--devices", "1xcpu", "--calibration", str(calib), "-o", str(tmp_path / "p"))

    other = plan_with("0" * 64)
    assert other.returncode == 0, other.stderr
    warned = [line for line in other.stderr.splitlines() if "was measured on the shapes of" in line]
    assert len(warned) == 1 and warned[0].startswith("parc: --calibration ")
    assert "measured on the shapes of resnet.train.onnx" in warned[0] and "gpt.train.onnx" in warned[0]
    same = plan_with(sha256_file(step))
    assert same.returncode == 0 and "measured on the shapes of" not in same.stderr
