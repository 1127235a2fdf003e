"""`parc explain PLAN_DIR`: what the plan chose, why, and what it costs (reads only plan.json)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from parc.errors import PlanFormatError, UsageError


@click.command()
@click.argument("plan_dir", metavar="PLAN_DIR")
@click.option("--format", "fmt", type=click.Choice(["text", "md", "html", "json"]), default="text",
              show_default=True, help="text: tables (plain when piped); md, html (self-contained), json (stable keys).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the report to FILE (atomically).")
def explain(plan_dir: str, fmt: str, output: str | None) -> None:
    """Explain the plan in PLAN_DIR: mesh, strategies, communication, memory, baselines."""
    from parc.plandir.manifest import MANIFEST, check_manifest
    from parc.report import PLAN_FILE, load_plan, plan_path, print_text, render
    from parc.report import explain as explain_plan

    plan_file = plan_path(plan_dir)
    if output is not None:
        _check_output(Path(output), plan_file, PLAN_FILE)
    if (Path(plan_dir) / MANIFEST).is_file():
        check_manifest(plan_dir, extra_ok=True)  # refuse a tampered or incomplete plan directory
    plan = load_plan(plan_dir)
    try:
        report = explain_plan(plan, str(plan_file))
    except (AttributeError, KeyError, TypeError, ValueError) as e:  # a nested value of the wrong shape
        raise PlanFormatError(f"{plan_file}: malformed plan ({type(e).__name__}: {e})") from e
    if output is None and fmt == "text" and sys.stdout.isatty():
        from rich.console import Console

        print_text(report, Console(highlight=False))
        return
    text = render(report, fmt)
    if output is None:
        click.echo(text, nl=False)
        return
    _write_atomic(Path(output), text)
    click.echo(f"wrote {output}: {fmt} report of {plan_file}")


def _check_output(out: Path, plan_file: Path, plan_name: str) -> None:
    if out.resolve() == plan_file.resolve() or (out.exists() and os.path.samefile(out, plan_file)):
        raise UsageError(f"-o {out}: refusing to overwrite the plan's own {plan_name}")
    if not out.parent.resolve().is_dir():
        raise UsageError(f"-o {out}: directory {out.parent} does not exist")


def _write_atomic(out: Path, text: str) -> None:
    """Write next to the target and rename over it, so a reader never sees half a report."""
    tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
