"""Inline SVG charts for the HTML report: hand-written SVG strings, no scripts, no external assets.

Each `*_svg` function is pure: plain rows in, one `<svg>` element out, every piece of text
escaped with `html.escape`, so a chart parses as XML whatever the names in the plan are.
`figures.py` turns a `Report` into these rows.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from parc.plandir.simulation import TIMELINE_RANKS
from parc.report.units import fmt_bytes, fmt_pct, fmt_ratio, fmt_time


@dataclass(frozen=True)
class Palette:
    """Every colour the charts use (Tableau 10 hues; text dark on light backgrounds)."""

    compute: str = "#4e79a7"
    comm: str = "#f28e2b"
    wait: str = "#cfc9c3"
    plan: str = "#4e79a7"
    baseline: str = "#a0aab4"
    infeasible: str = "#b8b8b8"
    budget: str = "#c0392b"
    text: str = "#222222"
    muted: str = "#5f5f5f"
    grid: str = "#e4e4e4"
    box: str = "#f6f7f9"
    line: str = "#7a7a7a"
    series: tuple[str, ...] = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f")


PALETTE = Palette()
MERGE_FRACTION = 1e-3  # spans of one kind closer than this fraction of the step are drawn as one bar
TIMELINE_ROWS = TIMELINE_RANKS  # ranks drawn: as many as plan.json's simulation lists
GRID_SQUARES = 64  # device squares drawn per stage box
_KIND_WORDS = {"compute": "compute", "comm": "communication", "wait": "waiting (bubble)"}
_e = html.escape

Span = tuple[float, float, str, str]  # (start_s, end_s, kind, label) as plan.json's simulation.timeline
Scale = Callable[[float], float]  # a value to its x coordinate


# -- timeline -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Bar:
    """One drawn rectangle of a timeline: a span, or spans of one kind merged."""

    start_s: float
    end_s: float
    kind: str
    label: str | None  # None: several spans merged (no tooltip)
    spans: int


@dataclass(frozen=True)
class TimelineRow:
    label: str  # `rank 2 (stage 1)`
    spans: Sequence[Span]
    note: str = ""  # the label's tooltip


def merge_spans(spans: Iterable[Span], tolerance_s: float) -> list[Bar]:
    """Bars for spans: spans of one kind less than tolerance_s apart (or overlapping) become one bar.

    Kinds merge separately, so compute interleaved with short transfers still merges; at most
    one bar per kind starts in any window of tolerance_s, which bounds a row's size.
    """
    bars: list[Bar] = []
    for start, end, kind, label in sorted(spans, key=lambda s: (s[2], s[0], s[1])):
        last = bars[-1] if bars else None
        if last is not None and last.kind == kind and start - last.end_s < tolerance_s:
            bars[-1] = Bar(last.start_s, max(last.end_s, end), kind, None, last.spans + 1)
        else:
            bars.append(Bar(start, end, kind, label, 1))
    return sorted(bars, key=lambda b: (b.start_s, b.kind))


def timeline_svg(rows: Sequence[TimelineRow], step_s: float) -> str:
    """A Gantt chart of one step: per row, compute and waiting on the main lane, communication
    on a thin lane below it (it may overlap compute), an x axis in ms and a legend."""
    left, right, top, row_h = 130, 20, 30, 30
    width = 960
    plot = width - left - right
    hi = max([step_s, *(s[1] for r in rows for s in r.spans)]) or 1.0
    x = _scale(hi, left, plot)
    height = top + row_h * len(rows) + 34
    body = [_legend([(PALETTE.compute, _KIND_WORDS["compute"]), (PALETTE.comm, _KIND_WORDS["comm"]),
                     (PALETTE.wait, _KIND_WORDS["wait"])], left, 6)]
    body += _x_axis(hi, x, top - 4, top + row_h * len(rows), lambda t: f"{t * 1e3:g} ms")
    lanes = {"compute": (4, 15), "wait": (4, 15), "comm": (21, 6)}  # kind -> (y offset, height)
    for k, row in enumerate(rows):
        y0 = top + k * row_h
        body.append(_text(left - 8, y0 + 16, row.label, anchor="end", tip=row.note))
        bars = merge_spans(row.spans, MERGE_FRACTION * hi)
        for kind in ("compute", "wait", "comm"):  # waiting drawn over compute it was merged into
            rects = [_bar_rect(b, x, y0 + lanes[kind][0], lanes[kind][1]) for b in bars if b.kind == kind]
            if rects:
                body.append(f'<g fill="{getattr(PALETTE, kind)}">' + "".join(rects) + "</g>")
    return _svg(width, height, body, "timeline of one simulated step")


def _bar_rect(b: Bar, x: Scale, y: float, h: float) -> str:
    x0, x1 = x(b.start_s), x(b.end_s)
    rect = f'<rect x="{_n(x0)}" y="{_n(y)}" width="{_n(max(x1 - x0, 0.5))}" height="{_n(h)}"'
    if b.label is None:
        return rect + "/>"
    tip = f"{b.label} ({_KIND_WORDS[b.kind]}): start {fmt_time(b.start_s)}, {fmt_time(b.end_s - b.start_s)}"
    return rect + f"><title>{_e(tip)}</title></rect>"


# -- memory ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryRow:
    label: str  # `devices 0-1 (cpu)`
    parts: dict[str, float]  # part -> bytes, stacked in this order (one part: no breakdown)
    budget_bytes: float


def memory_svg(rows: Sequence[MemoryRow]) -> str:
    """Horizontal bars of memory per device (stacked by part when there are several) with each
    row's budget marked by a red line."""
    left, plot, row_h, top = 160, 520, 28, 30
    width = left + plot + 340
    hi = max([1.0, *(max(r.budget_bytes, sum(r.parts.values())) for r in rows)])
    x = _scale(hi, left, plot)
    names = list(dict.fromkeys(p for r in rows for p in r.parts))
    colour = {p: PALETTE.series[k % len(PALETTE.series)] for k, p in enumerate(names)}
    key = [(colour[p], p) for p in names] if len(names) > 1 else [(PALETTE.series[0], "predicted")]
    body = [_legend([*key, (PALETTE.budget, "budget")], left, 6)]
    unit, name = next((u, n) for u, n in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"),
                                          (1, "B")) if hi >= u)
    body += _x_axis(hi, x, top - 4, top + row_h * len(rows), lambda t: f"{t / unit:g} {name}", ticks=4, unit=unit)
    for k, r in enumerate(rows):
        y0 = top + k * row_h
        body.append(_text(left - 8, y0 + 17, r.label, anchor="end"))
        at = 0.0
        for part, b in r.parts.items():
            w = max(x(at + b) - x(at), 1.0 if b > 0 else 0.0)
            body.append(f'<rect x="{_n(x(at))}" y="{y0 + 5}" width="{_n(w)}" height="16" fill="{colour[part]}">'
                        f"<title>{_e(f'{part}: {fmt_bytes(b)}')}</title></rect>")
            at += b
        bx = x(r.budget_bytes)
        body.append(f'<line x1="{_n(bx)}" x2="{_n(bx)}" y1="{y0 + 1}" y2="{y0 + 25}" stroke="{PALETTE.budget}" '
                    f'stroke-width="2"><title>{_e("budget " + fmt_bytes(r.budget_bytes))}</title></line>')
        frac = at / r.budget_bytes if r.budget_bytes > 0 else 0.0
        over = ", over budget" if at > r.budget_bytes else ""
        body.append(_text(left + plot + 10, y0 + 17, f"{fmt_bytes(at)} of {fmt_bytes(r.budget_bytes)} "
                                                     f"({fmt_pct(frac)}{over})"))
    return _svg(width, top + row_h * len(rows) + 34, body, "memory per device against its budget")


