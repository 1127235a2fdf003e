"""`parc run --trace FILE`: what every rank did in the last step, task by task, measured.

The file is the Chrome trace event format (a JSON object with `traceEvents`), which Perfetto
(ui.perfetto.dev) and chrome://tracing open: one process per rank, named with its stage, one
complete event ("ph": "X") per task of the rank's static order, in microseconds from the
earliest rank's start of the step. Each event's `args` hold what `parc simulate` priced the same
task at (`predicted_ms`, the task graph's `time_s`; a collective with a handoff also
its `handoff_ms`; a compute task on a host whose ranks share its cores, its time at the count
of ranks the simulation has computing beside it) and its micro-batch, so a task the cost model
misjudges shows beside its measured length; the rank's wait for its sends at the end of the step is one more event
(`send completion`), and so is each microbatch's fold into the step's sums (`fold mbK`).

A run on several hosts places each rank by its own wall clock: events compare within a rank, and
across hosts only as well as their clocks agree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from parc.errors import UsageError

FORMAT = "parc.trace/1"  # in `otherData`: how a file parc wrote is told from the user's own
SEND_COMPLETION = "send completion"
FOLD = "fold"  # a microbatch added into the step's sums


def check_output(path: str) -> None:
    """--trace FILE: a file parc may write: not a directory, in a directory that exists, and not
    a file of the user's (only a trace parc wrote before is replaced)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"--trace {path}: is a directory (expected a file to write the trace to)")
    if not p.parent.is_dir():
        raise UsageError(f"--trace {path}: the directory {p.parent} does not exist")
    if p.exists() and not _is_trace(p):
        raise UsageError(f"--trace {path}: the file exists and is not a trace parc wrote; not overwriting it")


def _is_trace(p: Path) -> bool:
    try:
        return json.loads(p.read_text()).get("otherData", {}).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def rank_events(rank: int, stage: int | None, order: Sequence[dict], spans: Sequence[tuple],
                fold_s: float = 0.0, simulated: Mapping[str, float] | None = None) -> list[dict]:
    """One rank's events: `spans` are (position in `order`, start, end) in seconds from the
    rank's start of the step (position -1: the wait for the sends), or (position, start, end,
    FOLD): the fold of the microbatch that ended at that task, which the task graph prices at
    `fold_s` (`TaskGraph.folds`). `simulated`: compute tasks' seconds as the simulation runs
    them where they differ from `time_s` (a host whose ranks share its cores:
    `stepsim.shared_times`). Times stay in seconds from the rank's start here; `write` places
    the ranks on one clock."""
    events = [{"name": "process_name", "ph": "M", "pid": rank,
               "args": {"name": f"rank {rank}" + (f" (stage {stage})" if stage is not None else "")}}]
    for pos, t0, t1, *what in spans:
        if what:
            task = order[pos]
            events.append({"name": f"{FOLD} mb{task.get('micro_batch')}", "cat": "compute", "ph": "X", "pid": rank,
                           "tid": 0, "ts": t0, "dur": t1 - t0,
                           "args": {"predicted_ms": round(fold_s * 1e3, 6), "micro_batch": task.get("micro_batch")}})
            continue
        if pos < 0:
            events.append({"name": SEND_COMPLETION, "cat": "send", "ph": "X", "pid": rank, "tid": 0,
                           "ts": t0, "dur": t1 - t0, "args": {}})
            continue
        task = order[pos]
        args = {"predicted_ms": round((simulated or {}).get(task["id"], task.get("time_s", 0.0)) * 1e3, 6)}
        if task.get("handoff_s"):
            args["handoff_ms"] = round(task["handoff_s"] * 1e3, 6)
        if task.get("micro_batch") is not None:
            args["micro_batch"] = task["micro_batch"]
        events.append({"name": task["id"], "cat": task["kind"], "ph": "X", "pid": rank, "tid": 0,
                       "ts": t0, "dur": t1 - t0, "args": args})
    return events


def write(path: str | Path, per_rank: Sequence[tuple[float, list[dict]]], step: int) -> None:
    """The trace file of `step` from every rank's (start of the step on its wall clock,
    `rank_events`), times in microseconds from the earliest start, written atomically."""
    origin = min((start for start, _ in per_rank), default=0.0)
    events = []
    for start, evs in per_rank:
        shift = start - origin  # small: the offsets keep their microseconds (an epoch time would not)
        for e in evs:
            if "ts" in e:
                e = {**e, "ts": round((shift + e["ts"]) * 1e6, 3), "dur": round(e["dur"] * 1e6, 3)}
            events.append(e)
    body = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"format": FORMAT, "step": step}}
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(body))
    tmp.replace(out)


def _events(path: str | Path) -> list[dict]:
    body = json.loads(Path(path).read_text())
    if body.get("otherData", {}).get("format") != FORMAT:
        raise UsageError(f"{path}: not a trace `parc run --trace` wrote")
    return body["traceEvents"]


def collective_seconds(path: str | Path) -> dict[str, float]:
    """Each collective of a trace file: the seconds from its last member's start to its last
    member's end, what `parc simulate` holds its members for ({task id: s})."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in _events(path):
        if e.get("ph") == "X" and e.get("cat") == "collective":
            spans.setdefault(e["name"], []).append((e["ts"], e["ts"] + e["dur"]))
    return {name: (max(b for _, b in s) - max(a for a, _ in s)) * 1e-6 for name, s in spans.items()}


def load(path: str | Path) -> dict:
    """A trace file back: {rank: [(task id, kind, measured s, predicted s)]} in each rank's order."""
    out: dict[int, list] = {}
    for e in _events(path):
        if e.get("ph") == "X":
            out.setdefault(e["pid"], []).append((e["name"], e["cat"], e["dur"] * 1e-6,
                                                 e["args"].get("predicted_ms", 0.0) * 1e-3))
    return out
