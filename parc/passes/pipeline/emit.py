"""A pipelined plan's per-rank programs and its task graph (Rhino 6.1-6.2, Whale's TaskGraphs).

Every rank of stage s runs its stage's program (`lower_rank` on the stage's subgraph), cut
into modules per pass: forward (``mf<depth>``), backward (``mb<depth>``) and optimizer
(``ma<depth>``; ``maa<depth>`` when the step is microbatched, the apply part). One forward and
one backward program serve every microbatch. The order of each rank is stage s's static 1F1B
schedule (`one_f_one_b`): per forward step F(k) the data of microbatch k, what other stages
send it for that pass, the forward modules and their collectives, then its own sends; per
backward step the same for the backward pass; after the last backward the gradients, summed
over the microbatches, are applied once; last, a weight read by another stage (a tied
embedding) goes there in its new value.

A value crossing stages goes where `transfer_routes` says (split along time as the microbatch
layout says: one microbatch's piece), and each receiver gets only its shard. When the two
stages' device meshes have the same shape, rank j of the producing stage holds the value in the
reading stage's layout and sends rank j its shard; otherwise the producing stage holds it whole
and rank i mod |sender group| cuts receiver i's shard out of it (the send task's `slice`). Sends do not wait for their receiver (the executor completes
them by the end of the step), so the orders cannot deadlock through them; `check_taskgraph`
runs the orders to make sure.
"""

from __future__ import annotations

from pathlib import Path

from parc import plandir
from parc.ir.state import phase
from parc.passes.emit import (
    _param_stats,
    _part_tasks,
    comms_by_place,
    local_bytes,
    residents_json,
    write_rank_files,
    write_taskgraph,
)
from parc.passes.lower import APPLY, MICRO, PASSES, bindings, layout_key, loss_name, lower_rank, rules_of
from parc.passes.pipeline.plan import PipelinePlan, p2p_link, transfer_routes
from parc.passes.pipeline.stages import stage_outputs
from parc.passes.schedule import one_f_one_b
from parc.passes.timing import annotate, fold_seconds, shared_hosts
from parc.plandir.taskgraph import FORMAT, TaskGraph

TAG_LIMIT = 32767  # the largest MPI tag every implementation accepts


def write_pipeline_programs(pp: PipelinePlan, out: Path) -> TaskGraph:
    """Lower every rank of every stage; write modules, init, program.json and taskgraph.json."""
    m, count = pp.micro_batches, len(pp.stages)
    schedule = one_f_one_b(count, m)
    binds = bindings(pp.graph)
    stats = _param_stats(pp.graph)
    owned = {s.index: stage_outputs(pp.graph, pp.assignment, s.index) for s in pp.stages}
    progs: dict[int, tuple] = {}  # global rank -> (stage plan, program, module tasks)
    layouts = transfer_routes(pp)
    for st in pp.stages:
        d = st.plan.decision
        graph, mesh, strategies, specs, micro = d.graph, d.mesh, list(d.strategies), d.specs, d.micro_batches
        sends = {b.name: (b.phase, list(dict.fromkeys(_sent_layout(layouts[b.name, d]) for d in b.dst)))
                 for b in pp.crossing if b.src == st.index}
        received = frozenset(b.name for b in pp.crossing if st.index in b.dst and b.name not in binds)
        not_outputs = frozenset(o.name for o in graph.outputs) - owned[st.index]
        rules = rules_of(graph)
        for local, rank in enumerate(st.ranks):
            p = lower_rank(graph, mesh, local, strategies, specs, micro, rules, sends, received, not_outputs,
                           st.plan.best.model.buckets)
            progs[rank] = (st, p, write_rank_files(p, graph, plandir.rank_dir(out, rank), pp.cluster.devices[rank],
                                                   pp.cluster.shared_devices(rank)))
    tasks: list[dict] = []
    edges: list[list[str]] = []
    collectives: dict[str, dict] = {}
    order: dict[str, list[str]] = {}
    links = _links(pp, progs, layouts)
    bound_in = {(lk["dst_rank"], lk["tensor"]) for lk in links if lk["bound"]}  # new weights received
    data: dict[str, dict] = {}
    for _, p, _ in progs.values():
        for x in p.residents.values():
            if x.kind == "data":
                data.setdefault(x.name, {"name": x.name, "kind": "data", "spec": "", "shape": list(x.shape),
                                         "local": list(x.shape), "dtype": x.dtype, "high": x.high})
    data_inputs = [data[v.name] for v in pp.graph.inputs if v.name in data]
    loss = loss_name(pp.graph)
    reporter = min((r for r, (_, p, _) in progs.items() if loss in p.outputs), default=0)
    for rank, (st, p, mod_tasks) in sorted(progs.items()):
        mine_bound = {new: old for new, old in binds.items() if new in p.outputs or (rank, new) in bound_in}
        plandir.write_program(out, plandir.Program(
            rank=rank, coords=p.coords, mesh=p.mesh, micro_batches=m, residents=residents_json(p, stats),
            outputs=p.outputs, accumulate=p.accumulate, bindings=mine_bound,
            loss=loss if loss in p.outputs else None, stage=st.index, stages=count, stage_ranks=st.ranks,
            data_inputs=data_inputs, reporter=reporter))
        order[str(rank)] = _rank_order(rank, st, p, mod_tasks, schedule[st.index], m, links, tasks, edges,
                                       collectives)
    tasks.extend(collectives.values())
    doc = {"format": FORMAT, "ranks": pp.ranks, "micro_batches": m,
           "stages": [{"id": st.index, "ranks": list(st.ranks), "mesh": list(st.plan.best.mesh.shape)}
                      for st in pp.stages],
           "tasks": tasks, "edges": edges, "order": order,
           **({"folds": {str(rank): fold_seconds(p.accumulate, p.info, pp.cluster.devices[rank])
                         for rank, (_, p, _) in sorted(progs.items())}} if m > 1 else {}),
           **shared_hosts(pp.cluster, range(pp.ranks))}
    stage_of = {rank: st for st in pp.stages for rank in st.ranks}
    annotate(doc, lambda t: stage_of[t["group"][0]].plan.best.mesh.links[t["axis"]],
             lambda a, b: p2p_link(pp.cluster, stage_of[a].ranks, stage_of[b].ranks,
                                   min(len(stage_of[a].ranks), len(stage_of[b].ranks))))
    return write_taskgraph(doc, out)


