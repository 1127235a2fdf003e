"""`parc plan` writes every rank's modules without the repeats `parc grad`'s recomputation puts
beside the forward nodes it repeats (`parc.ir.simplify`), and the plan still verifies against
the source step on CPU ranks."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from parc.ir.simplify import eliminate_common_subexpressions
from tests.helpers import needs_mpiexec, parc

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("emit_simplify")
    assert parc("models", "build", "gpt-tiny", "--set", "batch=4", "-o", str(d / "m.onnx")).returncode == 0
    res = parc("grad", str(d / "m.onnx"), "--optimizer", "sgd", "--lr", "0.05", "--recompute", "-o", str(d / "t.onnx"))
    assert res.returncode == 0, res.stderr
    (d / "dp.yaml").write_text("default: replicate\n")
    return d


@needs_mpiexec
def test_rank_modules_hold_no_repeats_and_the_plan_verifies(step):
    """The step repeats forward nodes in its backward pass; a data-parallel plan keeps a layer's
    forward and backward in one module, where they were repeats before the plan was written."""
    _, repeats = eliminate_common_subexpressions(onnx.load(str(step / "t.onnx"), load_external_data=False))
    assert repeats > 0
    out = step / "plan"
    res = parc("plan", str(step / "t.onnx"), "--devices", "2xa100-80g", "--jobs", "1", "--hints",
               str(step / "dp.yaml"), "--mesh-dims", "1", "-o", str(out))
    assert res.returncode == 0, res.stderr
    modules = sorted(out.glob("rank_*/m*.onnx"))
    assert len({p.parent for p in modules}) == 2
    for path in modules:
        model = onnx.load(str(path), load_external_data=False)
        onnx.checker.check_model(model)
        assert eliminate_common_subexpressions(model) == (model, 0), path
    res = parc("verify", str(out), "--steps", "2", "--rtol", "1e-4", "--atol", "1e-6", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified:" in res.stdout
