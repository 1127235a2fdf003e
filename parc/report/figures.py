"""The report's charts as HTML `<figure>`s: a `Report` turned into the rows `charts` draws, with a
caption that says what the chart shows and what plan.json does not record."""

from __future__ import annotations

import html
import math

from parc.report.charts import (
    MERGE_FRACTION,
    TIMELINE_ROWS,
    MemoryRow,
    StageBox,
    TimeBar,
    TimelineRow,
    baselines_svg,
    memory_svg,
    stages_svg,
    timeline_svg,
)
from parc.report.facts import Report
from parc.report.units import fmt_bytes, fmt_pct, fmt_shape, fmt_time

NO_TIMELINE = "no simulated timeline in this plan (re-plan with this parc)"


def figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{html.escape(caption)}</figcaption></figure>"


def timeline_figure(r: Report) -> str:
    """The simulated step's timeline, or a one-line note when plan.json has no simulation."""
    sim = r.simulation
    if sim is None or not sim.timeline:
        return f'<p class="note">{NO_TIMELINE}</p>'
    stage_of = {d: s["id"] for s in (r.pipeline or {}).get("stages") or [] for d in s.get("devices", [])}
    ranks = {str(x.rank): x for x in sim.ranks}
    keys = sorted(sim.timeline, key=lambda k: (0, int(k), "") if k.lstrip("-").isdigit() else (1, 0, k))
    rows = []
    for key in keys[:TIMELINE_ROWS]:
        stage = stage_of.get(int(key)) if key.lstrip("-").isdigit() else None
        x = ranks.get(key)
        note = (f"busy {fmt_time(x.busy_s)}: compute {fmt_time(x.compute_s)}, communication {fmt_time(x.comm_s)}, "
                f"waiting {fmt_time(x.wait_s)}" + (f"; peak {fmt_bytes(x.peak_bytes)}" if x.peak_bytes else "")
                if x else "")
        rows.append(TimelineRow(f"rank {key}" + (f" (stage {stage})" if stage is not None else ""),
                                sim.timeline[key], note))
    shown = f" (the first {TIMELINE_ROWS} of {len(keys)} ranks)" if len(keys) > TIMELINE_ROWS else ""
    caption = (f"One simulated step of {fmt_time(sim.step_time_s)}{shown}: per rank, compute and waiting on the "
               f"upper lane, communication on the lower one. Bubble {fmt_time(sim.bubble_s)}, exposed "
               f"communication {fmt_time(sim.exposed_comm_s)}, hidden behind compute {fmt_time(sim.hidden_comm_s)}; "
               f"critical path {len(sim.critical_path)} tasks. Spans of one kind less than "
               f"{fmt_pct(MERGE_FRACTION)} of the step apart are drawn as one bar; hover a single span for its task.")
    return figure(timeline_svg(rows, sim.step_time_s), caption)


def memory_figure(r: Report) -> str:
    """Memory per device (consecutive devices with the same numbers share a bar) against the budget."""
    m = r.memory
    budgets = list((r.mixed or {}).get("budget_bytes") or [])
    types = _device_types(r)
    keys = [(b, budgets[i] if i < len(budgets) else m.budget_bytes,
             types[i] if types and i < len(types) else None) for i, b in enumerate(m.per_device_bytes)]
    rows = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            used, budget, kind = keys[start]
            name = f"device {start}" if i - start == 1 else f"devices {start}-{i - 1}"
            rows.append(MemoryRow(name + (f" ({kind})" if kind else ""), {"predicted": used}, budget))
            start = i
    caption = ("Predicted memory per device against its budget (red line); devices with the same "
               "numbers share a bar. No breakdown into parameters, gradients, optimizer state and "
               "activations is recorded in plan.json, so each bar is the total.")
    return figure(memory_svg(rows), caption)


def baselines_figure(r: Report) -> str:
    rows = [TimeBar("plan", r.step.step_time_s, True, plan=True)]
    rows += [TimeBar(b.name, b.step_time_s, b.feasible) for b in r.baselines]
    caption = ("Predicted step time of the plan and of each baseline in the same cost model; hatched: the "
               "baseline does not fit the memory budget; dashed line: the plan.")
    return figure(baselines_svg(rows), caption)


def stages_figure(r: Report) -> str:
    """The pipeline's stages (or the one mesh) with each mesh as a grid of devices."""
    stages = (r.pipeline or {}).get("stages") or []
    types = _device_types(r)
    if stages:
        boxes = []
        for s in stages:
            devs = [int(d) for d in s.get("devices", [])]
            kinds = [types[d] for d in devs] if types and all(d < len(types) for d in devs) else None
            lines = [f"devices {devs[0]}-{devs[-1]}" if len(devs) > 1 else f"device {devs[0]}" if devs else "",
                     f"mesh {fmt_shape(s.get('mesh', []))}" + (f", {'+'.join(s['device_types'])}"
                                                               if s.get("device_types") else ""),
                     f"fwd {fmt_time(s.get('forward_s'))}, bwd {fmt_time(s.get('backward_s'))}",
                     f"stage step {fmt_time(s.get('step_time_s'))}"]
            boxes.append(StageBox(f"stage {s.get('id')}", lines, tuple(s.get("mesh", [])), devs, kinds))
        caption = (f"{len(stages)} pipeline stages, each on its own mesh (squares: devices); arrows: activations "
                   "go forward and their gradients back. fwd, bwd: one device's forward and backward per step.")
    else:
        shape = tuple(r.summary.mesh_shape)
        n = math.prod(shape)
        boxes = [StageBox("one mesh", [f"{n} devices", f"mesh {fmt_shape(shape)}",
                                       f"step {fmt_time(r.step.step_time_s)}"], shape, list(range(n)), types)]
        caption = "The plan runs on one device mesh (squares: devices, the last mesh axis across)."
    return figure(stages_svg(boxes), caption)


def _device_types(r: Report) -> list[str] | None:
    """Each device's type: a mixed mesh names them; one type names them all; else None."""
    if r.mixed and r.mixed.get("devices"):
        return [str(t) for t in r.mixed["devices"]]
    if len(r.summary.device_types) == 1:
        return [next(iter(r.summary.device_types))] * r.summary.devices
    return None
