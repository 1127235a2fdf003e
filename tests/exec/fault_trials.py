"""Seeded fault-injection trials of `parc run`: a rank dies, hangs or raises at a chosen step and
task, and the job must end in time, name that rank and task, keep a complete checkpoint and
resume from it to the state of an uninterrupted run.

Used by tests/exec/test_fault_suite.py (a few trials in `make test`, 100 in `make test-all`) and
benchmarks/faults.py (the table in docs/benchmarks.md). Each trial:

1. runs `parc run PLAN --steps STEPS --checkpoint CK --checkpoint-every 1 --timeout T` with
   `PARC_FAULT=RANK:STEP:ACTION:KIND` (parc.exec.watch.parse_fault);
2. checks that the job ended within the clean run's time + T + 10 s, that no rank process is
   left, and that the error names RANK (and no other rank as the one that failed) and the task;
3. checks the checkpoint directory (every shard's sha256 against the manifest) holds the last
   checkpoint before the fault, or the one the fault interrupted, complete;
4. resumes from it to STEPS and compares the losses and the final parameters and optimizer state
   (every tensor, exactly) with an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from parc.exec.watch import FAULT_KINDS
from tests.helpers import parc

STEPS = 5  # steps of every run; faults strike at steps 2..STEPS
TIMEOUT = 5.0  # --timeout of the faulty runs (s)
SLACK = 10.0  # the job must end within the clean run's time + TIMEOUT + SLACK
ACTIONS = ("die", "hang", "raise")
CHECKPOINT_KINDS = ("checkpoint_write", "checkpoint_rename", "checkpoint_commit")
# what a message says for each kind of task (parc.exec.watch.describe_task)
TASK_WORDS = {"compute": "compute ", "collective": " with ranks ", "send": "send of ", "recv": "recv of ",
              "checkpoint_write": "checkpoint's write of", "checkpoint_rename": "checkpoint's rename of",
              "checkpoint_commit": "checkpoint's commit"}
# the line that blames a rank, per action: the launcher's for a dead rank, the rank's own for an
# error, the timeout's "not responding" list for a hung one
BLAME = {"die": re.compile(r"parc: error: rank (\d+) \(pid"),
         "raise": re.compile(r"parc: rank (\d+): InjectedFault"),
         "hang": re.compile(r"not responding: rank (\d+) \(")}
ANY_BLAME = re.compile(r"parc: error: rank (\d+) \(pid|parc: rank (\d+): InjectedFault|not responding: rank (\d+) \(")


@dataclass(frozen=True)
class Trial:
    seed: int
    plan: str
    rank: int
    step: int
    action: str
    kind: str

    @property
    def fault(self) -> str:
        return f"{self.rank}:{self.step}:{self.action}:{self.kind}"


@dataclass
class Reference:
    """An uninterrupted run of a plan: its losses, final state and wall time."""

    losses: list[float]
    state: dict[str, np.ndarray]
    seconds: float
    kinds: dict[int, tuple[str, ...]]  # rank -> the kinds of task it runs


@dataclass
class Outcome:
    trial: Trial
    seconds: float = 0.0
    ended: bool = False  # within the limit, no process left
    named: bool = False  # the message names the rank and its task
    wrong_blame: bool = False  # a message blames another rank
    checkpoint_ok: bool = False  # a complete checkpoint, of the step before the fault or the fault's
    resumed_equal: bool = False  # resumed to the end, equal to the uninterrupted run
    checkpoint_step: int | None = None
    problems: list[str] = field(default_factory=list)
    message: str = ""

    @property
    def survived(self) -> bool:
        return self.ended and self.named and not self.wrong_blame and self.checkpoint_ok and self.resumed_equal


def build_plans(directory: Path) -> dict[str, Path]:
    """gpt-tiny's AdamW step planned on 4 ranks: one SPMD mesh, and a 2-stage pipeline."""
    directory.mkdir(parents=True, exist_ok=True)
    model = directory / "gpt-tiny.train.onnx"
    res = parc("models", "build", "gpt-tiny", "--train", "adamw", "-o", str(model))
    assert res.returncode == 0, res.stderr
    plans = {"spmd": directory / "spmd", "pipeline": directory / "pipeline"}
    for name, extra in (("spmd", ["--mesh-dims", "1"]), ("pipeline", ["--pipeline", "2"])):
        res = parc("plan", str(model), "--devices", "4xa100-80g", *extra, "--jobs", "1", "-o", str(plans[name]))
        assert res.returncode == 0, res.stderr
    return plans


def reference(plan: Path, work: Path) -> Reference:
    from parc.exec.checkpoint import check_checkpoint, full_tensors
    from parc.plandir.taskgraph import load_taskgraph

    ck = work / f"reference-{plan.name}"
    t0 = time.monotonic()
    res = parc("run", str(plan), "--steps", str(STEPS), "--json", "--checkpoint", str(ck), "--checkpoint-every", "1")
    seconds = time.monotonic() - t0
    assert res.returncode == 0, res.stderr
    graph = load_taskgraph(plan / "taskgraph.json")
    kinds = {r: tuple(sorted(({graph.tasks[t]["kind"] for t in ids} & set(FAULT_KINDS)) |
                             {"checkpoint_write", "checkpoint_rename"} | ({"checkpoint_commit"} if r == 0 else set())))
             for r, ids in graph.order.items()}
    return Reference(losses=[json.loads(line)["loss"] for line in res.stdout.splitlines()],
                     state=full_tensors(ck, check_checkpoint(ck)), seconds=seconds, kinds=kinds)


