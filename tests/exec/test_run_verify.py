"""The oracle: `parc verify` (source model on one device vs the plan on 4 CPU ranks under mpiexec)
on the tiny zoo models' training steps, with plans forced into each family by hints, a memory
limit, microbatches and uneven pins; and forward-only (inference) plans.

Training steps use SGD here: its update is linear in the gradient, so the comparison is tight
(rtol 1e-4, atol 1e-6). Adam divides by the gradient's magnitude, which turns round-off on
gradients that are zero in exact arithmetic (a key bias under softmax) into differences of up
to the learning rate; test_adamw_data_parallel checks Adam at `parc verify`'s defaults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import needs_mpiexec, parc

pytestmark = needs_mpiexec
pytest.importorskip("onnxruntime")

MODELS = ["gpt-tiny", "moe-tiny", "resnet-tiny", "unet-tiny", "t5-tiny"]
TIGHT = ("--rtol", "1e-4", "--atol", "1e-6")
HINTS = {"dp": "default: replicate\n", "tp": "default: split\n",
         "tp2": "default: {split: 2}\n"}  # 2-way tensor parallel: on 4 devices only the 2x2 mesh holds it


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("verify")
    for name, text in HINTS.items():
        (d / f"{name}.yaml").write_text(text)
    return d


def _step(work: Path, model: str, optimizer: str = "sgd") -> Path:
    src, step = work / f"{model}.onnx", work / f"{model}.{optimizer}.onnx"
    if not step.exists():
        res = parc("models", "build", model, "--set", "batch=4", "-o", str(src))
        assert res.returncode == 0, res.stderr
        lr = "0.05" if optimizer == "sgd" else "1e-3"
        res = parc("grad", str(src), "--optimizer", optimizer, "--lr", lr, "-o", str(step))
        assert res.returncode == 0, res.stderr
    return step


def _plan(model_path: Path, out: Path, *args: str) -> dict:
    res = parc("plan", str(model_path), "--devices", "4xa100-80g", "--jobs", "1", "-o", str(out), *args)
    assert res.returncode == 0, res.stderr
    return json.loads((out / "plan.json").read_text())


def _verify(plan_dir: Path, *args: str) -> str:
    res = parc("verify", str(plan_dir), "--steps", "2", *args, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "verified:" in res.stdout
    return res.stdout


def _params(plan: dict) -> dict[str, str]:
    return {k: v for k, v in plan["specs"].items() if k.endswith((".weight", ".bias"))}


SLOW = pytest.mark.slow  # planning these takes 30-70 s each on 2 cores (2-D meshes, memory budgets)


# `make test` verifies every family on gpt-tiny and each other model in one family (its own
# sharding rules: convolutions, skip connections, encoder-decoder, experts); `make test-all` all
FAST_FAMILIES = {("gpt-tiny", "dp"), ("gpt-tiny", "tp"), ("gpt-tiny", "2x2"), ("resnet-tiny", "tp"),
                 ("unet-tiny", "tp"), ("t5-tiny", "dp"), ("moe-tiny", "tp")}


@pytest.mark.parametrize("model, family", [(m, f) if (m, f) in FAST_FAMILIES else pytest.param(m, f, marks=SLOW)
                                           for f in ("dp", "tp", "2x2") for m in MODELS])
def test_hinted_families_verify(work, model, family):
    _family(work, model, family)


def _family(work, model, family):
    step = _step(work, model)
    out = work / f"{model}-{family}"
    hints = work / {"dp": "dp.yaml", "tp": "tp.yaml", "2x2": "tp2.yaml"}[family]
    dims = "2" if family == "2x2" else "1"
    plan = _plan(step, out, "--hints", str(hints), "--mesh-dims", dims)
    params = _params(plan)
    if family == "dp":
        assert set(params.values()) == {"R"}, params
        # parameters whole, work divided: most nodes split (the batch), not all replicated
        split = [n for n, label in plan["strategies"].items() if label != "-"]
        assert len(split) > len(plan["strategies"]) / 2, (len(split), len(plan["strategies"]))
    elif family == "tp":
        assert any("S(" in v for v in params.values()), params
    else:  # tensor parallel over one axis, data parallel over the other
        assert tuple(plan["mesh"]["shape"]) == (2, 2), plan["mesh"]
        assert any("S(" in v for v in params.values()), params
    _verify(out, *TIGHT)


@pytest.mark.parametrize("model", [m if m in ("gpt-tiny", "unet-tiny") else pytest.param(m, marks=SLOW)
                                   for m in MODELS])
def test_zero_like_sharding_under_a_memory_limit(work, model):
    step = _step(work, model)
    free = _plan(step, work / f"{model}-free", "--mesh-dims", "1")
    need = free["predicted"]["memory_bytes_per_device"][0]
    out = work / f"{model}-zero"
    for share in (0.6, 0.75, 0.9):  # the tightest budget that still fits
        res = parc("plan", str(step), "--devices", "4xa100-80g", "--jobs", "1", "-o", str(out),
                   "--mesh-dims", "1", "--mem-limit", f"{need * share / 2**30:.9f}")
        if res.returncode == 0:
            break
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    state = {k: v for k, v in plan["specs"].items() if k in plan["tensors"] and "S(" in v}
    assert any(k.endswith((".weight", ".bias", "exp_avg")) or ".weight" in k for k in state), plan["specs"]
    _verify(out, *TIGHT)


@pytest.mark.parametrize("model", ["gpt-tiny", pytest.param("moe-tiny", marks=SLOW), "unet-tiny"])
def test_four_microbatches_verify(work, model):
    step = _step(work, model)
    out = work / f"{model}-micro"
    plan = _plan(step, out, "--mesh-dims", "1", "--micro-batches", "4")
    assert plan["micro_batches"]["count"] == 4
    _verify(out, *TIGHT)


def test_microbatches_refused_with_batch_norm(work):
    """Batch statistics need the whole batch at once: the planner says so in one line."""
    res = parc("plan", str(_step(work, "resnet-tiny")), "--devices", "4xa100-80g", "--mesh-dims", "1",
               "--micro-batches", "2", "-o", str(work / "resnet-micro"))
    assert res.returncode == 2 and "microbatches" in res.stderr and "Traceback" not in res.stderr


def test_uneven_split_verifies(work):
    step = _step(work, "gpt-tiny")
    hints = work / "uneven.yaml"
    hints.write_text('pins:\n  wte.weight: "S(0,[50,30,28,20])"\n  h.0.mlp.fc.weight: "S(1,[80,48,64,64])"\n')
    out = work / "gpt-uneven"
    plan = _plan(step, out, "--mesh-dims", "1", "--hints", str(hints))
    assert plan["specs"]["wte.weight"] == "S(0,[50,30,28,20])"
    shapes = [json.loads((out / f"rank_{r}" / "program.json").read_text()) for r in range(4)]
    wte = [next(x["local"] for x in p["residents"] if x["name"] == "wte.weight") for p in shapes]
    assert [s[0] for s in wte] == [50, 30, 28, 20]
    _verify(out, *TIGHT)


@pytest.mark.parametrize("family", ["dp", "tp"])
def test_inference_plans_verify(work, family):
    _step(work, "gpt-tiny")
    out = work / f"gpt-infer-{family}"
    _plan(work / "gpt-tiny.onnx", out, "--mesh-dims", "1", "--hints", str(work / f"{family}.yaml"))
    text = _verify(out, *TIGHT)
    assert "logits" in text


def test_adamw_data_parallel(work):
    step = _step(work, "gpt-tiny", "adamw")
    out = work / "gpt-adamw-dp"
    _plan(step, out, "--mesh-dims", "1", "--hints", str(work / "dp.yaml"))
    _verify(out)


def test_verify_reports_a_mismatch(work):
    """A plan whose weights were changed after planning (manifest rewritten to hide it) fails
    verify with exit 1, naming the tensor."""
    from parc.plandir.manifest import write_manifest

    step = _step(work, "gpt-tiny")
    out = work / "gpt-broken"
    _plan(step, out, "--mesh-dims", "1", "--hints", str(work / "dp.yaml"))
    data = bytearray((out / "rank_1" / "weights.bin").read_bytes())
    data[:64] = bytes(64)
    (out / "rank_1" / "weights.bin").write_bytes(bytes(data))
    write_manifest(out)
    res = parc("verify", str(out), "--steps", "1", timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MISMATCH" in res.stdout and "BAD" in res.stdout


def test_seeded_init_is_the_same_whatever_the_plan(work):
    """--init seeded: each rank draws only its shard, and data-parallel and tensor-parallel
    plans start from the same whole parameters (same first loss), which verify confirms."""
    step = _step(work, "gpt-tiny")
    losses = []
    for family in ("dp", "tp"):
        out = work / f"gpt-seeded-{family}"
        _plan(step, out, "--mesh-dims", "1", "--hints", str(work / f"{family}.yaml"))
        res = parc("run", str(out), "--steps", "1", "--init", "seeded", "--seed", "7", "--json")
        assert res.returncode == 0, res.stderr
        losses.append(json.loads(res.stdout.splitlines()[0])["loss"])
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    source = parc("run", str(work / "gpt-seeded-tp"), "--steps", "1", "--json")
    assert json.loads(source.stdout.splitlines()[0])["loss"] != pytest.approx(losses[0], rel=1e-6)
    _verify(work / "gpt-seeded-tp", "--init", "seeded", "--seed", "7", *TIGHT)


def test_seeded_shards_assemble_to_the_whole_tensor():
    import numpy as np

    from parc.exec.init import seeded_shard
    from parc.sharding.layout import assemble, devices, shard_index

    shape, mesh = (6, 8), (2, 2)
    whole = seeded_shard(3, "w", shape, tuple(np.arange(e) for e in shape), 0.1, 0.02, np.float32)
    assert abs(float(whole.mean()) - 0.1) < 0.02 and 0.01 < float(whole.std()) < 0.03
    for spec in ("S(0)S(1)", "S(1,2)R", "RS(0,[4,2])"):
        shards = {c: seeded_shard(3, "w", shape, shard_index(shape, spec, mesh, c), 0.1, 0.02, np.float32)
                  for c in devices(mesh)}
        np.testing.assert_array_equal(assemble(shards, spec, mesh), whole)
