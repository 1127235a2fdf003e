"""The report as a document: sections of key-value lines, tables, bars and bullets.

One layout, three renderers (`render_text`, `render_markup` for Markdown and HTML), so every
format shows the same rows in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parc.report.facts import Report
from parc.report.units import bar, fmt_bytes, fmt_gap, fmt_groups, fmt_pct, fmt_ratio, fmt_shape, fmt_time

GROUP_ROWS = 40  # op groups shown; the JSON has them all
PARAM_ROWS = 20  # sharded parameters listed by name


@dataclass(frozen=True)
class Table:
    columns: list[str]
    rows: list[list[str]]
    right: frozenset[int] = frozenset()  # columns aligned right (numbers)
    note: str | None = None


@dataclass(frozen=True)
class Section:
    title: str
    pairs: list[tuple[str, str]] = field(default_factory=list)  # key-value lines, first
    tables: list[Table] = field(default_factory=list)
    bullets: list[str] = field(default_factory=list)


def document(r: Report) -> tuple[str, list[Section]]:
    """(title, sections) of the report."""
    title = f"parc explain: {r.plan}"
    pipeline = [_pipeline(r)] if r.pipeline else []
    return title, [_summary(r), *pipeline, _groups(r), _parameters(r), _communication(r), _memory(r),
                   _baselines(r), Section("Why", bullets=list(r.why))]


def _pipeline(r: Report) -> Section:
    p = r.pipeline or {}
    tried = "; ".join(f"{t['stages']} stages: " + (fmt_time(t["step_time_s"]) if t.get("feasible") else "infeasible")
                      for t in p.get("tried") or [])
    if not p.get("stages"):
        return Section("Pipeline", [("not chosen", f"one mesh is faster; tried {tried}")])
    step = r.step.step_time_s
    sched = p["schedule"]
    pairs = [("schedule", f"{sched.get('kind', '?')}, {len(p['stages'])} stages x {sched.get('micro_batches')} "
                          f"microbatches; bubble {fmt_time(p['bubble_s'])} ({fmt_pct(p['bubble_s'] / step if step else 0)} "
                          "of the step)"),
             ("between stages", f"{p['transfers']} values, {fmt_bytes(p['transfer_bytes'])} per step "
                                "(activations forward, their gradients back, tied weights after the update)")]
    search = p.get("stage_search") or {}
    if search:
        pairs.append(("stage search", f"ILP {search.get('status', '?')}, tolerance {search.get('tolerance', 0):g}, "
                                      f"{fmt_bytes(search.get('cut_bytes', 0))} cut, slowest stage "
                                      f"{search.get('balance', 1):.2f}x the mean, {fmt_time(search.get('time_s'))}"))
    spmd = p.get("spmd_only") or {}
    if spmd.get("step_time_s"):
        gain = 1 - step / spmd["step_time_s"]
        pairs.append(("vs one mesh", f"the best SPMD-only plan (mesh {fmt_shape(spmd.get('mesh', []))}) takes "
                                     f"{fmt_time(spmd['step_time_s'])}: the pipeline is {fmt_pct(abs(gain))} "
                                     f"{'faster' if gain >= 0 else 'slower'}"))
    elif spmd.get("searched") is False:
        pairs.append(("vs one mesh", "not searched (--pipeline S); --pipeline auto compares"))
    elif spmd:
        pairs.append(("vs one mesh", f"no SPMD-only plan fits ({spmd.get('error', '')})"))
    if tried:
        pairs.append(("tried", tried))
    types = {t for s in p["stages"] for t in s.get("device_types", [])}  # named on a mixed cluster
    rows = [[str(s["id"]), f"{s['devices'][0]}-{s['devices'][-1]}"
             + (f" ({'+'.join(s['device_types'])})" if s.get("device_types") and len(types) > 1 else ""),
             fmt_shape(s["mesh"]), str(s["nodes"]),
             fmt_time(s["forward_s"] + s["backward_s"]), fmt_time(s["per_micro_batch_s"]),
             fmt_time(s["optimizer_s"]), fmt_time(s["send_s"]), fmt_bytes(s["memory_bytes_per_device"]),
             f"{s['parameters']:,}"] for s in p["stages"]]
    table = Table(["stage", "devices", "mesh", "nodes", "fwd+bwd (1 device)", "per microbatch", "optimizer",
                   "sends/mb", "memory/device", "parameters"], rows, frozenset({3, 4, 5, 6, 7, 8, 9}),
                  "per microbatch: the stage's forward and backward with their collectives; memory: sources "
                  "plus the microbatches of activations 1F1B keeps (min(S - s, M))")
    return Section("Pipeline", pairs, [table])


def _link_figures(a) -> str:
    """' (bandwidth, latency[, call cost][, handoff][; a kind's own figures][; x the step ratio])'
    of a mesh axis's link, or '' unknown."""
    if not (a.bandwidth and a.latency):
        return ""
    figures = [f"{a.bandwidth / 1e9:g} GB/s", f"{a.latency * 1e6:g} us"]
    figures += [f"{a.call * 1e6:g} us a call"] if a.call else []
    figures += [f"{a.handoff * 1e6:g} us handoff"] if a.handoff else []
    own = [f"{kind.replace('_', '-')} {bw / 1e9:.3g} GB/s, {lat * 1e6:.3g} us"
           for kind, (lat, bw) in sorted((a.kinds or {}).items())]
    ratio = [f"collectives x{a.step_ratio:.2f} (the calibration's step_ratio)"] if a.step_ratio else []
    return f" ({'; '.join([', '.join(figures), *own, *ratio])})"


