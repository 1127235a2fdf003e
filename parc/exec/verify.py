"""`parc verify`: the source model on one device against the plan on its ranks.

The reference is the source model file itself (plan.json names it and its sha256) run by plain
onnxruntime (parc's array engine on the CPU for values onnxruntime cannot compute with:
a bf16 step), step after step, with the `parc.state` bindings feeding new parameters and state
back. The plan runs through `parc run --dump` on its ranks from the same initial state (the
model's initializers, which every rank slices) and the same seeded data. Compared: every
output other than the new state at every step (the loss), and every state tensor at the end,
gathered from the ranks' shards.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from parc.autodiff.precision import unit_roundoff
from parc.errors import UsageError
from parc.exec.data import NpzData, step_inputs, synthetic
from parc.exec.engine_choice import ort_cpu_lacks
from parc.exec.engines.array import ArrayEngine
from parc.exec.runner import ort_session
from parc.ir.state import StepState, step_state
from parc.plandir import Plan, load_program


def _source(plan_dir: str, plan: Plan) -> Path:
    if plan.model is None:
        raise UsageError(f"{plan_dir}: the plan names no source model (planned from Python with a ModelProto); "
                         "parc verify compares against it")
    path = Path(plan.model.path)
    if not path.is_file():
        raise UsageError(f"{plan_dir}: the source model {path} is gone; parc verify compares against it")
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    if h != plan.model.sha256:
        raise UsageError(f"{plan_dir}: the source model {path} changed since it was planned (sha256 differs)")
    return path


def source_precision(plan_dir: str, plan: Plan) -> str | None:
    """What the source step's products compute in ("bf16", "fp16"), or None for float32."""
    model = onnx.load(str(_source(plan_dir, plan)), load_external_data=False)
    record = step_state({p.key: p.value for p in model.metadata_props})
    return (record.precision or {}).get("compute") if record is not None else None


def reference_run(plan_dir: str, plan: Plan, ranks: int, steps: int, seed: int, init: str = "source",
                  data_file: str | None = None) -> dict:
    """{"outputs": [per step {name: array}], "state": {name: array}} of the source model."""
    path = _source(plan_dir, plan)
    programs = [load_program(plan_dir, r) for r in range(ranks)]
    model = onnx.load(str(path))
    inputs = {i.name for i in model.graph.input}
    state = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in inputs}
    binds, residents = {}, {}
    for prog in programs:  # a pipeline's stages hold parts
        binds.update(prog.bindings)
        residents.update({r["name"]: r for r in prog.residents})
    if init == "seeded":  # the same whole tensors the ranks draw shards of
        from onnx import helper

        from parc.exec.init import seeded_shard

        for r in residents.values():
            if r.get("init") and r["init"]["std"]:
                shape = tuple(r["shape"])
                state[r["name"]] = seeded_shard(seed, r["name"], shape, tuple(np.arange(e) for e in shape),
                                                r["init"]["mean"], r["init"]["std"],
                                                helper.tensor_dtype_to_np_dtype(r["dtype"]))
    names = [o.name for o in model.graph.output]
    if not ort_cpu_lacks(plan):
        sess = ort_session(model, None)
        run = functools.partial(sess.run, names)
    else:  # values onnxruntime's CPU provider cannot compute with (bf16): the array engine, on the CPU
        engine = ArrayEngine(model, device="cpu")
        run = lambda feeds: [engine.run(feeds)[k] for k in names]  # noqa: E731
    data = step_inputs(programs[0])
    source = NpzData(data_file, data) if data_file else None
    outputs = []
    for step in range(steps):
        batch = source.batch(step) if source is not None else synthetic(data, seed, step)
        feeds = {**batch, **{k: v for k, v in state.items() if k in binds.values()}}
        got = dict(zip(names, run(feeds)))
        outputs.append({k: v for k, v in got.items() if k not in binds})
        for out, inp in binds.items():
            state[inp] = got[out]
    record = step_state({p.key: p.value for p in model.metadata_props})
    eps = unit_roundoff((record.precision or {}).get("compute")) if record is not None else None
    adam = _adam_bounds(record, state, steps, eps) if record is not None else {}
    return {"outputs": outputs, "state": {k: state[k] for k in binds.values()}, "bounds": adam, "low_eps": eps}