# -- baselines ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TimeBar:
    label: str
    step_time_s: float | None  # None: not priced
    feasible: bool
    plan: bool = False  # the plan itself: the reference, in the accent colour


def baselines_svg(rows: Sequence[TimeBar]) -> str:
    """Predicted step time of the plan and each baseline; those that do not fit are hatched and
    say so, and a dashed line marks the plan's time."""
    left, plot, row_h, top = 160, 520, 28, 30
    width = left + plot + 340
    hi = max([0.0, *(r.step_time_s or 0.0 for r in rows)]) or 1.0
    x = _scale(hi, left, plot)
    ref = next((r.step_time_s for r in rows if r.plan and r.step_time_s), None)
    hatch = ('<defs><pattern id="parc-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
             f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#ffffff"/>'
             f'<rect width="3" height="6" fill="{PALETTE.infeasible}"/></pattern></defs>')
    body = [hatch, _legend([(PALETTE.plan, "plan"), (PALETTE.baseline, "baseline"),
                            ("url(#parc-hatch)", "does not fit")], left, 6)]
    body += _x_axis(hi, x, top - 4, top + row_h * len(rows), lambda t: f"{t * 1e3:g} ms")
    for k, r in enumerate(rows):
        y0 = top + k * row_h
        body.append(_text(left - 8, y0 + 17, r.label, anchor="end"))
        fill = "url(#parc-hatch)" if not r.feasible else PALETTE.plan if r.plan else PALETTE.baseline
        w = x(r.step_time_s) - left if r.step_time_s is not None else 40.0
        body.append(f'<rect x="{left}" y="{y0 + 5}" width="{_n(max(w, 1.0))}" height="16" fill="{fill}"'
                    + ("" if r.feasible else f' stroke="{PALETTE.line}"') + "/>")
        words = fmt_time(r.step_time_s) if r.step_time_s is not None else "not priced"
        if ref and r.step_time_s is not None and not r.plan:
            words += f" ({fmt_ratio(r.step_time_s / ref)} the plan)"
        if not r.feasible:
            words += ", does not fit"
        body.append(_text(left + max(w, 1.0) + 6 if r.step_time_s is None else left + plot + 10, y0 + 17, words))
    if ref:
        body.append(f'<line x1="{_n(x(ref))}" x2="{_n(x(ref))}" y1="{top - 4}" y2="{top + row_h * len(rows)}" '
                    f'stroke="{PALETTE.text}" stroke-dasharray="4 3"/>')
    return _svg(width, top + row_h * len(rows) + 34, body, "predicted step time of the plan and its baselines")


