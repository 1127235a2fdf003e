"""taskgraph.json: the static task graph a plan runs (Rhino 6.1), its format and its checks.

The schedule that orders each rank's tasks is a compiler decision: `parc.passes.schedule`.

Format `parc.taskgraph/1` (docs/taskgraph.md):

    {"format": "parc.taskgraph/1", "ranks": R, "micro_batches": M,
     "stages": [{"id": s, "ranks": [...]}, ...],
     "tasks": [{"id": str, "kind": KIND, ...}, ...],
     "edges": [[before_id, after_id], ...],
     "order": {"<rank>": [task ids in the order that rank runs them], ...}}

Kinds and their fields (all tasks may carry `stage`, `micro_batch`, `phase`):
- compute: `rank`, `module` (an ONNX file relative to the plan directory);
- collective: `group` (ranks), `op` (all_reduce, all_gather, reduce_scatter, all_to_all,
  broadcast), `tensor`;
- send / recv: `rank`, `peer`, `tensor` (a send pairs with the recv on `peer` of the same tensor);
  a recv also says what arrives: `shape`, `dtype`, `global` (the value's shape), `spec` (the
  receiver's layout) and `layout`: `whole` (the value whole; the receiver keeps its shard) or the
  device layout both stages hold it in (the receiver's shard itself);
- source / sink: `rank`, `tensor` (data read in, results handed out).

Optional `folds`: {"<rank>": seconds} a rank spends after each of its microbatches (after its
last task of that microbatch) adding it into the step's sums.

`load_taskgraph` validates everything an executor relies on: ids, kinds and fields, ranks in
range, edges between known tasks and acyclic, sends paired with receives, and each rank's order
listing exactly the tasks it takes part in; then it runs the orders against the edges (every rank
in its own order, a collective only when its whole group has reached it) and refuses orders that
deadlock, or whose transfers between two ranks come in different orders on the two sides. Errors are one-line PlanFormatErrors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from parc.errors import PlanFormatError

FORMAT = "parc.taskgraph/1"
TASKGRAPH_FILE = "taskgraph.json"  # in the plan directory (parc.plandir)
KINDS = {"compute": ("rank", "module"), "collective": ("group", "op", "tensor"),
         "send": ("rank", "peer", "tensor"), "recv": ("rank", "peer", "tensor"),
         "source": ("rank", "tensor"), "sink": ("rank", "tensor")}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
# Module inputs the executor feeds per microbatch t (the lowering names them; the names end in
# the piece's size or the dtype): bounds of t's slice of a value whole along time, and a flag
# that is 1 for microbatch 0 only.
MB_START, MB_END, MB_FIRST = "parc.mb.start", "parc.mb.end", "parc.mb.first"
WHOLE = "whole"  # a recv's `layout` when the value arrives whole
TASK, STAGE = "task", "stage"  # granularities


@dataclass(frozen=True)
class TaskGraph:
    """A validated task graph."""

    ranks: int
    micro_batches: int
    stages: tuple[dict, ...]
    tasks: Mapping[str, dict]
    edges: tuple[tuple[str, str], ...]
    order: Mapping[int, tuple[str, ...]]
    mesh: tuple[int, ...] = ()  # the device mesh of an SPMD plan (ranks row-major); () if none
    # "task": one rank per device, modules to run; "stage" (`parc plan --no-programs`): one
    # rank per stage standing for the stage's `devices`, for the simulator only
    granularity: str = TASK
    # rank -> seconds it spends after each of its microbatches folding it into the step's sums
    # (`parc.passes.timing.fold_seconds`); {} without microbatches
    folds: Mapping[int, float] = field(default_factory=dict)
    # the ranks of each host whose ranks outnumber its cores: a compute task there takes its
    # `shared_s` time when fewer of them compute at once (`parc.passes.timing`); () if none
    hosts: tuple[tuple[int, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "ranks": self.ranks, "micro_batches": self.micro_batches,
                "stages": list(self.stages), "tasks": list(self.tasks.values()),
                "edges": [list(e) for e in self.edges],
                "order": {str(r): list(ids) for r, ids in sorted(self.order.items())},
                **({"mesh": list(self.mesh)} if self.mesh else {}),
                **({"granularity": self.granularity} if self.granularity != TASK else {}),
                **({"folds": {str(r): s for r, s in sorted(self.folds.items())}} if self.folds else {}),
                **({"hosts": [list(h) for h in self.hosts]} if self.hosts else {})}

    def represents(self) -> dict[int, list[int]]:
        """A stage-level graph's simulated rank -> the devices it stands for ({} if task-level)."""
        if self.granularity != STAGE:
            return {}
        return {r: list(s["devices"]) for s in self.stages for r in s["ranks"]}


