"""explain: a pure function from a checked plan.json dict to the Report of facts.

Nothing here reads files or imports the planner; `load.load_plan` gives the dict. Totals are
sums over what plan.json lists, so the JSON report can be checked against the plan.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from parc.errors import PlanFormatError
from parc.report import scopes
from parc.report.facts import (
    SPAN_KINDS,
    Baseline,
    CommStat,
    Communication,
    Edge,
    Group,
    Memory,
    MeshAxis,
    MeshTried,
    Parameter,
    Parameters,
    Report,
    SimRank,
    Simulation,
    Step,
    Summary,
)
from parc.report.why import reasons

TOP_EDGES = 10
PARAMETER_RULE = ("a spec name X is a parameter when X.new is also a spec name and no shorter "
                  "such name is a prefix of X; X.<suffix> names with X.<suffix>.new are its optimizer state")


def explain(plan: Mapping[str, Any], plan_file: str = "plan.json") -> Report:
    """The report of one plan (a dict that `load.check_plan` accepted)."""
    pred = plan["predicted"]
    step_s = float(pred["step_time_s"])
    step = Step(step_s, float(pred["compute_s"]), float(pred["comm_s"]),
                float(pred["comm_s"]) / step_s if step_s > 0 else 0.0)
    memory = _memory(pred)
    params = _parameters(plan)
    report = Report(
        plan=plan_file, format_version=int(plan["format_version"]),
        model=(plan.get("model") or {}).get("path"), summary=_summary(plan), step=step,
        groups=_groups(plan["strategies"], plan["specs"]), strategy_mix=_mix(plan["strategies"], plan["specs"]),
        parameters=params,
        communication=_communication(plan.get("communication"), step.comm_s), memory=memory,
        baselines=_baselines(plan.get("baselines") or {}, step_s, memory.max_bytes), why=[],
        pipeline=_pipeline(plan), mixed=_mixed(plan), given=plan.get("devices_given"), simulation=_simulation(plan.get("simulation"), plan_file))
    return replace(report, why=reasons(report))


def _mixed(plan: Mapping[str, Any]) -> dict[str, Any] | None:
    """A mixed mesh's facts as plan.json states them (docs/heterogeneous.md)."""
    pred = plan["predicted"]
    if not pred.get("devices"):
        return None
    return {"devices": list(pred["devices"]), "compute_s": list(pred.get("compute_s_per_device") or []),
            "memory_bytes": list(pred.get("memory_bytes_per_device") or []),
            "budget_bytes": list(pred.get("memory_budget_bytes_per_device") or []),
            "axes": list((plan.get("balance") or {}).get("axes") or [])}


def _simulation(sim: Any, where: str) -> Simulation | None:
    """plan.json's optional `simulation`, checked key by key (`load_plan` does not look inside it)."""
    if sim is None:
        return None

    def need(ok: bool, key: str, expected: str, found: Any) -> None:
        if not ok:
            raise PlanFormatError(f"{where}: simulation.{key} should be {expected}, found {found!r}"[:300])

    def number(value: Any, key: str) -> float:
        need(isinstance(value, int | float) and not isinstance(value, bool), key, "a number", value)
        return float(value)

    need(isinstance(sim, Mapping), "", "an object", type(sim).__name__)
    ranks = []
    for k, r in enumerate(sim.get("ranks") or []):
        need(isinstance(r, Mapping) and isinstance(r.get("rank"), int), f"ranks[{k}]", "an object with an int rank", r)
        peak = r.get("peak_bytes")
        need(peak is None or isinstance(peak, int | float), f"ranks[{k}].peak_bytes", "bytes or null", peak)
        ranks.append(SimRank(r["rank"], *(number(r.get(f), f"ranks[{k}].{f}") for f in
                                          ("busy_s", "compute_s", "comm_s", "wait_s")),
                             None if peak is None else int(peak)))
    timeline: dict[str, list[tuple[float, float, str, str]]] = {}
    for rank, spans in (sim.get("timeline") or {}).items():
        need(isinstance(spans, list), f"timeline.{rank}", "a list of spans", type(spans).__name__)
        rows = []
        for k, span in enumerate(spans):
            key = f"timeline.{rank}[{k}]"
            need(isinstance(span, list | tuple) and len(span) == 4, key, "[start_s, end_s, kind, label]", span)
            start, end, kind, label = span
            need(kind in SPAN_KINDS, key + "[2]", " or ".join(SPAN_KINDS), kind)
            rows.append((number(start, key + "[0]"), number(end, key + "[1]"), kind, str(label)))
        timeline[str(rank)] = rows
    return Simulation(*(number(sim.get(f), f) for f in ("step_time_s", "bubble_s", "exposed_comm_s", "hidden_comm_s")),
                      ranks, timeline, [str(t) for t in sim.get("critical_path") or []])


