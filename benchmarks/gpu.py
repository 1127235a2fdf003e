"""One GPU: `parc run --engine cupy` against the same model in PyTorch eager (issue 14).

    python benchmarks/gpu.py all --work DIR [--model gpt-medium] [--set batch=8 ...] [--steps 7]

builds the model with random weights, makes an AdamW training step (`parc grad`), plans it for
one device, and then measures, each in its own process so neither sees the other's memory:
the matmul and copy ceilings of the GPU (through PyTorch), `parc run --engine cupy --json` in
fp32 and with TF32 matmuls, the same GPT written in PyTorch eager from the same config and the
same initial weights and batches (AdamW, PyTorch's default foreach implementation), and one
profiled step of each (per op type: CUDA events around each parc kernel, torch.profiler for
PyTorch). Everything lands in DIR/results.json; the table printed last is what
docs/benchmarks.md records. `scripts/gpu.sh` runs it with the GPU tests in one command.

The PyTorch side computes what the ONNX graph computes (explicit attention with the additive
mask, exact GELU, tied LM head, mean cross-entropy), so losses agree to fp32 round-off.
Step times exclude the first step (warm-up: CuPy compiles its kernels then); memory is what each
process holds from the device: CuPy's pool high-water mark against torch's max_memory_reserved.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def sh(*args: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True, env={**os.environ, **(env or {})})
    if check and res.returncode:
        raise SystemExit(f"{' '.join(args)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def parc_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return sh(sys.executable, "-m", "parc.cli.main", *args, env=env)


# ---- set-up --------------------------------------------------------------------------------------
def setup(work: Path, model: str, sets: list[str], lr: float, devices: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    overrides = [a for s in sets for a in ("--set", s)]
    parc_cli("models", "build", model, *overrides, "-o", str(work / "model.onnx"))
    fill_weights(work / "model.onnx")
    t1 = time.perf_counter()
    parc_cli("grad", str(work / "model.onnx"), "--optimizer", "adamw", "--lr", str(lr), "-o", str(work / "train.onnx"))
    t2 = time.perf_counter()
    parc_cli("plan", str(work / "train.onnx"), "--devices", devices, "-o", str(work / "plan"))
    t3 = time.perf_counter()
    info = {k: v for k, v in json.loads(parc_cli("inspect", str(work / "train.onnx"), "--json").stdout).items()
            if not isinstance(v, list | dict) or k == "phases"}
    plan = json.loads((work / "plan" / "plan.json").read_text())
    cfg = dict(s.split("=", 1) for s in sets)
    return {"model": model, "set": cfg, "lr": lr, "devices": devices,
            "build_s": t1 - t0, "grad_s": t2 - t1, "plan_s": t3 - t2, "inspect": info,
            "predicted_step_s": plan["predicted"]["step_time_s"],
            "predicted_memory_bytes": max(plan["predicted"]["memory_bytes_per_device"])}


def setup_bf16(work: Path) -> None:
    """The bf16 mixed-precision step (`parc grad --precision bf16`) of the same model and weights,
    planned as the float32 one (made only when a bf16 part runs: it costs the GPU's time)."""
    if (work / "plan_bf16").exists():
        return
    info = json.loads((work / "setup.json").read_text())
    parc_cli("grad", str(work / "model.onnx"), "--optimizer", "adamw", "--lr", str(info["lr"]), "--precision",
             "bf16", "-o", str(work / "train_bf16.onnx"))
    parc_cli("plan", str(work / "train_bf16.onnx"), "--devices", info["devices"], "-o", str(work / "plan_bf16"))


def fill_weights(path: Path, seed: int = 0) -> None:
    """Give a model's parameters real values (the zoo's inits: N(0, 0.02) matrices, ones for
    norm scales, zeros for biases) in place, whether inline or external (a sparse build)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path), load_external_data=False)
    rng = np.random.default_rng(seed)
    inline = False
    for t in model.graph.initializer:
        if t.data_type != onnx.TensorProto.FLOAT or t.name.startswith(("const.", "causal_mask")):
            continue
        shape = tuple(t.dims)
        if t.name.endswith(".bias"):
            value = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            value = np.ones(shape, np.float32)
        else:
            value = (rng.standard_normal(shape, np.float32) * (0.01 if t.name == "wpe.weight" else 0.02))
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            out = np.memmap(path.parent / info["location"], np.float32, "r+", int(info.get("offset", 0)), shape)
            out[...] = value
            out.flush()
        else:
            t.CopyFrom(numpy_helper.from_array(value, t.name))
            inline = True
    if inline:
        onnx.save(model, str(path))


# ---- the GPU's ceilings --------------------------------------------------------------------------
def ceilings() -> dict:
    import torch

    out = {}
    n = 8192
    for name, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                              ("bf16", torch.bfloat16, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        out[f"matmul_{name}_flops"] = 2 * n**3 / _cuda_time(lambda: a @ b, 10)  # noqa: B023
    torch.backends.cuda.matmul.allow_tf32 = False
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    out["copy_bytes_per_s"] = 2 * x.numel() / _cuda_time(lambda: y.copy_(x), 20)
    return out


def _cuda_time(fn, reps: int) -> float:
    """Median seconds of fn on the current stream (CUDA events), after warm-up."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


# ---- parc ----------------------------------------------------------------------------------------
def run_parc(work: Path, steps: int, tf32: bool, kernels: bool = True, plan: str = "plan", rows: bool = True) -> dict:
    """`parc run --engine cupy`; without `kernels`, CuPy's generic operations only
    (PARC_CUPY_KERNELS=0: no fused elementwise kernels, no softmax kernel); without `rows`, the
    row steps' parts apart (PARC_CUPY_ROWS=0: what taking the trees into the softmax kernels
    gives); `plan`: plan_bf16 for the bf16 step."""
    env = {**({} if kernels else {"PARC_CUPY_KERNELS": "0"}), **({} if rows else {"PARC_CUPY_ROWS": "0"})}
    res = parc_cli("run", str(work / plan), "--steps", str(steps), "--engine", "cupy", "--json",
                   *(["--tf32"] if tf32 else []), env=env or None)
    records = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {"losses": [r["loss"] for r in records], "step_times_s": [r["step_time_s"] for r in records],
            "device_bytes": max(r.get("device_bytes", 0) for r in records),
            # the tensors the rank held at its peak, counted as on a CPU (what `parc simulate` predicts)
            "held_bytes": max(records[-1].get("peak_bytes_per_rank") or [0])}


WARM_STEPS = 3  # a run's steps 1-2 compile kernels and size the pool (step 2: 1.0-1.6 s on an H100)


def profile_parc(work: Path, tf32: bool, steps: int = 2, plan: str = "plan") -> dict:
    """Per op type GPU time of `steps` steps after WARM_STEPS warm-up steps, in this process."""
    if tf32:
        os.environ["CUPY_TF32"] = "1"
    from parc.exec.comm import MpiComm
    from parc.exec.data import step_inputs, synthetic
    from parc.exec.runner import Rank

    rank = Rank(work / plan, 0, comm=MpiComm(timeout=120), engine="cupy")
    inputs = step_inputs(rank.program)
    for s in range(WARM_STEPS):  # kernels compiled, and the memory pool at its size (no more releases)
        rank.step(synthetic(inputs, 0, s))
    rank.synchronize()
    profile: dict[str, list] = {}
    for e in rank.engines.values():
        e.engine.profile = profile
    t0 = time.perf_counter()
    for s in range(steps):
        rank.step(synthetic(inputs, 0, WARM_STEPS + s))
    rank.synchronize()
    wall = (time.perf_counter() - t0) / steps
    ops = {op: {"calls": c // steps, "s": t / steps} for op, (c, t) in profile.items() if "[" not in op}
    shapes = sorted(((op, c // steps, t / steps) for op, (c, t) in profile.items() if "[" in op), key=lambda x: -x[2])
    return {"wall_s": wall, "kernel_s": sum(v["s"] for v in ops.values()), "ops": ops,
            "by_shape": [{"op": op, "calls": c, "s": t} for op, c, t in shapes[:40]]}


# ---- PyTorch -------------------------------------------------------------------------------------
def torch_gpt(weights: dict[str, np.ndarray], cfg: dict):
    """The zoo GPT (parc.models.gpt) in PyTorch eager, holding `weights` by their ONNX names."""
    import torch
    import torch.nn.functional as F  # noqa: N812

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.names = [k for k in weights if not k.startswith(("const.", "causal_mask"))]
            for k in self.names:
                self.register_parameter(k.replace(".", "__"), torch.nn.Parameter(torch.from_numpy(weights[k].copy())))
            seq = int(cfg["seq"])
            self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

        def p(self, name: str):
            return getattr(self, name.replace(".", "__"))

        def forward(self, ids, labels):
            b, s = ids.shape
            h, heads = int(cfg["hidden"]), int(cfg["heads"])
            d = h // heads
            p = self.p
            x = p("wte.weight")[ids] + p("wpe.weight")
            for i in range(int(cfg["layers"])):
                a = F.layer_norm(x, (h,), p(f"h.{i}.ln_1.weight"), p(f"h.{i}.ln_1.bias"), 1e-5)
                qkv = a @ p(f"h.{i}.attn.qkv.weight") + p(f"h.{i}.attn.qkv.bias")
                q, k, v = qkv.split(h, dim=-1)
                q = q.view(b, s, heads, d).transpose(1, 2)
                k = k.view(b, s, heads, d).permute(0, 2, 3, 1)
                v = v.view(b, s, heads, d).transpose(1, 2)
                sc = (q @ k) * (1.0 / math.sqrt(d))
                sc = torch.where(self.mask, sc, torch.tensor(-1e9, dtype=sc.dtype, device=sc.device))
                c = (sc.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h)
                x = x + (c @ p(f"h.{i}.attn.proj.weight") + p(f"h.{i}.attn.proj.bias"))
                m = F.layer_norm(x, (h,), p(f"h.{i}.ln_2.weight"), p(f"h.{i}.ln_2.bias"), 1e-5)
                m = F.gelu(m @ p(f"h.{i}.mlp.fc.weight") + p(f"h.{i}.mlp.fc.bias"))
                x = x + (m @ p(f"h.{i}.mlp.proj.weight") + p(f"h.{i}.mlp.proj.bias"))
            x = F.layer_norm(x, (h,), p("ln_f.weight"), p("ln_f.bias"), 1e-5)
            logits = x.reshape(b * s, h) @ p("wte.weight").t()
            return F.cross_entropy(logits, labels.reshape(-1))

    return GPT()


def run_torch(work: Path, steps: int, tf32: bool, device: str, profile: bool = False, bf16: bool = False) -> dict:
    """PyTorch eager; `bf16`: under torch.autocast(bfloat16), its float32 master weights and
    AdamW unchanged (what `parc grad --precision bf16` writes)."""
    import onnx
    import torch
    from onnx import numpy_helper

    from parc.exec.data import step_inputs, synthetic
    from parc.plandir import load_program

    torch.backends.cuda.matmul.allow_tf32 = tf32
    setup_info = json.loads((work / "setup.json").read_text())
    model = onnx.load(str(work / "model.onnx"))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    del model
    cfg = _config(setup_info)
    net = torch_gpt(weights, cfg).to(device)
    del weights
    opt = torch.optim.AdamW(net.parameters(), lr=setup_info["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    inputs = step_inputs(load_program(work / "plan", 0))

    def step(s: int) -> torch.Tensor:
        batch = synthetic(inputs, 0, s)
        ids = torch.from_numpy(batch["input_ids"]).to(device)
        labels = torch.from_numpy(batch["labels"]).to(device)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            loss = net(ids, labels)
        loss.backward()
        opt.step()
        return loss

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if profile:
        step(0)
        sync()
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as tprofile

        with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
            step(1)
            sync()
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        return {"kernels": [{"name": e.key[:80], "calls": e.count, "s": e.device_time_total / 1e6}
                            for e in rows[:25]],
                "kernel_s": sum(e.self_device_time_total for e in rows) / 1e6}
    losses, times = [], []
    for s in range(steps):
        t0 = time.perf_counter()
        loss = step(s)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().cpu()))
    out = {"losses": losses, "step_times_s": times}
    if device == "cuda":
        out["device_bytes"] = int(torch.cuda.max_memory_reserved())
        out["allocated_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def _config(setup_info: dict) -> dict:
    from parc.models.registry import _lookup

    cfg = dict(_lookup(setup_info["model"]).info.defaults)
    cfg.update({k: int(v) if str(v).isdigit() else v for k, v in setup_info["set"].items()})
    return cfg


# ---- calibration: `parc profile` on the GPU, the plan's prediction from it ------------------------
def calibrate(work: Path, tf32: bool, seconds: float = 0.3) -> dict:
    """`parc profile --engine cupy` (fp32 or TF32 matmuls), then the one-GPU plan of the same
    training step with that calibration: its predicted step time (the task graph's simulation,
    whose task times price the modules as the engine runs them) and memory."""
    import yaml

    prec = "tf32" if tf32 else "fp32"
    env = {"CUPY_TF32": "1" if tf32 else "0"}
    calib = work / f"calib_{prec}.yaml"
    t0 = time.perf_counter()
    parc_cli("profile", "-o", str(calib), "--engine", "cupy", "--seconds", str(seconds), env=env)
    profile_s = time.perf_counter() - t0
    text = calib.read_text()
    device, figures = next(iter(yaml.safe_load(text)["devices"].items()))
    plan = work / f"plan_{prec}"
    parc_cli("plan", str(work / "train.onnx"), "--devices", f"1x{device}", "--calibration", str(calib),
             "-o", str(plan))
    doc = json.loads((plan / "plan.json").read_text())
    predicted = doc["predicted"]
    return {"device": device, "figures": figures, "profile_s": profile_s,
            "header": [line for line in text.splitlines() if line.startswith("#")],
            "predicted_step_s": doc["simulation"]["step_time_s"], "search_step_s": predicted["step_time_s"],
            "predicted_memory_bytes": max(predicted["memory_bytes_per_device"]),
            "simulated_held_bytes": max(r.get("peak_bytes") or 0 for r in doc["simulation"]["ranks"])}


# ---- the whole measurement -----------------------------------------------------------------------
def child(kind: str, work: Path, *args: str) -> dict:
    """Run one measurement in a fresh interpreter (its own CUDA context and memory pool)."""
    res = sh(sys.executable, __file__, kind, "--work", str(work), *args)
    return json.loads(res.stdout.strip().splitlines()[-1])


def environment() -> dict:
    out = {"python": platform.python_version(), "host": platform.node()}
    try:
        out["gpu"] = sh("nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                        "--format=csv,noheader", check=False).stdout.strip()
    except FileNotFoundError:
        out["gpu"] = "none (no nvidia-smi)"
    try:
        import cupy

        out["cupy"] = cupy.__version__
        out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        out["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as e:  # reported, not fatal: the table says what is missing
        out["cupy"] = f"unavailable: {e}"
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        out["torch"] = "unavailable"
    return out


def summary(r: dict) -> str:
    def med(xs):
        return statistics.median(xs[1:]) if len(xs) > 1 else xs[0]

    lines = [f"environment: {json.dumps(r['environment'])}"]
    c = r.get("ceilings", {})
    if c:
        lines.append("ceilings (torch, 8192^3 matmul, 1 GiB copy): " + ", ".join(
            f"{k} {v / 1e12:.1f} T" if "flops" in k else f"{k} {v / 1e12:.2f} TB/s" for k, v in c.items()))
    flops = r["setup"]["inspect"].get("flops_step") or 3 * r["setup"]["inspect"].get("flops_forward", 0)
    lines.append(f"model {r['setup']['model']} {r['setup']['set']}: {flops / 1e12:.2f} TFLOP/step; "
                 f"plan predicted {r['setup']['predicted_step_s'] * 1e3:.1f} ms, "
                 f"{r['setup']['predicted_memory_bytes'] / 2**30:.2f} GiB")
    lines.append("| precision | parc step ms | torch step ms | time ratio | parc GiB | torch GiB | mem ratio "
                 "| max loss rel diff | parc MFU |")
    lines.append("|---|---|---|---|---|---|---|---|---|")
    for prec in ("fp32", "tf32", "bf16", "fp32_generic", "tf32_generic", "tf32_rows_apart"):
        base = prec.split("_")[0]
        p, t = r.get(f"parc_{prec}"), r.get(f"torch_{base}")
        if not p or not t:
            continue
        pm, tm = med(p["step_times_s"]), med(t["step_times_s"])
        diff = max(abs(a - b) / abs(b) for a, b in zip(p["losses"][:5], t["losses"][:5]))
        peak = c.get(f"matmul_{base}_flops")
        mfu = f"{flops / pm / peak:.1%}" if peak else "-"
        pb, tb = p.get("device_bytes", 0), t.get("device_bytes", 0)
        ratio = f"{pb / tb:.3f}" if tb else "-"
        lines.append(f"| {prec} | {pm * 1e3:.1f} | {tm * 1e3:.1f} | {pm / tm:.3f} | {pb / 2**30:.2f} | "
                     f"{tb / 2**30:.2f} | {ratio} | {diff:.2e} | {mfu} |")
    for prec in ("fp32", "tf32"):
        cal, p = r.get(f"calibrate_{prec}"), r.get(f"parc_{prec}")
        if not cal:
            continue
        f = cal["figures"]
        line = (f"parc profile ({prec}, {cal['profile_s']:.0f} s): matmul {f['fp32_tflops'] * f['compute_efficiency']:.1f} "
                f"TFLOP/s, memory {f['bandwidth_gbs']:.0f} GB/s, floor {f['launch_floor_us']:.1f} us, task "
                f"{f['task_overhead_us']:.1f} us; plan on 1x{cal['device']} with it predicts "
                f"{cal['predicted_step_s'] * 1e3:.1f} ms, {cal['predicted_memory_bytes'] / 2**30:.2f} GiB")
        if p:
            pb, held, sim_held = p.get("device_bytes", 0), p.get("held_bytes", 0), cal.get("simulated_held_bytes", 0)
            line += (f" (measured {med(p['step_times_s']) * 1e3:.1f} ms: predicted/measured "
                     f"{cal['predicted_step_s'] / med(p['step_times_s']):.3f}"
                     + (f"; memory {cal['predicted_memory_bytes'] / pb:.3f} of the pool's high-water mark" if pb else "")
                     + (f"; tensors held at peak: simulated {sim_held / 2**30:.2f} GiB, counted {held / 2**30:.2f} "
                        f"GiB, {sim_held / held:.3f}" if held and sim_held else "") + ")")
        lines.append(line)
    prof = r.get("profile_parc")
    if prof:
        lines.append(f"parc profile ({r.get('profile_precision')}): wall {prof['wall_s'] * 1e3:.1f} ms/step, kernels "
                     f"{prof['kernel_s'] * 1e3:.1f} ms")
        for op, v in sorted(prof["ops"].items(), key=lambda kv: -kv[1]["s"])[:14]:
            lines.append(f"  {op:<28} {v['calls']:>6} calls {v['s'] * 1e3:9.2f} ms")
        lines.append("  by input shapes:")
        for v in prof.get("by_shape", [])[:25]:
            lines.append(f"  {v['op'][:70]:<70} {v['calls']:>5} calls {v['s'] * 1e3:8.2f} ms")
    tprof = r.get("profile_torch")
    if tprof:
        lines.append(f"torch profile: kernels {tprof['kernel_s'] * 1e3:.1f} ms")
        for k in tprof["kernels"][:12]:
            lines.append(f"  {k['name'][:60]:<60} {k['calls']:>6} {k['s'] * 1e3:9.2f} ms")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["all", "setup", "ceilings", "parc", "torch", "profile-parc", "profile-torch",
                                     "calibrate", "summary"])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--model", default="gpt-medium")
    ap.add_argument("--set", dest="sets", action="append", default=None)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--devices", default="1xh100-80g")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--tf32", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="the bf16 mixed-precision step (plan_bf16; torch autocast)")
    ap.add_argument("--no-kernels", action="store_true", help="parc without its own CUDA kernels")
    ap.add_argument("--rows-apart", action="store_true", help="parc with its row steps' parts apart (PARC_CUPY_ROWS=0)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--results", type=Path, help="where `all` writes results.json (default: in --work)")
    ap.add_argument("--skip", action="append", default=[], help="parts of `all` to leave out")
    ap.add_argument("--profile-seconds", type=float, default=0.3, help="`parc profile --seconds` of `calibrate`")
    a = ap.parse_args()
    sets = a.sets if a.sets is not None else ["batch=8"]
    if a.kind == "setup":
        print(json.dumps(setup(a.work, a.model, sets, a.lr, a.devices)))
    elif a.kind == "ceilings":
        print(json.dumps(ceilings()))
    elif a.kind == "parc":
        if a.bf16:
            setup_bf16(a.work)
        print(json.dumps(run_parc(a.work, a.steps, a.tf32, not a.no_kernels, "plan_bf16" if a.bf16 else "plan",
                                  not a.rows_apart)))
    elif a.kind == "torch":
        print(json.dumps(run_torch(a.work, a.steps, a.tf32, a.device, bf16=a.bf16)))
    elif a.kind == "profile-parc":
        if a.bf16:
            setup_bf16(a.work)
        print(json.dumps(profile_parc(a.work, a.tf32, plan="plan_bf16" if a.bf16 else "plan")))
    elif a.kind == "profile-torch":
        print(json.dumps(run_torch(a.work, a.steps, a.tf32, a.device, profile=True)))
    elif a.kind == "calibrate":
        print(json.dumps(calibrate(a.work, a.tf32, a.profile_seconds)))
    elif a.kind == "summary":
        print(summary(json.loads((a.results or a.work / "results.json").read_text())))
    else:
        results_path = a.results or a.work / "results.json"
        r = {"environment": environment()}
        a.work.mkdir(parents=True, exist_ok=True)

        def save(key: str, value) -> None:
            r[key] = value
            results_path.write_text(json.dumps(r, indent=1))
            print(f"[{time.strftime('%H:%M:%S')}] {key} done", flush=True)

        if (a.work / "setup.json").exists() and "setup" in a.skip:
            save("setup", json.loads((a.work / "setup.json").read_text()))
        else:
            save("setup", setup(a.work, a.model, sets, a.lr, a.devices))
            (a.work / "setup.json").write_text(json.dumps(r["setup"]))
        dev = ["--device", a.device]
        if "ceilings" not in a.skip and a.device == "cuda":
            save("ceilings", child("ceilings", a.work))
        for prec in ("fp32", "tf32"):
            flag = ["--tf32"] if prec == "tf32" else []
            if f"parc_{prec}" not in a.skip:
                save(f"parc_{prec}", child("parc", a.work, "--steps", str(a.steps), *flag))
            if f"parc_{prec}_generic" not in a.skip and a.device == "cuda":
                save(f"parc_{prec}_generic", child("parc", a.work, "--steps", str(a.steps), *flag, "--no-kernels"))
            if f"torch_{prec}" not in a.skip:
                save(f"torch_{prec}", child("torch", a.work, "--steps", str(a.steps), *flag, *dev))
        if "parc_bf16" not in a.skip:
            setup_bf16(a.work)
            save("parc_bf16", child("parc", a.work, "--steps", str(a.steps), "--bf16"))
        if "torch_bf16" not in a.skip:
            save("torch_bf16", child("torch", a.work, "--steps", str(a.steps), "--bf16", *dev))
        if "parc_tf32_rows_apart" not in a.skip and a.device == "cuda":  # after the bars' parts: cut first
            save("parc_tf32_rows_apart", child("parc", a.work, "--steps", str(a.steps), "--tf32", "--rows-apart"))
        if "calibrate" not in a.skip and a.device == "cuda":
            for prec in ("fp32", "tf32"):
                save(f"calibrate_{prec}", child("calibrate", a.work, "--profile-seconds", str(a.profile_seconds),
                                                *(["--tf32"] if prec == "tf32" else [])))
        if "profile" not in a.skip:
            r["profile_precision"] = "tf32"
            save("profile_parc", child("profile-parc", a.work, "--tf32"))
            if a.device == "cuda":
                save("profile_torch", child("profile-torch", a.work, "--tf32", *dev))
        print(summary(r))


if __name__ == "__main__":
    main()