def _sent_layout(route):
    """The device layout the sending stage holds a value in to send it (None: whole)."""
    return route.layout if route.shared else None


def _links(pp: PipelinePlan, progs: dict[int, tuple], layouts: dict) -> list[dict]:
    """Every (value, sending rank, receiving rank) of the plan, with the pass each side runs it
    in, the array that travels and the receiver's layout. The array is the receiver's shard
    (`layout` its device layout): the sender's own when the meshes are shared, else cut out of
    the value the sender holds whole (`slice`: the receiver's layout, model mesh and
    coordinates); or, when the receiver's layout is unknown, the whole value (`layout` whole)."""
    binds = bindings(pp.graph)
    out = []
    for i, b in enumerate(pp.crossing):
        src = pp.stages[b.src]
        for d in b.dst:
            dst = pp.stages[d]
            route = layouts[b.name, d]
            for j, rank in enumerate(dst.ranks):
                sender = src.ranks[j % len(src.ranks)]  # the same j when the meshes are shared
                _, sp, _ = progs[sender]
                _, rp, _ = progs[rank]
                send_pass, by_layout = sp.sends[b.name]
                local = by_layout[layout_key(_sent_layout(route))]
                shape = sp.info[local][1]
                held = rp.residents[binds[b.name]] if b.name in binds else rp.residents[b.name]
                # a new weight for a stage that reads it arrives after the update
                recv_pass = "A" if b.name in binds else _first_pass(dst.graph, b.name)
                link = {"index": i, "tensor": b.name, "src_rank": sender, "dst_rank": rank, "src_local": local,
                        "send_pass": send_pass, "recv_pass": recv_pass, "shape": list(shape), "global": list(b.shape),
                        "dtype": b.dtype, "spec": str(held.spec), "layout": layout_key(route.layout),
                        "bound": b.name in binds}
                if not route.shared and route.layout is not None:
                    link["slice"] = {"spec": str(held.spec), "mesh": list(rp.mesh), "global": list(b.shape),
                                     "coords": [0, *rp.coords[1:]] if pp.micro_batches > 1 else list(rp.coords)}
                    link["shape"] = list(held.local)
                out.append(link)
    return out


def _first_pass(graph, name: str) -> str:
    """The earliest pass of the stage's nodes that read `name`."""
    passes = {PASSES[phase(u)] for v in graph.inputs if v.name == name for u, _ in v.uses}
    for ph in ("F", "B", "A"):
        if ph in passes:
            return ph
    return "F"


def _tag(index: int, mb: int | None, m: int) -> int:
    return (index * (m + 1) + (0 if mb is None else mb + 1)) % TAG_LIMIT


