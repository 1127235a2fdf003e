"""The "why" of a report: short sentences derived only from the report's numbers."""

from __future__ import annotations

from collections import Counter

from parc.report import facts, scopes
from parc.report.units import fmt_bytes, fmt_gap, fmt_pct, fmt_shape, fmt_time

_NAMES_SHOWN = 5


def reasons(r: facts.Report) -> list[str]:
    """Every sentence that the numbers support, most important first."""
    out = [_comm_share(r)]
    out += _strategy_mix(r)
    out += _communication(r.communication, r.parameters)
    out += _parameters(r)
    out += _memory(r)
    out += _idle(r)
    out += _mixed(r)
    out += [_baseline(r, b) for b in r.baselines]
    out += _meshes(r.summary)
    out += _solver(r.summary)
    return out


def _idle(r: facts.Report) -> list[str]:
    """On a mixed cluster: which devices the plan leaves idle, or why it uses them all."""
    g = r.given
    if not g:
        return []
    tried = g.get("tried") or []
    every = tried[0] if tried else None  # the plan on every device comes first
    chosen = next((t for t in tried if t.get("chosen")), None)
    others = [t for t in tried if t is not chosen]
    margin = fmt_pct(g.get("min_gain", 0.0))
    if g.get("idle") and chosen is not None and every is not None:
        idle = ", ".join(f"{n} {name}" for name, n in g["idle"].items())
        gain = 1 - chosen["step_time_s"] / every["step_time_s"]
        return [f"{idle} of the {g['num_devices']} devices given are left idle: the plan on {chosen['devices']} "
                f"({'node' if len(chosen['nodes']) == 1 else 'nodes'} {', '.join(map(str, chosen['nodes']))}) is predicted {fmt_time(chosen['step_time_s'])} "
                f"against {fmt_time(every['step_time_s'])} on every device, {fmt_pct(gain)} faster (devices are "
                f"left idle for a gain of {margin} or more; --all-devices uses them all)"]
    out = []
    for t in others:
        if not t.get("feasible") or t.get("step_time_s") is None:
            out.append(f"every device given is used: a plan on {t['devices']} alone does not fit "
                       f"({t.get('error', 'infeasible')})")
            continue
        gain = 1 - t["step_time_s"] / r.step.step_time_s
        what = (f"{fmt_pct(gain)} faster, under the {margin} that leaving devices idle must gain" if gain > 0
                else f"{fmt_pct(-gain)} slower")
        out.append(f"every device given is used: a plan on {t['devices']} alone is predicted "
                   f"{fmt_time(t['step_time_s'])}, {what}")
    return out


def _mixed(r: facts.Report) -> list[str]:
    """What a mesh of mixed devices was given: each type's share, compute and memory."""
    m = r.mixed
    if not m:
        return []
    out = []
    for a in m["axes"]:
        kinds: dict[str, list[float]] = {}
        for name, share in zip(a["slices"], a["shares"]):
            kinds.setdefault(name, []).append(share)
        shares = ", ".join(f"{name} {fmt_pct(sum(v) / len(v))} each" for name, v in kinds.items())
        line = f"mixed devices on mesh axis {a['axis']}: the work is split by speed ({shares})"
        if a.get("optimum") is not None:
            line += (f"; the batch of {a['units']} goes {a['optimum']} (exact balance, slowest slice "
                     f"{fmt_time(a['time_optimum_s'])}), Whale's Algorithm 1 would give {a['algorithm1']} "
                     f"({fmt_time(a['time_algorithm1_s'])}), an even split {fmt_time(a['time_even_s'])}")
        out.append(line)
    types: dict[str, list[int]] = {}
    for i, name in enumerate(m["devices"]):
        types.setdefault(name, []).append(i)
    parts = []
    for name, idx in types.items():
        c = max(m["compute_s"][i] for i in idx) if m["compute_s"] else 0.0
        mem = max(m["memory_bytes"][i] for i in idx) if m["memory_bytes"] else 0.0
        budget = m["budget_bytes"][idx[0]] if m["budget_bytes"] else 0.0
        parts.append(f"{name}: compute {fmt_time(c)}, memory {fmt_bytes(mem)} of {fmt_bytes(budget)}")
    out.append("per device type: " + "; ".join(parts))
    return out


