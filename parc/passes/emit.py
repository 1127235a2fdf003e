"""Emit a plan's per-rank programs (DESIGN: --schedule-->, --emit-->).

For every rank, `lower_rank`'s program is cut into ONNX modules at communication (see
`parc/passes/lower.py`) and written to the plan directory:

- ``rank_<r>/m<part><depth>.onnx``: the modules, each a valid ONNX model on local shapes;
- ``rank_<r>/init.onnx`` + ``rank_<r>/weights.bin``: the rank's shards of the parameters,
  optimizer state and large constants (external data), sliced from the source model without
  reading more of it than the shard; running init.onnx yields them;
- ``rank_<r>/program.json``: what the executor holds (residents: data, state, weights, with
  global shape, layout and local shape), which local value each graph output is, the
  microbatch accumulations, and the step bindings (`parc.plandir.Program`);
- ``taskgraph.json``: compute, collective, source and sink tasks, data edges, each rank's order.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

from parc import plandir
from parc.cluster.cluster import Cluster
from parc.cluster.devices import DEVICES, DeviceSpec
from parc.cluster.links import LINKS, LinkSpec
from parc.ir.dtypes import onnx_nbytes
from parc.ir.graph import Graph
from parc.ir.scatter import scatter_as_elements
from parc.ir.simplify import simplify
from parc.ir.state import step_state
from parc.ops.base import masked_classes
from parc.passes.lower import APPLY, MICRO, Comm, RankProgram, bindings, loss_name, lower_rank, rules_of
from parc.passes.spmd.pool import run_jobs
from parc.passes.timing import annotate, fold_seconds, module_times, shared_hosts
from parc.plandir.taskgraph import FORMAT, TaskGraph, check_taskgraph
from parc.sharding.layout import shard_index
from parc.sharding.spec import ShardSpec

ALIGN = 64


PASS_ORDER = {"": 0, "F": 0, "B": 1, "A": 2}


def _modules(p: RankProgram) -> list[tuple[str, str, int, list[onnx.NodeProto]]]:
    """(part, pass, depth, nodes) per module, in run order: the microbatch part, then the apply
    part; in a pipeline stage's program each part's forward, backward and optimizer passes apart."""
    groups: dict[tuple[str, str, int], list[onnx.NodeProto]] = defaultdict(list)
    for (depth, part, node), ph in zip(p.nodes, p.phases, strict=True):
        groups[part, ph, depth].append(node)
    return [(part, ph, d, groups[part, ph, d])
            for part, ph, d in sorted(groups, key=lambda k: (k[0] != MICRO, PASS_ORDER[k[1]], k[2]))]


def module_name(part: str, phase: str, depth: int) -> str:
    return f"m{'a' if part == APPLY else ''}{phase.lower()}{depth:03d}"


def local_bytes(p: RankProgram, name: str) -> int:
    """Bytes of a local value of the rank's program (its local shape and type)."""
    dtype, shape = p.info[name]
    return onnx_nbytes(shape, dtype)


def _value_info(p: RankProgram, name: str) -> onnx.ValueInfoProto:
    dtype, shape = p.info[name]
    return helper.make_tensor_value_info(name, dtype, list(shape))


