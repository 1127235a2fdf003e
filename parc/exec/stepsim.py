"""The step simulator: a discrete-event replay of taskgraph.json (`parc simulate`).

It runs every rank's static order the way the executor (`parc.exec.runner`) does, with each
task's `time_s` from `parc plan` (`parc.passes.timing`):

- a rank runs its tasks one at a time, in its order: compute, collectives and receives block it;
- a collective starts when every member has reached it, and ends for all of them together;
  the first one after compute also pays its link's handoff (`handoff_s`: on a host whose ranks
  outnumber its cores, how far apart members that computed side by side arrive), in the
  proportion the host was crowded while its members computed (`_settle`): in full when every
  rank of the host computed beside them, as `parc profile` measured it, not at all when no
  more computed than the count their time stops growing at;
- a send is posted and the rank goes on; its message moves once the receiver has posted the
  matching recv (rendezvous, as MPI does for large messages) and the recv ends when it has
  arrived, with no handoff (a recv whose message was already sent is traced far below the
  link's handoff: benchmarks/LOG.md, "Figures moved out of code comments");
  a rank's step ends when its last task has and its sends have completed (the executor waits
  for them at the end of the step);
- sources and sinks take no time;
- a rank with microbatches folds each into the step's sums after its last task of it
  (`TaskGraph.folds`), as compute;
- on a host whose ranks share its cores (`TaskGraph.hosts`), a compute task runs at the rate
  of the count of that host's ranks computing beside it (`shared_times`).

So communication overlaps compute only where the task graph lets it: a send's transfer runs while
its sender computes (hidden); a collective or a recv holds its rank (exposed).

It reports the step time (the last rank's end), per rank busy (compute, communication), the time
each rank waits (for a peer, a message or the end of the step: the bubble), communication exposed
and hidden, the critical path (the chain of tasks that ends last, back to the start), and per
rank peak memory when the plan has its programs (`peak_bytes`: the resident state plus the values
alive, freed after their last reader as the executor frees them).

Plans written with `--no-programs` have a stage-level task graph (`granularity: stage`, from
`parc.passes.schedule.stage_taskgraph`): one simulated rank per stage stands for the stage's ranks,
which run the same program; the report expands it back to every rank.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parc.errors import PlanFormatError
from parc.ir.liveness import interval_peak
from parc.plandir.simulation import COMM, COMPUTE, TIMELINE_RANKS, WAIT
from parc.plandir.taskgraph import TaskGraph, last_of_micro


@dataclass
class RankStats:
    rank: int
    end_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0  # collectives and receives: the rank is held (exposed)
    hidden_s: float = 0.0  # its sends' transfers, while it went on
    peak_bytes: int | None = None

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class Simulation:
    step_time_s: float
    ranks: list[RankStats]
    spans: dict[int, list[tuple[float, float, str, str]]]  # rank -> (start, end, kind, task id)
    critical_path: list[str]
    stage_of: dict[int, int] = field(default_factory=dict)
    represents: dict[int, list[int]] = field(default_factory=dict)  # simulated rank -> real ranks

    @property
    def wait_s(self) -> list[float]:
        return [max(0.0, self.step_time_s - r.busy_s) for r in self.ranks]  # not -1e-19

    @property
    def bubble_s(self) -> float:
        """The mean time a rank is not busy within the step (over real ranks: a stage-level
        graph's rank weighs as the devices it stands for)."""
        weights = [len(self.represents.get(r.rank, [r.rank])) for r in self.ranks]
        return sum(w * x for w, x in zip(weights, self.wait_s)) / sum(weights)

    @property
    def exposed_comm_s(self) -> float:
        return max(r.comm_s for r in self.ranks)

    @property
    def hidden_comm_s(self) -> float:
        return max(r.hidden_s for r in self.ranks)

    def to_json(self, timeline_ranks: int = TIMELINE_RANKS) -> dict[str, Any]:
        """Stable keys (docs/simulate.md). Per-rank figures of every real rank; the timeline of at
        most `timeline_ranks` simulated ranks."""
        rows = []
        for r in self.ranks:
            for real in self.represents.get(r.rank, [r.rank]):
                rows.append({"rank": real, "stage": self.stage_of.get(r.rank, 0), "busy_s": r.busy_s,
                             "compute_s": r.compute_s, "comm_s": r.comm_s, "hidden_comm_s": r.hidden_s,
                             "wait_s": max(0.0, self.step_time_s - r.busy_s), "end_s": r.end_s,
                             "peak_bytes": r.peak_bytes})
        rows.sort(key=lambda row: row["rank"])
        shown = sorted(self.spans, key=lambda r: (r not in _stage_leads(self.stage_of), r))[:timeline_ranks]
        timeline = {str(self.represents.get(r, [r])[0]): [[a, b, kind, label] for a, b, kind, label in self.spans[r]]
                    for r in sorted(shown)}
        return {"step_time_s": self.step_time_s, "bubble_s": self.bubble_s,
                "exposed_comm_s": self.exposed_comm_s, "hidden_comm_s": self.hidden_comm_s,
                "ranks": rows, "timeline": timeline, "critical_path": self.critical_path,
                "granularity": "stage" if self.represents else "task"}


def _stage_leads(stage_of: Mapping[int, int]) -> set[int]:
    first: dict[int, int] = {}
    for r, s in sorted(stage_of.items()):
        first.setdefault(s, r)
    return set(first.values())


def _key(src: int, dst: int, t: Mapping) -> tuple:
    return (src, dst, t["tensor"], t.get("micro_batch"))


def simulate(graph: TaskGraph, keep_spans: bool = True) -> Simulation:
    """Replay one step of `graph` (see the module docstring); `keep_spans`: record every task's
    span. On hosts whose ranks share their cores (`graph.hosts`), each compute task takes the
    time its host's concurrency gives it (`shared_times`)."""
    times, crowd = _settle(graph) if graph.hosts else (None, None)
    return _replay(graph, keep_spans, times, crowd=crowd)


SHARING_ROUNDS = 24  # replays at most to settle the compute times on shared hosts
SHARING_SETTLED = 1e-4  # ... until no task's time moves by more than this fraction


def shared_times(graph: TaskGraph) -> dict[str, float]:
    """The seconds of every compute task on a host whose ranks share its cores (`_settle`)."""
    return _settle(graph)[0]


def _settle(graph: TaskGraph) -> tuple[dict[str, float], dict[str, float]]:
    """The seconds of every compute task on a host whose ranks share its cores, as processor
    sharing gives them: while a ranks of its host compute (itself included) a task runs at the
    rate of its time at a, interpolated linearly between the counts its `shared_s` has (below
    the least of them, that one's time) and its `time_s` at the host's full count. A rank
    that waits for a message or a collective gives its core up (`parc.exec.comm` yields, then
    naps on its doorbell), so a pipeline stage computing while the other waits runs faster
    than with every rank computing, which is what `time_s` is priced at.

    Which tasks overlap depends on their times, so the times are found by replaying the step
    with the last ones, finding the time each task's share of the work takes at the rates that
    replay gave it, and moving halfway there, until they settle (`SHARING_ROUNDS`,
    `SHARING_SETTLED`).

    Also each such task's crowding in the last replay: how much of the slowdown from one rank
    computing to all of them (its curve) its span saw, from 0 to 1 (1 where the curve is flat)."""
    host_of = {r: h for h, ranks in enumerate(graph.hosts) for r in ranks}
    curves: dict[str, np.ndarray] = {}  # task -> its seconds with 1..n of its host's ranks computing
    for tid, t in graph.tasks.items():
        if t["kind"] == "compute" and t["rank"] in host_of and t.get("shared_s") and t["time_s"] > 0:
            n = len(graph.hosts[host_of[t["rank"]]])
            points = sorted((int(a), float(v)) for a, v in t["shared_s"].items() if int(a) < n and v > 0)
            points.append((n, float(t["time_s"])))
            curves[tid] = np.interp(np.arange(1, n + 1), [a for a, _ in points], [v for _, v in points])
    times = {tid: float(graph.tasks[tid]["time_s"]) for tid in curves}
    crowd: dict[str, float] = {}
    if not curves:
        return times, crowd
    for _ in range(SHARING_ROUNDS):
        busy: dict[int, list[tuple[float, float, str | None]]] = defaultdict(list)
        _replay(graph, False, times, busy)
        moved = 0.0
        for ranks in graph.hosts:
            spans = [(a, b, tid) for r in ranks for a, b, tid in busy.get(r, ()) if b > a]  # folds: tid None
            mine = [(a, b, tid) for a, b, tid in spans if tid in curves]
            if not mine:
                continue
            # how many of the host's ranks compute between two span ends, and how long the host
            # has spent at each count up to each end (so that a task's span costs two lookups)
            edges = np.array(sorted({x for a, b, _ in spans for x in (a, b)}))
            delta = np.zeros(len(edges))
            np.add.at(delta, np.searchsorted(edges, [a for a, _, _ in spans]), 1)
            np.add.at(delta, np.searchsorted(edges, [b for _, b, _ in spans]), -1)
            count = np.rint(np.cumsum(delta)[:-1]).astype(int)
            widths = np.diff(edges)
            at = np.zeros((len(ranks) + 1, len(edges)))
            for c in range(1, len(ranks) + 1):
                at[c, 1:] = np.cumsum(np.where(count == c, widths, 0.0))
            i = np.searchsorted(edges, [a for a, _, _ in mine])
            j = np.searchsorted(edges, [b for _, b, _ in mine])
            spent = (at[1:, j] - at[1:, i]).T  # per task, its span's time at each count 1..n
            rates = 1.0 / np.stack([curves[tid] for _, _, tid in mine])
            # the share of each task done over its span at those rates: the time that does it all
            done = np.sum(spent * rates, axis=1)
            curve = np.stack([curves[tid] for _, _, tid in mine])
            rise = curve[:, -1] - curve[:, 0]
            share = spent / np.maximum(spent.sum(axis=1, keepdims=True), 1e-300)
            seen = np.sum(share * (curve - curve[:, :1]), axis=1) / np.where(rise > 0, rise, 1.0)
            for (a, b, tid), d, c, r in zip(mine, done, seen, rise):
                crowd[tid] = float(np.clip(c, 0.0, 1.0)) if r > 0 else 1.0
                new = (b - a) / d
                moved = max(moved, abs(new - times[tid]) / times[tid])
                times[tid] = (times[tid] + new) / 2
        if moved <= SHARING_SETTLED:
            break
    return times, crowd


def _replay(graph: TaskGraph, keep_spans: bool, times: Mapping[str, float] | None = None,
            busy: dict[int, list] | None = None, crowd: Mapping[str, float] | None = None) -> Simulation:
    """`simulate`'s replay: compute task `tid` takes `times[tid]` where given, else its
    `time_s`; `busy` (rank -> list) collects each rank's compute spans (start, end, task id, or
    None for a fold); a collective after compute task `tid` pays `crowd[tid]` of its handoff
    (all of it where `crowd` has no entry)."""
    tasks = graph.tasks
    for tid, t in tasks.items():
        if "time_s" not in t:
            raise PlanFormatError(f"taskgraph.json: task {tid!r} has no time_s (a plan from an older parc: "
                                  "plan it again with this parc)")
    ranks = sorted(graph.order)
    orders = {r: graph.order[r] for r in ranks}
    pos = dict.fromkeys(ranks, 0)
    clock = dict.fromkeys(ranks, 0.0)
    stats = {r: RankStats(r) for r in ranks}
    spans: dict[int, list] = {r: [] for r in ranks}
    cause: dict[str, str | None] = {}  # task (per rank for collectives: id@rank) -> the task that let it start
    last: dict[int, str | None] = dict.fromkeys(ranks, None)  # each rank's last finished task
    arrived: dict[str, list[tuple[int, float]]] = defaultdict(list)
    posted: dict[tuple, tuple[float, str | None, str]] = {}  # send key -> (post time, what preceded it, its id)
    waiting: dict[tuple, int] = {}  # send key -> the rank blocked on its recv
    send_done: dict[int, list[tuple[float, str]]] = defaultdict(list)
    ready = deque(ranks)
    folds = {r: {pos: graph.folds[r] for pos in last_of_micro([tasks[i] for i in orders[r]]).values()}
             for r in ranks if graph.folds.get(r)}

    def advance(r: int) -> None:
        """Rank r is done with its current task: on to the next, after folding a microbatch
        that ended there."""
        fold = folds[r].get(pos[r], 0.0) if r in folds else 0.0
        pos[r] += 1
        if fold:
            span(r, clock[r], clock[r] + fold, COMPUTE, f"{last[r]} (fold)")
            if busy is not None:
                busy[r].append((clock[r], clock[r] + fold, None))
            stats[r].compute_s += fold
            clock[r] += fold

    def span(r: int, a: float, b: float, kind: str, label: str) -> None:
        if keep_spans and b > a:
            spans[r].append((a, b, kind, label))

    def handoff_share(r: int) -> float:
        """The share of a handoff rank r's current task pays: 0 where the rank comes to it from
        communication, else its compute's crowding (1 at the start of the step)."""
        p = pos[r] - 1
        while p >= 0 and tasks[orders[r][p]]["kind"] in ("source", "sink", "send"):
            p -= 1
        if p < 0:
            return 1.0
        before = orders[r][p]
        if tasks[before]["kind"] != "compute":
            return 0.0
        return 1.0 if crowd is None else crowd.get(before, 1.0)

    def finish_recv(r: int, t: Mapping, tid: str) -> None:
        key = _key(t["peer"], r, t)
        sent_at, sent_cause, send_id = posted[key]
        begin = max(sent_at, clock[r])
        held = t["time_s"]
        end = begin + held
        span(r, clock[r], begin, WAIT, tid)
        span(r, begin, end, COMM, tid)
        stats[r].comm_s += held
        stats[t["peer"]].hidden_s += t["time_s"]
        send_done[t["peer"]].append((end, send_id))
        # the transfer starts when the later of the send and the recv is posted
        cause[tid] = cause[send_id] = sent_cause if sent_at >= clock[r] else last[r]
        clock[r] = end
        last[r] = tid
        advance(r)

    while ready:
        r = ready.popleft()
        order = orders[r]
        while pos[r] < len(order):
            tid = order[pos[r]]
            t = tasks[tid]
            kind = t["kind"]
            if kind == "collective":
                members = t["group"]
                if len(members) == 1:
                    arrivals = [(r, clock[r])]
                else:
                    arrivals = arrived[tid]
                    if all(m != r for m, _ in arrivals):
                        arrivals.append((r, clock[r]))
                    if len(arrivals) < len(members):
                        break  # wait for the others; the last to arrive completes it for all
                    del arrived[tid]
                start = max(at for _, at in arrivals)
                held = t["time_s"] + t.get("handoff_s", 0.0) * max(handoff_share(m) for m, _ in arrivals)
                end = start + held
                before = last[max(arrivals, key=lambda x: x[1])[0]]  # what the last arrival ran
                for m, at in arrivals:
                    span(m, at, start, WAIT, tid)
                    span(m, start, end, COMM, tid)
                    stats[m].comm_s += held
                    cause[f"{tid}@{m}"] = before
                    clock[m] = end
                    last[m] = f"{tid}@{m}"
                    advance(m)
                    if m != r:
                        ready.append(m)
                continue
            if kind == "recv":
                key = _key(t["peer"], r, t)
                if key not in posted:
                    waiting[key] = r
                    break
                finish_recv(r, t, tid)
                continue
            if kind == "send":
                key = _key(r, t["peer"], t)
                posted[key] = (clock[r], last[r], tid)
                cause[tid] = last[r]
                advance(r)
                if key in waiting:
                    peer = waiting.pop(key)
                    rt_id = orders[peer][pos[peer]]
                    finish_recv(peer, tasks[rt_id], rt_id)
                    ready.append(peer)
                continue
            d = t["time_s"] if times is None else times.get(tid, t["time_s"])
            if kind == "compute":
                span(r, clock[r], clock[r] + d, COMPUTE, tid)
                stats[r].compute_s += d
                if busy is not None:
                    busy[r].append((clock[r], clock[r] + d, tid))
            cause[tid] = last[r]
            clock[r] += d
            last[r] = tid
            advance(r)
    stuck = [r for r in ranks if pos[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        raise PlanFormatError(f"taskgraph.json: rank {r} never gets past task {orders[r][pos[r]]!r} (the orders deadlock)")
    ends: dict[int, tuple[float, str | None]] = {}
    for r in ranks:
        end, what = clock[r], last[r]
        for at, label in send_done.get(r, []):
            if at > end:
                end, what = at, label
        span(r, clock[r], end, WAIT, "sends")
        stats[r].end_s = end
        ends[r] = (end, what)
    step = max(end for end, _ in ends.values())
    for r in ranks:
        span(r, ends[r][0], step, WAIT, "end of step")
    path: list[str] = []
    node = max(ends.values(), key=lambda e: e[0])[1]
    while node is not None and len(path) < 1_000_000:
        path.append(node)
        node = cause.get(node)
    path.reverse()
    return Simulation(step, [stats[r] for r in ranks], spans, [p.split("@")[0] for p in path])


def held_peak(graph: TaskGraph, rank: int, program) -> int:
    """The most bytes of tensors rank `rank` holds at once in a step, replaying its order the way
    the executor keeps values (`runner.Rank.step`) and counting them as it does (`held_bytes`:
    distinct arrays). Each value made is a new array: the rank's state; each microbatch's values
    until their last reader (`last_uses`); at a microbatch's end its accumulations (a sum is a new
    array, `last` the value itself, `concat` a list of the values, concatenated into a new array
    after the last microbatch) and its values for the apply part; the outputs handed out (the
    values themselves); send buffers until the end of the step (the value itself, or a new array
    when the send cuts the receiver's shard).

    The count is taken after each task has made its values, before it frees any: the replay
    finds the tasks between which each array is held and `parc.ir.liveness.interval_peak` sweeps
    those intervals, one position a task."""
    from parc.plandir import local_bytes as resident_bytes
    from parc.plandir.taskgraph import last_uses

    order = [graph.tasks[t] for t in graph.order[rank]]
    free_after = last_uses(order, program)
    last_of_mb = last_of_micro(order)
    micro = len(last_of_mb)
    size: list[int] = []  # bytes of each array made, by its id
    first: list[int] = []  # by array id, the first task whose count includes it
    last: list[int | None] = []  # the last such task (before `first`: none); None: still held
    clock = 0  # the task whose count what is held now is in: this one, the next once counted

    def made(nbytes: int) -> int:
        size.append(int(nbytes))
        first.append(clock)
        last.append(None)
        return len(size) - 1

    live: dict[int, int] = {}  # array id -> how many places hold it (an array counts once)

    def hold(i: int | None) -> None:
        if i is not None:
            assert i in live or last[i] is None, "an array released is held again"
            live[i] = live.get(i, 0) + 1

    def release(i: int | None) -> None:
        if i is not None:
            live[i] -= 1
            if not live[i]:
                del live[i]
                last[i] = clock - 1

    def put(holder: dict, key: str, i: int) -> None:
        hold(i)
        old = holder.get(key)
        holder[key] = i
        for j in old if isinstance(old, list) else [old]:
            release(j)

    shared: dict[str, int] = {}
    for r in program.residents:
        if r["kind"] not in ("data", "recv"):
            put(shared, r["name"], made(resident_bytes(r)))
    envs: dict[Any, dict[str, int]] = {}
    sums: dict[str, Any] = {}  # name -> array id, or a list of ids (concat)
    latest: dict[str, int] = {}
    outputs: dict[str, int] = {}
    folded = 0

    def lookup(env: dict, name: str) -> int | None:
        for holder in (env, shared, latest):
            if name in holder:
                return holder[name]
        return None

    for pos, t in enumerate(order):
        mb = t.get("micro_batch")
        env = shared if mb is None else envs.setdefault(mb, {})
        kind = t["kind"]
        if kind == "compute":
            for name, nbytes in zip(t["outputs"], t.get("out_bytes", [0] * len(t["outputs"]))):
                put(env, name, made(nbytes))
        elif kind in ("collective", "source"):
            put(env, t["dst"] if kind == "collective" else t["tensor"], made(t.get("out_bytes", [0])[0]))
        elif kind == "recv":
            put(env, t["local"], made(t.get("bytes", 0)))
        elif kind == "send":  # held until the end of the step
            held = lookup(env, t["local"])
            hold(made(t.get("bytes", 0)) if "slice" in t or held is None else held)
        elif kind == "sink":
            held = lookup(env, t["local"])
            if held is not None:
                put(outputs, t["tensor"], held)
        clock = pos + 1
        for name in free_after[pos]:
            release(env.pop(name, None))
        if mb is not None and last_of_mb.get(mb) == pos:
            for name, (src, how, *_dim) in program.accumulate.items():
                x = env.get(src)
                if x is None:
                    continue
                if how == "sum":
                    put(sums, name, made(size[x]))
                elif how == "last":
                    put(sums, name, x)
                else:
                    hold(x)
                    sums.setdefault(name, []).append(x)
            folded += 1
            for i in latest.values():
                release(i)
            latest = envs.pop(mb)
            if folded == micro:
                for name, (_src, how, *_dim) in program.accumulate.items():
                    if name in sums:
                        x = sums[name]
                        put(shared, name, made(sum(size[i] for i in x)) if how == "concat" else x)
    held_to_end = len(order) - 1
    return interval_peak(size, first, [held_to_end if j is None else j for j in last]).nbytes


def simulate_plan(plan_dir, keep_spans: bool = True) -> Simulation:
    """Simulate the task graph of a plan directory (see the module docstring), with each rank's
    peak of tensors held when the plan has its programs."""
    from pathlib import Path

    from parc.plandir import TASKGRAPH_FILE, plan_path
    from parc.plandir.taskgraph import load_taskgraph

    plan_path(plan_dir)  # a missing or wrong directory says so first
    path = Path(plan_dir) / TASKGRAPH_FILE
    if not path.is_file():
        raise PlanFormatError(f"{plan_dir}: no {TASKGRAPH_FILE} (a plan from an older parc: plan it again)")
    graph = load_taskgraph(path)
    programs = None
    if not graph.represents():
        from parc.plandir import load_program

        programs = {r: load_program(plan_dir, r) for r in range(graph.ranks)}
    return simulate_graph(graph, keep_spans, programs)


def simulate_graph(graph: TaskGraph, keep_spans: bool = True, programs: Mapping | None = None) -> Simulation:
    """`simulate`, with the stages and (a stage-level graph) the devices each rank stands for;
    `programs` (rank -> `plandir.Program`) turns on the memory count."""
    sim = simulate(graph, keep_spans=keep_spans)
    if programs is not None:
        for stats in sim.ranks:
            stats.peak_bytes = held_peak(graph, stats.rank, programs[stats.rank])
    sim.stage_of = {r: s["id"] for s in graph.stages for r in s["ranks"]}
    sim.represents = graph.represents()
    return sim
