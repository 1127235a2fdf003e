"""`parc profile -o calib.yaml`: measure this machine for the cost model (`parc.exec.profile`)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from parc.errors import UsageError


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), metavar="FILE",
              help="Calibration YAML to write (`parc plan --calibration FILE` reads it).")
@click.option("--ranks", "max_ranks", type=int, default=4, show_default=True,
              help="Measure 1, 2, 4, ... up to this many ranks sharing this host.")
@click.option("--seconds", "budget", type=float,
              help="How long each benchmark runs (default 0.6; longer: steadier figures on a noisy host).")
@click.option("--worker", hidden=True, type=click.Path(dir_okay=False))
def profile(output: str | None, max_ranks: int, budget: float | None, worker: str | None) -> None:
    """Measure this machine (compute per op class with parc's engine, collectives between
    ranks) and write a calibration file for `parc plan --calibration`."""
    from parc.exec import profile as prof

    budget = prof.BUDGET if budget is None else budget
    if not budget > 0:
        raise UsageError(f"--seconds {budget}: expected a positive number of seconds")
    if worker is not None:
        prof.worker(worker, budget)
        return
    if output is None:
        raise UsageError("-o FILE is required: the calibration file to write")
    if max_ranks < 1:
        raise UsageError(f"--ranks {max_ranks}: expected a count >= 1")
    out = Path(output)
    if out.exists() and out.is_dir():
        raise UsageError(f"-o {output}: is a directory (expected a file to write)")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise UsageError(f"-o {output}: cannot write into {out.parent}")
    prof.profile(out, max_ranks, budget, echo=lambda s: click.echo(s, err=True))
    click.echo(f"wrote {out}")
