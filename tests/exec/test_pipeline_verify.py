"""Pipelined plans against the source model: `parc verify` on 4 CPU ranks under mpiexec, the
stages' task graphs, checkpoints and resume, and a plan whose transfers are broken on purpose."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.exec.test_run_verify import TIGHT, _plan, _step, _verify
from tests.helpers import needs_mpiexec, parc

pytestmark = needs_mpiexec


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline")


@pytest.mark.parametrize("model, args", [
    ("gpt-tiny", ["--pipeline", "2"]),  # 2 stages x 2 devices, 4 microbatches of one sample
    ("gpt-tiny", ["--pipeline", "2", "--micro-batches", "2", "--hints", "dp"]),  # 2 stages x 2 data parallel
    ("gpt-tiny", ["--pipeline", "4", "--micro-batches", "2"]),
    ("unet-tiny", ["--pipeline", "2"]),  # skip connections cross stages
    # a masked mean's token count needs every microbatch's labels: they are read whole
    ("t5-tiny", ["--pipeline", "2", "--micro-batches", "2"]),
    pytest.param("bert-tiny", ["--pipeline", "2", "--micro-batches", "2"],  # and the token-type embedding's scatter
                 marks=pytest.mark.slow),
    pytest.param("moe-tiny", ["--pipeline", "2"], marks=pytest.mark.slow),
])
def test_pipelined_sgd_steps_verify(work, model, args):
    plan_dir = work / f"{model}-{'-'.join(args)}"
    if "dp" in args:
        (work / "dp.yaml").write_text("default: replicate\n")
        args = [str(work / "dp.yaml") if a == "dp" else a for a in args]
    doc = _plan(_step(work, model), plan_dir, *args)
    stages = int(args[1])
    assert doc["format_version"] == 3 and len(doc["stages"]) == stages
    if "--micro-batches" in args:
        assert doc["micro_batches"]["count"] == int(args[args.index("--micro-batches") + 1])
    tg = json.loads((plan_dir / "taskgraph.json").read_text())
    assert len(tg["stages"]) == stages
    kinds = {t["kind"] for t in tg["tasks"]}
    assert {"send", "recv"} <= kinds
    if "--hints" in args:  # both stages data parallel on 2 devices:
        recvs = [t for t in tg["tasks"] if t["kind"] == "recv" and t["pass"] == "F"]  # shards travel
        assert any(t["layout"] == "S(0)" for t in recvs) and all(t["layout"] in ("S(0)", "R") for t in recvs)
        assert all(math.prod(t["shape"]) * 2 * (2 if t["layout"] == "S(0)" else 1) == math.prod(t["global"])
                   for t in recvs)
    _verify(plan_dir, *TIGHT)


def test_pipelined_adamw_verifies_at_the_defaults(work):
    plan_dir = work / "gpt-adamw"
    _plan(_step(work, "gpt-tiny", "adamw"), plan_dir, "--pipeline", "2")
    out = _verify(plan_dir, "--steps", "3")
    assert "wte.weight " in out  # the tied embedding: updated on stage 0, read by stage 1


def test_1f1b_orders_interleave_forward_and_backward(work):
    plan_dir = work / "gpt-tiny---pipeline-4---micro-batches-2"
    if not plan_dir.exists():
        _plan(_step(work, "gpt-tiny"), plan_dir, "--pipeline", "4", "--micro-batches", "2")
    tg = json.loads((plan_dir / "taskgraph.json").read_text())
    tasks = {t["id"]: t for t in tg["tasks"]}
    for rank, ids in tg["order"].items():
        passes = [(tasks[i].get("pass"), tasks[i].get("micro_batch")) for i in ids
                  if tasks[i]["kind"] == "compute" and tasks[i].get("pass") in ("F", "B")]
        seq = []
        for p in passes:
            if not seq or seq[-1] != p:
                seq.append(p)
        stage = int(rank)  # one rank per stage
        warm = min(4 - stage - 1, 2)
        assert seq[:warm] == [("F", k) for k in range(warm)]
        assert seq[-1] == ("B", 1)


def test_pipelined_checkpoint_resumes_exactly(work, tmp_path):
    plan_dir = work / "gpt-tiny---pipeline-2"
    if not plan_dir.exists():
        _plan(_step(work, "gpt-tiny"), plan_dir, "--pipeline", "2")
    ck = tmp_path / "ck"
    once = parc("run", str(plan_dir), "--steps", "4", "--json", timeout=300)
    assert once.returncode == 0, once.stderr
    first = parc("run", str(plan_dir), "--steps", "2", "--checkpoint", str(ck), timeout=300)
    assert first.returncode == 0, first.stderr
    doc = json.loads((ck / "checkpoint.json").read_text())
    assert doc["tensors"]["wte.weight"]["ranks"] == [0, 1]  # the first stage's copy
    resumed = parc("run", str(plan_dir), "--steps", "4", "--checkpoint", str(ck), "--resume", "--json",
                   timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    want = [json.loads(x)["loss"] for x in once.stdout.splitlines()][2:]
    got = [json.loads(x)["loss"] for x in resumed.stdout.splitlines()]
    assert got == pytest.approx(want, rel=1e-6)


def test_verify_catches_a_stage_reading_a_stale_microbatch(work, tmp_path):
    """Swap the microbatches of the activations stage 1 receives: the plan still runs, and
    verify must say MISMATCH (the transfer's tags are what pair a send with its receive)."""
    import shutil

    src = work / "gpt-tiny---pipeline-2"
    if not src.exists():
        _plan(_step(work, "gpt-tiny"), src, "--pipeline", "2")
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    tg = json.loads((bad / "taskgraph.json").read_text())
    swapped = 0
    for t in tg["tasks"]:
        if t["kind"] == "recv" and t["rank"] == 2 and t.get("pass") == "F" and t.get("micro_batch") in (0, 1):
            t["tag"] = t["tag"] + (1 if t["micro_batch"] == 0 else -1)
            swapped += 1
    assert swapped >= 2
    (bad / "taskgraph.json").write_text(json.dumps(tg))
    from parc.plandir.manifest import write_manifest

    write_manifest(bad)  # a plan as parc would write it, but wrong
    res = parc("verify", str(bad), "--steps", "2", timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MISMATCH" in res.stdout


def test_two_stages_of_two_way_tensor_parallel_verify(work):
    """`default: split` applies inside each stage: the MLP matmuls split over the stage's 2 devices."""
    hints = work / "tp.yaml"
    hints.write_text("default: split\n")
    plan_dir = work / "gpt-pp2-tp2"
    doc = _plan(_step(work, "gpt-tiny"), plan_dir, "--pipeline", "2", "--hints", str(hints))
    # the weight's dims split (n: columns, k: rows); replicated (-) or batch-split (m) would be DP
    assert doc["strategies"]["h.0.mlp.fc.matmul"] in ("n", "k")
    assert doc["strategies"]["h.1.mlp.fc.matmul"] in ("n", "k")
    _verify(plan_dir, *TIGHT)


def test_microbatched_tensor_parallel_verifies(work):
    """Hints on a microbatched one-mesh plan count the devices, not the microbatch axis."""
    hints = work / "tp.yaml"
    hints.write_text("default: split\n")
    plan_dir = work / "gpt-mb2-tp"
    doc = _plan(_step(work, "gpt-tiny"), plan_dir, "--micro-batches", "2", "--hints", str(hints))
    assert set(doc["strategies"]["h.0.mlp.fc.matmul"].split("x")) <= {"n", "k"}
    _verify(plan_dir, *TIGHT)


def test_stage_hints_place_nodes(work):
    """Unpinned, the ILP cuts gpt-tiny after h.1.ln_1 (its output crosses); pinning block 0's MLP
    to stage 1 moves the cut before it, so nothing of block 1 crosses."""
    hints = work / "stages.yaml"
    hints.write_text('scopes:\n  - match: "^h\\\\.0\\\\.mlp\\\\."\n    stage: 1\n')
    step = _step(work, "gpt-tiny")
    crossing = {}
    for name, extra in (("free", []), ("staged", ["--hints", str(hints)])):
        _plan(step, work / f"gpt-{name}", "--pipeline", "2", "--no-programs", *extra)
        doc = json.loads((work / f"gpt-{name}" / "plan.json").read_text())
        crossing[name] = {t["value"] for t in doc["transfers"] if t["pass"] == "forward"}
    assert any(v.startswith("h.1.") for v in crossing["free"])
    assert not any(v.startswith(("h.1.", "h.0.mlp.")) for v in crossing["staged"])


def test_stage_hints_against_the_graph_order_are_refused(work):
    from tests.helpers import assert_one_line_error

    hints = work / "backwards.yaml"
    hints.write_text('scopes:\n  - match: "^h\\\\.0\\\\."\n    stage: 1\n  - match: "^h\\\\.1\\\\."\n    stage: 0\n')
    res = parc("plan", str(_step(work, "gpt-tiny")), "--devices", "4xa100-80g", "--pipeline", "2", "--hints",
               str(hints), "-o", str(work / "never"))
    assert_one_line_error(res, "backwards.yaml:4", "stage")
    hints.write_text('scopes:\n  - match: "^h\\\\.0\\\\."\n    stage: 5\n')
    res = parc("plan", str(_step(work, "gpt-tiny")), "--devices", "4xa100-80g", "--pipeline", "2", "--hints",
               str(hints), "-o", str(work / "never"))
    assert_one_line_error(res, "backwards.yaml:2", "stage 5")


@pytest.mark.parametrize("fault", ["scale:mlp.fc.weight.grad:4", "skip:mlp.proj.bias.grad"])
def test_adamw_verify_still_catches_injected_bugs(work, fault):
    """Adam's round-off bound must not hide real bugs: a gradient all-reduce missing its 1/n (a
    factor 4 on 4 ranks) or not run at all makes verify fail, although Adam's step is invariant
    to the gradient's scale (the moments are compared plainly)."""
    import os

    hints = work / "dp.yaml"
    hints.write_text("default: replicate\n")
    plan_dir = work / "gpt-adamw-dp"
    if not plan_dir.exists():
        _plan(_step(work, "gpt-tiny", "adamw"), plan_dir, "--hints", str(hints), "--mesh-dims", "1")
    _verify(plan_dir, "--steps", "3")
    os.environ["PARC_TEST_FAULT"] = fault
    try:
        res = parc("verify", str(plan_dir), "--steps", "3", timeout=300)
    finally:
        del os.environ["PARC_TEST_FAULT"]
    assert res.returncode == 1, res.stdout + res.stderr
    assert "MISMATCH" in res.stdout


def test_stages_on_different_meshes_send_each_receiver_its_shard(work, tmp_path):
    """Stage 0 on a flat mesh of 4, stage 1 on 2 x 2 (pins force the meshes): the sender holds a
    crossing value whole and cuts each receiver's shard out of it (`slice`); the plan verifies
    on 8 ranks, and cutting the wrong shard makes verify fail."""
    import shutil

    from parc.plandir.manifest import write_manifest

    hints = tmp_path / "meshes.yaml"
    hints.write_text("pins:\n  h.0.mlp.fc.weight: R\n  h.1.mlp.fc.weight: RR\n")
    plan_dir = tmp_path / "mixed"
    res = parc("plan", str(_step(work, "gpt-tiny")), "--devices", "8xa100-80g", "--jobs", "1", "--pipeline", "2",
               "--hints", str(hints), "-o", str(plan_dir))
    assert res.returncode == 0, res.stderr
    doc = json.loads((plan_dir / "plan.json").read_text())
    assert [s["mesh"] for s in doc["stages"]] == [[4], [2, 2]]
    tg = json.loads((plan_dir / "taskgraph.json").read_text())
    sliced = [t for t in tg["tasks"] if t["kind"] == "send" and "slice" in t]
    assert sliced and all(t["kind"] != "recv" or t["layout"] != "whole" for t in tg["tasks"])
    _verify(plan_dir, *TIGHT)
    bad = tmp_path / "bad"
    shutil.copytree(plan_dir, bad)
    tg = json.loads((bad / "taskgraph.json").read_text())
    for t in tg["tasks"]:  # every forward activation of stage 1's rank 4 cut as rank 7's
        if t["kind"] == "send" and t["peer"] == 4 and t.get("pass") == "F" and "slice" in t:
            t["slice"]["coords"] = [t["slice"]["coords"][0], 1, 1][-len(t["slice"]["coords"]):]
    (bad / "taskgraph.json").write_text(json.dumps(tg))
    write_manifest(bad)
    res = parc("verify", str(bad), "--steps", "2", timeout=300)
    assert res.returncode == 1, res.stdout + res.stderr


@pytest.mark.parametrize("args", [["--pipeline", "2"], ["--pipeline", "4", "--micro-batches", "2"]])
def test_transfers_matched_by_order_alone_give_the_source_loss(work, args, monkeypatch):
    """NcclComm's links carry no tags: a receive gets the next send of its peer. The in-process
    runner's links do the same (FIFO per direction), so running a pipelined plan on them checks
    that the task graph's orders alone pair every transfer right, as they must on GPUs. Each
    receive waits a little first, so senders run ahead and several transfers queue on a link."""
    import time

    from parc.exec.data import step_inputs, synthetic
    from parc.exec.threads import ThreadComm, run_threads

    recv = ThreadComm.recv

    def late_recv(self, *a, **k):
        time.sleep(0.02)
        return recv(self, *a, **k)

    monkeypatch.setattr(ThreadComm, "recv", late_recv)
    from parc.exec.verify import reference_run
    from parc.plandir import load_plan, load_program

    plan_dir = work / f"gpt-tiny-{'-'.join(args)}"
    if not plan_dir.exists():
        _plan(_step(work, "gpt-tiny"), plan_dir, *args)
    plan = load_plan(plan_dir)
    batches = [synthetic(step_inputs(load_program(plan_dir, 0)), 0, s) for s in range(2)]
    got, _ = run_threads(plan_dir, batches, timeout=120)
    want = reference_run(str(plan_dir), plan, 4, 2, 0)["outputs"]
    assert [float(o["loss"]) for o in got] == pytest.approx([float(o["loss"]) for o in want], rel=1e-5)


def test_pipelined_gradient_buckets_verify(work):
    """On PCIe GPUs gradient buckets pay between 2 devices (11.4 us of latency per member against
    copying 1 MiB twice at 600 GB/s): each data-parallel stage runs its small gradients' all-reduces as
    buckets, and the pipeline still computes the source's step."""
    (work / "dp.yaml").write_text("default: replicate\n")
    plan_dir = work / "gpt-buckets"
    res = parc("plan", str(_step(work, "gpt-tiny")), "--devices", "4xa10-24g", "--jobs", "1", "--pipeline", "2",
               "--micro-batches", "2", "--hints", str(work / "dp.yaml"), "-o", str(plan_dir))
    assert res.returncode == 0, res.stderr
    tg = json.loads((plan_dir / "taskgraph.json").read_text())
    buckets = [t for t in tg["tasks"] if t["kind"] == "collective" and t["tensor"].startswith("grad bucket: ")]
    assert {t["group"][0] for t in buckets} == {0, 2}  # one per stage (its group's first rank)
    _verify(plan_dir, *TIGHT)
