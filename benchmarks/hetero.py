"""Mixed devices: Whale's experiments in parc's cost model, and heterogeneity measured here.

`--model` (the default): Whale fig. 17 (data parallel on 8 V100 + 8 P100: BERT-Large,
ResNet50-100k, a GNMT-like T5) and fig. 18 (a 4-stage pipeline on 4 V100 + 4 P100: BERT-Large,
T5-Large), and an A100 + H100 mix, each as `parc plan` chooses it and with data parallel
forced, against the `even-split` baseline; Algorithm 1's batch split against the optimum's.

`--measured`: 3 CPU ranks on 2 cores, rank 0 alone on core 0 and ranks 1 and 2 sharing core 1
(hydra's `-bind-to user:0,1,1`), so rank 0 is about twice as fast. A cluster file says so
(`cpu-whole` and `cpu-half`); the balanced plan (uneven data parallel) and the even split (the
same model planned on three equal CPUs) both run under that pinning with `parc run`, and their
measured median steps are printed next to the predicted ratio.

    python benchmarks/hetero.py [--measured] [--steps 30] [--batch 96] [--hidden 384] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CLUSTER = """devices:
  cpu-whole: {base: cpu}
  cpu-half: {base: cpu, fp32_tflops: 0.5, bandwidth_gbs: 50}
nodes:
  - gpus: [cpu-whole, 2xcpu-half]
    intra_link: shm
"""
EVEN = """nodes:
  - gpus: 3xcpu
    intra_link: shm
