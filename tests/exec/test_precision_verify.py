"""Mixed-precision plans run and verify on CPU ranks: a bf16 AdamW step of gpt-tiny, data
parallel on 2 ranks (the array engine: onnxruntime's CPU provider has no bfloat16 kernels), its
bf16 gradient exchange moved by MPI; verify's widened tolerances still catch a wrong gradient."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import assert_one_line_error, parc


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    work = tmp_path_factory.mktemp("precision")
    assert parc("models", "build", "gpt-tiny", "-o", str(work / "m.onnx")).returncode == 0
    (work / "dp.yaml").write_text("default: replicate\n")
    out = {}
    for precision in ("bf16", "fp16"):
        res = parc("grad", str(work / "m.onnx"), "--optimizer", "adamw", "--precision", precision, "-o",
                   str(work / f"{precision}.onnx"))
        assert res.returncode == 0, res.stderr
        res = parc("plan", str(work / f"{precision}.onnx"), "--devices", "2xcpu", "--hints", str(work / "dp.yaml"),
                   "--mesh-dims", "1", "-o", str(work / precision))
        assert res.returncode == 0, res.stderr
        out[precision] = work / precision
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_plan_verifies_and_catches_a_wrong_gradient(plans, precision):
    res = parc("verify", str(plans[precision]), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "over 1 step on 2 ranks (widened for" in res.stdout
    # a factor 2 on the exchange of a gradient's values: the first reduction of the plan whose
    # tensor is in h.0.mlp.fc's backward (the bias gradient's sum, all-reduced or reduce-scattered)
    tasks = json.loads((plans[precision] / "taskgraph.json").read_text())["tasks"]
    target = next(t["tensor"] for t in tasks if t["kind"] == "collective" and t["op"] in ("all_reduce", "reduce_scatter")
                  and "h.0.mlp.fc" in t["tensor"] and ".grad" in t["tensor"])
    os.environ["PARC_TEST_FAULT"] = f"scale:{target}:2"
    try:
        bad = parc("verify", str(plans[precision]), timeout=300)
    finally:
        del os.environ["PARC_TEST_FAULT"]
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout, bad.stdout + bad.stderr


def test_bf16_plan_runs_on_the_array_engine_and_refuses_onnxruntime(plans):
    res = parc("run", str(plans["bf16"]), "--steps", "2", "--json", timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count('"loss"') == 2
    assert_one_line_error(parc("run", str(plans["bf16"]), "--engine", "ort", "--steps", "1"),
                          "--engine ort", "bfloat16", "--engine numpy")


def test_only_plans_holding_bfloat16_leave_onnxruntime():
    """verify's reference and `--engine auto` stay on onnxruntime for every other plan (a float32
    plan's reference on the array engine made t5's pipeline miss verify's tolerance)."""
    from types import SimpleNamespace

    from parc.exec.engine_choice import ort_cpu_lacks, plan_engine
    from parc.plandir.plan import Tensor

    def plan_of(dtypes: dict[str, str]):  # what the choice reads of a Plan: its tensors' types
        return SimpleNamespace(tensors={name: Tensor((4,), dtype, 16) for name, dtype in dtypes.items()})

    fp32 = plan_of({"w": "float", "h": "float16"})
    bf16 = plan_of({"w": "float", "w.bf16": "bfloat16"})
    assert ort_cpu_lacks(fp32) == [] and plan_engine("auto", fp32) == "auto" and plan_engine("ort", fp32) == "ort"
    assert ort_cpu_lacks(bf16) == ["bfloat16"] and plan_engine("auto", bf16) in ("numpy", "cupy")