def _pipeline(plan: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pipeline's facts as plan.json states them (format 2), with the transfer totals; also
    what `--pipeline auto` tried for a one-mesh plan."""
    tried = (plan.get("solver") or {}).get("pipelines") or []
    if not plan.get("stages"):
        return {"tried": tried} if tried else None
    transfers = plan.get("transfers") or []
    return {"stages": list(plan["stages"]), "schedule": dict(plan.get("schedule") or {}),
            "bubble_s": float(plan["predicted"].get("bubble_s", 0.0)),
            "transfers": len(transfers), "transfer_bytes": int(sum(t.get("bytes", 0) * len(t.get("to_stages", []))
                                                                    for t in transfers)),
            "stage_search": dict(plan.get("stage_search") or {}), "spmd_only": plan.get("spmd_only"),
            "tried": tried}


def _summary(plan: Mapping[str, Any]) -> Summary:
    cluster = plan.get("cluster") or {}
    nodes = cluster.get("nodes") or []
    types = Counter(d for n in nodes for d in n.get("devices", []))
    mesh = plan["mesh"]
    shape = [int(n) for n in mesh["shape"]]
    links = mesh.get("links") or []
    spans = mesh.get("spans_nodes") or []
    axes = [MeshAxis(n, _get(links, k, "name"), _get(links, k, "bandwidth"), _get(links, k, "latency"),
                     spans[k] if k < len(spans) else None, _get(links, k, "call"), _get(links, k, "handoff"),
                     _get(links, k, "kinds"), _get(links, k, "step_ratio"))
            for k, n in enumerate(shape)]
    solver = plan.get("solver") or {}
    tried = [MeshTried([int(n) for n in m.get("shape", [])], bool(m.get("feasible", False)),
                       m.get("step_time_s"), m.get("gap"),
                       bool(m.get("chosen", [int(n) for n in m.get("shape", [])] == shape)),
                       m.get("skipped"), m.get("stage"), m.get("lower_bound_s"))
             for m in solver.get("meshes") or []]
    devices = sum(types.values()) or len(mesh.get("devices") or []) or math.prod(shape)
    return Summary(devices, len(nodes), dict(sorted(types.items())), _cluster_words(cluster, devices),
                   shape, axes, tried, solver.get("level"), solver.get("time_s"), solver.get("gap"),
                   solver.get("status"), solver.get("nodes"), solver.get("gap_over_meshes"))


def _cluster_words(cluster: Mapping[str, Any], devices: int) -> str:
    nodes = cluster.get("nodes") or []
    if not nodes:
        return f"{devices} devices"
    kinds = Counter(d for n in nodes for d in n.get("devices", []))
    what = " + ".join(f"{c} x {t}" for t, c in sorted(kinds.items()))
    intra = sorted({(n.get("intra_link") or {}).get("name", "?") for n in nodes})
    text = f"{what} in {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({', '.join(intra)} inside"
    inter = (cluster.get("inter_link") or {}).get("name")
    text += f", {inter} across)" if inter and len(nodes) > 1 else ")"
    ratios = sorted({float(v["step_ratio"]) for v in (cluster.get("device_types") or {}).values()
                     if float(v.get("step_ratio", 1.0)) != 1.0})
    if ratios:  # a calibration's measured correction: say that the predictions carry it
        text += f"; node times x{' / x'.join(f'{r:.2f}' for r in ratios)} (the calibration's step_ratio)"
    return text


def _groups(strategies: Mapping[str, str], specs: Mapping[str, str]) -> list[Group]:
    by_scope: dict[str, list[str]] = defaultdict(list)
    for name in strategies:
        by_scope[scopes.scope_of(name)].append(name)
    groups = []
    for scope, names in by_scope.items():
        words = {n: scopes.strategy_words(strategies[n], n, specs) for n in names}
        phases = Counter(scopes.phase_of(n) for n in names)
        update = [w for n, w in words.items() if scopes.phase_of(n) == "optimizer"]
        compute = [w for n, w in words.items() if scopes.phase_of(n) != "optimizer"]
        top, count = _ranked(compute)[0] if compute else (None, 0)
        opt, opt_count = _ranked(update)[0] if update else (None, 0)
        groups.append(Group(scope, len(names), {p: phases[p] for p in ("forward", "backward", "optimizer")},
                            top, count, opt, opt_count, dict(_ranked(list(words.values())))))
    return sorted(groups, key=lambda g: _natural(g.scope))  # h.2 before h.10


def _mix(strategies: Mapping[str, str], specs: Mapping[str, str]) -> dict[str, dict[str, int]]:
    by_phase: dict[str, list[str]] = {"forward": [], "backward": [], "optimizer": []}
    for name, strategy in strategies.items():
        by_phase[scopes.phase_of(name)].append(scopes.strategy_words(strategy, name, specs))
    return {phase: dict(_ranked(words)) for phase, words in by_phase.items()}


def _ranked(words: list[str]) -> list[tuple[str, int]]:
    return sorted(Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))


def _natural(text: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _parameters(plan: Mapping[str, Any]) -> Parameters:
    specs = plan["specs"]
    sizes = _tensor_bytes(plan.get("tensors"))
    items = []
    for name, state in scopes.parameters(specs).items():
        spec = specs[name]
        items.append(Parameter(name, scopes.scope_of(name), spec, scopes.spec_words(spec), scopes.is_sharded(spec),
                               specs.get(name + ".new"), {s: specs[s] for s in state}, sizes.get(name)))
    sharded = [p for p in items if p.sharded]
    known = bool(items) and all(p.bytes is not None for p in items)
    return Parameters(
        PARAMETER_RULE, len(items), len(items) - len(sharded), len(sharded),
        sum(len(p.state) for p in items), sum(scopes.is_sharded(s) for p in items for s in p.state.values()),
        sum(specs[x] != specs[x + ".new"] for p in items for x in (p.name, *p.state)),
        sum(p.bytes for p in items if not p.sharded) if known else None,  # type: ignore[misc]
        sum(p.bytes for p in sharded) if known else None, items)  # type: ignore[misc]


def _tensor_bytes(tensors: Any) -> dict[str, int]:
    """Whole-tensor bytes by name from an optional `tensors` {name: {bytes}} key (not in format 1)."""
    if not isinstance(tensors, Mapping):
        return {}
    return {k: int(v["bytes"]) for k, v in tensors.items()
            if isinstance(v, Mapping) and isinstance(v.get("bytes"), int | float)}


def _communication(edges: Any, predicted_s: float) -> Communication:
    recorded = isinstance(edges, list)
    rows: list[Edge] = []
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    axes: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for e in edges or []:
        colls = e.get("collectives") or []
        total = float(sum(c.get("bytes_per_device", 0.0) for c in colls))
        time_s = float(e.get("time_s", 0.0))
        for c in colls:
            # An edge's time is shared by its collectives in proportion to their bytes.
            b = float(c.get("bytes_per_device", 0.0))
            share = time_s * (b / total if total > 0 else 1 / len(colls))
            for table, key in ((kinds, str(c.get("kind"))), (axes, str(c.get("axis")))):
                table[key][0] += 1
                table[key][1] += b
                table[key][2] += share
        rows.append(Edge(str(e.get("value")), str(e.get("consumer")), str(e.get("from")), str(e.get("to")),
                         [f"{c.get('kind')}@{c.get('axis')}" for c in colls], total, time_s))
    time_s = sum(r.time_s for r in rows)
    top = sorted(rows, key=lambda r: (-r.time_s, r.value, r.consumer))[:TOP_EDGES]
    return Communication(recorded, len(rows), sum(len(r.collectives) for r in rows),
                         sum(r.bytes_per_device for r in rows), time_s, predicted_s,
                         predicted_s - time_s if recorded else 0.0, _stats(kinds), _stats(axes), top)


def _stats(table: Mapping[str, list[float]]) -> list[CommStat]:
    return sorted((CommStat(k, int(v[0]), v[1], v[2]) for k, v in table.items()), key=lambda s: (-s.time_s, s.key))


def _memory(pred: Mapping[str, Any]) -> Memory:
    per = [float(m) for m in pred["memory_bytes_per_device"]]
    top = max(per, default=0.0)
    budget = float(pred["memory_budget_bytes"])
    return Memory(per, top, budget, top / budget if budget > 0 else 0.0)


def _baselines(baselines: Mapping[str, Any], step_s: float, mem: float) -> list[Baseline]:
    out = []
    for name, b in sorted(baselines.items()):
        t, m = b.get("step_time_s"), b.get("memory_bytes_per_device")
        out.append(Baseline(name, bool(b.get("feasible", t is not None)), t,
                            t / step_s if t is not None and step_s > 0 else None, m,
                            m / mem if m is not None and mem > 0 else None))
    return out


def _get(rows: list, k: int, key: str) -> Any:
    return rows[k].get(key) if k < len(rows) and isinstance(rows[k], Mapping) else None
