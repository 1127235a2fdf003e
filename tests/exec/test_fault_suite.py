"""The fault-injection suite (tests/exec/fault_trials.py): a rank dies, hangs or raises at a
chosen step and task of an SPMD or pipelined plan; the job ends in time with no process left,
names that rank and task, keeps a complete checkpoint, and resumes from it to the uninterrupted
run's losses and state. `make test` runs the hand-picked trials below, `make test-all` 100 seeded
ones (benchmarks/faults.py writes their table to docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from tests.exec import fault_trials as ft
from tests.helpers import needs_mpiexec

pytestmark = needs_mpiexec
pytest.importorskip("onnxruntime")

# every action, every checkpoint step, pipeline transfers, on both plans
SHORT = [ft.Trial(-1, "spmd", 2, 3, "die", "collective"),
         ft.Trial(-2, "pipeline", 1, 2, "hang", "recv"),
         ft.Trial(-3, "pipeline", 3, 4, "raise", "send"),
         ft.Trial(-4, "spmd", 1, 3, "die", "checkpoint_write"),
         ft.Trial(-5, "pipeline", 2, 2, "die", "checkpoint_rename"),
         ft.Trial(-6, "spmd", 0, 4, "die", "checkpoint_commit"),
         ft.Trial(-7, "pipeline", 0, 3, "hang", "checkpoint_commit"),
         ft.Trial(-8, "spmd", 3, 5, "raise", "compute")]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    work = tmp_path_factory.mktemp("faults")
    plans = ft.build_plans(work)
    return plans, {name: ft.reference(p, work) for name, p in plans.items()}, work


@pytest.mark.parametrize("trial", SHORT, ids=lambda t: f"{t.plan}-{t.action}-{t.kind}")
def test_fault(suite, trial):
    plans, refs, work = suite
    assert trial.kind in refs[trial.plan].kinds[trial.rank]
    out = ft.run_trial(trial, plans, refs, work)
    assert out.survived, (out.problems, out.message)


@pytest.mark.slow
def test_hundred_seeded_faults(suite):
    plans, refs, work = suite
    outcomes = [ft.run_trial(ft.make_trial(seed, refs), plans, refs, work) for seed in range(100)]
    failed = [(o.trial, o.problems, o.message) for o in outcomes if not o.survived]
    assert not failed, ft.table(outcomes) + "\n" + "\n".join(map(str, failed))


def test_trials_are_seeded(suite):
    _, refs, _ = suite
    trials = [ft.make_trial(seed, refs) for seed in range(100)]
    assert trials == [ft.make_trial(seed, refs) for seed in range(100)]
    assert {t.action for t in trials} == set(ft.ACTIONS) and {t.plan for t in trials} == {"spmd", "pipeline"}
    assert set(ft.CHECKPOINT_KINDS) | {"send", "recv", "compute", "collective"} <= {t.kind for t in trials}
