"""Executor overhead and data-parallel scaling on this machine (docs/benchmarks.md).

1. `parc run`'s rank loop against a bare onnxruntime loop over the same modules on one rank:
   the same sessions (same thread settings), the same feeds, state fed back by hand; the
   difference is the executor's bookkeeping (task dispatch, slicing, freeing, bindings).
2. Step time of a 2-rank data-parallel plan against the 1-rank plan (`parc run --json`).

    python benchmarks/runtime.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
GPT_SMALL = ["--set", "batch=32", "--set", "hidden=256", "--set", "seq=64"]


def parc(*args: str) -> str:
    res = subprocess.run([sys.executable, "-m", "parc.cli.main", *args], capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"parc {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def bare_loop(plan: Path, batches: list[dict], threads: int) -> list[float]:
    """The modules of rank 0 in task order, by hand: no executor."""
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from parc.plandir.taskgraph import load_taskgraph
    from parc.sharding.layout import shard_index
    from parc.sharding.spec import ShardSpec

    graph = load_taskgraph(plan / "taskgraph.json")
    program = json.loads((plan / "rank_0" / "program.json").read_text())
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    order = [graph.tasks[t] for t in graph.order[0]]
    sessions = {t["module"]: ort.InferenceSession(str(plan / t["module"]), opts, providers=["CPUExecutionProvider"])
                for t in order if t["kind"] == "compute"}
    init = onnx.load(str(plan / "rank_0" / "init.onnx"))
    state = {t.name.removesuffix(".init"): numpy_helper.to_array(t).copy() for t in init.graph.initializer}
    data = {r["name"]: r for r in program["residents"] if r["kind"] == "data"}
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        values = dict(state)
        for name, r in data.items():
            index = shard_index(tuple(r["shape"]), ShardSpec.parse(r["spec"]), tuple(program["mesh"]),
                                tuple(program["coords"]))
            values[name] = batch[name][np.ix_(*index)]
        for t in order:
            if t["kind"] == "compute":
                outs = sessions[t["module"]].run(t["outputs"], {i: values[i] for i in t["inputs"]})
                values.update(zip(t["outputs"], outs))
        for out, inp in program["bindings"].items():
            state[inp] = values[program["outputs"][out]]
        times.append(time.perf_counter() - t0)
    return times


def parc_loop(plan: Path, batches: list[dict], threads: int) -> list[float]:
    from parc.exec.comm import MpiComm
    from parc.exec.runner import Rank

    rank = Rank(plan, 0, MpiComm(), "ort", threads=threads)
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        rank.step(batch)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each loop")
    args = ap.parse_args()
    from parc.exec.data import data_inputs, synthetic

    threads = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        parc("models", "build", "gpt-tiny", *GPT_SMALL, "--train", "adamw", "-o", str(d / "step.onnx"))
        parc("plan", str(d / "step.onnx"), "--devices", "1xa100-80g", "-o", str(d / "one"))
        (d / "dp.yaml").write_text("default: replicate\n")
        parc("plan", str(d / "step.onnx"), "--devices", "2xa100-80g", "--mesh-dims", "1", "--hints",
             str(d / "dp.yaml"), "-o", str(d / "two"))
        program = json.loads((d / "one" / "rank_0" / "program.json").read_text())
        batches = [synthetic(data_inputs(program), 0, s) for s in range(args.steps)]
        bare, ours = [], []
        for _ in range(args.rounds):  # alternate, so drift on a shared machine hits both
            bare += bare_loop(d / "one", batches, threads)[3:]
            ours += parc_loop(d / "one", batches, threads)[3:]
        b, o = statistics.median(bare), statistics.median(ours)
        print("| measure | value |")
        print("|---|---:|")
        print(f"| gpt-small AdamW step, 1 rank, bare onnxruntime loop (median) | {b * 1e3:.2f} ms |")
        print(f"| same, `parc run`'s rank loop (median) | {o * 1e3:.2f} ms |")
        print(f"| executor overhead | {(o / b - 1) * 100:+.1f}% |")
        steps = {}
        for name in ("one", "two"):
            out = parc("run", str(d / name), "--steps", str(args.steps), "--json")
            times = [json.loads(line)["step_time_s"] for line in out.splitlines()][3:]
            steps[name] = statistics.median(times)
        print(f"| `parc run`, 1 rank (median step) | {steps['one'] * 1e3:.2f} ms |")
        print(f"| `parc run`, data parallel on 2 ranks (median step) | {steps['two'] * 1e3:.2f} ms |")
        print(f"| 2-rank / 1-rank step time | {steps['two'] / steps['one']:.3f} |")


if __name__ == "__main__":
    main()