def _comm_share(r: facts.Report) -> str:
    s = r.step
    return (f"communication is {fmt_pct(s.comm_fraction)} of the predicted step ({fmt_time(s.comm_s)} of "
            f"{fmt_time(s.step_time_s)}); compute is {fmt_time(s.compute_s)}")


def _strategy_mix(r: facts.Report) -> list[str]:
    out = []
    compute: Counter[str] = Counter(r.strategy_mix.get("forward", {}))
    compute.update(r.strategy_mix.get("backward", {}))
    for what, words in (("forward and backward", compute), ("optimizer", Counter(r.strategy_mix.get("optimizer", {})))):
        total = sum(words.values())
        if total:
            top, n = sorted(words.items(), key=lambda kv: (-kv[1], kv[0]))[0]
            out.append(f"{n} of {total} {what} nodes ({fmt_pct(n / total)}) run {top}")
    return out


def _communication(c: facts.Communication, p: facts.Parameters) -> list[str]:
    if not c.recorded:
        return ["plan.json lists no communication edges (written by an older parc plan)"]
    out = []
    if c.by_kind:
        k = c.by_kind[0]
        out.append(f"most communication time is {k.key} ({k.count} collectives, "
                   f"{fmt_bytes(k.bytes_per_device)} per device, {fmt_time(k.time_s)})")
    if c.top_edges:
        e = c.top_edges[0]
        out.append(f"the slowest edge is {e.value} -> {e.consumer}: {e.src} to {e.dst} by "
                   f"{', '.join(e.collectives)}, {fmt_time(e.time_s)}")
    if c.predicted_s > 0 and abs(c.unitemized_s) > 0.01 * c.predicted_s:
        text = (f"{fmt_time(c.unitemized_s)} of the predicted communication "
                f"({fmt_pct(c.unitemized_s / c.predicted_s)}) is on no edge plan.json lists")
        moved = next((q for q in p.items if q.new_spec is not None and q.new_spec != q.spec), None)
        if p.relaid:
            example = f" (e.g. {moved.name}: {moved.new_spec} -> {moved.spec})" if moved else ""
            text += (f": {p.relaid} parameter and optimizer state tensors leave the step in another layout "
                     f"than they enter it{example} and are resharded for the next step")
        out.append(text)
    return out


def _parameters(r: facts.Report) -> list[str]:
    p = r.parameters
    if not p.count:
        return ["no trained parameters found (plan.json records no training step)"]
    if not p.sharded:
        return [f"all {p.count} parameters are replicated, as in data parallel"] + _state_only(p)
    names = [q.name for q in p.items if q.sharded]
    shown = ", ".join(names[:_NAMES_SHOWN]) + (f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else "")
    size = f" ({fmt_bytes(p.sharded_bytes)})" if p.sharded_bytes is not None else ""
    state = f"; {p.state_sharded} of {p.state_tensors} optimizer state tensors are sharded" if p.state_tensors else ""
    out = [f"the plan shards {p.sharded} of {p.count} parameters{size} that data parallel replicates "
           f"({shown}){state}"]
    return out + _state_only(p)


def _state_only(p: facts.Parameters) -> list[str]:
    """Replicated parameters whose optimizer state (and so their update) is sharded: ZeRO-1 style."""
    n = sum(1 for q in p.items if not q.sharded and any(scopes.is_sharded(s) for s in q.state.values()))
    if not n:
        return []
    return [f"{n} replicated parameters keep their optimizer state sharded: each device updates its shard "
            f"(ZeRO-1 style)"]


