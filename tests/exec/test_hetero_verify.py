"""Plans on a mixed cluster (2 V100 + 2 P100 on 4 CPU ranks): uneven data and tensor parallel
shards lower to per-rank programs with their own local shapes, and `parc verify` finds them
equal to the single-device model (the mean loss weighted by each rank's samples included)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import needs_mpiexec, parc

pytestmark = needs_mpiexec
pytest.importorskip("onnxruntime")

MIXED = "2xv100-32g+2xp100-16g"
TIGHT = ("--rtol", "1e-4", "--atol", "1e-6")


def _plan(tmp: Path, model: str, batch: int, *args: str, sets: tuple[str, ...] = ()) -> tuple[Path, dict]:
    step = tmp / f"{model}.onnx"
    res = parc("models", "build", model, "--set", f"batch={batch}", *[x for v in sets for x in ("--set", v)],
               "--train", "sgd", "-o", str(step))
    assert res.returncode == 0, res.stderr
    out = tmp / f"{model}-plan"
    res = parc("plan", str(step), "--devices", MIXED, "--mesh-dims", "1", "--pipeline", "off", "--jobs", "1",
               "--all-devices", "-o", str(out), *args)
    assert res.returncode == 0, res.stderr
    return out, json.loads((out / "plan.json").read_text())


def _uneven(plan: dict) -> list[str]:
    return [k for k, v in plan["specs"].items() if "[" in v]


def _verify(out: Path) -> None:
    res = parc("verify", str(out), "--steps", "2", *TIGHT, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified:" in res.stdout


@pytest.mark.parametrize("model, batch", [("gpt-tiny", 32), pytest.param("moe-tiny", 32, marks=pytest.mark.slow),
                                          ("unet-tiny", 16)])
def test_uneven_data_parallel_verifies(tmp_path, model, batch):
    out, plan = _plan(tmp_path, model, batch)
    assert _uneven(plan), "no uneven split in the mixed-cluster plan"
    # every dim that holds whole batches is cut where the batch is (a flattened [B*S, H] too)
    pieces = {tuple(map(int, re.findall(r"\d+", v.split("[", 1)[1]))) for v in plan["specs"].values() if "[" in v}
    cut = next(p for p in pieces if sum(p) == batch)
    assert all(p == tuple(c * (sum(p) // batch) for c in cut) for p in pieces if sum(p) % batch == 0), pieces
    assert plan["baselines"]["even-split"]["step_time_s"] >= plan["predicted"]["step_time_s"] * (1 - 1e-9)
    _verify(out)
    res = parc("explain", str(out))
    assert res.returncode == 0, res.stderr
    assert "mixed devices on mesh axis 0: the work is split by speed (v100-32g" in res.stdout
    assert "per device type: v100-32g: compute" in res.stdout


def test_uneven_tensor_parallel_verifies(tmp_path):
    hints = tmp_path / "tp.yaml"
    hints.write_text("default: split\n")
    # hidden 512: the matmuls outweigh the launch floors, so the balanced shards beat equal ones
    # (4.072 ms against 4.085)
    out, plan = _plan(tmp_path, "gpt-tiny", 4, "--hints", str(hints), sets=("hidden=512", "ffn=2048"))
    assert any("weight" in k for k in _uneven(plan)), _uneven(plan)[:5]
    _verify(out)


def test_heterogeneous_pipeline_verifies(tmp_path):
    """2 P100 + 2 V100 in two stages: stage 0 on the V100s (the larger memory), with more of the
    layers than the P100 stage when that is faster."""
    step = tmp_path / "gpt.onnx"
    res = parc("models", "build", "gpt-tiny", "--set", "batch=8", "--set", "layers=4", "--train", "sgd",
               "-o", str(step))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "pipe"
    res = parc("plan", str(step), "--devices", "2xp100-16g+2xv100-32g", "--pipeline", "2", "--jobs", "1",
               "--all-devices", "-o", str(out))
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert [s["devices"] for s in plan["stages"]] == [[2, 3], [0, 1]]
    assert [s["device_types"] for s in plan["stages"]] == [["v100-32g"], ["p100-16g"]]
    _verify(out)
    res = parc("explain", str(out))
    assert res.returncode == 0 and "2-3 (v100-32g)" in res.stdout and "0-1 (p100-16g)" in res.stdout


def test_an_uneven_checkpoint_reshards_onto_an_even_plan_and_back(tmp_path):
    """Steps 1-2 on the uneven plan, 3 on an even plan of the same model, 4 on the uneven one
    again: the losses equal one uninterrupted uneven run's."""

    out, plan = _plan(tmp_path, "gpt-tiny", 32)
    assert _uneven(plan)
    even = tmp_path / "even"
    res = parc("plan", str(tmp_path / "gpt-tiny.onnx"), "--devices", "4xv100-32g", "--mesh-dims", "1",
               "--jobs", "1", "-o", str(even))
    assert res.returncode == 0, res.stderr

    def run(plan_dir: Path, steps: int, ck: Path, resume: bool) -> list[str]:
        res = parc("run", str(plan_dir), "--steps", str(steps), "--checkpoint", str(ck),
                   *(["--resume"] if resume else []), timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        return re.findall(r"loss (\S+)", res.stdout)

    whole = run(out, 4, tmp_path / "ck-whole", False)
    ck = tmp_path / "ck"
    parts = run(out, 2, ck, False) + run(even, 3, ck, True) + run(out, 4, ck, True)
    assert [float(x) for x in parts] == pytest.approx([float(x) for x in whole], rel=1e-5)


def test_a_2d_mesh_uneven_on_its_mixed_axis_verifies(tmp_path):
    """Two nodes of one V100 and one P100: on the 2 x 2 mesh the axis inside a node joins unlike
    devices and splits unevenly, the axis between nodes evenly (batch 128: at 32 the step's kernels
    take no longer than their launch, and no split of them gains)."""
    step = tmp_path / "gpt.onnx"
    assert parc("models", "build", "gpt-tiny", "--set", "batch=128", "--train", "sgd", "-o", str(step)).returncode == 0
    hints = tmp_path / "tp2.yaml"
    hints.write_text("default: {split: 2}\n")  # on 4 devices only the 2 x 2 mesh holds it
    out = tmp_path / "mesh2d"
    res = parc("plan", str(step), "--devices", "2x(v100-32g+p100-16g)", "--pipeline", "off", "--hints", str(hints),
               "--jobs", "1", "-o", str(out))
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["mesh"]["shape"] == [2, 2]
    assert [a["axis"] for a in plan["balance"]["axes"]] == [1]
    assert any(v.startswith("R") and "[" in v for v in plan["specs"].values())  # axis 0 even, axis 1 uneven
    _verify(out)


def test_slow_devices_are_left_idle_when_that_is_faster(tmp_path):
    """gpt-tiny (batch 8, hidden 256) on 2 V100 + 2 T4 (two nodes): the T4s slow every step
    (their launch floors, and the gradients crossing the link between the nodes), so the plan
    runs on the V100 node alone; it verifies on 2 ranks, explain says why, and the plan on every
    device is its `all-devices` baseline."""
    step = tmp_path / "gpt.onnx"
    assert parc("models", "build", "gpt-tiny", "--set", "batch=8", "--set", "hidden=256", "--train", "sgd",
                "-o", str(step)).returncode == 0
    out = tmp_path / "plan"
    res = parc("plan", str(step), "--devices", "2xv100-32g+2xt4", "--mesh-dims", "1", "--pipeline", "off",
               "--jobs", "1", "-o", str(out))
    assert res.returncode == 0, res.stderr
    assert "2 t4-16g left idle" in res.stdout
    plan = json.loads((out / "plan.json").read_text())
    given = plan["devices_given"]
    assert given["idle"] == {"t4-16g": 2} and given["nodes_used"] == [0] and given["num_devices"] == 4
    assert [len(n["devices"]) for n in plan["cluster"]["nodes"]] == [2]
    every, alone = given["tried"]
    assert (every["devices"], every["chosen"]) == ("2xv100-32g+2xt4-16g", False)
    assert (alone["devices"], alone["chosen"]) == ("2xv100-32g", True)
    me = plan["predicted"]["step_time_s"]
    assert me == pytest.approx(alone["step_time_s"]) and me <= every["step_time_s"] * (1 - given["min_gain"])
    assert plan["baselines"]["all-devices"]["step_time_s"] == pytest.approx(every["step_time_s"])
    assert plan["baselines"]["even-split"]["step_time_s"] > me  # the naive use of every device
    _verify(out)
    res = parc("explain", str(out))
    assert res.returncode == 0, res.stderr
    assert "2 t4-16g of the 4 devices given are left idle: the plan on 2xv100-32g (node 0)" in " ".join(res.stdout.split())

    res = parc("plan", str(step), "--devices", "2xv100-32g+2xt4", "--mesh-dims", "1", "--pipeline", "off",
               "--jobs", "1", "--all-devices", "-o", str(tmp_path / "all"))
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "all" / "plan.json").read_text())
    assert plan["devices_given"] is None and len(plan["predicted"]["memory_bytes_per_device"]) == 4
    assert plan["predicted"]["step_time_s"] == pytest.approx(every["step_time_s"])


