"""`make bench`: time and peak memory of zoo builds and of import + inspect, as a Markdown table.

Each measurement runs in a fresh process so its peak RSS is its own. Usage:
    python benchmarks/run.py [--models gpt-medium,gpt-6.7b,...] [--out out/bench.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = ["gpt-tiny", "gpt-medium", "gpt-2.7b", "gpt-6.7b", "moe-8e-380m", "moe-32e-10b",
           "bert-large", "t5-large", "vgg19", "resnet50-1m", "wr-12b", "unet", "dnabert"]

_CHILD = """
import json, resource, sys, time
t = time.perf_counter()
from parc.analysis.inspect import inspect_file
t_import = time.perf_counter()
r = inspect_file(sys.argv[1])
dt = time.perf_counter() - t_import
print(json.dumps({"seconds": dt, "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "parameters": r["parameters"], "nodes": r["nodes"], "flops": r["flops_forward"],
                  "act": r["activation_bytes_peak"], "norule": r["replicate_only_ops"]}))
"""


def run_timed(cmd: list[str]) -> tuple[float, str]:
    """Wall seconds and stdout of a child process."""
    t = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return time.perf_counter() - t, out.stdout


def disk_kib(path: Path) -> int:
    return sum(p.stat().st_blocks // 2 for p in path.parent.glob(path.name + "*"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(DEFAULT))
    ap.add_argument("--out", default="out/bench.md")
    args = ap.parse_args()
    parc = [sys.executable, "-m", "parc.cli.main"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = Path(tmp) / f"{name}.onnx"
            build_s, _ = run_timed([*parc, "models", "build", name, "-o", str(path)])
            out = subprocess.run([sys.executable, "-c", _CHILD, str(path)], check=True,
                                 capture_output=True, text=True).stdout
            r = json.loads(out)
            cli_s, _ = run_timed([*parc, "inspect", str(path), "--json"])
            rows.append((name, r["nodes"], r["parameters"], build_s, disk_kib(path), r["seconds"], cli_s,
                         r["rss_kib"], r["flops"], r["act"], r["norule"]))
            print(f"{name}: import+inspect {r['seconds']:.2f}s, peak {r['rss_kib'] / 1024:.0f} MiB",
                  file=sys.stderr)
            for p in Path(tmp).glob(f"{name}.onnx*"):
                p.unlink()
    head = (f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}\n\n"
            "| model | nodes | parameters | build s | disk KiB | import+inspect s | `parc inspect` s "
            "| peak RSS MiB | GFLOPs/fwd | act. peak GiB | replicate-only ops |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n")
    body = "".join(
        f"| {n} | {nodes} | {p / 1e6:,.1f}M | {b:.2f} | {d:,} | {s:.2f} | {c:.2f} | {rss / 1024:.0f} | "
        f"{(f or 0) / 1e9:,.0f} | {(a or 0) / 2**30:.2f} | {', '.join(nr) or '-'} |\n"
        for n, nodes, p, b, d, s, c, rss, f, a, nr in rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(head + body)
    print(head + body)


if __name__ == "__main__":
    main()