def make_trial(seed: int, refs: dict[str, Reference]) -> Trial:
    """The fault of trial `seed`: a plan, an action, a kind of task the plan runs (each equally
    likely: rank 0's checkpoint commit as often as a collective), a rank that runs it, a step."""
    rng = random.Random(seed)
    plan = rng.choice(sorted(refs))
    action = rng.choice(ACTIONS)
    kinds = refs[plan].kinds
    kind = rng.choice(sorted({k for ks in kinds.values() for k in ks}))
    rank = rng.choice([r for r in sorted(kinds) if kind in kinds[r]])
    return Trial(seed, plan, rank, rng.randint(2, STEPS), action, kind)


def _left(ck: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", f"--checkpoint {ck}( |$)"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def run_trial(trial: Trial, plans: dict[str, Path], refs: dict[str, Reference], work: Path) -> Outcome:
    from parc.errors import UsageError
    from parc.exec.checkpoint import check_checkpoint, full_tensors

    out = Outcome(trial)
    plan, ref = plans[trial.plan], refs[trial.plan]
    ck = work / f"ck-{trial.seed}"
    limit = ref.seconds + TIMEOUT + SLACK
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "parc.cli.main", "run", str(plan), "--steps", str(STEPS),
                             "--checkpoint", str(ck), "--checkpoint-every", "1", "--timeout", str(TIMEOUT)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PARC_FAULT": trial.fault})
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        out.problems.append(f"still running after {limit:.0f} s")
    out.seconds = time.monotonic() - t0
    left = _left(ck)
    for pid in left:
        subprocess.run(["kill", "-9", str(pid)], capture_output=True)
    if left:
        out.problems.append(f"{len(left)} process(es) left")
    out.ended = not out.problems
    out.message = " | ".join(line for line in err.splitlines() if line.startswith("parc:"))
    if proc.returncode == 0:
        out.problems.append("the run succeeded: the fault did not strike")
    # the message: the injected rank, by the line its action calls for, with its task
    named = [m for line in err.splitlines() for m in BLAME[trial.action].finditer(line)
             if int(m.group(1)) == trial.rank and TASK_WORDS[trial.kind] in line[m.start():]]
    out.named = bool(named)
    if not named:
        out.problems.append("the injected rank and task are not named")
    blamed = {int(next(g for g in m.groups() if g)) for m in ANY_BLAME.finditer(err)}
    if blamed - {trial.rank}:
        out.wrong_blame = True
        out.problems.append(f"blames rank(s) {sorted(blamed - {trial.rank})}")
    # the checkpoint: complete, and the one before the fault or the one it interrupted
    allowed = {trial.step - 1, trial.step} if trial.kind in CHECKPOINT_KINDS else {trial.step - 1}
    try:
        doc = check_checkpoint(ck)
        out.checkpoint_step = int(doc["step"])
        out.checkpoint_ok = out.checkpoint_step in allowed
        if not out.checkpoint_ok:
            out.problems.append(f"checkpoint at step {out.checkpoint_step}, expected {sorted(allowed)}")
    except UsageError as e:
        out.problems.append(f"checkpoint lost: {e}")
        return out
    # resume to the end: the uninterrupted run's losses and final state, exactly
    res = parc("run", str(plan), "--steps", str(STEPS), "--json", "--checkpoint", str(ck), "--resume",
                timeout=limit + 60)
    if res.returncode != 0:
        out.problems.append(f"resume failed: {res.stderr.strip().splitlines()[-1:]}")
        return out
    losses = [json.loads(line)["loss"] for line in res.stdout.splitlines()]
    state = full_tensors(ck, check_checkpoint(ck))
    same_state = sorted(state) == sorted(ref.state) and all(np.array_equal(state[k], ref.state[k]) for k in state)
    out.resumed_equal = losses == ref.losses[out.checkpoint_step:] and same_state
    if not out.resumed_equal:
        out.problems.append("resumed run differs from the uninterrupted one" +
                            ("" if same_state else " (final state)"))
    return out


def table(outcomes: list[Outcome]) -> str:
    """The summary table (markdown): per action and plan, and in all."""
    rows = []
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.trial.action, o.trial.plan), []).append(o)
    head = ("| fault | plan | tried | survived | wrong blames | not named | hangs or leftovers | lost checkpoints "
            "| resume differs | slowest end (s) |\n|---|---|---|---|---|---|---|---|---|---|")

    def row(name: str, plan: str, os_: list[Outcome]) -> str:
        return (f"| {name} | {plan} | {len(os_)} | {sum(o.survived for o in os_)} | {sum(o.wrong_blame for o in os_)} "
                f"| {sum(not o.named for o in os_)} | {sum(not o.ended for o in os_)} "
                f"| {sum(not o.checkpoint_ok for o in os_)} "
                f"| {sum(o.checkpoint_ok and not o.resumed_equal for o in os_)} | {max(o.seconds for o in os_):.1f} |")

    for (action, plan), os_ in sorted(groups.items()):
        rows.append(row(action, plan, os_))
    rows.append(row("**all**", "", outcomes))
    kinds: dict[str, list[Outcome]] = {}
    for o in outcomes:
        kinds.setdefault(o.trial.kind, []).append(o)
    by_kind = ", ".join(f"{k} {sum(o.survived for o in v)}/{len(v)}" for k, v in sorted(kinds.items()))
    return head + "\n" + "\n".join(rows) + f"\n\nBy task kind (survived/tried): {by_kind}."
