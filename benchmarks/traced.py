"""A plan's step as `parc run --trace` measured it, beside what `parc simulate` priced: compute
per rank, collectives from their last member's arrival (by group size), and receives whose
message was already sent against those that waited for it. The figures docs/benchmarks.md
quotes for the handoff and the links' `step_ratio` come from this.

    python benchmarks/traced.py PLAN_DIR [--trace FILE] [--steps 8]

Without `--trace` it runs the plan (`parc run PLAN_DIR --steps N --trace`) and reads that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

PARC = [sys.executable, "-m", "parc.cli.main"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--trace", help="a trace `parc run --trace` wrote for this plan (default: run it)")
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    plan = Path(args.plan)
    trace = Path(args.trace) if args.trace else Path(tempfile.mkdtemp(prefix="parc-traced-")) / "trace.json"
    if not args.trace:
        subprocess.run([*PARC, "run", str(plan), "--steps", str(args.steps), "--trace", str(trace)],
                       check=True, capture_output=True)
    from parc.exec.trace import collective_seconds

    tasks = {t["id"]: t for t in json.loads((plan / "taskgraph.json").read_text())["tasks"]}
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    ms = 1e-3  # the trace is in microseconds

    compute: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    sent: dict[tuple, float] = {}
    for e in events:
        t = tasks.get(e["name"])
        if t is None:
            continue
        if t["kind"] == "compute":
            compute[e["pid"]][0] += e["dur"] * ms
            compute[e["pid"]][1] += e["args"].get("predicted_ms", 0.0)
        elif t["kind"] == "send":
            sent[t["rank"], t["peer"], t["tensor"], t.get("micro_batch")] = e["ts"]
    print(f"{plan}: compute per rank, traced / priced ms: "
          + ", ".join(f"{r} {m:.2f} / {p:.2f}" for r, (m, p) in sorted(compute.items())))

    by_size: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for name, took in collective_seconds(trace).items():
        t = tasks[name]
        by_size[len(t["group"])].append((took * 1e3, t["time_s"] * 1e3, t.get("handoff_s", 0.0) * 1e3))
    for n, rows in sorted(by_size.items()):
        print(f"  {len(rows)} collectives of {n} ranks, from the last arrival: sum {sum(r[0] for r in rows):.2f} ms "
              f"(median {statistics.median(r[0] for r in rows):.3f}) against figures {sum(r[1] for r in rows):.2f} ms "
              f"(median {statistics.median(r[1] for r in rows):.3f}), handoff {rows[0][2]:.3f} ms where charged")

    there, waited = [], []
    for e in events:
        t = tasks.get(e["name"])
        if t is None or t["kind"] != "recv":
            continue
        posted = sent.get((t["peer"], t["rank"], t["tensor"], t.get("micro_batch")))
        if posted is None:
            continue
        took = (e["ts"] + e["dur"] - max(posted, e["ts"])) * ms
        (there if posted <= e["ts"] else waited).append((took, t["time_s"] * 1e3))
    for label, rows in (("message already sent", there), ("waited for its send (from the send)", waited)):
        if rows:
            print(f"  {len(rows)} recvs, {label}: median {statistics.median(r[0] for r in rows):.3f} ms, "
                  f"priced {statistics.median(r[1] for r in rows):.3f} ms")


if __name__ == "__main__":
    main()