def build_modules(p: RankProgram, graph: Graph) -> tuple[list[dict], dict[str, onnx.ModelProto]]:
    """The rank's module tasks (name, part, depth, inputs, outputs) and ONNX models, each without
    the repeated nodes and no-op Casts onnxruntime would remove (`parc.ir.simplify`: what is
    priced and written is what runs)."""
    groups = _modules(p)
    read_later: set[str] = set(p.outputs.values())
    read_later |= {c.src for c in p.comms}
    read_later |= {src for src, *_ in p.accumulate.values()}
    read_later |= {local for _, by_layout in p.sends.values() for local in by_layout.values()}
    readers: dict[str, set[int]] = defaultdict(set)
    for k, (_, _, _, nodes) in enumerate(groups):
        for n in nodes:
            for i in n.input:
                if i:
                    readers[i].add(k)
    opsets = [helper.make_opsetid(d, v) for d, v in sorted(p.opset.items())]
    ir_version = max(8, helper.find_min_ir_version_for(opsets, ignore_unknown=True))
    dtypes = {name: dtype for name, (dtype, _) in p.info.items() if dtype}
    tasks, models = [], {}
    for k, (part, phase, depth, nodes) in enumerate(groups):
        made = {o for n in nodes for o in n.output if o}
        ins, inits, seen = [], [], set()
        for n in nodes:
            for i in n.input:
                if not i or i in made or i in seen:
                    continue
                seen.add(i)
                if i in p.embedded:
                    inits.append(p.embedded[i])
                else:
                    ins.append(i)
        outs = [o for n in nodes for o in n.output
                if o and (o in read_later or readers[o] - {k})]
        name = module_name(part, phase, depth)
        g = helper.make_graph(nodes, f"{graph.name}.rank{p.rank}.{name}", [_value_info(p, i) for i in ins],
                              [_value_info(p, o) for o in outs], initializer=inits)
        model = helper.make_model(g, opset_imports=opsets, producer_name="parc", ir_version=ir_version)
        models[name], _ = simplify(model, dtypes)  # its outputs stay, so the task's inputs and outputs do
        tasks.append({"name": name, "part": part, "phase": phase, "depth": depth, "inputs": ins, "outputs": outs})
    return tasks, models


