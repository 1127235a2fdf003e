"""Planner time per model and level, and plan quality against the baselines, as a Markdown table.

Each zoo model's AdamW training step is built once (`parc models build NAME --train adamw`),
then `parc plan` runs in a fresh process per (devices, level) with a per-solve time limit.
Usage:
    python benchmarks/plan.py [--models gpt-tiny,resnet-tiny,unet-tiny] [--devices 2xa100-80g,4xa100-80g]
                              [--levels O2,O3] [--time-limit 10] [--out out/bench-plan.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETS = {"gpt-tiny": ["--set", "batch=32", "--set", "hidden=256", "--set", "seq=64"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt-tiny,resnet-tiny,unet-tiny")
    ap.add_argument("--devices", default="2xa100-80g,4xa100-80g")
    ap.add_argument("--levels", default="O2,O3")
    ap.add_argument("--time-limit", default="10")
    ap.add_argument("--out", default="out/bench-plan.md")
    args = ap.parse_args()
    parc = [sys.executable, "-m", "parc.cli.main"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            step = Path(tmp) / f"{name}.train.onnx"
            subprocess.run([*parc, "models", "build", name, *SETS.get(name, []), "--train", "adamw",
                            "-o", str(step)], check=True, capture_output=True)
            for devices in args.devices.split(","):
                for level in args.levels.split(","):
                    out = Path(tmp) / f"{name}-{devices}-{level}"
                    t = time.perf_counter()
                    subprocess.run([*parc, "plan", str(step), "--devices", devices, f"-{level}",
                                    "--time-limit", args.time_limit, "-o", str(out)],
                                   check=True, capture_output=True)
                    wall = time.perf_counter() - t
                    doc = json.loads((out / "plan.json").read_text())
                    best = doc["predicted"]["step_time_s"]
                    base = {k: v["step_time_s"] for k, v in doc["baselines"].items() if v["step_time_s"]}
                    rows.append((name, devices, level, doc["solver"]["nodes"], wall,
                                 "x".join(map(str, doc["mesh"]["shape"])), best, doc["solver"]["gap"], base))
                    print(f"{name} {devices} {level}: {wall:.1f} s", file=sys.stderr)
    names = sorted({k for r in rows for k in r[8]})
    head = (f"Machine: {platform.machine()}, Python {platform.python_version()}, "
            f"per-solve time limit {args.time_limit} s\n\n"
            "| model | devices | level | problem nodes | plan s | mesh | predicted ms | gap | "
            + " | ".join(f"{n} / plan" for n in names) + " |\n"
            "|---|---|---|---:|---:|---|---:|---:|" + "---:|" * len(names) + "\n")
    body = "".join(
        f"| {m} | {d} | {lv} | {nodes} | {wall:.1f} | {mesh} | {best * 1e3:.3f} | {gap:.1%} | "
        + " | ".join(f"{base[n] / best:.3f}" if n in base else "-" for n in names) + " |\n"
        for m, d, lv, nodes, wall, mesh, best, gap, base in rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(head + body)
    print(head + body)


if __name__ == "__main__":
    main()
