"""explain: a pure function from a plan (`parc.plandir.Plan`) to the Report of facts.

Nothing here reads files or imports the planner; `parc.plandir.load_plan` gives the plan. Totals
are sums over what plan.json lists, so the JSON report can be checked against the plan.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from parc.cluster import Cluster
from parc.errors import PlanFormatError
from parc.ir.state import BACKWARD, FORWARD, OPTIMIZER
from parc.plandir.plan import Baseline as PlannedBaseline
from parc.plandir.plan import Plan, Prediction
from parc.plandir.simulation import SPAN_KINDS
from parc.report import scopes
from parc.report.facts import (
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
PARAMETER_RULE = "the training step's record (parc grad): each parameter, its next value and its optimizer state"


def explain(plan: Plan, plan_file: str = "plan.json") -> Report:
    """The report of one plan."""
    pred = plan.predicted
    step_s = pred.step_time_s
    step = Step(step_s, pred.compute_s, pred.comm_s, pred.comm_s / step_s if step_s > 0 else 0.0)
    memory = _memory(pred)
    params = _parameters(plan)
    report = Report(
        plan=plan_file, format_version=plan.format_version,
        model=plan.model.path if plan.model else None, summary=_summary(plan), step=step,
        groups=_groups(plan.strategies, plan.specs, plan.phases),
        strategy_mix=_mix(plan.strategies, plan.specs, plan.phases),
        parameters=params,
        communication=_communication(None if plan.communication is None else list(plan.communication), step.comm_s),
        memory=memory,
        baselines=_baselines(plan.baselines, step_s, memory.max_bytes), why=[],
        pipeline=_pipeline(plan), mixed=_mixed(plan), given=plan.devices_given,
        simulation=_simulation(plan.simulation, plan_file))
    return replace(report, why=reasons(report))


def _mixed(plan: Plan) -> dict[str, Any] | None:
    """A mixed mesh's facts as plan.json states them (docs/heterogeneous.md)."""
    per = plan.predicted.per_device
    if not per.get("devices"):
        return None
    return {"devices": list(per["devices"]), "compute_s": list(per.get("compute_s_per_device") or []),
            "memory_bytes": list(plan.predicted.memory_bytes_per_device),
            "budget_bytes": list(per.get("memory_budget_bytes_per_device") or []),
            "axes": list((plan.balance or {}).get("axes") or [])}


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


def _pipeline(plan: Plan) -> dict[str, Any] | None:
    """The pipeline's facts as plan.json states them, with the transfer totals; also what
    `--pipeline auto` tried for a one-mesh plan."""
    tried = plan.solver.get("pipelines") or []
    if not plan.pipelined:
        return {"tried": tried} if tried else None
    transfers = plan.transfers
    return {"stages": [s.to_json(with_specs=False) for s in plan.stages], "schedule": plan.schedule.to_json(),
            "bubble_s": plan.predicted.bubble_s,
            "transfers": len(transfers), "transfer_bytes": int(sum(t.get("bytes", 0) * len(t.get("to_stages", []))
                                                                    for t in transfers)),
            "stage_search": dict(plan.stage_search or {}), "spmd_only": plan.spmd_only,
            "tried": tried}


def _summary(plan: Plan) -> Summary:
    cluster = plan.cluster
    types = Counter(d.name for n in cluster.nodes for d in n.devices)
    shape = list(plan.mesh.shape)
    links = list(plan.mesh.links)
    spans = list(plan.mesh.spans_nodes)
    order = _mesh_devices(plan, shape)
    axes = [MeshAxis(n, _get(links, k, "name"), _get(links, k, "bandwidth"), _get(links, k, "latency"),
                     spans[k] if k < len(spans) else None, _get(links, k, "call"), _get(links, k, "handoff"),
                     _get(links, k, "kinds"), _get(links, k, "step_ratio"),
                     None if order is None else _axis_groups(order, shape, k))
            for k, n in enumerate(shape)]
    solver = plan.solver
    tried = [MeshTried([int(n) for n in m.get("shape", [])], bool(m.get("feasible", False)),
                       m.get("step_time_s"), m.get("gap"),
                       bool(m.get("chosen", [int(n) for n in m.get("shape", [])] == shape)),
                       m.get("skipped"), m.get("stage"), m.get("lower_bound_s"))
             for m in solver.get("meshes") or []]
    devices = sum(types.values()) or len(plan.mesh.devices or ()) or math.prod(shape)
    return Summary(devices, len(cluster.nodes), dict(sorted(types.items())), _cluster_words(cluster, devices),
                   shape, axes, tried, solver.get("level"), solver.get("time_s"), solver.get("gap"),
                   solver.get("status"), solver.get("nodes"), solver.get("gap_over_meshes"))


def _mesh_devices(plan: Plan, shape: list[int]) -> list[int] | None:
    """The mesh's devices in mesh order: plan.json's `mesh.devices`, or a pipeline's stages'
    devices in stage order when every stage has the same mesh. None: unknown."""
    devices = plan.mesh.devices
    if devices is None and plan.pipelined and all(list(s.mesh) == shape[1:] for s in plan.stages):
        devices = [d for s in plan.stages for d in s.devices]
    return [int(d) for d in devices] if devices and len(devices) == math.prod(shape) else None


