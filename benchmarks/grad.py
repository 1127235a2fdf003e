"""Time and peak memory of `parc grad` on large zoo models, as a Markdown table.

Each model is built by `parc models build` (weights: a sparse external file, all holes), then
`parc grad MODEL -o STEP --optimizer adamw` runs in a fresh process whose own peak RSS is read
from os.wait4. The step must not materialise the weights: its data file stays sparse too, so
the disk column is small next to the apparent size. Usage:

    python benchmarks/grad.py [--models gpt-medium,gpt-6.7b,moe-32e-10b] [--out out/bench-grad.md]
                              [--profile DIR]   # also write a cProfile of each `parc grad` run
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

DEFAULT = ["gpt-medium", "gpt-6.7b", "moe-32e-10b"]
TARGET = {"gpt-6.7b": (60.0, 4096.0)}  # the issue's budget: seconds, peak RSS MiB


@dataclass
class Row:
    model: str
    nodes_before: int
    nodes_after: int | None = None
    seconds: float | None = None
    rss_mib: float | None = None
    disk_mib: float | None = None  # blocks actually allocated, model + data file
    apparent_gib: float | None = None  # file sizes, holes included
    error: str = ""


def run_measured(cmd: list[str]) -> tuple[int, float, float, str]:
    """Exit code, wall seconds, peak RSS (MiB) and stderr of a child process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read() if proc.stderr else ""
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, seconds, usage.ru_maxrss / 1024, stderr  # ru_maxrss: KiB on Linux


def files_of(path: Path) -> list[Path]:
    return [p for p in (path, path.parent / (path.name + ".data")) if p.exists()]


def node_count(path: Path) -> int:
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def measure(name: str, tmp: Path, profile: Path | None) -> Row:
    parc = [sys.executable, "-m", "parc.cli.main"]
    model, step = tmp / f"{name}.onnx", tmp / f"{name}.step.onnx"
    subprocess.run([*parc, "models", "build", name, "-o", str(model)], check=True, capture_output=True)
    row = Row(name, node_count(model))
    cmd = [*parc, "grad", str(model), "-o", str(step), "--optimizer", "adamw", "--weight-decay", "0.01"]
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "cProfile", "-o", str(profile / f"{name}.prof"), "-m", "parc.cli.main",
               *cmd[3:]]
    code, row.seconds, row.rss_mib, stderr = run_measured(cmd)
    if code != 0:
        row.error = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {code}"
    else:
        row.nodes_after = node_count(step)
        out = files_of(step)
        row.disk_mib = sum(p.stat().st_blocks * 512 for p in out) / 2**20
        row.apparent_gib = sum(p.stat().st_size for p in out) / 2**30
    for p in files_of(model) + files_of(step):
        p.unlink()
    return row


def table(rows: list[Row]) -> str:
    head = (f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
            "`parc grad --optimizer adamw`, one fresh process per model\n\n"
            "| model | nodes before | nodes after | seconds | peak RSS MiB | output on disk MiB "
            "| output apparent GiB | note |\n|---|---:|---:|---:|---:|---:|---:|---|\n")
    body = ""
    for r in rows:
        note = r.error
        if not note and r.model in TARGET:
            s, m = TARGET[r.model]
            ok = r.seconds is not None and r.rss_mib is not None and r.seconds <= s and r.rss_mib <= m
            note = f"target {s:.0f} s / {m / 1024:.0f} GiB: {'met' if ok else 'MISSED'}"

        def fmt(x, spec):
            return "-" if x is None else format(x, spec)

        body += (f"| {r.model} | {r.nodes_before} | {fmt(r.nodes_after, 'd')} | {fmt(r.seconds, '.2f')} | "
                 f"{fmt(r.rss_mib, '.0f')} | {fmt(r.disk_mib, '.1f')} | {fmt(r.apparent_gib, '.1f')} | {note} |\n")
    return head + body


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT))
    ap.add_argument("--out", default="out/bench-grad.md")
    ap.add_argument("--profile", type=Path, help="write <model>.prof (cProfile) here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            row = measure(name, Path(tmp), args.profile)
            rows.append(row)
            print(f"{name}: {row.seconds:.2f} s, peak {row.rss_mib:.0f} MiB {row.error}", file=sys.stderr)
    text = table(rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
