"""Optimizer steps of `gpt-tiny` run in plain onnxruntime against a NumPy float64 reference of
PyTorch's optimizers, fed the gradients the step itself computes (exposed as extra outputs).

A training loop here is what any runtime does with a step: feed data and the current state,
then feed each output back to the input `parc.state` binds it to.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from parc.autodiff import OptimizerConfig, make_training_step
from parc.ir import load, to_onnx
from parc.models import build_model

VOCAB, SHAPE = 128, (2, 16)  # gpt-tiny's vocabulary and (batch, seq)


@pytest.fixture(scope="module")
def forward(tmp_path_factory) -> Path:
    return build_model("gpt-tiny", tmp_path_factory.mktemp("gpt_tiny") / "gpt-tiny.onnx")


class Step:
    """A training step in an onnxruntime session, with its gradients as extra outputs."""

    def __init__(self, path: Path, cfg: OptimizerConfig) -> None:
        graph = load(path)
        make_training_step(graph, cfg)
        model = to_onnx(graph)
        self.record = json.loads(graph.metadata["parc.state"])
        self.grads: dict[str, str] = self.record["grads"]
        model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(g) for g in self.grads.values())
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
        self.state = {name: inits[name] for name in self.record["bindings"].values()}  # initial values
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.out_names = [o.name for o in self.sess.get_outputs()]

    def run(self, data: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One step: returns every output and moves the state on by the bindings."""
        out = dict(zip(self.out_names, self.sess.run(None, {**data, **self.state})))
        self.state = {inp: out[o] for o, inp in self.record["bindings"].items()}
        return out


def batch(seed: int = 0) -> dict[str, np.ndarray]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, SHAPE, dtype=np.int64)
    return {"input_ids": ids, "labels": np.roll(ids, -1, axis=1)}