def _axis_groups(devices: list[int], shape: list[int], k: int) -> list[list[int]]:
    """The groups of devices that differ only in their coordinate on axis `k`: a collective along
    the axis runs within each."""
    return np.moveaxis(np.array(devices).reshape(shape), k, -1).reshape(-1, shape[k]).tolist()


def _cluster_words(cluster: Cluster, devices: int) -> str:
    nodes = cluster.nodes
    if not nodes:
        return f"{devices} devices"
    kinds = Counter(d.name for n in nodes for d in n.devices)
    what = " + ".join(f"{c} x {t}" for t, c in sorted(kinds.items()))
    text = f"{what} in {len(nodes)} node{'s' if len(nodes) != 1 else ''} ({cluster.links_text()})"
    ratios = sorted({float(d.step_ratio) for d in cluster.device_types if float(d.step_ratio) != 1.0})
    if ratios:  # a calibration's measured correction: say that the predictions carry it
        text += f"; node times x{' / x'.join(f'{r:.2f}' for r in ratios)} (the calibration's step_ratio)"
    return text


def _groups(strategies: Mapping[str, str], specs: Mapping[str, str], phases: Mapping[str, str]) -> list[Group]:
    by_scope: dict[str, list[str]] = defaultdict(list)
    for name in strategies:
        by_scope[scopes.scope_of(name)].append(name)
    groups = []
    for scope, names in by_scope.items():
        of = {n: phases.get(n, FORWARD) for n in names}
        words = {n: scopes.strategy_words(strategies[n], n, specs, of[n]) for n in names}
        counts = Counter(of.values())
        update = [w for n, w in words.items() if of[n] == OPTIMIZER]
        compute = [w for n, w in words.items() if of[n] != OPTIMIZER]
        top, count = _ranked(compute)[0] if compute else (None, 0)
        opt, opt_count = _ranked(update)[0] if update else (None, 0)
        groups.append(Group(scope, len(names), {p: counts[p] for p in (FORWARD, BACKWARD, OPTIMIZER)},
                            top, count, opt, opt_count, dict(_ranked(list(words.values())))))
    return sorted(groups, key=lambda g: _natural(g.scope))  # h.2 before h.10


def _mix(strategies: Mapping[str, str], specs: Mapping[str, str], phases: Mapping[str, str]) -> dict[str, dict[str, int]]:
    by_phase: dict[str, list[str]] = {FORWARD: [], BACKWARD: [], OPTIMIZER: []}
    for name, strategy in strategies.items():
        phase = phases.get(name, FORWARD)
        by_phase[phase].append(scopes.strategy_words(strategy, name, specs, phase))
    return {phase: dict(_ranked(words)) for phase, words in by_phase.items()}


def _ranked(words: list[str]) -> list[tuple[str, int]]:
    return sorted(Counter(words).items(), key=lambda kv: (-kv[1], kv[0]))


def _natural(text: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def _parameters(plan: Plan) -> Parameters:
    """Each trained parameter's layout, its next value's and its optimizer state's, from the
    step's roles (plan.json's `step`); none for a plan of a graph that is not a training step."""
    specs = plan.specs
    sizes = {name: t.bytes for name, t in plan.tensors.items()}
    items = []
    relaid = 0
    for name, role in (plan.step.parameters if plan.step is not None else {}).items():
        spec = specs.get(name)
        if spec is None:  # not a value of the planned graph (a pipeline stage's, under another name)
            continue
        state = {s: specs[s] for s in role.state if s in specs}
        items.append(Parameter(name, scopes.scope_of(name), spec, scopes.spec_words(spec), scopes.is_sharded(spec),
                               specs.get(role.new) if role.new else None, state, sizes.get(name)))
        pairs = [(name, role.new), *role.state.items()]
        relaid += sum(new is not None and old in specs and new in specs and specs[old] != specs[new]
                      for old, new in pairs)
    sharded = [p for p in items if p.sharded]
    known = bool(items) and all(p.bytes is not None for p in items)
    return Parameters(
        PARAMETER_RULE, len(items), len(items) - len(sharded), len(sharded),
        sum(len(p.state) for p in items), sum(scopes.is_sharded(s) for p in items for s in p.state.values()),
        relaid,
        sum(p.bytes for p in items if not p.sharded) if known else None,  # type: ignore[misc]
        sum(p.bytes for p in sharded) if known else None, items)  # type: ignore[misc]


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


def _memory(pred: Prediction) -> Memory:
    per = list(pred.memory_bytes_per_device)
    top = max(per, default=0.0)
    budget = pred.memory_budget_bytes
    return Memory(per, top, budget, top / budget if budget > 0 else 0.0)


def _baselines(baselines: Mapping[str, PlannedBaseline], step_s: float, mem: float) -> list[Baseline]:
    out = []
    for name, b in sorted(baselines.items()):
        t, m = b.step_time_s, b.memory_bytes_per_device
        out.append(Baseline(name, b.feasible and t is not None, t,
                            t / step_s if t is not None and step_s > 0 else None, m,
                            m / mem if m is not None and mem > 0 else None))
    return out


def _get(rows: list, k: int, key: str) -> Any:
    return rows[k].get(key) if k < len(rows) and isinstance(rows[k], Mapping) else None