# -- stages and meshes ----------------------------------------------------------------------------

@dataclass(frozen=True)
class StageBox:
    title: str  # `stage 0`
    lines: list[str]  # what the box says under its title
    mesh: tuple[int, ...]
    devices: list[int]  # ranks in mesh order (row-major)
    device_types: list[str] | None = None  # per device, for colour; None: one colour


def stages_svg(boxes: Sequence[StageBox]) -> str:
    """A box per stage, arrows from each stage to the next, and in each box its mesh as a grid of
    device squares (at most GRID_SQUARES drawn, then `+N more`)."""
    per_row, gap, sq = 4, 56, 17
    types = list(dict.fromkeys(t for b in boxes for t in b.device_types or []))
    colour = {t: PALETTE.series[(k + 4) % len(PALETTE.series)] for k, t in enumerate(types)}
    grids = [_grid(b) for b in boxes]
    box_w = max([210, *(20 + cols * sq for cols, _, _ in grids)])
    text_h = 30 + 16 * max([0, *(len(b.lines) for b in boxes)])
    box_h = text_h + max([0, *(rows * sq + (18 if more else 0) for _, rows, more in grids)]) + 12
    top = 28 if len(types) > 1 else 8
    n_rows = math.ceil(len(boxes) / per_row)
    width = 16 + min(len(boxes), per_row) * (box_w + gap) - gap + 16
    height = top + n_rows * (box_h + gap) - gap + 12
    body = ['<defs><marker id="parc-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="8" '
            f'markerHeight="8" orient="auto"><path d="M0,0L10,5L0,10z" fill="{PALETTE.line}"/></marker></defs>']
    if len(types) > 1:
        body.append(_legend([(colour[t], t) for t in types], 16, 6))
    pos = [(16 + (k % per_row) * (box_w + gap), top + (k // per_row) * (box_h + gap)) for k in range(len(boxes))]
    for k, (b, (cols, rows, more), (bx, by)) in enumerate(zip(boxes, grids, pos)):
        body.append(f'<rect x="{bx}" y="{by}" width="{box_w}" height="{box_h}" rx="6" fill="{PALETTE.box}" '
                    f'stroke="{PALETTE.line}"/>')
        body.append(_text(bx + 10, by + 18, b.title, bold=True))
        body += [_text(bx + 10, by + 36 + 16 * i, line, muted=True) for i, line in enumerate(b.lines)]
        gy = by + text_h
        for i, dev in enumerate(b.devices[:GRID_SQUARES]):
            kind = b.device_types[i] if b.device_types and i < len(b.device_types) else None
            fill = colour.get(kind, PALETTE.series[4]) if kind else PALETTE.series[4]
            body.append(f'<rect x="{bx + 10 + (i % cols) * sq}" y="{gy + (i // cols) * sq}" width="{sq - 3}" '
                        f'height="{sq - 3}" rx="2" fill="{fill}"><title>'
                        f'{_e(f"device {dev}" + (f" ({kind})" if kind else ""))}</title></rect>')
        if more:
            body.append(_text(bx + 10, gy + rows * sq + 12, f"+{more} more", muted=True))
        if k + 1 < len(boxes):
            body.append(_arrow((bx, by), pos[k + 1], box_w, box_h, gap))
    return _svg(width, height, body, "pipeline stages and their device meshes")


def _grid(b: StageBox) -> tuple[int, int, int]:
    """(columns, rows, devices not drawn) of a box's device squares: the mesh's last axis across
    (a 1-D mesh wraps at 8), capped at 16 columns and GRID_SQUARES squares."""
    n = len(b.devices)
    cols = b.mesh[-1] if len(b.mesh) > 1 else min(n, 8)
    cols = max(1, min(cols, 16, n or 1))
    drawn = min(n, GRID_SQUARES)
    return cols, math.ceil(drawn / cols), n - drawn


def _arrow(a: tuple[int, int], b: tuple[int, int], w: int, h: int, gap: int) -> str:
    (ax, ay), (bx, by) = a, b
    if ay == by:  # same row: straight across the gap
        d = f"M{ax + w + 4},{ay + h // 2}H{bx - 4}"
    else:  # next row: down from the box, back to the left, down into the next box
        mid = ay + h + gap // 2
        d = f"M{ax + w // 2},{ay + h + 2}V{mid}H{bx + w // 2}V{by - 4}"
    return f'<path d="{d}" fill="none" stroke="{PALETTE.line}" stroke-width="2" marker-end="url(#parc-arrow)"/>'


# -- shared pieces --------------------------------------------------------------------------------

def _svg(width: int, height: int, body: list[str], label: str) -> str:
    return (f'<svg viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" role="img" aria-label="{_e(label)}" font-family="system-ui,sans-serif" '
            f'font-size="12" fill="{PALETTE.text}">' + "".join(body) + "</svg>")


def _text(x: float, y: float, s: str, *, anchor: str = "start", bold: bool = False, muted: bool = False,
          tip: str = "") -> str:
    attrs = (f' text-anchor="{anchor}"' if anchor != "start" else "") + (' font-weight="bold"' if bold else "")
    attrs += f' fill="{PALETTE.muted}"' if muted else ""
    title = f"<title>{_e(tip)}</title>" if tip else ""
    return f'<text x="{_n(x)}" y="{_n(y)}"{attrs}>{title}{_e(s)}</text>'


def _legend(items: list[tuple[str, str]], x: float, y: float) -> str:
    out = []
    for fill, words in items:
        out.append(f'<rect x="{_n(x)}" y="{_n(y)}" width="12" height="12" fill="{fill}" stroke="{PALETTE.line}" '
                   f'stroke-width="0.5"/>' + _text(x + 16, y + 10, words))
        x += 16 + 7 * len(words) + 18
    return "".join(out)


def _x_axis(hi: float, x: Scale, y0: float, y1: float, label: Callable[[float], str], ticks: int = 6,
            unit: float = 1.0) -> list[str]:
    """Grid lines from y0 to y1 at round multiples of `unit`, with their labels under y1."""
    out = []
    for t in (v * unit for v in _ticks(hi / unit, ticks)):
        out.append(f'<line x1="{_n(x(t))}" x2="{_n(x(t))}" y1="{_n(y0)}" y2="{_n(y1)}" stroke="{PALETTE.grid}"/>')
        out.append(_text(x(t), y1 + 16, label(t), anchor="middle", muted=True))
    return out


def _ticks(hi: float, count: int) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten apart) from 0 to at most hi."""
    if hi <= 0:
        return [0.0]
    raw = hi / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [k * step for k in range(int(hi / step + 1e-9) + 1)]


def _scale(hi: float, left: float, plot: float) -> Scale:
    return lambda v: left + plot * (v / hi if hi > 0 else 0.0)


def _n(v: float) -> str:
    """A coordinate with one decimal at most (`12`, `12.5`): small files, sub-pixel enough."""
    return f"{v:.1f}".removesuffix(".0")
