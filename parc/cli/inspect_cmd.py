"""`parc inspect MODEL`: op histogram, parameters, FLOPs, activation peak, coverage."""

from __future__ import annotations

import json

import click

from parc.analysis.inspect import inspect_file
from parc.ir import importer, print_graph


def _fmt_count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@click.command()
@click.argument("model", type=click.Path(dir_okay=False))
@click.option("--dim", "dims", multiple=True, metavar="NAME=VALUE", help="Bind a symbolic dim.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (stable keys).")
@click.option("--dump-after", type=click.Choice(["import", "fold-shapes"]),
              help="Also print the IR (to stderr) after this step.")
def inspect(model: str, dims: tuple[str, ...], as_json: bool, dump_after: str | None) -> None:
    """Report what MODEL is made of: ops, parameters, FLOPs, activation memory."""
    bound = importer.parse_dims(dims)
    report = inspect_file(model, bound)
    if dump_after and not report["unbound_dims"]:
        graph = importer.load(model, bound, fold=dump_after != "import")
        click.echo(print_graph(graph), err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    _print_report(report)


def _fmt_io(x: dict) -> str:
    from rich.markup import escape

    dtype = x["dtype"] if x["dtype"] not in (None, "None") else "?"
    shape = "[" + ", ".join(map(str, x["shape"])) + "]" if x["shape"] is not None else ""
    return escape(f"{x['name']} {dtype}{shape}")


def _print_report(r: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    summary = Table(title=escape(str(r["model"])), show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("opset / nodes", f"{r['opset']} / {r['nodes']}")
    for io in ("inputs", "outputs"):
        if r[io]:
            shown = ", ".join(_fmt_io(x) for x in r[io][:6])
            more = f" ... and {len(r[io]) - 6} more" if len(r[io]) > 6 else ""
            summary.add_row(io, shown + more)
    summary.add_row("parameters", f"{_fmt_count(r['parameters'])} ({r['parameters']:,}) in "
                    f"{r['parameter_tensors']} tensors, {_fmt_bytes(r['parameter_bytes'])}")
    summary.add_row("FLOPs / forward", _fmt_count(r["flops_forward"]))
    if r["training"]:
        summary.add_row("FLOPs / step", _fmt_count(r["flops_step"]))
        summary.add_row("phases", ", ".join(f"{k}: {v} nodes" for k, v in r["phases"].items()))
        opt = r["optimizer"]
        summary.add_row("optimizer", f"{opt['name']} lr={opt['lr']:g} weight_decay={opt['weight_decay']:g}")
        summary.add_row("gradients", _fmt_bytes(r["gradient_bytes"]))
        summary.add_row("optimizer state", _fmt_bytes(r["optimizer_state_bytes"]))
    summary.add_row("activation peak", _fmt_bytes(r["activation_bytes_peak"]))
    summary.add_row("shape-derived values", str(r["shape_dependent_values"]))
    if r["unbound_dims"]:
        summary.add_row("[red]unbound dims[/red]", ", ".join(r["unbound_dims"]) +
                        "  (bind with --dim NAME=VALUE for FLOPs and memory)")
    replicate = set(r["replicate_only_ops"])
    summary.add_row("replicate-only ops", ", ".join(sorted(replicate)) or "none")
    console.print(summary)
    ops = Table(title="ops", box=None)
    ops.add_column("op")
    ops.add_column("count", justify="right")
    ops.add_column("rule")
    for op, n in r["ops"].items():
        ops.add_row(op, str(n), "replicate-only" if op in replicate else "yes")
    console.print(ops)
