"""Renderers of the report document: rich text, Markdown, self-contained HTML, and JSON."""

from __future__ import annotations

import html
import io
import json
import re

from parc.report import figures
from parc.report.facts import Report
from parc.report.layout import Section, Table, document
from parc.report.units import fmt_bytes, fmt_time

FORMATS = ("text", "md", "html", "json")
TEXT_WIDTH = 140  # columns of text written to a file or pipe, so it is the same everywhere
SIM_RANK_ROWS = 32  # ranks listed under the simulated timeline; the JSON has them all


def render(report: Report, fmt: str) -> str:
    """The report in one of FORMATS, as a string (text is plain: no colour, ASCII boxes)."""
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2, sort_keys=True) + "\n"
    if fmt == "md":
        return markdown(report)
    if fmt == "html":
        return html_page(report)
    if fmt == "text":
        from rich.console import Console

        console = Console(file=io.StringIO(), width=TEXT_WIDTH, color_system=None, force_terminal=False,
                          highlight=False, emoji=False)
        print_text(report, console, plain=True)
        text = console.file.getvalue()  # type: ignore[attr-defined]
        return "".join(line.rstrip() + "\n" for line in text.splitlines())
    raise ValueError(f"unknown report format {fmt!r}; expected one of {', '.join(FORMATS)}")


def print_text(report: Report, console, *, plain: bool = False) -> None:
    """Print the report with rich tables on `console` (a terminal gets colour and round boxes)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table as RichTable

    title, sections = document(report)
    style = box.ASCII2 if plain else box.ROUNDED
    console.print(f"[bold]{escape(title)}[/bold]")
    for s in sections:
        console.print()
        console.print(f"[bold underline]{escape(s.title)}[/bold underline]")
        if s.pairs:
            kv = RichTable(show_header=False, box=None, pad_edge=False)
            kv.add_column(style="bold", no_wrap=True)
            kv.add_column()
            for k, v in s.pairs:
                kv.add_row(escape(k), escape(v))
            console.print(kv)
        for t in s.tables:
            rt = RichTable(box=style, caption=escape(t.note) if t.note else None, caption_justify="left",
                           header_style="bold")
            for k, c in enumerate(t.columns):
                rt.add_column(escape(c), justify="right" if k in t.right else "left", overflow="fold")
            for row in t.rows:
                rt.add_row(*map(escape, row))
            console.print(rt)
        if s.bullets:
            items = RichTable.grid(padding=(0, 1))
            items.add_column(no_wrap=True)
            items.add_column()
            for b in s.bullets:
                items.add_row("-", escape(b))
            console.print(items)


def markdown(report: Report) -> str:
    title, sections = document(report)
    lines = [f"# {_md(title)}", ""]
    for s in sections:
        lines += [f"## {_md(s.title)}", ""]
        if s.pairs:
            lines += [f"- **{_md(k)}**: {_md(v)}" for k, v in s.pairs] + [""]
        for t in s.tables:
            lines += _md_table(t)
        if s.bullets:
            lines += [f"- {_md(b)}" for b in s.bullets] + [""]
    return "\n".join(lines)


def _md_table(t: Table) -> list[str]:
    def row(cells: list[str]) -> str:
        return "| " + " | ".join(_md(c).replace("|", "\\|") or " " for c in cells) + " |"

    sep = "| " + " | ".join("---:" if k in t.right else "---" for k in range(len(t.columns))) + " |"
    out = [row(t.columns), sep] + [row(r) for r in t.rows] + [""]
    return out + ([f"*{_md(t.note)}*", ""] if t.note else [])


def _md(text: str) -> str:
    """Escape what Markdown would read as markup; `_` inside a word (`ln_1`) is left alone."""
    for ch in ("\\", "*", "`", "<", "[", "]"):
        text = text.replace(ch, "\\" + ch)
    return re.sub(r"(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])", r"\\_", text)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;max-width:80em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
caption{caption-side:bottom;text-align:left;font-size:.85em;color:#666;padding-top:.3em}
dl{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}dt{font-weight:bold}dd{margin:0}
code,.mono{font-family:ui-monospace,monospace}
figure{margin:1em 0}figure svg{display:block;max-width:100%;height:auto}
figcaption{font-size:.85em;color:#555;max-width:60em;margin-top:.3em}p.note{color:#555;font-style:italic}"""


def html_page(report: Report) -> str:
    """A self-contained page: inline CSS and SVG charts, no scripts, no external assets."""
    title, sections = document(report)
    e = html.escape
    charts = _charts(report)
    parts = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
             f"<title>{e(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>", f"<h1>{e(title)}</h1>"]
    for s in sections:
        parts.append(f"<section><h2>{e(s.title)}</h2>")
        if s.pairs:
            parts.append("<dl>" + "".join(f"<dt>{e(k)}</dt><dd class=\"mono\">{e(v)}</dd>" for k, v in s.pairs)
                         + "</dl>")
        parts += charts.get(s.title, [])
        for t in s.tables:
            parts.append(_html_table(t))
        if s.bullets:
            parts.append("<ul>" + "".join(f"<li>{e(b)}</li>" for b in s.bullets) + "</ul>")
        parts.append("</section>")
        if s.title == "Summary":
            parts.append(_simulated_step(report))
    parts += ["</body>", "</html>", ""]
    return "\n".join(parts)


def _charts(report: Report) -> dict[str, list[str]]:
    """The charts by the title of the section they illustrate."""
    mesh = "Pipeline" if report.pipeline and report.pipeline.get("stages") else "Summary"
    return {mesh: [figures.stages_figure(report)], "Memory": [figures.memory_figure(report)],
            "Against baselines": [figures.baselines_figure(report)]}


def _simulated_step(report: Report) -> str:
    """A section of its own: the timeline of the simulated step and each rank's totals."""
    sim = report.simulation
    parts = ["<section><h2>Simulated step</h2>", figures.timeline_figure(report)]
    if sim is not None and sim.ranks:
        rows = [[str(x.rank), fmt_time(x.busy_s), fmt_time(x.compute_s), fmt_time(x.comm_s), fmt_time(x.wait_s),
                 fmt_bytes(x.peak_bytes)] for x in sim.ranks[:SIM_RANK_ROWS]]
        more = len(sim.ranks) - SIM_RANK_ROWS
        note = f"simulated step {fmt_time(sim.step_time_s)}" + (f"; {more} more ranks in --format json" if more > 0 else "")
        parts.append(_html_table(Table(["rank", "busy", "compute", "communication", "waiting", "peak memory"],
                                       rows, frozenset({1, 2, 3, 4, 5}), note)))
    return "\n".join(parts + ["</section>"])


def _html_table(t: Table) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(f"<td class=\"num\">{e(c)}</td>" if k in t.right else f"<td>{e(c)}</td>"
                                    for k, c in enumerate(row)) + "</tr>" for row in t.rows)
    caption = f"<caption>{e(t.note)}</caption>" if t.note else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


__all__ = ["FORMATS", "Section", "print_text", "render"]