def reference(cfg: OptimizerConfig, p: np.ndarray, g: np.ndarray, state: dict[str, np.ndarray],
              step: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One update in float64, written as torch.optim's single-tensor code writes it; `step` is
    the number of steps taken before this one."""
    p, g = p.astype(np.float64), g.astype(np.float64)
    state = {k: v.astype(np.float64) for k, v in state.items()}
    lr, wd = cfg.lr, cfg.weight_decay
    if cfg.name == "adamw":
        p = p * (1 - lr * wd)
    elif wd:
        g = g + wd * p
    if cfg.name == "sgd":
        return p - lr * g, {}
    if cfg.name == "momentum":  # dampening 0, not Nesterov; a zero buffer is torch's first step
        buf = cfg.momentum * state["momentum"] + g
        return p - lr * buf, {"momentum": buf}
    b1, b2 = cfg.betas
    t = step + 1
    m = state["exp_avg"] + (g - state["exp_avg"]) * (1 - b1)  # lerp_
    v = state["exp_avg_sq"] * b2 + (1 - b2) * g * g
    step_size = lr / (1 - b1**t)
    denom = np.sqrt(v) / np.sqrt(1 - b2**t) + cfg.eps
    return p - step_size * m / denom, {"exp_avg": m, "exp_avg_sq": v}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def assert_update(new: np.ndarray, old: np.ndarray, want: np.ndarray, rtol: float, what) -> None:
    """new - old (float32 parameters) is the update `want`, element by element, to `rtol` of the
    tensor's largest update plus float32 rounding at the parameter's scale (up to half a unit
    in the last place each for AdamW's factor 1 - lr wd, the decay and the subtraction; one
    unit is about 1e-4 of a 1e-3 update of a parameter near 1, which is why a check of the
    parameter alone, to 1e-5, cannot see a wrong update)."""
    got = new.astype(np.float64) - old
    tol = rtol * np.abs(want).max() + 1.5 * np.spacing(np.abs(new))
    worst = np.argmax(np.abs(got - want) - tol)
    assert np.all(np.abs(got - want) <= tol), (what, got.flat[worst], want.flat[worst])


def test_adamw_50_steps_match_reference_and_loss_falls(forward):
    cfg = OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01)
    step = Step(forward, cfg)
    params = step.record["params"]
    assert step.record["step"] == "parc.step"
    ref_p = {p: step.state[p].astype(np.float64) for p in params}
    ref_s = {p: {k: step.state[f"{p}.{k}"].astype(np.float64) for k in cfg.state_names} for p in params}
    data = batch()
    losses = []
    for t in range(50):
        before = {p: step.state[p] for p in params}
        out = step.run(data)
        losses.append(float(out["loss"]))
        assert int(step.state["parc.step"]) == t + 1
        for p in params:
            new, ref_s[p] = reference(cfg, ref_p[p], out[step.grads[p]], ref_s[p], t)
            delta_ref, ref_p[p] = new - ref_p[p], new
            assert rel(out[f"{p}.new"], ref_p[p]) < 1e-5, (t, p)
            assert_update(out[f"{p}.new"], before[p], delta_ref, 1e-5, (t, p))
            for k in cfg.state_names:
                assert rel(out[f"{p}.{k}.new"], ref_s[p][k]) < 1e-5, (t, p, k)
    assert losses[-1] < 0.5 * losses[0], losses
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), losses


ONE_STEP = [
    OptimizerConfig("sgd", lr=0.1, weight_decay=0.01),
    OptimizerConfig("momentum", lr=0.1, weight_decay=0.01, momentum=0.8),
    OptimizerConfig("adam", lr=0.1, weight_decay=0.01, betas=(0.8, 0.99), eps=1e-6),
    OptimizerConfig("adamw", lr=0.1, weight_decay=0.01, betas=(0.8, 0.99), eps=1e-6),
]


@pytest.mark.parametrize("cfg", ONE_STEP, ids=[c.name for c in ONE_STEP])
def test_one_step_matches_reference(forward, cfg):
    """From random optimizer state (and, for Adam, step 3), so every term of the rule counts."""
    step = Step(forward, cfg)
    rng = np.random.default_rng(1)
    params = step.record["params"]
    for p in params:
        for k in cfg.state_names:
            shape = step.state[p].shape
            s = rng.standard_normal(shape) * 1e-2
            step.state[f"{p}.{k}"] = (np.abs(s) * 1e-2 if k == "exp_avg_sq" else s).astype(np.float32)
    before = dict(step.state)
    if cfg.uses_step:
        before["parc.step"] = step.state["parc.step"] = np.array(3, np.int64)
    out = step.run(batch(seed=2))
    for p in params:
        state = {k: before[f"{p}.{k}"] for k in cfg.state_names}
        new, new_state = reference(cfg, before[p], out[step.grads[p]], state, 3)
        assert rel(out[f"{p}.new"], new) < 1e-5, p
        assert_update(out[f"{p}.new"], before[p], new - before[p], 1e-5, p)
        for k, v in new_state.items():
            assert rel(out[f"{p}.{k}.new"], v) < 1e-5, (p, k)
    if cfg.uses_step:
        assert int(out["parc.step.next"]) == 4


@pytest.mark.parametrize("cfg", ONE_STEP, ids=[c.name for c in ONE_STEP])
def test_reference_is_torch_optim(cfg):
    """The NumPy reference is PyTorch's optimizer (checked where torch is installed)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    p0, grads = rng.standard_normal((4, 5)), [rng.standard_normal((4, 5)) for _ in range(3)]
    w = torch.nn.Parameter(torch.tensor(p0))
    kw = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    opt = {"sgd": lambda: torch.optim.SGD([w], **kw),
           "momentum": lambda: torch.optim.SGD([w], momentum=cfg.momentum, **kw),
           "adam": lambda: torch.optim.Adam([w], betas=cfg.betas, eps=cfg.eps, **kw),
           "adamw": lambda: torch.optim.AdamW([w], betas=cfg.betas, eps=cfg.eps, **kw)}[cfg.name]()
    p, state = p0, {k: np.zeros_like(p0) for k in cfg.state_names}
    for t, g in enumerate(grads):
        w.grad = torch.tensor(g)
        opt.step()
        p, state = reference(cfg, p, g, state, t)
        np.testing.assert_allclose(w.detach().numpy(), p, rtol=1e-12, atol=1e-12)