def ranks_of(task: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(task["group"]) if task["kind"] == "collective" else (task["rank"],)


def load_taskgraph(path: str | Path) -> TaskGraph:
    """Read and validate a taskgraph.json."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanFormatError(f"{p}: no such task graph") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanFormatError(f"{p}: not valid JSON ({e})") from None
    return check_taskgraph(doc, str(p))


def check_taskgraph(doc: Any, where: str = TASKGRAPH_FILE) -> TaskGraph:
    """The TaskGraph of `doc`, or PlanFormatError saying the first thing wrong with it."""

    def fail(msg: str) -> PlanFormatError:
        return PlanFormatError(f"{where}: {msg}")

    if not isinstance(doc, dict):
        raise fail(f"expected a JSON object, found {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise fail(f"unknown format {doc.get('format')!r} (this parc reads {FORMAT!r})")
    ranks, micro = doc.get("ranks"), doc.get("micro_batches", 1)
    if not isinstance(ranks, int) or ranks < 1:
        raise fail(f"ranks: expected an int >= 1, found {ranks!r}")
    if not isinstance(micro, int) or micro < 1:
        raise fail(f"micro_batches: expected an int >= 1, found {micro!r}")
    tasks: dict[str, dict] = {}
    for t in doc.get("tasks", []):
        if not isinstance(t, dict) or not isinstance(t.get("id"), str):
            raise fail(f"a task needs a string id: {t!r}")
        tid, kind = t["id"], t.get("kind")
        if tid in tasks:
            raise fail(f"task {tid!r} appears twice")
        if kind not in KINDS:
            raise fail(f"task {tid!r}: unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
        missing = [f for f in KINDS[kind] if f not in t]
        if missing:
            raise fail(f"task {tid!r} ({kind}): missing {', '.join(missing)}")
        if kind == "collective":
            group = t["group"]
            if not isinstance(group, list) or not group or len(set(group)) != len(group):
                raise fail(f"task {tid!r}: group must be a non-empty list of distinct ranks")
            if t["op"] not in COLLECTIVES:
                raise fail(f"task {tid!r}: unknown collective {t['op']!r}")
        for r in ranks_of(t) + ((t["peer"],) if kind in ("send", "recv") else ()):
            if not isinstance(r, int) or not 0 <= r < ranks:
                raise fail(f"task {tid!r}: rank {r!r} out of range 0..{ranks - 1}")
        tasks[tid] = t
    edges = []
    for e in doc.get("edges", []):
        if not (isinstance(e, list) and len(e) == 2 and all(x in tasks for x in e)):
            raise fail(f"edge {e!r}: expected [before, after] between known task ids")
        edges.append((e[0], e[1]))
    _check_acyclic(tasks, edges, fail)
    _check_pairs(tasks, fail)
    order = _check_order(doc.get("order"), tasks, ranks, fail)
    _check_runs(tasks, edges, order, fail)
    _check_p2p_order(tasks, order, fail)
    mesh = doc.get("mesh", [])
    if not (isinstance(mesh, list) and all(isinstance(n, int) and n >= 1 for n in mesh)
            and (not mesh or int(np.prod(mesh)) == ranks)):
        raise fail(f"mesh: expected a list of axis sizes whose product is {ranks}, found {mesh!r}")
    granularity = doc.get("granularity", TASK)
    if granularity not in (TASK, STAGE):
        raise fail(f"granularity: expected {TASK!r} or {STAGE!r}, found {granularity!r}")
    stages = tuple(doc.get("stages", []))
    if granularity == STAGE and not all(isinstance(s, dict) and isinstance(s.get("devices"), list) for s in stages):
        raise fail("a stage-level task graph needs the devices each stage stands for (stages[].devices)")
    folds = doc.get("folds", {})
    if not isinstance(folds, dict) or not all(
            isinstance(k, str) and k.isdigit() and int(k) < ranks and isinstance(v, (int, float)) and v >= 0
            for k, v in folds.items()):
        raise fail(f"folds: expected {{rank: seconds >= 0}} for ranks 0..{ranks - 1}, found {folds!r}")
    hosts = doc.get("hosts", [])
    flat = [r for h in hosts for r in h] if isinstance(hosts, list) and all(isinstance(h, list) for h in hosts) else None
    if flat is None or not all(isinstance(r, int) and 0 <= r < ranks for r in flat) or len(set(flat)) != len(flat):
        raise fail(f"hosts: expected lists of distinct ranks 0..{ranks - 1}, each rank on one host, found {hosts!r}")
    for tid, t in tasks.items():
        shared = t.get("shared_s")
        if shared is not None and not (isinstance(shared, dict) and all(
                isinstance(k, str) and k.isdigit() and int(k) >= 1 and isinstance(v, (int, float)) and v >= 0
                for k, v in shared.items())):
            raise fail(f"task {tid!r}: shared_s: expected {{count of ranks computing: seconds >= 0}}, found {shared!r}")
    return TaskGraph(ranks, micro, stages, tasks, tuple(edges), order, tuple(mesh), granularity,
                     {int(k): float(v) for k, v in folds.items()}, tuple(tuple(h) for h in hosts))


def _check_acyclic(tasks, edges, fail) -> None:
    succ: dict[str, list[str]] = {t: [] for t in tasks}
    indeg = dict.fromkeys(tasks, 0)
    for a, b in edges:
        succ[a].append(b)
        indeg[b] += 1
    ready = [t for t, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        t = ready.pop()
        seen += 1
        for u in succ[t]:
            indeg[u] -= 1
            if indeg[u] == 0:
                ready.append(u)
    if seen != len(tasks):
        stuck = sorted(t for t, d in indeg.items() if d > 0)[0]
        raise fail(f"the edges have a cycle (through task {stuck!r})")


def _check_pairs(tasks, fail) -> None:
    sends = {(t["rank"], t["peer"], t["tensor"], t.get("micro_batch")) for t in tasks.values() if t["kind"] == "send"}
    recvs = {(t["peer"], t["rank"], t["tensor"], t.get("micro_batch")) for t in tasks.values() if t["kind"] == "recv"}
    for src, dst, tensor, mb in sorted(sends ^ recvs, key=str):
        side = "send" if (src, dst, tensor, mb) in sends else "recv"
        raise fail(f"{side} of {tensor!r} (micro-batch {mb}) from rank {src} to rank {dst} has no matching "
                   f"{'recv' if side == 'send' else 'send'}")


def _check_p2p_order(tasks, order, fail) -> None:
    """Between two ranks, the sender's sends come in the order the receiver's receives do: a
    transport without tags (NCCL's send/recv) matches them by position alone."""
    seqs: dict[tuple[str, int, int], list] = {}
    for r, ids in order.items():
        for tid in ids:
            t = tasks[tid]
            if t["kind"] in ("send", "recv"):
                pair = (r, t["peer"]) if t["kind"] == "send" else (t["peer"], r)
                seqs.setdefault((t["kind"], *pair), []).append((t["tensor"], t.get("micro_batch")))
    for (kind, src, dst), sent in sorted(seqs.items()):
        if kind != "send":
            continue
        got = seqs.get(("recv", src, dst), [])
        for k, (a, b) in enumerate(zip(sent, got)):
            if a != b:
                raise fail(f"rank {src} sends {a[0]!r} (micro-batch {a[1]}) to rank {dst} as its transfer {k}, "
                           f"but rank {dst} receives {b[0]!r} (micro-batch {b[1]}) there: transfers between "
                           f"two ranks must come in the same order on both")


def _check_order(order, tasks, ranks, fail) -> dict[int, tuple[str, ...]]:
    if not isinstance(order, dict):
        raise fail("order: expected {rank: [task ids]}")
    out = {}
    for r in range(ranks):
        ids = order.get(str(r), [])
        want = {tid for tid, t in tasks.items() if r in ranks_of(t)}
        if len(ids) != len(set(ids)) or set(ids) != want:
            extra, missing = sorted(set(ids) - want), sorted(want - set(ids))
            raise fail(f"order of rank {r}: must list each of its tasks once"
                       + (f"; not its tasks: {extra[:3]}" if extra else "")
                       + (f"; missing: {missing[:3]}" if missing else ""))
        out[r] = tuple(ids)
    return out


def _check_runs(tasks, edges, order, fail) -> None:
    """Run the static orders: a task runs when it is next on every rank it involves and all its
    predecessors have run. Everything must run; otherwise the orders deadlock."""
    preds: dict[str, set[str]] = {t: set() for t in tasks}
    for a, b in edges:
        preds[b].add(a)
    pos = dict.fromkeys(order, 0)
    done: set[str] = set()
    progress = True
    while progress:
        progress = False
        for r, ids in order.items():
            while pos[r] < len(ids):
                tid = ids[pos[r]]
                t = tasks[tid]
                if not preds[tid] <= done:
                    break
                if any(pos[q] >= len(order[q]) or order[q][pos[q]] != tid for q in ranks_of(t)):
                    break
                for q in ranks_of(t):
                    pos[q] += 1
                done.add(tid)
                progress = True
    if len(done) != len(tasks):
        r = next(r for r, ids in order.items() if pos[r] < len(ids))
        tid = order[r][pos[r]]
        waiting = sorted(preds[tid] - done)
        why = f"waits for {waiting[0]!r}" if waiting else "waits for its group"
        raise fail(f"the static orders deadlock: rank {r} is stuck at task {tid!r}, which {why}")


def last_of_micro(order: list[Mapping[str, Any]]) -> dict[int, int]:
    """Microbatch -> the position in a rank's `order` of its last task of that microbatch (where
    the executor folds the microbatch into the step's sums and lets its values go)."""
    return {t["micro_batch"]: pos for pos, t in enumerate(order) if t.get("micro_batch") is not None}


def last_uses(order: list[Mapping[str, Any]], program) -> list[list[str]]:
    """Per task of a rank's order, the values of its microbatch that no later task reads: the
    executor frees them after it runs (and the simulator counts them freed). State, and what the
    microbatch accumulation reads, stay. `program`: the rank's `plandir.Program`."""
    keep = {r["name"] for r in program.residents if r["kind"] != "recv"} | set(program.accumulate)
    keep |= {src for src, *_ in program.accumulate.values()}
    last: dict[tuple[str, Any], int] = {}
    once: set[str] = set()  # read by a task outside the microbatches (the apply part)
    for pos, t in enumerate(order):
        for name in reads(t):
            last[name, t.get("micro_batch")] = pos
            if t.get("micro_batch") is None:
                once.add(name)
    out: list[list[str]] = [[] for _ in order]
    for (name, mb), pos in last.items():
        if name not in keep and (mb is None or name not in once):
            out[pos].append(name)
    return out


def reads(t: Mapping[str, Any]) -> list[str]:
    """The local values a task reads."""
    kind = t["kind"]
    return (list(t["inputs"]) if kind == "compute" else [t["src"]] if kind == "collective"
            else [t["local"]] if kind in ("sink", "send") else [])
