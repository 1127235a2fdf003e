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
def build_cmd(name: str, sets: tuple[str, ...], output: str) -> None:
    """Write zoo model NAME as ONNX (large weights as a sparse external-data file)."""
    from parc.models import build_model

    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = value.strip()
    path = build_model(name, output, overrides)
    click.echo(f"wrote {path}")
