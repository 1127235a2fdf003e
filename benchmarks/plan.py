"""`parc plan` speed and plan quality, as Markdown tables (docs/benchmarks.md, issue 4).

Every model's AdamW training step is built once (`parc models build NAME --train adamw`), then
each `parc plan` runs in a fresh process; *wall s* is the whole command. Suites:

* ``tiny``: the tiny zoo models on 2 and 4 A100s, -O2 and -O3 (`--models/--devices/--levels/--time-limit`).
* ``zoo``: plan quality against the baselines for the full-size zoo models on 8 x V100-32G, flat
  mesh only (`--mesh-dims 1`; `--zoo-mesh-dims 2` for the 2-D meshes too), -O2 and -O3, 60 s per solve.
* ``agreement``: the same zoo at -O2 on the default meshes with programs written: the search's
  predicted step beside the simulated step of the plan it chose (`--zoo-models`).
* ``scaling``: GPT with hidden 512, 8 heads, FFN 2048 and L layers on 8 x A100-80G, -O2, flat
  mesh, 120 s per solve; plus one L=72 run over the default 2-D meshes.
* ``medium``: gpt-medium (default batch) on 8 x A100-80G, -O2 and -O3, default meshes, 60 s per solve.
* ``scale``: the planner-at-scale cases (issue 11), each a whole `parc plan` command with its goal:
  gpt-medium on 8 x V100-32G at O2/O3, with and without programs; a 4-layer GPT under a binding
  `--mem-limit`; GPT with 12-96 layers of hidden 512 on the default 2-D meshes; GPT-39B-like on
  8 x 8 A100-80G (SPMD only); gpt-2.7b over 4 nodes joined by 25 GbE (SPMD only). Peak memory
  is the largest resident set of the command and its worker processes.

Usage:
    python benchmarks/plan.py [--suite tiny|zoo|agreement|scaling|medium|scale|all] [--zoo-models a,b] [--layers 12,24]
                              [--models gpt-tiny,resnet-tiny,unet-tiny] [--devices 2xa100-80g,4xa100-80g]
                              [--levels O2,O3] [--time-limit 10] [--out out/bench-plan.md]
Tables go to out/bench-plan[-SUITE].md, the raw rows to out/bench-plan-SUITE.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

PARC = [sys.executable, "-m", "parc.cli.main"]
SETS = {"gpt-tiny": ["--set", "batch=32", "--set", "hidden=256", "--set", "seq=64"]}
ZOO = "gpt-medium,gpt-2.7b,bert-large,t5-large,vgg19,resnet50-1m,unet,dnabert,moe-8e-380m"
# Zoo models whose default config makes planning infeasible on 8 x V100-32G get a --set here
# (and the table says so): dnabert at its default batch 32 needs 78.6 GB per device.
ZOO_SETS: dict[str, list[str]] = {"dnabert": ["--set", "batch=8"]}
CMD_TIMEOUT_S = 1200  # a single `parc plan` past this is recorded as timed out


def build(name: str, sets: list[str], path: Path) -> int:
    """Write NAME's AdamW step to PATH; return its IR node count."""
    import onnx

    subprocess.run(
        [*PARC, "models", "build", name, *sets, "--train", "adamw", "-o", str(path)],
        check=True,
        capture_output=True,
    )
    return len(onnx.load(str(path), load_external_data=False).graph.node)


def plan(
    step: Path,
    out: Path,
    devices: str,
    level: str,
    time_limit: str,
    mesh_dims: int | None = None,
    programs: bool = False,
) -> dict:
    """One `parc plan` in a fresh process: wall time and plan.json, or the error line. Without
    `programs`, the search alone (`--no-programs`)."""
    cmd = [
        *PARC,
        "plan",
        str(step),
        "--devices",
        devices,
        f"-{level}",
        "--time-limit",
        time_limit,
        *([] if programs else ["--no-programs"]),  # the search's time; lowering: benchmarks/runtime.py
        "-o",
        str(out),
    ]
    if mesh_dims is not None:
        cmd += ["--mesh-dims", str(mesh_dims)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"wall": time.perf_counter() - t, "rc": None, "error": f"timed out after {CMD_TIMEOUT_S} s"}
    wall = time.perf_counter() - t
    if p.returncode != 0:
        lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        return {"wall": wall, "rc": p.returncode, "error": lines[-1] if lines else f"exit {p.returncode}"}
    return {"wall": wall, "rc": 0, "doc": json.loads((out / "plan.json").read_text())}


