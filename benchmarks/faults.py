"""The fault-injection suite's table: seeded trials (tests/exec/fault_trials.py) in which a rank of
a 4-rank gpt-tiny AdamW plan (one SPMD mesh, or a 2-stage pipeline) dies, hangs or raises at a
chosen step and task (compute, collective, pipeline send/recv, checkpoint write, rename or commit).

Each trial counts as survived when the job ended within the clean run's time + --timeout + 10 s
with no process left, the message named the injected rank and its task and blamed no other, the
checkpoint directory held a complete checkpoint (sha256 of every shard) of the step before the
fault or of the one it interrupted, and `--resume` from it reached the uninterrupted run's losses
and final state exactly.

    python benchmarks/faults.py [--trials 100] [--first-seed 0] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.exec import fault_trials as ft  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="parc-faults-") as tmp:
        work = Path(tmp)
        plans = ft.build_plans(work)
        refs = {name: ft.reference(p, work) for name, p in plans.items()}
        outcomes = []
        for seed in range(args.first_seed, args.first_seed + args.trials):
            trial = ft.make_trial(seed, refs)
            o = ft.run_trial(trial, plans, refs, work)
            outcomes.append(o)
            status = "ok" if o.survived else "FAILED: " + "; ".join(o.problems)
            print(f"seed {seed:3d} {trial.plan:8s} rank {trial.rank} step {trial.step} {trial.action:5s} "
                  f"{trial.kind:17s} {o.seconds:5.1f} s  checkpoint {o.checkpoint_step}  {status}", flush=True)
            if not o.survived:
                print(f"    {o.message}", flush=True)
    text = (f"{len(outcomes)} trials (seeds {args.first_seed}-{args.first_seed + args.trials - 1}), "
            f"{time.monotonic() - t0:.0f} s on {platform.node()} ({platform.processor() or platform.machine()}), "
            f"--timeout {ft.TIMEOUT:g} s, {ft.STEPS} steps, a checkpoint every step\n\n" + ft.table(outcomes))
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
