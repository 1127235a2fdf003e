"""More `transformers` families, end to end as a user runs them: each export (legacy and dynamo)
through `parc grad --optimizer adamw`, planned on a mixed cluster (uneven shards) and as a
2-stage pipeline on 4 CPU ranks, and `parc verify` of both plans against the single-device step.

The families are what the six of `test_torch_exports` do not cover: an encoder-decoder with tied
embeddings and learned positions (BART), partial rotary embeddings with parallel attention and MLP
(GPT-NeoX), a sequence classifier with one label per sequence (DistilBERT), depthwise
convolutions with channels-last LayerNorm (ConvNeXt), shifted-window attention (Swin: its dynamic
shapes do not pass torch.export, so legacy only) and grouped-query attention with a sliding
window and tied embeddings (Mistral). Slow (about 9 minutes on 2 cores): `make test-all`.
"""

from __future__ import annotations

import importlib.util
import logging

import pytest

from tests.helpers import needs_mpiexec, parc

pytestmark = [pytest.mark.torch, pytest.mark.slow, needs_mpiexec]
pytest.importorskip("torch")
pytest.importorskip("transformers")

FAMILIES = ("bart", "neox", "distilbert", "convnext", "swin", "mistral")
DYNAMO = ("bart", "neox", "distilbert", "convnext", "mistral")  # swin: torch.export refuses its dims
CASES = [f"{m}-legacy" for m in FAMILIES] + [f"{m}-dynamo" for m in DYNAMO]
LAYOUTS = {"mixed": ["--devices", "2xv100-32g+2xp100-16g"], "pipeline": ["--devices", "4xcpu", "--pipeline", "2"]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, script) -> tuple:
    exporters = ["legacy"] + (["dynamo"] if importlib.util.find_spec("onnxscript") else [])
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    out = tmp_path_factory.mktemp("families")
    return out, script.export_all(out, list(FAMILIES), exporters)


@pytest.mark.parametrize("key", CASES)
def test_a_family_plans_and_verifies_on_mixed_devices_and_as_a_pipeline(exported, key, tmp_path):
    out, results = exported
    if key not in results:
        pytest.skip(f"{key}: the dynamo exporter needs onnxscript")
    info = results[key]
    assert not isinstance(info, str), f"{key}: torch export failed: {info}"
    dims = [a for d in info["dims"] for a in ("--dim", f"{d}={8 if d == 'batch' else info['dims'][d]}")]
    step = tmp_path / "step.onnx"
    res = parc("grad", str(out / info["onnx"]), "--optimizer", "adamw", *dims, "-o", str(step))
    assert res.returncode == 0, res.stderr
    for name, layout in LAYOUTS.items():
        plan = tmp_path / name
        res = parc("plan", str(step), *layout, "-o", str(plan))
        assert res.returncode == 0, f"{name}: {res.stderr}"
        res = parc("verify", str(plan), "--steps", "2")
        assert res.returncode == 0 and "verified:" in res.stdout, f"{name}: {res.stdout[-500:]} {res.stderr[-500:]}"