def test_every_device_is_used_when_idling_gains_too_little(tmp_path):
    """gpt-tiny on 2 V100 + 2 P100 (the acceptance check's case): the V100s alone are predicted
    a few percent faster, under `IDLE_MIN_GAIN`, so every device is used and explain says so."""
    from parc.passes.planner import IDLE_MIN_GAIN

    step = tmp_path / "gpt.onnx"
    assert parc("models", "build", "gpt-tiny", "--set", "batch=32", "--train", "sgd", "-o", str(step)).returncode == 0
    out = tmp_path / "plan"
    res = parc("plan", str(step), "--devices", MIXED, "--mesh-dims", "1", "--pipeline", "off", "--jobs", "1",
               "-o", str(out))
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    given = plan["devices_given"]
    assert given["idle"] == {} and given["nodes_used"] == [0, 1] and "all-devices" not in plan["baselines"]
    every, alone = given["tried"]
    assert every["chosen"] and not alone["chosen"] and alone["devices"] == "2xv100-32g"
    assert every["step_time_s"] * (1 - IDLE_MIN_GAIN) < alone["step_time_s"]
    assert _uneven(plan)
    res = parc("explain", str(out))
    assert "every device given is used: a plan on 2xv100-32g alone is predicted" in " ".join(res.stdout.split())