# A gradient this small against the largest of its tensor is taken to be zero in exact arithmetic
# (a padded row, the key part of a fused QKV bias under softmax): its value is round-off, which
# plans order differently.
ROUNDOFF_GRADIENT = 1e-4
# So is one this small against the largest of any tensor Adam trains: a tensor whose gradient is
# round-off throughout (a key bias of its own under softmax) has no largest of its own to compare
# with. In the reference's second moments of five PyTorch exports (2 steps), the key biases of
# ViT and BERT stood at 1.6e-10 to 1.3e-9 of the model's largest, every other tensor at 6e-4
# or more.
ROUNDOFF_IN_MODEL = 1e-6

# A mixed-precision step (`parc grad --precision`) rounds its products to bfloat16 or float16:
# a plan sums their partial results in another order and rounds them at other places, so its
# values differ from the reference's by multiples of that type's epsilon, not float32's. Its
# tolerances scale with it: rtol at least LOW_RTOL_PER_EPS epsilons, each tensor's atol widened
# by LOW_ATOL_PER_EPS epsilons of its largest magnitude, the first step's loss held to one
# epsilon, and Adam's round-off gradients (above) are those under ROUNDOFF_PER_EPS epsilons of
# the largest (the epsilon: `precision.unit_roundoff`). A missing gradient reduction or a wrong
# shard is off by far more (tested).
LOW_RTOL_PER_EPS, LOW_ATOL_PER_EPS, ROUNDOFF_PER_EPS = 8, 8, 64


def _adam_bounds(record: StepState, state: dict, steps: int, eps: float | None = None) -> dict[str, np.ndarray]:
    """Per parameter trained by Adam(W), the extra error each element may show: Adam divides the
    first moment by the root of the second, so a gradient at round-off level still moves its
    element by up to about lr a step, in a direction the round-off decides. Where the reference's
    second moment says the gradient was at round-off level (ROUNDOFF_GRADIENT of its tensor's
    largest, or ROUNDOFF_IN_MODEL of the largest of every parameter's), the element may differ by
    2 * lr * steps; everywhere else the plain tolerance holds,
    and the moments themselves are always compared plainly."""
    opt = record.optimizer or {}
    if opt.get("name") not in ("adam", "adamw"):
        return {}
    out = {}
    roots = {p: np.sqrt(np.asarray(v, np.float64)) for p in record.params
             if (v := state.get(f"{p}.exp_avg_sq")) is not None and np.size(v)}
    largest = max((float(r.max()) for r in roots.values()), default=0.0)
    for p, rms in roots.items():
        tiny = (rms <= max(ROUNDOFF_GRADIENT, ROUNDOFF_PER_EPS * (eps or 0.0)) * float(rms.max())) | \
            (rms <= ROUNDOFF_IN_MODEL * largest)
        if tiny.any():
            out[p] = np.where(tiny, 2.0 * float(opt["lr"]) * steps, 0.0)
    return out


