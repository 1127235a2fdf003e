"""`parc profile -o calib.yaml`: measure this machine for the cost model (`parc.calibrate`)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from parc.errors import UsageError


@click.command()
@click.option("-o", "--output", type=click.Path(dir_okay=False), metavar="FILE",
              help="Calibration YAML to write (`parc plan --calibration FILE` reads it).")
@click.option("--ranks", "max_ranks", type=int,
              help="Measure 1, 2, 4, ... up to this many ranks sharing this host (default: 4 on CPUs, 1 on a GPU).")
@click.option("--seconds", "budget", type=float,
              help="How long each benchmark runs (default 0.6; longer: steadier figures on a noisy host).")
@click.option("--engine", default="auto", show_default=True, metavar="ENGINE",
              help="The engine `parc run --engine` will use: auto (cupy on a GPU, else ort), ort, numpy, or "
                   "cupy (one GPU: its matmul, memory and launch figures; CUPY_TF32=1 measures TF32 matmuls).")
@click.option("--device", "device", metavar="TYPE",
              help="The device type the file calibrates (default: cpu, or the catalogue's name of the GPU).")
@click.option("--model", "models", multiple=True, type=click.Path(dir_okay=False), metavar="FILE",
              help="An ONNX model (a training step from `parc grad`) whose own products and convolutions "
                   "calibrate their classes, at each rank count's share of their batch (repeatable).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE",
              help="Bind a symbolic dim of the --model files (as `parc plan --dim`).")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="On CPUs, end with reference training steps (the --model files, else two zoo models) run with "
                   "`parc run` on each rank count, whose measured time over their simulation is the "
                   "calibration's step_ratio (about 30 s for the zoo's).")
@click.option("--cases", hidden=True, type=click.Path(dir_okay=False))
@click.option("--worker", hidden=True, type=click.Path(dir_okay=False))
def profile(output: str | None, max_ranks: int | None, budget: float | None, engine: str, device: str | None,
            models: tuple[str, ...], dims: tuple[str, ...], reference: bool, cases: str | None, worker: str | None) -> None:
    """Measure this machine (compute per op class with parc's engine, collectives between
    ranks) and write a calibration file for `parc plan --calibration`."""
    from parc import calibrate
    from parc.ir.importer import parse_dims

    budget = calibrate.BUDGET if budget is None else budget
    if not budget > 0:
        raise UsageError(f"--seconds {budget}: expected a positive number of seconds")
    if worker is not None:
        calibrate.worker(worker, budget, engine, cases)
        return
    if output is None:
        raise UsageError("-o FILE is required: the calibration file to write")
    if max_ranks is not None and max_ranks < 1:
        raise UsageError(f"--ranks {max_ranks}: expected a count >= 1")
    out = Path(output)
    if out.exists() and out.is_dir():
        raise UsageError(f"-o {output}: is a directory (expected a file to write)")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK):
        raise UsageError(f"-o {output}: cannot write into {out.parent}")
    if dims and not models:
        raise UsageError("--dim binds the symbolic dims of --model files: give --model FILE")
    for m in models:
        if not Path(m).is_file():
            raise UsageError(f"--model {m}: no such file (expected an ONNX model)")
    if device is not None:
        from parc.cluster.devices import lookup_device

        device = lookup_device(device, "--device").name
    calibrate.profile(out, max_ranks, budget, device, echo=lambda s: click.echo(s, err=True), engine=engine, models=models,
                 dims=parse_dims(dims), reference=reference)
    click.echo(f"wrote {out}")
