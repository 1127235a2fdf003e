"""`parc run PLAN_DIR`: train (or run) a plan on its ranks; `parc verify PLAN_DIR`: compare it with
the source model on one device."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from parc.errors import UsageError
from parc.plandir.runnable import check_runnable


def _common(f):
    for opt in reversed([
        click.option("--engine", type=click.Choice(["auto", "ort", "cupy", "numpy"]), default="auto",
                     show_default=True,
                     help="auto: cupy on a GPU, else ort; ort: onnxruntime on the CPU; cupy: parc's own kernels "
                          "on a GPU (refused without one); numpy: the same kernels on the CPU."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed of the synthetic data (and of the parameters with --init seeded)."),
        click.option("--init", type=click.Choice(["source", "seeded"]), default="source", show_default=True,
                     help="source: the model's own values; seeded: drawn from --seed, each rank only its "
                          "shard, the same whole tensors whatever the plan."),
        click.option("--timeout", type=float, default=60.0, show_default=True, metavar="SECONDS",
                     help="A collective that does not complete in this time ends the job."),
        click.option("--force", is_flag=True, help="Run even if the plan's predicted memory exceeds the devices."),
    ]):
        f = opt(f)
    return f


@click.command()
@click.argument("plan_dir", metavar="PLAN_DIR")
@click.option("--steps", type=int, default=10, show_default=True,
              help="The total count of training steps: with --resume, the run goes on from the checkpoint's step "
                   "up to this one.")
@click.option("--data", type=click.Path(dir_okay=False), help="npz: one array per data input ([steps, ...] or one batch).")
@click.option("--checkpoint", type=click.Path(file_okay=False), help="Checkpoint directory (written at the end).")
@click.option("--checkpoint-every", type=int, default=0, metavar="N", help="Also checkpoint every N steps.")
@click.option("--resume", is_flag=True, help="Continue from --checkpoint (resharding if the plan differs).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per step on stdout.")
@click.option("--tf32", is_flag=True, help="On a GPU, float32 matmuls on TF32 tensor cores (faster, ~1e-3 "
              "relative error).")
@click.option("--trace", type=click.Path(), metavar="FILE",
              help="Write every rank's tasks of the last step, measured, beside the times parc simulate gives "
                   "them (Chrome trace JSON: open it in ui.perfetto.dev).")
@click.option("--dump", hidden=True, type=click.Path(file_okay=False))
@_common
def run(plan_dir: str, steps: int, data: str | None, checkpoint: str | None, checkpoint_every: int, resume: bool,
        as_json: bool, tf32: bool, trace: str | None, dump: str | None, engine: str, seed: int, init: str,
        timeout: float, force: bool) -> None:
    """Run the plan in PLAN_DIR on its ranks for --steps steps (loss, step time, samples/s)."""
    from parc.exec.engine_choice import pick_engine, plan_engine
    from parc.exec.launch import CHILD, launch, rank_from_env, train
    from parc.exec.watch import FAULT_ENV, parse_fault

    if steps < 1:
        raise UsageError(f"--steps {steps}: expected a count >= 1")
    if resume and not checkpoint:
        raise UsageError("--resume needs --checkpoint DIR")
    if checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every {checkpoint_every}: expected a count >= 0")
    if os.environ.get(FAULT_ENV):  # the failure tests' switch: a bad one is one line, before any rank starts
        parse_fault(os.environ[FAULT_ENV])
    pick_engine(engine)  # --engine cupy without a usable GPU: one line, before any rank starts
    if trace:
        from parc.exec.trace import check_output

        check_output(trace)
    in_job = rank_from_env() is not None or os.environ.get(CHILD)
    if in_job and not os.environ.get(CHILD):  # the user's own mpiexec or srun: each rank checks
        plan, _ = check_runnable(plan_dir, force)
        engine = plan_engine(engine, plan)
        _check_checkpoint(checkpoint, resume, plan_dir, hashes=False)  # each rank's load checks the sha256
    if not in_job:
        plan, ranks = check_runnable(plan_dir, force)
        engine = plan_engine(engine, plan)
        if data:
            from parc.exec.data import NpzData, step_inputs
            from parc.plandir import load_program

            NpzData(data, step_inputs(load_program(plan_dir, 0)))
        _check_checkpoint(checkpoint, resume, plan_dir)
        if ranks > 1:
            argv = ["run", plan_dir, "--steps", str(steps), "--engine", engine, "--seed", str(seed), "--init", init,
                    "--timeout", str(timeout), "--force"]
            argv += ["--data", data] if data else []
            argv += ["--checkpoint", checkpoint, "--checkpoint-every", str(checkpoint_every)] if checkpoint else []
            argv += ["--resume"] if resume else []
            argv += ["--json"] if as_json else []
            argv += ["--tf32"] if tf32 else []
            argv += ["--dump", dump] if dump else []
            argv += ["--trace", trace] if trace else []
            rc = launch(ranks, argv)
            if rc:
                raise SystemExit(2 if rc == 2 else 1)  # a rank's bad input, else a failed run
            return
    train(Path(plan_dir), steps=steps, seed=seed, engine=engine, data=data, as_json=as_json, timeout=timeout,
          dump=dump, checkpoint=checkpoint, resume=resume, checkpoint_every=checkpoint_every, init=init,
          tf32=tf32, trace=trace, echo=lambda s: click.echo(s))


def _check_checkpoint(checkpoint: str | None, resume: bool, plan_dir: str, hashes: bool = True) -> None:
    """--checkpoint's directory: a valid checkpoint the plan can resume from, and a place parc
    may write."""
    from parc.exec.checkpoint import check_resumable, check_writable

    if resume:
        check_resumable(checkpoint, plan_dir, hashes)  # type: ignore[arg-type]
    if checkpoint:
        check_writable(checkpoint)


@click.command()
@click.argument("plan_dir", metavar="PLAN_DIR")
@click.option("--steps", type=int, default=None, help="Steps to compare [default: 3; 1 for a mixed-precision step].")
@click.option("--rtol", type=float, default=1e-3, show_default=True, help="Relative tolerance.")
@click.option("--atol", type=float, default=1e-5, show_default=True, help="Absolute tolerance.")
@click.option("--json", "as_json", is_flag=True, help="The comparison as JSON.")
@click.option("--data", type=click.Path(dir_okay=False), help="npz batches to compare on (default: synthetic).")
@_common
def verify(plan_dir: str, steps: int | None, rtol: float, atol: float, as_json: bool, data: str | None, engine: str,
           seed: int, init: str, timeout: float, force: bool) -> None:
    """Run the source model on one device (onnxruntime) and the plan on its ranks from the same
    state and data; compare the outputs every step and the parameters at the end (exit 1 on a
    mismatch)."""
    from parc.api import verify as verify_plan

    result = verify_plan(plan_dir, steps=steps, rtol=rtol, atol=atol, data=data, engine=engine, seed=seed,
                         init=init, timeout=timeout, force=force)
    ok, rows, rtol, steps, ranks = result.ok, result.tensors, result.rtol, result.steps, result.ranks
    low = f" (widened for {result.low_eps:.3g}-epsilon products: parc grad --precision)" if result.low_eps else ""
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=1))
    else:
        width = max(len(r["tensor"]) for r in rows)
        for r in rows:
            note = (f"  ({r['roundoff_elements']} elements with a round-off gradient: Adam's bound)"
                    if r.get("roundoff_elements") else "")
            click.echo(f"{'ok ' if r['ok'] else 'BAD'} {r['tensor']:<{width}}  max rel err {r['max_rel_err']:.3e}  "
                       f"max abs err {r['max_abs_err']:.3e}{note}")
        bad = sum(not r["ok"] for r in rows)
        click.echo(f"{'verified' if ok else 'MISMATCH'}: {len(rows) - bad}/{len(rows)} tensors within rtol {rtol:g}, "
                   f"atol {atol:g} over {steps} step{'s' if steps > 1 else ''} on {ranks} rank{'s' if ranks > 1 else ''}"
                   f"{low}")
    if not ok:
        sys.exit(1)


@click.command("export")
@click.argument("checkpoint", metavar="CHECKPOINT_DIR")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The ONNX file to write.")
def export(checkpoint: str, output: str) -> None:
    """Write the source model with a checkpoint's trained values as one ONNX file."""
    from parc.exec.checkpoint import export_checkpoint

    if not Path(output).parent.resolve().is_dir():
        raise UsageError(f"-o {output}: directory {Path(output).parent} does not exist")
    out = export_checkpoint(checkpoint, output)
    click.echo(f"wrote {out}")