def _summary(r: Report) -> Section:
    s = r.summary
    piped = r.pipeline is not None
    axes = "; ".join(f"axis {k}: {a.size} {'stages (pipeline)' if piped and k == 0 else 'devices'} over {a.link or '?'}"
                     + _link_figures(a) + (", across nodes" if a.spans_nodes else "")
                     for k, a in enumerate(s.mesh_axes))
    pairs = [("devices", f"{s.devices}: {s.cluster}"), ("mesh", f"{fmt_shape(s.mesh_shape)}: {axes}"),
             ("predicted step", f"{fmt_time(r.step.step_time_s)} (compute {fmt_time(r.step.compute_s)}, "
                                f"communication {fmt_time(r.step.comm_s)}, {fmt_pct(r.step.comm_fraction)})"),
             ("solver", f"{s.solver_level or '?'}, {s.solver_status or '?'}, gap {fmt_gap(s.solver_gap)}, "
                        f"{s.solver_nodes if s.solver_nodes is not None else '?'} problem nodes, "
                        f"{fmt_time(s.solver_time_s)} planning")]
    if r.simulation is not None:  # what `parc simulate` gives; the search's estimate above does not order the tasks
        sim = r.simulation
        parts = [f"{what} {fmt_time(s)}" for what, s in (("bubble a rank", sim.bubble_s), ("communication exposed",
                 sim.exposed_comm_s), ("hidden", sim.hidden_comm_s)) if s >= 1e-9]  # less: the replay's rounding
        pairs.insert(3, ("simulated step", f"{fmt_time(sim.step_time_s)} (the task graph replayed, as parc simulate"
                                           f"{': ' + ', '.join(parts) if parts else ''})"))
    if r.model:
        pairs.insert(0, ("model", r.model))
    axes_table = Table(["mesh axis", "size", "link", "across nodes", "device groups"],
                       [[f"{k}{' (stages)' if piped and k == 0 else ''}", str(a.size), a.link or "?",
                         "-" if a.spans_nodes is None else "yes" if a.spans_nodes else "no", fmt_groups(a.groups)]
                        for k, a in enumerate(s.mesh_axes)], frozenset({1}),
                       "device groups: the devices a collective along the axis runs among, one group each")
    staged = any(m.stage is not None for m in s.meshes)  # a pipeline: each stage's meshes
    rows = [[*([str(m.stage)] if staged else []), fmt_shape(m.shape),
             "yes" if m.feasible else "no (hints)" if m.skipped else "no (memory)",
             fmt_time(m.step_time_s), fmt_gap(m.gap), "yes" if m.chosen else ""] for m in s.meshes]
    head = [*(["stage"] if staged else []), "mesh tried", "feasible", "step time", "gap", "chosen"]
    tables = [axes_table] + ([Table(head, rows, frozenset({2 + staged, 3 + staged}))] if rows else [])
    return Section("Summary", pairs, tables)