def plan_run(plan_dir: str, ranks: int, steps: int, seed: int, engine: str, timeout: float, tmp: Path,
             init: str = "source", data_file: str | None = None) -> dict:
    """The same, from the plan's ranks: `parc run --dump` for the outputs, and a checkpoint of its
    last step for the state (whole tensors gathered from the shards as `parc export` does)."""
    from parc.exec.checkpoint import check_checkpoint, full_tensors
    from parc.exec.launch import train

    argv = ["run", plan_dir, "--steps", str(steps), "--seed", str(seed), "--engine", engine,
            "--timeout", str(timeout), "--force", "--dump", str(tmp), "--init", init,
            "--checkpoint", str(tmp / "state")]
    argv += ["--data", data_file] if data_file else []
    if ranks > 1:
        from parc.exec.launch import launch

        if launch(ranks, argv):
            raise UsageError(f"{plan_dir}: the plan's ranks failed (see above); nothing to compare")
    else:  # one rank: this process runs it, as a library (no second trip through the CLI)
        train(Path(plan_dir), steps=steps, seed=seed, engine=engine, data=data_file, as_json=False,
              timeout=timeout, dump=str(tmp), checkpoint=str(tmp / "state"), init=init, echo=lambda _s: None)
    outputs: list[dict] = [{} for _ in range(steps)]
    for path in sorted(tmp.glob("outputs*.npz")):  # one file per pipeline stage
        flat = np.load(path)
        for key in flat.files:
            name, step = key.rsplit("@", 1)
            outputs[int(step)].setdefault(name, flat[key])
    state = full_tensors(tmp / "state", check_checkpoint(tmp / "state"), strict=False)
    return {"outputs": outputs, "state": state}


def _errors(got: np.ndarray, want: np.ndarray, rtol: float, atol: float,
            extra: np.ndarray | float = 0.0, eps: float | None = None) -> tuple[float, float, bool]:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf"), float("inf"), False
    if got.size == 0:
        return 0.0, 0.0, True
    diff = np.abs(got - want)
    scale = float(np.max(np.abs(want)))
    if eps:
        atol += LOW_ATOL_PER_EPS * eps * scale
    ok = bool(np.all(diff <= atol + rtol * np.abs(want) + extra))
    return float(diff.max()) / scale if scale else float(diff.max()), float(diff.max()), ok


# The first step's scalar outputs (the loss) come from the same initial state on both sides, so
# only the order of float32 sums differs: a wrong share of a mean (an uneven split averaged as if
# even: 2.8e-4 on gpt-tiny) passes the default rtol 1e-3 but not this.
FIRST_STEP_RTOL = 1e-5


def effective_rtol(want: dict, rtol: float) -> float:
    """The rtol compared with: the user's, or LOW_RTOL_PER_EPS epsilons of a mixed-precision step's
    low type where that is larger."""
    eps = want.get("low_eps")
    return max(rtol, LOW_RTOL_PER_EPS * eps) if eps else rtol


def compare(want: dict, got: dict, rtol: float, atol: float) -> tuple[list[dict], bool]:
    """One row per output (worst step) and per state tensor: max relative (to the tensor's
    largest magnitude) and absolute error, and whether every element is within atol + rtol*|want|
    (a scalar output at the first step: within atol + min(rtol, FIRST_STEP_RTOL)*|want|)."""
    rows = []
    eps = want.get("low_eps")
    rtol = effective_rtol(want, rtol)
    first = max(FIRST_STEP_RTOL, eps or 0.0)
    for name in want["outputs"][0]:
        worst = (0.0, 0.0, True)
        for step, (w, g) in enumerate(zip(want["outputs"], got["outputs"])):
            if name not in g:
                worst = (float("inf"), float("inf"), False)
                break
            tight = step == 0 and np.asarray(w[name]).size == 1
            e = _errors(g[name], w[name], min(rtol, first) if tight else rtol, atol, eps=eps)
            worst = (max(worst[0], e[0]), max(worst[1], e[1]), worst[2] and e[2])
        rows.append({"tensor": name, "max_rel_err": worst[0], "max_abs_err": worst[1], "ok": worst[2]})
    bounds = want.get("bounds", {})
    for name, w in want["state"].items():
        g = got["state"].get(name)
        e = (_errors(g, w, rtol, atol, bounds.get(name, 0.0), eps) if g is not None
             else (float("inf"), float("inf"), False))
        row = {"tensor": name, "max_rel_err": e[0], "max_abs_err": e[1], "ok": e[2]}
        if name in bounds:
            row["roundoff_elements"] = int(np.count_nonzero(bounds[name]))
        rows.append(row)
    return rows, all(r["ok"] for r in rows)
