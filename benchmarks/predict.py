"""Predicted against measured, on this machine: `parc profile` (with the models' own products and
convolutions, `--model`), then for each model and layout
`parc plan --calibration`, `parc simulate` (predicted step and peak memory per rank) and
`parc run` (measured median step over the steps after the first five, and the peak of tensors
each rank held). Prints one Markdown table (docs/benchmarks.md, "Predicted against measured").
Its `host` column is how fast this host ran a fixed product (`parc.calibrate.host_probe`) just
before the run against just after the profile, or against the script's start with
`--calibration FILE` (1.00: as calibrated; 0.70: the run had 70% of the speed the calibration saw):
a shared VM's speed moves by tens of percent over minutes, and this says when a miss is the host's.

    python benchmarks/predict.py [--calibration FILE] [--steps 30] [--rounds 1] [--models gpt-tiny,moe-tiny,unet-tiny]
                                 [--built-in]

A `--models` entry that names an ONNX file is a training step (`parc grad`'s) used as it is.
`--built-in` profiles without the models' own products and convolutions (`parc profile` with no
`--model`, as the simulate check calibrates).

`--rounds R` runs every plan R times, the plans in turn each round (so that a slow spell of the
host falls on different plans): the measured figure is the median of the R runs' medians, and
the range of the R medians is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARC = [sys.executable, "-m", "parc.cli.main"]
# (devices, `parc plan` arguments); "split" stands for a hints file that splits every parameter
# over all the ranks (tensor parallelism: Whale's split), which the search would not choose here
LAYOUTS = (("1xcpu", ()), ("2xcpu", ()), ("2xcpu", ("--hints", "split")), ("4xcpu", ()),
           ("4xcpu", ("--pipeline", "2")))
BUILD = {"gpt-tiny": ("--set", "batch=32", "--set", "hidden=256", "--set", "seq=64"),
         "moe-tiny": ("--set", "batch=32"), "unet-tiny": ("--set", "batch=16")}


def parc(*args: str) -> str:
    res = subprocess.run([*PARC, *args], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"parc {' '.join(args)} failed: {res.stderr.strip().splitlines()[-1:]}")
    return res.stdout


def measure(plan: Path, steps: int) -> tuple[float, list[int]]:
    lines = [json.loads(line) for line in parc("run", str(plan), "--steps", str(steps), "--json").splitlines()
             if line.startswith("{")]
    return statistics.median(r["step_time_s"] for r in lines[5:]), lines[-1]["peak_bytes_per_rank"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", help="a calibration file (default: run parc profile first)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--models", default=",".join(BUILD))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--built-in", action="store_true", help="profile without the models' own shapes")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 6:
        ap.error("expected --rounds >= 1 and --steps >= 6 (the median is of the steps after the fifth)")
    work = Path(tempfile.mkdtemp(prefix="parc-predict-"))
    calib = Path(args.calibration) if args.calibration else work / "calib.yaml"
    models = args.models.split(",")
    steps = {}
    for model in models:
        if model.endswith(".onnx"):
            steps[model] = Path(model)
            continue
        steps[model] = work / f"{model}.train.onnx"
        parc("models", "build", model, *BUILD.get(model, ()), "--train", "momentum", "-o", str(steps[model]))
    if not args.calibration:
        t0 = time.perf_counter()
        own = () if args.built_in else (a for m in models for a in ("--model", str(steps[m])))
        parc("profile", "-o", str(calib), *own)
        print(f"parc profile: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    from parc.calibrate import host_probe
    from parc.exec.engine_choice import rank_threads

    threads = rank_threads(1)  # as `parc profile` probes
    calibrated = host_probe(threads)
    print(f"Predicted against measured: {platform.node()}, {platform.processor() or platform.machine()}, "
          f"calibration from `parc profile`, {args.steps} steps, median of steps 6-{args.steps}"
          f"{f'; measured: the median of {args.rounds} runs, their range in brackets' if args.rounds > 1 else ''}.\n")
    print("| model | devices | plan | predicted step ms | measured ms | error | host | predicted peak MiB/rank "
          "| measured MiB/rank | error |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    worst_t, worst_m = 0.0, 0.0
    plans = []
    split = work / "split.yaml"
    split.write_text("default: split\n")
    for model in models:
        for devices, extra in LAYOUTS:
            plan = work / f"{Path(model).stem}-{devices}{''.join(extra)}"
            extra = tuple(str(split) if a == "split" else a for a in extra)
            parc("plan", str(steps[model]), "--devices", devices, "--calibration", str(calib), *extra, "-o", str(plan))
            plans.append((model, devices, plan))
    runs: dict[Path, list[tuple[float, float, list[int]]]] = {plan: [] for *_, plan in plans}
    for r in range(args.rounds):
        for model, devices, plan in plans:
            host = calibrated / host_probe(threads)
            measured, peaks = measure(plan, args.steps)
            runs[plan].append((measured, host, peaks))
            if r < args.rounds - 1:
                continue
            sim = json.loads(parc("simulate", str(plan), "--json"))
            doc = json.loads((plan / "plan.json").read_text())
            shape = (f"{len(doc['stages'])} stages x {doc['schedule']['micro_batches']} mb"
                     if len(doc["stages"]) > 1 else f"mesh {tuple(doc['mesh']['shape'])}")
            shape += ", every parameter split" if "hints" in plan.name else ""
            times = [t for t, _, _ in runs[plan]]
            measured = statistics.median(times)
            spread = f" ({min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})" if len(times) > 1 else ""
            hosts = "/".join(f"{h:.2f}" for _, h, _ in runs[plan])
            peaks = runs[plan][-1][2]
            predicted_peaks = [r["peak_bytes"] for r in sim["ranks"]]
            err_t = (sim["step_time_s"] - measured) / measured
            err_m = max(abs(p - m) / m for p, m in zip(predicted_peaks, peaks))
            worst_t, worst_m = max(worst_t, abs(err_t)), max(worst_m, err_m)
            print(f"| {model} | {devices} | {shape} | {sim['step_time_s'] * 1e3:.1f} | {measured * 1e3:.1f}{spread} | "
                  f"{err_t:+.1%} | {hosts} | {max(predicted_peaks) / 2**20:.2f} | {max(peaks) / 2**20:.2f} | {err_m:.1%} |",
                  flush=True)
    print(f"\nworst step error {worst_t:.1%}, worst memory error {worst_m:.1%}")


if __name__ == "__main__":
    main()