def _memory(r: facts.Report) -> list[str]:
    m = r.memory
    out = [f"memory per device is {fmt_bytes(m.max_bytes)}, {fmt_pct(m.fraction)} of the "
           f"{fmt_bytes(m.budget_bytes)} budget"]
    dp = next((b for b in r.baselines if b.name == "data-parallel" and b.memory_bytes_per_device is not None), None)
    if dp is not None:
        diff = dp.memory_bytes_per_device - m.max_bytes  # type: ignore[operator]
        if abs(diff) >= 1:
            more_less = "saving" if diff > 0 else "using"
            tail = "" if diff > 0 else " more"
            out.append(f"against data parallel the plan predicts {fmt_bytes(m.max_bytes)} per device instead of "
                       f"{fmt_bytes(dp.memory_bytes_per_device)}, {more_less} {fmt_bytes(abs(diff))}{tail} "
                       f"per device")
    return out


def _baseline(r: facts.Report, b: facts.Baseline) -> str:
    budget = fmt_bytes(r.memory.budget_bytes)
    if not b.feasible:
        if b.memory_bytes_per_device is not None:
            return (f"baseline {b.name} is infeasible: it needs {fmt_bytes(b.memory_bytes_per_device)} per "
                    f"device > budget {budget}")
        return f"baseline {b.name} is infeasible: no layout around its pins fits the {budget} budget"
    assert b.time_ratio is not None and b.step_time_s is not None
    delta = b.step_time_s - r.step.step_time_s
    if abs(b.time_ratio - 1) < 5e-4:
        speed = "as fast as the plan"
    elif delta > 0:
        speed = f"{fmt_pct(b.time_ratio - 1)} slower than the plan (+{fmt_time(delta)} per step)"
    else:
        speed = f"{fmt_pct(1 - b.time_ratio)} faster than the plan ({fmt_time(delta)} per step)"
    text = f"baseline {b.name} is predicted {speed}: {fmt_time(b.step_time_s)} vs {fmt_time(r.step.step_time_s)}"
    if b.memory_bytes_per_device is not None:
        text += f", with {fmt_bytes(b.memory_bytes_per_device)} per device"
    return text


def _meshes(s: facts.Summary) -> list[str]:
    chosen = next((m for m in s.meshes if m.chosen), None)
    out = []
    for m in s.meshes:
        if m.chosen:
            continue
        if m.skipped:
            out.append(f"mesh {fmt_shape(m.shape)} was skipped: {m.skipped}")
        elif not m.feasible:
            out.append(f"mesh {fmt_shape(m.shape)} does not fit the memory budget")
        elif chosen is not None and chosen.step_time_s and m.step_time_s is not None:
            gap = f" (solver gap {fmt_gap(m.gap)})" if m.gap else ""
            if m.gap and m.lower_bound_s is not None and m.lower_bound_s >= chosen.step_time_s:
                gap = f"; no plan on it is faster than {fmt_time(m.lower_bound_s)} (proven), so it cannot win"
            out.append(f"mesh {fmt_shape(m.shape)} was predicted {fmt_time(m.step_time_s)}, "
                       f"{fmt_pct(m.step_time_s / chosen.step_time_s - 1)} slower than {fmt_shape(chosen.shape)}{gap}")
    return out


def _solver(s: facts.Summary) -> list[str]:
    if s.solver_status is None:
        return []
    if s.solver_gap_over_meshes is not None and sum(m.feasible for m in s.meshes) > 1:
        return [f"the solver ({s.solver_level}) proves that no plan on any mesh tried is more than "
                f"{fmt_gap(s.solver_gap_over_meshes)} faster than this one in the cost model"
                + (f" (on its own mesh: {fmt_gap(s.solver_gap or 0.0)})"
                   if s.solver_gap_over_meshes > (s.solver_gap or 0.0) * (1 + 1e-9) + 1e-12 else "")]
    if s.solver_gap:
        return [f"the solver ({s.solver_level}) reports {s.solver_status} with a relative gap of "
                f"{fmt_gap(s.solver_gap)}: the best plan on this mesh is at most that much faster"]
    took = f"; planning took {fmt_time(s.solver_time_s)}" if s.solver_time_s is not None else ""
    return [f"the solver ({s.solver_level}) reports the plan {s.solver_status} on its mesh "
            f"in the cost model{took}"]