def _groups(r: Report) -> Section:
    rows = []
    for g in r.groups[:GROUP_ROWS]:
        compute = g.phases["forward"] + g.phases["backward"]
        opt = f"{g.optimizer_strategy} ({g.optimizer_nodes}/{g.phases['optimizer']})" if g.optimizer_strategy else "-"
        rows.append([g.scope, f"{g.phases['forward']}/{g.phases['backward']}/{g.phases['optimizer']}",
                     g.strategy or "-", f"{g.strategy_nodes}/{compute}" if compute else "-", opt])
    note = ("fwd/bwd/opt: nodes by phase (backward and optimizer nodes count in the scope they come from); "
            "strategy: the most common one, and on how many nodes"
            + (f"; {len(r.groups) - GROUP_ROWS} more groups in --format json" if len(r.groups) > GROUP_ROWS else ""))
    return Section("Strategy per op group", tables=[Table(
        ["scope", "fwd/bwd/opt", "strategy (fwd+bwd)", "nodes", "optimizer"],
        rows, frozenset({1, 3}), note)])


def _parameters(r: Report) -> Section:
    p = r.parameters
    if not p.count:
        return Section("Parameter layouts", bullets=["no trained parameters found (" + p.rule + ")"])
    size = (lambda b: f" ({fmt_bytes(b)})") if p.sharded_bytes is not None else (lambda b: "")
    pairs = [("parameters", f"{p.count}: {p.replicated} replicated{size(p.replicated_bytes)}, "
                            f"{p.sharded} sharded{size(p.sharded_bytes)}"),
             ("optimizer state", f"{p.state_tensors} tensors, {p.state_sharded} sharded")]
    rows = [[q.name, q.spec, q.layout, ", ".join(sorted(set(q.state.values()))) or "-", fmt_bytes(q.bytes)]
            for q in p.items if q.sharded][:PARAM_ROWS]
    tables = [Table(["sharded parameter", "spec", "layout", "state specs", "bytes"], rows, frozenset({4}),
                    f"parameter rule: {p.rule}")] if rows else []
    return Section("Parameter layouts", pairs, tables)


def _communication(r: Report) -> Section:
    c = r.communication
    if not c.recorded:
        return Section("Communication", [("predicted", fmt_time(c.predicted_s))],
                       bullets=["plan.json has no `communication` list"])
    pairs = [("edges", f"{c.edges} resharded edges, {c.collectives} collectives, {fmt_bytes(c.bytes_per_device)} "
                       f"per device, {fmt_time(c.time_s)}"),
             ("predicted", fmt_time(c.predicted_s) + (f" ({fmt_time(c.unitemized_s)} on no listed edge)"
                                                      if abs(c.unitemized_s) > 1e-3 * max(c.predicted_s, 1e-12) else ""))]

    def stats(title: str, rows: list) -> Table:
        return Table([title, "count", "bytes/device", "time"],
                     [[s.key, str(s.count), fmt_bytes(s.bytes_per_device), fmt_time(s.time_s)] for s in rows],
                     frozenset({1, 2, 3}))

    top = Table(["value", "consumer", "resharding", "bytes/device", "time"],
                [[e.value, e.consumer, f"{e.src} -> {e.dst}: {', '.join(e.collectives)}", fmt_bytes(e.bytes_per_device),
                  fmt_time(e.time_s)] for e in c.top_edges], frozenset({3, 4}),
                f"top {len(c.top_edges)} edges by time")
    return Section("Communication", pairs, [stats("kind", c.by_kind), stats("mesh axis", c.by_axis), top])


def _memory(r: Report) -> Section:
    m = r.memory
    pairs = [("per device", f"{bar(m.fraction)} {fmt_bytes(m.max_bytes)} of {fmt_bytes(m.budget_bytes)} "
                            f"({fmt_pct(m.fraction)})")]
    if len(set(m.per_device_bytes)) > 1:
        pairs.append(("by device", ", ".join(f"{k}: {fmt_bytes(b)}" for k, b in enumerate(m.per_device_bytes))))
    return Section("Memory", pairs)


def _baselines(r: Report) -> Section:
    rows = [["plan", fmt_time(r.step.step_time_s), fmt_ratio(1.0), fmt_bytes(r.memory.max_bytes), fmt_ratio(1.0), "yes"]]
    for b in r.baselines:
        rows.append([b.name, fmt_time(b.step_time_s), fmt_ratio(b.time_ratio), fmt_bytes(b.memory_bytes_per_device),
                     fmt_ratio(b.memory_ratio), "yes" if b.feasible else "no"])
    return Section("Against baselines", tables=[Table(
        ["strategy", "step time", "vs plan", "memory/device", "vs plan", "feasible"], rows, frozenset({1, 2, 3, 4}),
        "same cost model; data-parallel and zero-3 on the flat mesh, megatron-tpN on a (dp, N) mesh; "
        "ratios are baseline / plan")])