"""
STEP = re.compile(r"step\s+(\d+)/\d+\s+loss\s+\S+\s+([\d.]+) ms")


def parc(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "parc.cli.main", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"parc {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def run_pinned(plan: Path, steps: int) -> list[float]:
    """Step times (ms) of `parc run` on 3 ranks pinned 0 -> core 0, 1 and 2 -> core 1."""
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    cmd = [mpiexec, "-n", "3", "-bind-to", "user:0,1,1", sys.executable, "-m", "parc.cli.main", "run", str(plan),
           "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={"OMP_NUM_THREADS": "1", **_env()})
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: {out.stderr.strip()[-500:]}")
    return [float(m.group(2)) for m in STEP.finditer(out.stdout)]


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


# (label, zoo model, --set overrides, devices, plan flags); "dp" forces data parallel on one mesh
CASES = [
    ("fig. 17", "bert-large", ("batch=64",), "8xv100-32g+8xp100-16g", ()),
    ("fig. 17", "bert-large", ("batch=64",), "8xv100-32g+8xp100-16g", ("dp",)),
    ("fig. 17", "resnet50-100k", ("batch=128",), "8xv100-32g+8xp100-16g", ()),
    ("fig. 17", "resnet50-100k", ("batch=128",), "8xv100-32g+8xp100-16g", ("dp",)),
    ("fig. 17 (GNMT-like)", "t5-large", ("batch=64", "layers=4", "dec_layers=4"), "8xv100-32g+8xp100-16g", ("dp",)),
    # mixed precision (`parc grad --precision fp16`): products on V100's tensor cores, 5.9x a P100's
    ("fig. 17 (fp16)", "bert-large", ("batch=64",), "8xv100-32g+8xp100-16g", ("fp16",)),
    ("fig. 17 (fp16)", "bert-large", ("batch=64",), "8xv100-32g+8xp100-16g", ("fp16", "dp")),
    ("fig. 17 (fp16)", "resnet50-100k", ("batch=128",), "8xv100-32g+8xp100-16g", ("fp16",)),
    ("fig. 17 (fp16)", "resnet50-100k", ("batch=128",), "8xv100-32g+8xp100-16g", ("fp16", "dp")),
    ("fig. 18", "bert-large", ("batch=32",), "4xv100-32g+4xp100-16g", ("--pipeline", "4")),
    ("fig. 18", "t5-large", ("batch=32",), "4xv100-32g+4xp100-16g", ("--pipeline", "4")),
    ("fig. 18 (fp16)", "bert-large", ("batch=32",), "4xv100-32g+4xp100-16g", ("fp16", "--pipeline", "4")),
    ("fig. 18 (fp16)", "t5-large", ("batch=32",), "4xv100-32g+4xp100-16g", ("fp16", "--pipeline", "4")),
    ("A100 + H100", "gpt-medium", ("batch=32",), "8xa100-80g+8xh100-80g", ()),
]


def cost_model(out: Path | None, only: list[str] | None = None) -> None:
    """Whale's experiments in the cost model: one `parc plan` per case, the plan against its
    even split (`only`: the cases whose label is listed)."""
    import time

    rows = ["| case | model | devices | plan | plan step | even split | even / plan | Algorithm 1 vs optimum "
            "(batch per slice; slowest slice's compute) | plan time |",
            "|---|---|---|---|---:|---:|---:|---|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "dp.yaml").write_text("default: replicate\n")
        for label, model, sets, devices, flags in CASES:
            if only and label not in only:
                continue
            precision = "fp16" if "fp16" in flags else "fp32"
            step = d / f"{model}-{'-'.join(sets)}-{precision}.onnx"
            if not step.exists():
                forward = d / f"{model}-{'-'.join(sets)}.forward.onnx"
                parc("models", "build", model, *[x for v in sets for x in ("--set", v)], "-o", str(forward))
                parc("grad", str(forward), "--optimizer", "adamw", "--precision", precision, "-o", str(step))
            extra = ["--hints", str(d / "dp.yaml"), "--mesh-dims", "1", "--pipeline", "off"] if "dp" in flags \
                else [f for f in flags if f != "fp16"]
            plan = d / "plan"
            t0 = time.perf_counter()
            parc("plan", str(step), "--devices", devices, "-O2", "--no-programs", *extra, "-o", str(plan))
            took = time.perf_counter() - t0
            data = json.loads((plan / "plan.json").read_text())
            me = data["predicted"]["step_time_s"]
            even = data["baselines"].get("even-split", {}).get("step_time_s")
            kind = (f"{len(data['stages'])} stages" if len(data["stages"]) > 1 else f"mesh {data['mesh']['shape']}")
            idle = (data.get("devices_given") or {}).get("idle")
            if idle:  # the plan leaves the slower devices idle (`--all-devices` uses them)
                kind += ", " + ", ".join(f"{n} {name}" for name, n in idle.items()) + " idle"
            axes = (data.get("balance") or {}).get("axes") or []
            if axes:
                a = axes[0]
                alg = (f"{_short(a['algorithm1'])} {a['time_algorithm1_s'] * 1e3:.1f} ms vs {_short(a['optimum'])} "
                       f"{(a['time_optimum_s'] or float('nan')) * 1e3:.1f} ms")
            else:
                alg = "-"
            rows.append(f"| {label} | {model} {' '.join(sets)} | {devices} | {kind}{' (dp forced)' if 'dp' in flags else ''} "
                        f"| {me * 1e3:.1f} ms | {'-' if even is None else f'{even * 1e3:.1f} ms'} "
                        f"| {'-' if even is None else f'{even / me:.3f}'} | {alg} | {took:.0f} s |")
            print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def _short(split: list[int] | None) -> str:
    """[5, 5, 5, 3, 3] -> 5x3+3x2 (run lengths)."""
    if not split:
        return "none"
    runs: list[list[int]] = []
    for x in split:
        if runs and runs[-1][0] == x:
            runs[-1][1] += 1
        else:
            runs.append([x, 1])
    return "+".join(f"{v}x{n}" if n > 1 else str(v) for v, n in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", action="store_true", help="the pinned CPU ranks, measured with parc run")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=96)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--case", action="append", help="only the cases of this label (e.g. 'fig. 18'); repeatable")
    args = ap.parse_args()
    if not args.measured:
        cost_model(args.out, args.case)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "mixed.yaml").write_text(CLUSTER)
        (d / "even.yaml").write_text(EVEN)
        (d / "dp.yaml").write_text("default: replicate\n")
        step = d / "gpt.onnx"
        parc("models", "build", "gpt-tiny", "--set", f"batch={args.batch}", "--set", f"hidden={args.hidden}",
             "--set", f"ffn={4 * args.hidden}", "--train", "sgd", "-o", str(step))
        rows = []
        for name, cluster in (("balanced", "mixed.yaml"), ("even split", "even.yaml")):
            plan = d / name.replace(" ", "-")
            parc("plan", str(step), "--cluster", str(d / cluster), "--mesh-dims", "1", "--hints", str(d / "dp.yaml"),
                 "--jobs", "1", "-o", str(plan))
            data = json.loads((plan / "plan.json").read_text())
            times = run_pinned(plan, args.steps)
            warm = times[len(times) // 3:]  # the first third warms up
            rows.append((name, data, statistics.median(warm)))
        (_, bal, t_bal), (_, _, t_even) = rows
        pred_bal = bal["predicted"]["step_time_s"]
        pred_even = bal["baselines"]["even-split"]["step_time_s"]
        axes = bal["balance"]["axes"][0]
        lines = [
            "| plan | batch per rank | predicted step (mixed cluster's model) | measured median step |",
            "|---|---|---:|---:|",
            f"| balanced | {axes['optimum']} | {pred_bal * 1e3:.2f} ms | {t_bal:.1f} ms |",
            f"| even split | {axes['even']} | {pred_even * 1e3:.2f} ms | {t_even:.1f} ms |",
            "",
            f"speedup of the balanced plan: predicted {pred_even / pred_bal:.3f}x, measured {t_even / t_bal:.3f}x "
            f"({args.steps} steps, median of the last {len(warm)}; gpt-tiny batch {args.batch}, hidden {args.hidden})",
        ]
        text = "\n".join(lines)
        print(text)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