def machine(extra: str) -> str:
    return f"Machine: {platform.machine()}, Python {platform.python_version()}, {extra}\n\n"


def write(name: str, text: str, rows: list) -> None:
    Path(f"out/bench-plan-{name}.md").parent.mkdir(parents=True, exist_ok=True)
    Path(f"out/bench-plan-{name}.md").write_text(text)
    Path(f"out/bench-plan-{name}.json").write_text(json.dumps(rows, indent=1, default=str))
    print(text)


def forward_matmuls(step: Path, strategies: dict[str, str]) -> str:
    """Forward MatMul/Gemm count per strategy label, e.g. 'b0 120, n 24'."""
    import onnx

    graph = onnx.load(str(step), load_external_data=False).graph
    c = Counter(
        strategies.get(n.name, "?")
        for n in graph.node
        if n.op_type in ("MatMul", "Gemm") and ".grad" not in n.name and ".update" not in n.name
    )
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def suite_tiny(args: argparse.Namespace, tmp: Path) -> None:
    rows = []
    for name in args.models.split(","):
        step = tmp / f"{name}.train.onnx"
        build(name, SETS.get(name, []), step)
        for devices in args.devices.split(","):
            for level in args.levels.split(","):
                r = plan(step, tmp / f"{name}-{devices}-{level}", devices, level, args.time_limit)
                if "doc" not in r:
                    raise SystemExit(f"{name} {devices} {level}: {r['error']}")
                doc = r["doc"]
                best = doc["predicted"]["step_time_s"]
                base = {k: v["step_time_s"] for k, v in doc["baselines"].items() if v["step_time_s"]}
                rows.append(
                    (
                        name,
                        devices,
                        level,
                        doc["solver"]["nodes"],
                        r["wall"],
                        "x".join(map(str, doc["mesh"]["shape"])),
                        best,
                        doc["solver"]["gap"],
                        base,
                    )
                )
                log(f"{name} {devices} {level}: {r['wall']:.1f} s")
    names = sorted({k for r in rows for k in r[8]})
    head = (
        machine(f"per-solve time limit {args.time_limit} s")
        + "| model | devices | level | problem nodes | plan s | mesh | predicted ms | gap | "
        + " | ".join(f"{n} / plan" for n in names)
        + " |\n"
        "|---|---|---|---:|---:|---|---:|---:|" + "---:|" * len(names) + "\n"
    )
    body = "".join(
        f"| {m} | {d} | {lv} | {nodes} | {wall:.1f} | {mesh} | {best * 1e3:.3f} | {gap:.1%} | "
        + " | ".join(f"{base[n] / best:.3f}" if n in base else "-" for n in names)
        + " |\n"
        for m, d, lv, nodes, wall, mesh, best, gap, base in rows
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(head + body)
    print(head + body)


def suite_zoo(args: argparse.Namespace, tmp: Path) -> None:
    devices, limit = "8xv100-32g", "60"
    rows = []
    for name in args.zoo_models.split(","):
        step = tmp / f"{name}.train.onnx"
        ir = build(name, ZOO_SETS.get(name, []), step)
        row = {"model": name, "sets": " ".join(ZOO_SETS.get(name, [])[1::2]), "ir_nodes": ir}
        for level in ("O2", "O3"):
            r = plan(step, tmp / f"{name}-{level}", devices, level, limit, mesh_dims=args.zoo_mesh_dims)
            row[level] = {"wall": r["wall"], "error": r.get("error")}
            if "doc" in r:
                doc = r["doc"]
                row["nodes"] = doc["solver"]["nodes"]
                row[level].update(
                    step=doc["predicted"]["step_time_s"],
                    gap=doc["solver"]["gap"],
                    status=doc["solver"]["status"],
                    mem=max(doc["predicted"]["memory_bytes_per_device"]) / 2**30,
                    baselines=doc["baselines"],
                )
            log(f"{name} {level}: {r['wall']:.1f} s {r.get('error') or ''}")
        rows.append(row)
    names = sorted({k for r in rows for lv in ("O2", "O3") for k in r[lv].get("baselines", {})})

    def ratio(run: dict, n: str) -> str:
        b = run.get("baselines", {}).get(n)
        if b is None or "step" not in run:
            return "-"
        if not b.get("feasible") or not b.get("step_time_s"):
            return "infeasible"
        return f"{b['step_time_s'] / run['step']:.3f}"

    def beats(run: dict) -> str:
        if "step" not in run:
            return "-"
        feas = [
            b["step_time_s"] for b in run["baselines"].values() if b.get("feasible") and b.get("step_time_s")
        ]
        return "yes" if all(run["step"] <= s * (1 + 1e-9) for s in feas) else "**no**"

    def ms(run: dict) -> str:
        return f"{run['step'] * 1e3:.1f}" if "step" in run else "-"

    def f(run: dict, key: str, fmt: str) -> str:
        return format(run[key], fmt) if key in run else "-"

    head = (
        machine(
            f"`--devices {devices} --mesh-dims {args.zoo_mesh_dims}`"
            f"{' (flat 8-device mesh only)' if args.zoo_mesh_dims == 1 else ''}, per-solve time limit {limit} s, "
            "`--jobs 2`; baselines are pinned versions of the same problem in the same cost model; "
            "cells with two figures are O2, O3"
        )
        + "| model | nodes | O2 s | O3 s | O2 ms | O3 ms | O2 / O3 | "
        + " | ".join(f"{n} / plan" for n in names)
        + " | GiB/device | plan <= baselines |\n|---|---:|---:|---:|---:|---:|---:|"
        + "---:|" * len(names)
        + "---:|---|\n"
    )
    body, notes = "", []
    for r in rows:
        o2, o3 = r["O2"], r["O3"]
        label = r["model"] + (f" ({r['sets']})" if r["sets"] else "")
        cost = f"{o2['step'] / o3['step']:.3f}" if "step" in o2 and "step" in o3 else "-"
        for lv, run in (("O2", o2), ("O3", o3)):
            if run.get("error"):
                notes.append(f"- {r['model']} -O{lv[1]}: {run['error']}")
        body += (
            f"| {label} | {r.get('nodes', '-')} | {o2['wall']:.1f} | {o3['wall']:.1f} | "
            f"{ms(o2)} | {ms(o3)} | {cost} | "
            + " | ".join(f"{ratio(o2, n)}, {ratio(o3, n)}" for n in names)
            + f" | {f(o2, 'mem', '.2f')}, {f(o3, 'mem', '.2f')} | {beats(o2)}, {beats(o3)} |\n"
        )
    text = head + body + ("\n" + "\n".join(notes) + "\n" if notes else "")
    write("zoo" if args.zoo_mesh_dims == 1 else f"zoo-{args.zoo_mesh_dims}d", text, rows)


def suite_agreement(args: argparse.Namespace, tmp: Path) -> None:
    """The search's figure against the simulated step of the plan it chose (issue 52: one cost
    model): the zoo on 8 x V100-32G, -O2, the default meshes, programs written."""
    devices, limit = "8xv100-32g", "60"
    rows = []
    for name in args.zoo_models.split(","):
        step = tmp / f"{name}.train.onnx"
        build(name, ZOO_SETS.get(name, []), step)
        r = plan(step, tmp / f"{name}-agree", devices, "O2", limit, programs=True)
        row = {"model": name, "sets": " ".join(ZOO_SETS.get(name, [])[1::2]), "wall": r["wall"], "error": r.get("error")}
        if "doc" in r:
            doc = r["doc"]
            p, sim = doc["predicted"], doc.get("simulation", {})
            row.update(
                mesh="x".join(map(str, doc["mesh"]["shape"])) if len(doc.get("stages") or [0]) <= 1 else "pipeline",
                search=p["step_time_s"],
                search_compute=p["compute_s"],
                search_comm=p["comm_s"],
                simulated=sim.get("step_time_s"),
                exposed=sim.get("exposed_comm_s"),
                bubble=sim.get("bubble_s", 0.0),
            )
        log(f"{name}: {r['wall']:.1f} s {r.get('error') or ''}")
        rows.append(row)

    def ms(x) -> str:
        return f"{x * 1e3:.1f}" if x is not None else "-"

    text = machine(f"`--devices {devices}`, -O2, default meshes, per-solve time limit {limit} s, programs written") + (
        "| model | mesh | wall s | search ms | search compute ms | search comm ms | simulated ms | "
        "simulated compute ms | exposed comm ms | simulated / search |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    for r in rows:
        label = r["model"] + (f" ({r['sets']})" if r["sets"] else "")
        if r.get("error") or r.get("simulated") is None:
            text += f"| {label} | - | {r['wall']:.1f} | {r.get('error') or 'no simulation'} |||||||\n"
            continue
        compute = r["simulated"] - r["exposed"] - r["bubble"]
        text += (
            f"| {label} | {r['mesh']} | {r['wall']:.1f} | {ms(r['search'])} | {ms(r['search_compute'])} | "
            f"{ms(r['search_comm'])} | {ms(r['simulated'])} | {ms(compute)} | {ms(r['exposed'])} | "
            f"{r['simulated'] / r['search']:.3f} |\n"
        )
    write("agreement", text, rows)


def suite_scaling(args: argparse.Namespace, tmp: Path) -> None:
    devices, limit = "8xa100-80g", "120"
    rows = []
    runs = [(int(L), 1) for L in args.layers.split(",")] + ([(72, 2)] if args.layers_2d else [])
    steps: dict[int, tuple[Path, int]] = {}
    for L, dims in runs:
        if L not in steps:
            step = tmp / f"gpt-L{L}.train.onnx"
            ir = build(
                "gpt-medium",
                ["--set", "hidden=512", "--set", "heads=8", "--set", "ffn=2048", "--set", f"layers={L}"],
                step,
            )
            steps[L] = (step, ir)
        step, ir = steps[L]
        r = plan(step, tmp / f"gpt-L{L}-d{dims}", devices, "O2", limit, mesh_dims=dims)
        row = {"layers": L, "mesh_dims": dims, "ir_nodes": ir, "wall": r["wall"], "error": r.get("error")}
        if "doc" in r:
            row.update(plan_facts(r["doc"], step))
        rows.append(row)
        log(f"L={L} mesh-dims {dims}: {r['wall']:.1f} s {r.get('error') or ''}")
    head = (
        machine(
            f"gpt-medium with `--set hidden=512 --set heads=8 --set ffn=2048 --set layers=L` "
            f"(seq 1024, batch 4, vocab 51200), AdamW step, `parc plan --devices {devices} -O2 "
            f"--time-limit {limit}`, `--jobs 2`"
        )
        + "| L | mesh dims | IR nodes | problem nodes | wall s | s / layer | mesh | predicted ms | gap | "
        "forward MatMuls per strategy |\n|---:|---:|---:|---:|---:|---:|---|---:|---:|---|\n"
    )
    body = ""
    for r in rows:
        if r["error"]:
            body += (
                f"| {r['layers']} | {r['mesh_dims']} | {r['ir_nodes']} | - | {r['wall']:.1f} | - | - | - | - | "
                f"{r['error']} |\n"
            )
            continue
        body += (
            f"| {r['layers']} | {r['mesh_dims']} | {r['ir_nodes']} | {r['nodes']} | {r['wall']:.1f} | "
            f"{r['wall'] / r['layers']:.2f} | {r['mesh']} | {r['step'] * 1e3:.1f} | {r['gap']:.1%} | "
            f"{r['matmuls']} |\n"
        )
    write("scaling", head + body, rows)


def plan_facts(doc: dict, step: Path) -> dict:
    """The plan.json figures the scaling and medium tables show."""
    return {"nodes": doc["solver"]["nodes"], "step": doc["predicted"]["step_time_s"],
            "gap": doc["solver"]["gap"], "status": doc["solver"]["status"],
            "mesh": "x".join(map(str, doc["mesh"]["shape"])), "meshes": doc["solver"]["meshes"],
            "matmuls": forward_matmuls(step, doc["strategies"])}


def suite_medium(args: argparse.Namespace, tmp: Path) -> None:
    devices, limit = "8xa100-80g", "60"
    step = tmp / "gpt-medium.train.onnx"
    ir = build("gpt-medium", [], step)
    rows = []
    for level in ("O2", "O3"):
        r = plan(step, tmp / f"gpt-medium-{level}", devices, level, limit)
        row = {"level": level, "ir_nodes": ir, "wall": r["wall"], "error": r.get("error")}
        if "doc" in r:
            row.update(plan_facts(r["doc"], step))
        rows.append(row)
        log(f"gpt-medium {level}: {r['wall']:.1f} s {r.get('error') or ''}")

    def meshes(ms: list[dict]) -> str:
        return ", ".join(
            "x".join(map(str, m["shape"]))
            + ": "
            + (
                f"{m['step_time_s'] * 1e3:.1f} ms" + (f" (gap {m['gap']:.1%})" if m.get("gap") else "")
                if m.get("feasible") and m.get("step_time_s")
                else "infeasible"
            )
            for m in ms
        )

    head = (
        machine(
            f"gpt-medium (default config, batch 4), AdamW step, `parc plan --devices {devices} "
            f"--time-limit {limit}` with the default `--mesh-dims 2` and `--jobs 2`"
        )
        + "| level | problem nodes | wall s | mesh | predicted ms | gap | status | per mesh | forward MatMuls |\n"
        "|---|---:|---:|---|---:|---:|---|---|---|\n"
    )
    body = ""
    for r in rows:
        if r["error"]:
            body += f"| {r['level']} | - | {r['wall']:.1f} | - | - | - | {r['error']} | - | - |\n"
            continue
        body += (
            f"| {r['level']} | {r['nodes']} | {r['wall']:.1f} | {r['mesh']} | {r['step'] * 1e3:.1f} | "
            f"{r['gap']:.1%} | {r['status']} | {meshes(r['meshes'])} | {r['matmuls']} |\n"
        )
    write("medium", head + body, rows)


def run_measured(cmd: list[str], timeout: float = CMD_TIMEOUT_S) -> tuple[float, int | None, float, str]:
    """(wall s, exit code or None on time-out, peak resident GiB of the command and its children, stderr)."""
    import os
    import signal

    t = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        deadline = t + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
                status = None
                break
            time.sleep(0.05)
        err.seek(0)
        text = err.read().decode(errors="replace")
    rc = None if status is None else os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t, rc, usage.ru_maxrss / 2**20, text


def suite_scale(args: argparse.Namespace, tmp: Path) -> None:
    """Issue 11's cases, one row each: the whole command's wall time against its goal."""
    gpt = ["--set", "hidden=512", "--set", "heads=8", "--set", "ffn=2048"]
    models = {
        "gpt-medium": ("gpt-medium", []),
        "gpt-4l-128": ("gpt-tiny", ["--set", "layers=4", "--set", "hidden=128", "--set", "vocab=1000"]),
        "gpt-39b": ("gpt-6.7b", ["--set", "layers=48", "--set", "hidden=8192", "--set", "ffn=32768",
                                 "--set", "heads=64"]),
        "gpt-2.7b-b32": ("gpt-2.7b", ["--set", "batch=32"]),
        **{f"gpt-L{L}": ("gpt-medium", [*gpt, "--set", f"layers={L}"]) for L in args.layers.split(",")},
    }
    slow = tmp / "slow.yaml"
    slow.write_text("nodes:\n  - gpus: 8xv100-32g\n    count: 4\ninter_link: 25gbe\n")
    v100 = ["--devices", "8xv100-32g"]
    cases = [  # (label, model, flags, goal s)
        ("gpt-medium O2", "gpt-medium", [*v100, "-O2", "--no-programs"], 20),
        ("gpt-medium O3", "gpt-medium", [*v100, "-O3", "--no-programs"], 60),
        ("gpt-medium O2, programs", "gpt-medium", [*v100, "-O2"], 30),
        ("4-layer GPT, --mem-limit 0.004", "gpt-4l-128",
         ["--devices", "4xa100-80g", "-O2", "--mem-limit", "0.004", "--no-programs"], 15),
        *((f"GPT {L} layers, 2-D meshes", f"gpt-L{L}", ["--devices", "8xa100-80g", "-O2", "--no-programs"],
           60 if L == "72" else None) for L in args.layers.split(",")),
        ("GPT-39B-like, 8x8 A100, SPMD", "gpt-39b",
         ["--devices", "8x8xa100-80g", "-O2", "--pipeline", "off", "--no-programs"], 120),
        ("gpt-2.7b, 4x8 V100 over 25 GbE, SPMD", "gpt-2.7b-b32",
         ["--cluster", str(slow), "-O2", "--pipeline", "off", "--no-programs"], None),
    ]
    if args.scale_cases:
        cases = [c for c in cases if any(k in c[0] for k in args.scale_cases.split(","))]
    built: dict[str, Path] = {}
    rows = []
    for label, model, flags, goal in cases:
        if model not in built:
            built[model] = tmp / f"{model}.train.onnx"
            build(models[model][0], models[model][1], built[model])
        out = tmp / f"plan-{len(rows)}"
        wall, rc, peak, err = run_measured([*PARC, "plan", str(built[model]), *flags, "-o", str(out)])
        row = {"case": label, "flags": " ".join(flags), "goal_s": goal, "wall": wall, "rc": rc, "peak_gib": peak}
        if rc == 0:
            doc = json.loads((out / "plan.json").read_text())
            base = [b["step_time_s"] for b in doc["baselines"].values() if b.get("feasible")]
            row.update(step=doc["predicted"]["step_time_s"], best_baseline=min(base) if base else None,
                       gap=doc["solver"]["gap"], mesh="x".join(map(str, doc["mesh"]["shape"])))
        else:
            row["error"] = (err.strip().splitlines() or ["timed out"])[-1]
        rows.append(row)
        log(f"{label}: {wall:.1f} s (goal {goal}) {row.get('error', '')}")
    head = machine("each case one `parc plan` command in a fresh process (default `--jobs`: one per CPU)") + (
        "| case | flags | wall s | goal s | peak GiB | mesh | predicted ms | / best baseline | proven gap |\n"
        "|---|---|---:|---:|---:|---|---:|---:|---:|\n")
    body = ""
    for r in rows:
        if r["rc"] != 0:
            body += f"| {r['case']} | `{r['flags']}` | {r['wall']:.1f} | {r['goal_s'] or '-'} | {r['peak_gib']:.2f} | " \
                    f"{r.get('error')} | - | - | - |\n"
            continue
        ratio = f"{r['step'] / r['best_baseline']:.3f}" if r["best_baseline"] else "-"
        body += (f"| {r['case']} | `{r['flags']}` | {r['wall']:.1f} | {r['goal_s'] or '-'} | {r['peak_gib']:.2f} | "
                 f"{r['mesh']} | {r['step'] * 1e3:.1f} | {ratio} | {r['gap']:.1%} |\n")
    write("scale", head + body, rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", default="all", choices=["tiny", "zoo", "agreement", "scaling", "medium", "scale", "all"])
    ap.add_argument("--scale-cases", default="", help="scale suite: only cases whose label contains one of these")
    ap.add_argument("--models", default="gpt-tiny,resnet-tiny,unet-tiny", help="tiny suite")
    ap.add_argument("--devices", default="2xa100-80g,4xa100-80g", help="tiny suite")
    ap.add_argument("--levels", default="O2,O3", help="tiny suite")
    ap.add_argument("--time-limit", default="10", help="tiny suite")
    ap.add_argument("--out", default="out/bench-plan.md", help="tiny suite")
    ap.add_argument("--zoo-models", default=ZOO, help="zoo suite")
    ap.add_argument("--zoo-mesh-dims", type=int, default=1, help="zoo suite: 1 (flat mesh) or 2 (2-D meshes too)")
    ap.add_argument("--layers", default="12,24,48,72,96", help="scaling suite")
    ap.add_argument(
        "--no-layers-2d",
        dest="layers_2d",
        action="store_false",
        help="scaling suite: skip the L=72 run over the 2-D meshes",
    )
    args = ap.parse_args()
    suites = {"tiny": suite_tiny, "zoo": suite_zoo, "agreement": suite_agreement, "scaling": suite_scaling, "medium": suite_medium,
              "scale": suite_scale}
    with tempfile.TemporaryDirectory() as tmp:
        for name, fn in suites.items():
            if args.suite in (name, "all"):
                fn(args, Path(tmp))


if __name__ == "__main__":
    main()