def _rank_order(rank: int, st, p, mod_tasks: list[dict], steps, m: int, links: list[dict], tasks: list[dict],
                edges: list[list[str]], collectives: dict[str, dict]) -> list[str]:
    """Append rank's tasks and edges; return its 1F1B order."""
    local = st.ranks.index(rank)
    device_mesh = tuple(p.mesh[1:] if m > 1 else p.mesh)
    shift = 1 if m > 1 else 0
    comms_at = comms_by_place(p)
    ids: list[str] = []
    made_by_mb: dict[int | None, dict[str, str]] = {}
    prefix = f"s{st.index}."
    data = [x for x in p.residents.values() if x.kind == "data"]

    def add_edges_for(made):
        def add(tid: str, names) -> None:
            for n in names:
                if n in made:
                    edges.append([made[n], tid])
        return add

    def transfers(kind: str, ph: str, mb: int | None, made: dict[str, str]) -> None:
        suffix = f".mb{mb}" if mb is not None else ""
        extra = {"micro_batch": mb} if mb is not None else {}
        for lk in links:
            if kind == "send" and lk["src_rank"] == rank and lk["send_pass"] == ph:
                tid = f"r{rank}.send.{lk['tensor']}.to{lk['dst_rank']}{suffix}"
                tasks.append({"id": tid, "kind": "send", "rank": rank, "peer": lk["dst_rank"],
                              "tensor": lk["tensor"], "local": lk["src_local"], "tag": _tag(lk["index"], mb, m),
                              "pass": ph, **({"slice": lk["slice"]} if "slice" in lk else {}), **extra})
                if lk["src_local"] in made:
                    edges.append([made[lk["src_local"]], tid])
                ids.append(tid)
            elif kind == "recv" and lk["dst_rank"] == rank and lk["recv_pass"] == ph:
                tid = f"r{rank}.recv.{lk['tensor']}{suffix}"
                tasks.append({"id": tid, "kind": "recv", "rank": rank, "peer": lk["src_rank"],
                              "tensor": lk["tensor"], "local": lk["tensor"], "tag": _tag(lk["index"], mb, m),
                              "shape": lk["shape"], "global": lk["global"], "dtype": lk["dtype"],
                              "spec": lk["spec"], "layout": lk["layout"], "pass": ph, **extra})
                edges.append([f"r{lk['src_rank']}.send.{lk['tensor']}.to{rank}{suffix}", tid])
                made[lk["tensor"]] = tid
                ids.append(tid)

    def run_pass(part: str, ph: str, mb: int | None, made: dict[str, str]) -> None:
        suffix = f".mb{mb}" if mb is not None else ""
        _part_tasks(local, p, part, mod_tasks, comms_at, device_mesh, shift, suffix, mb, tasks, edges,
                    collectives, ids, made, add_edges_for(made), phase=ph, ranks=st.ranks, prefix=prefix)

    for what, k in steps:
        mb = k if m > 1 else None
        made = made_by_mb.setdefault(mb, {})
        suffix = f".mb{k}" if m > 1 else ""
        if what == "F":
            for x in data:
                tid = f"r{rank}.source.{x.name}{suffix}"
                tasks.append({"id": tid, "kind": "source", "rank": rank, "tensor": x.name, "phase": MICRO,
                              "out_bytes": [local_bytes(p, x.name)],
                              **({"micro_batch": mb} if mb is not None else {})})
                ids.append(tid)
                made[x.name] = tid
        transfers("recv", what, mb, made)
        run_pass(MICRO, what, mb, made)
        transfers("send", what, mb, made)
    made = dict(made_by_mb.get(m - 1 if m > 1 else None, {}))
    if m == 1:
        run_pass(MICRO, "A", None, made)
    else:
        for ph in ("F", "B", "A"):
            run_pass(APPLY, ph, None, made)
    transfers("send", "A", None, made)
    transfers("recv", "A", None, made)
    for name, loc in p.outputs.items():
        tid = f"r{rank}.sink.{name}"
        tasks.append({"id": tid, "kind": "sink", "rank": rank, "tensor": name, "local": loc})
        if loc in made:
            edges.append([made[loc], tid])
        ids.append(tid)
    for lk in links:  # new values of weights this stage reads but another updates
        if lk["dst_rank"] == rank and lk["bound"]:
            tid = f"r{rank}.sink.{lk['tensor']}"
            tasks.append({"id": tid, "kind": "sink", "rank": rank, "tensor": lk["tensor"], "local": lk["tensor"]})
            edges.append([made[lk["tensor"]], tid])
            ids.append(tid)
    return ids

