"""Pipelined plans at scale: the issue's bars, each a whole `parc plan --no-programs` command.

    python benchmarks/pipeline_plans.py [--cases NAME ...] [--out DIR]

Per case: the cluster, what `parc plan` chose (stages x microbatches and the stage meshes, or
one mesh), its predicted step, the best one-mesh plan's, pipeline-uniform's and the best other
baseline's, the planning time of the whole command and its peak memory (the command and the
worker processes it forks). Figures are predictions of parc's cost model, not measured steps.
Slow (minutes per case on 2 cores): run it alone, not beside tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GPT_39B = ["--set", "layers=48", "--set", "hidden=8192", "--set", "ffn=32768", "--set", "heads=64"]
# name -> (zoo model, build options, devices or a cluster file's text, plan options)
CASES = {
    # Rhino fig. 9's PP-only setting: nodes joined by a slow network
    "gpt-2.7b/4x8xv100-32g/25gbe": ("gpt-2.7b", ["--set", "batch=32"],
                                    "nodes:\n  - gpus: 8xv100-32g\n    count: 4\ninter_link: 25gbe\n", ["-O2"]),
    # Rhino Table 1's device count for gpt-6.7b, with 16 GB devices and its full-parallelism batch
    "gpt-6.7b/2x8xv100-16g/batch64": ("gpt-6.7b", ["--set", "batch=64"], "2x8xv100-16g", []),
    # Alpa's GPT-39B on 8 nodes of 8 A100s, full search (one mesh and pipelines)
    "gpt-39b/8x8xa100-80g": ("gpt-6.7b", GPT_39B, "8x8xa100-80g", []),
    # what --pipeline auto adds to the planning time on 8 devices in 2 nodes (bar: at most 2x)
    "gpt-medium/2x4xa100-80g/off": ("gpt-medium", [], "2x4xa100-80g", ["--pipeline", "off"]),
    "gpt-medium/2x4xa100-80g/auto": ("gpt-medium", [], "2x4xa100-80g", []),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", help="keep the models and plans here (default: a temporary directory)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(a.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        print("| case | chose | predicted step | one mesh | pipeline-uniform | best other baseline | plan s | peak GiB |")
        print("|---|---|---|---|---|---|---|---|")
        for name in a.cases:
            print(_case(name, root), flush=True)


# runs argv, then prints the peak RSS (KiB) of the largest process it waited for (the plan
# command or one of the workers it forks) as the last line of stderr
_MEASURE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)")


def _case(name: str, root: Path) -> str:
    model, build, devices, extra = CASES[name]
    slug = name.replace("/", "_")
    onnx = root / f"{slug}.onnx"
    parc = [sys.executable, "-m", "parc.cli.main"]
    res = subprocess.run([*parc, "models", "build", model, *build, "--train", "adamw", "-o", str(onnx)],
                         capture_output=True, text=True)
    if res.returncode:
        return f"| {name} | build failed: {res.stderr.strip()[:100]} |"
    where = ["--devices", devices]
    if "\n" in devices:
        (root / f"{slug}.yaml").write_text(devices)
        where = ["--cluster", str(root / f"{slug}.yaml")]
    out = root / f"{slug}.plan"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _MEASURE, *parc, "plan", str(onnx), *where, "--no-programs",
                          "-o", str(out), *extra], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = float(res.stderr.strip().splitlines()[-1]) / 2**20  # KiB -> GiB: the largest process of the command
    if res.returncode:
        why = (res.stderr.strip().splitlines() or ["?"])[-2:][0][:120]
        return f"| {name} | exit {res.returncode}: {why} | | | | | {wall:.0f} | {peak:.1f} |"
    plan = json.loads((out / "plan.json").read_text())
    step = plan["predicted"]["step_time_s"]
    if len(plan["stages"]) > 1:
        meshes = ", ".join(sorted({"x".join(map(str, s["mesh"])) for s in plan["stages"]}))
        chose = f"{len(plan['stages'])} stages x {plan['schedule']['micro_batches']} mb ({meshes})"
        spmd = plan.get("spmd_only") or {}
        one = f"{spmd['step_time_s']:.3f} s" if spmd.get("step_time_s") else (
            "infeasible" if spmd.get("feasible") is False else "not searched")
    else:
        chose, one = "one mesh " + "x".join(map(str, plan["mesh"]["shape"])), f"{step:.3f} s"
    base = plan.get("baselines") or {}
    uniform = base.get("pipeline-uniform", {}).get("step_time_s")
    others = [(v["step_time_s"], k) for k, v in base.items()
              if k != "pipeline-uniform" and v.get("feasible") and v.get("step_time_s")]
    other = f"{min(others)[1]} {min(others)[0]:.3f} s" if others else "none feasible"
    return (f"| {name} | {chose} | {step:.3f} s | {one} | "
            f"{f'{uniform:.3f} s' if uniform else '-'} | {other} | {wall:.0f} | {peak:.1f} |")


if __name__ == "__main__":
    main()
