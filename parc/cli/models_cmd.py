"""`parc models list|build`: the bundled model zoo."""

from __future__ import annotations

import json

import click

from parc.errors import UsageError


@click.group()
def models() -> None:
    """The model zoo: the papers' benchmark models at any size."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def list_cmd(as_json: bool) -> None:
    """List the zoo's models."""
    from parc.models import list_models

    infos = list_models()
    if as_json:
        click.echo(json.dumps([{"name": m.name, "family": m.family, "description": m.description,
                                "params_paper": m.params_paper} for m in infos], indent=2))
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(box=None)
    for col in ("name", "family", "paper params", "description"):
        table.add_column(col)
    for m in infos:
        table.add_row(m.name, m.family, f"{m.params_paper / 1e6:,.0f}M" if m.params_paper else "-",
                      escape(m.description))
    Console(highlight=False).print(table)


@models.command("build")
@click.argument("name")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override a config field.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .onnx file.")
@click.option("--train", "optimizer", type=click.Choice(["sgd", "momentum", "adam", "adamw"]),
              help="Write the training step (as `parc grad` would) with this optimizer instead.")
@click.option("--lr", default=1e-3, type=float, show_default=True, help="Learning rate for --train.")
def build_cmd(name: str, sets: tuple[str, ...], output: str, optimizer: str | None, lr: float) -> None:
    """Write zoo model NAME as ONNX (large weights as a sparse external-data file)."""
    import tempfile
    from pathlib import Path

    from parc.models import build_model

    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = value.strip()
    if optimizer is None:
        click.echo(f"wrote {build_model(name, output, overrides)}")
        return
    from parc.autodiff import OptimizerConfig, make_training_step
    from parc.ir import load, save

    cfg = OptimizerConfig(optimizer, lr)
    with tempfile.TemporaryDirectory(dir=Path(output).resolve().parent) as tmp:
        graph = load(build_model(name, Path(tmp) / "forward.onnx", overrides))
        step = make_training_step(graph, cfg)
        save(graph, output)
    click.echo(f"wrote {output}: training step of {name} ({optimizer}, {len(step.params)} parameters)")