def _write_init(p: RankProgram, graph: Graph, rank_dir: Path) -> None:
    """init.onnx + weights.bin: the rank's shard of every state tensor and large constant."""
    by_name = {v.name: v for v in (*graph.input_constants, *graph.constants.values())}
    residents = [r for r in p.residents.values() if r.kind not in ("data", "recv")]
    inits, nodes, outs = [], [], []
    offset = 0
    with open(rank_dir / "weights.bin.tmp", "wb") as f:
        for r in residents:
            v = by_name[r.name]
            nbytes = int(np.prod(r.local, dtype=np.int64)) * v.dtype.itemsize
            if not v.const.zeros:  # zeros (fresh optimizer state) stay a hole in the file
                _write_sparse(f, offset, _shard(v.const.numpy(), r, p))
            t = onnx.TensorProto(name=r.name + ".init", data_type=r.dtype, dims=list(r.local))
            t.data_location = onnx.TensorProto.EXTERNAL
            for key, val in (("location", "weights.bin"), ("offset", str(offset)), ("length", str(nbytes))):
                t.external_data.add(key=key, value=val)
            inits.append(t)
            nodes.append(helper.make_node("Identity", [r.name + ".init"], [r.name]))
            outs.append(helper.make_tensor_value_info(r.name, r.dtype, list(r.local)))
            offset += -(-nbytes // ALIGN) * ALIGN
        f.truncate(offset)
    (rank_dir / "weights.bin.tmp").replace(rank_dir / "weights.bin")
    opsets = [helper.make_opsetid("", 13)]
    g = helper.make_graph(nodes, f"{graph.name}.rank{p.rank}.init", [], outs, initializer=inits)
    model = helper.make_model(g, opset_imports=opsets, producer_name="parc", ir_version=8)
    onnx.save(model, rank_dir / "init.onnx")


def _param_stats(graph: Graph) -> dict[str, dict[str, float]]:
    """Mean and spread of each trained parameter (what `parc run --init seeded` draws with)."""
    from concurrent.futures import ThreadPoolExecutor

    from parc.exec.init import init_stats

    record = step_state(graph.metadata)
    names = set(record.params) if record is not None else {v.name for v in graph.params()}
    values = {v.name: v for v in (*graph.input_constants, *graph.constants.values())}
    todo = [n for n in sorted(names) if n in values and not values[n].const.zeros]
    with ThreadPoolExecutor(max(1, min(os.cpu_count() or 1, 8))) as pool:  # numpy's sums free the GIL
        stats = list(pool.map(lambda n: init_stats(values[n].const.numpy()), todo))
    return dict(zip(todo, stats))


def _shard(full: np.ndarray, r, p: RankProgram) -> np.ndarray:
    """The rank's piece of a source tensor; from a memory map only the piece is read (plain
    slices where the piece is contiguous along a dim, an index array where it is strided)."""
    if not r.shape:
        return np.asarray(full)
    index = shard_index(r.shape, r.spec, p.mesh, p.coords)  # sorted, distinct positions per dim
    if all(len(ix) and ix[-1] - ix[0] + 1 == len(ix) for ix in index):
        return full[tuple(slice(int(ix[0]), int(ix[-1]) + 1) for ix in index)]
    return full[np.ix_(*index)]


def _write_sparse(f, offset: int, shard: np.ndarray) -> None:
    """Write the shard's bytes at `offset`, leaving runs of zeros as holes (models built by
    `parc models build` have sparse weights: their plans take no more disk than they do)."""
    flat = np.asarray(shard, order="C").reshape(-1).view(np.uint8)
    step = 1 << 22
    for start in range(0, flat.size, step):
        chunk = flat[start:start + step]
        if chunk.any():
            f.seek(offset + start)
            f.write(chunk.tobytes())


def write_rank_files(p: RankProgram, graph: Graph, rank_dir: Path, device: DeviceSpec,
                     shared: Sequence[tuple[int, DeviceSpec]] = ()) -> list[dict]:
    """A rank's modules, init.onnx and weights.bin in `rank_dir`; its module tasks, each with
    its time on `device` and its outputs' bytes (`timing.module_times`), and, on a host whose
    ranks outnumber its cores, its time when only a of them compute (`shared_s`, by a: the
    device as `Cluster.shared_devices` prices it then)."""
    rank_dir.mkdir(parents=True, exist_ok=True)
    mod_tasks, models = build_modules(p, graph)
    masked = masked_classes(graph)
    times = module_times(models, device, p.info, masked)
    fewer = {a: module_times(models, spec, p.info, masked) for a, spec in shared}
    for t in mod_tasks:
        t["time_s"] = times[t["name"]]["time_s"]
        if fewer:
            t["shared_s"] = {str(a): at[t["name"]]["time_s"] for a, at in fewer.items()}
        t["out_bytes"] = [times[t["name"]]["out_bytes"].get(o, 0) for o in t["outputs"]]
    for name, model in models.items():  # reducing ScatterNDs rewritten: exact on any onnxruntime thread count
        onnx.save(scatter_as_elements(model), rank_dir / f"{name}.onnx")
    _write_init(p, graph, rank_dir)
    return mod_tasks


def residents_json(p: RankProgram, stats: dict[str, dict[str, float]]) -> list[dict]:
    """program.json's residents: what the executor holds and feeds, with the seeded init's stats."""
    return [{"name": x.name, "kind": x.kind, "spec": str(x.spec), "shape": list(x.shape), "local": list(x.local),
             "dtype": x.dtype, "high": x.high, **({"init": stats[x.name]} if x.name in stats else {})}
            for x in p.residents.values()]


PARALLEL_LOWERING_NODES = 20_000  # graph nodes x ranks from which ranks are lowered in parallel


def write_programs(plan, out: Path) -> TaskGraph:
    """Lower every rank of `plan`; write its modules, init and program, and taskgraph.json
    (returned)."""
    mesh, decided = plan.best.mesh, plan.decision
    return write_programs_for(decided.graph, decided.mesh, list(decided.strategies), decided.specs,
                              decided.micro_batches, out, devices=[plan.cluster.devices[r] for r in mesh.devices],
                              links=mesh.links, buckets=plan.best.model.buckets,
                              cluster=plan.cluster, device_ids=[int(r) for r in mesh.devices])


def write_programs_for(graph: Graph, mesh: tuple[int, ...], strategies: list, specs: dict[str, ShardSpec],
                       micro: int, out: Path, devices: Sequence[DeviceSpec] | None = None,
                       links: Sequence[LinkSpec] | None = None, buckets: tuple[bool, ...] = (),
                       cluster: Cluster | None = None, device_ids: Sequence[int] = ()) -> TaskGraph:
    """`write_programs` from its parts: the graph, the model's mesh, a Strategy per node, each
    source's layout and the microbatch count; `devices` (per rank) and `links` (per device mesh
    axis) price the tasks (default: CPU ranks over shared memory); `buckets`: per axis of the
    model's mesh, whether gradient all-reduces run in buckets (`CostModel.buckets`; default
    none); `cluster` and `device_ids` (each rank's device in it): the hosts whose ranks share
    their cores (`timing.shared_hosts`)."""
    device_mesh = mesh[1:] if micro > 1 else mesh
    ranks = int(np.prod(device_mesh))
    devices = list(devices) if devices is not None else [DEVICES["cpu"]] * ranks
    links = list(links) if links is not None else [LINKS["shm"]] * len(device_mesh)
    binds = bindings(graph)
    tasks: list[dict] = []
    edges: list[list[str]] = []
    order: dict[str, list[str]] = {}
    collectives: dict[str, dict] = {}
    rules = rules_of(graph)
    stats = _param_stats(graph)

    def write_rank(g: Graph, r: int) -> tuple[RankProgram, list[dict]]:
        p = lower_rank(g, mesh, r, strategies, specs, micro, rules, buckets=buckets)
        mod_tasks = write_rank_files(p, g, plandir.rank_dir(out, r), devices[r],
                                     cluster.shared_devices(device_ids[r]) if cluster is not None else ())
        plandir.write_program(out, plandir.Program(
            rank=r, coords=p.coords, mesh=mesh, micro_batches=micro, residents=residents_json(p, stats),
            outputs=p.outputs, accumulate=p.accumulate, bindings=binds, loss=loss_name(g)))
        return p, mod_tasks

    # the ranks are lowered and written in forked processes (as the meshes are searched), when
    # there is enough to lower to pay for the fork (measured: benchmarks/LOG.md)
    big = len(graph.nodes) * ranks >= PARALLEL_LOWERING_NODES
    written = run_jobs(write_rank, graph, list(range(ranks)), min(os.cpu_count() or 1, ranks) if big else 1)
    for r, (p, mod_tasks) in enumerate(written):
        order[str(r)] = _rank_tasks(r, p, mod_tasks, device_mesh, micro, tasks, edges, collectives)
    tasks.extend(collectives.values())
    doc = {"format": FORMAT, "ranks": ranks, "micro_batches": micro, "mesh": list(device_mesh),
           "stages": [{"id": 0, "ranks": list(range(ranks))}],
           "tasks": tasks, "edges": edges, "order": order,
           **({"folds": {str(r): fold_seconds(p.accumulate, p.info, devices[r]) for r, (p, _) in enumerate(written)}}
              if micro > 1 else {}),
           **shared_hosts(cluster, device_ids)}
    annotate(doc, lambda t: links[t["axis"]], lambda a, b: links[0])
    return write_taskgraph(doc, out)


def write_taskgraph(doc: dict, out: Path) -> TaskGraph:
    """Check a task graph (the orders must run), write it as out/taskgraph.json atomically, and
    return it checked."""
    graph = check_taskgraph(doc)
    tmp = out / f"{plandir.TASKGRAPH_FILE}.tmp"
    tmp.write_text(json.dumps(doc, indent=0) + "\n")
    tmp.replace(out / plandir.TASKGRAPH_FILE)
    return graph


def _group(rank: int, device_mesh: tuple[int, ...], axis: int) -> tuple[list[int], int]:
    """The ranks of `rank`'s group along mesh `axis` (row-major), and the group's index."""
    coords = list(np.unravel_index(rank, device_mesh))
    members = []
    for c in range(device_mesh[axis]):
        coords[axis] = c
        members.append(int(np.ravel_multi_index(coords, device_mesh)))
    rest = [int(x) for k, x in enumerate(np.unravel_index(rank, device_mesh)) if k != axis]
    gid = int(np.ravel_multi_index(rest, [n for k, n in enumerate(device_mesh) if k != axis])) if rest else 0
    return members, gid


def _rank_tasks(r: int, p: RankProgram, mod_tasks: list[dict], device_mesh: tuple[int, ...], micro: int,
                tasks: list[dict], edges: list[list[str]], collectives: dict[str, dict]) -> list[str]:
    """Append rank r's tasks and edges; return its order (microbatch part repeated `micro` times)."""
    shift = 1 if micro > 1 else 0
    comms_at = comms_by_place(p)
    ids: list[str] = []
    made: dict[str, str] = {}  # local name -> producing task (this rank, current microbatch)

    def add_edges(tid: str, names) -> None:
        for n in names:
            if n in made:
                edges.append([made[n], tid])

    data = [x for x in p.residents.values() if x.kind == "data"]
    for k in range(micro):
        suffix = f".mb{k}" if micro > 1 else ""
        made = {}
        for x in data:
            tid = f"r{r}.source.{x.name}{suffix}"
            tasks.append({"id": tid, "kind": "source", "rank": r, "tensor": x.name, "phase": MICRO,
                          "out_bytes": [local_bytes(p, x.name)],
                          **({"micro_batch": k} if micro > 1 else {})})
            ids.append(tid)
            made[x.name] = tid
        _part_tasks(r, p, MICRO, mod_tasks, comms_at, device_mesh, shift, suffix, k if micro > 1 else None,
                    tasks, edges, collectives, ids, made, add_edges)
        micro_made = made
    made = dict(micro_made)
    if micro > 1:
        _part_tasks(r, p, APPLY, mod_tasks, comms_at, device_mesh, shift, "", None,
                    tasks, edges, collectives, ids, made, add_edges)
    for name, local in p.outputs.items():
        tid = f"r{r}.sink.{name}"
        tasks.append({"id": tid, "kind": "sink", "rank": r, "tensor": name, "local": local})
        add_edges(tid, [local])
        ids.append(tid)
    return ids


def comms_by_place(p: RankProgram) -> dict[tuple[str, str, int], list[tuple[int, Comm]]]:
    """The program's collectives (with their index) by part, pass and depth."""
    out: dict[tuple[str, str, int], list[tuple[int, Comm]]] = defaultdict(list)
    for j, c in enumerate(p.comms):
        out[c.part, c.phase, c.depth].append((j, c))
    return out


def _part_tasks(r, p, part, mod_tasks, comms_at, device_mesh, shift, suffix, mb, tasks, edges, collectives,
                ids, made, add_edges, phase: str | None = None, ranks: tuple[int, ...] | None = None,
                prefix: str = "") -> None:
    """The tasks of one part (and, in a pipeline stage, one pass): modules and collectives by
    depth. `ranks` maps the stage's local ranks to global ones; `prefix` keeps the collective ids
    of different stages apart."""
    extra = {"micro_batch": mb} if mb is not None else {}

    def mine(t_part, t_phase):
        return t_part == part and (phase is None or t_phase == phase)

    depths = sorted({t["depth"] for t in mod_tasks if mine(t["part"], t.get("phase", ""))}
                    | {d for (q, ph, d) in comms_at if mine(q, ph)})
    g = (lambda q: q) if ranks is None else (lambda q: ranks[q])
    for d in depths:
        for t in mod_tasks:
            if mine(t["part"], t.get("phase", "")) and t["depth"] == d:
                tid = f"r{g(r)}.{t['name']}{suffix}"
                tasks.append({"id": tid, "kind": "compute", "rank": g(r), "module": f"rank_{g(r)}/{t['name']}.onnx",
                              "phase": part, "inputs": t["inputs"], "outputs": t["outputs"],
                              "time_s": t["time_s"], **({"shared_s": t["shared_s"]} if "shared_s" in t else {}),
                              "out_bytes": t["out_bytes"], **({"pass": phase} if phase else {}), **extra})
                add_edges(tid, t["inputs"])
                ids.append(tid)
                for o in t["outputs"]:
                    made[o] = tid
        for j, c in [jc for (q, ph, dd), jcs in comms_at.items() if mine(q, ph) and dd == d for jc in jcs]:
            axis = c.step.axis - shift
            members, gid = _group(r, device_mesh, axis)
            members = [g(q) for q in members]
            tid = f"{prefix}c{j}.a{axis}.g{gid}{suffix}"
            if tid not in collectives:
                collectives[tid] = {"id": tid, "kind": "collective", "group": members, "op": c.step.kind,
                                    "tensor": c.value, "axis": axis, "step": c.step.to_json(),
                                    "out_bytes": [local_bytes(p, c.dst)],
                                    "shape": list(c.shape), "dtype": c.dtype, "src": c.src, "dst": c.dst,
                                    "phase": part, **({"pass": phase} if phase else {}), **extra}
            elif (collectives[tid]["src"], collectives[tid]["dst"]) != (c.src, c.dst):
                raise AssertionError(f"collective {tid}: ranks disagree on local names")
            add_edges(tid, [c.src])
            ids.append(tid)
            made[c.dst] = tid
