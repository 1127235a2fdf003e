"""Whole-graph gradients of the tiny zoo models against float64 finite differences.

Each tiny model (`params_paper is None`) is converted to float64 (`fd.to_float64`), its
parameters moved to a random point near theirs (see `_jitter`), imported, and differentiated
with respect to all its parameters; the exported gradient graph must pass ONNX's full check.
The directional derivative <grad, d> along random unit directions d over all parameters at
once must match central differences of the loss computed from the float64 ONNX model
(relative error < 1e-5). onnxruntime runs both where it has float64 kernels for every op
(t5-tiny); otherwise (Conv, Erf, pools) ONNX's reference evaluator runs them, with fd.py's
float64 kernels where onnx's own are imprecise or wrong. The slow test checks each parameter
tensor on its own.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from fd import (
    ORT,
    REF,
    LossFn,
    assert_directional,
    fd_directional,
    parc_gradients,
    to_float64,
    uses_op_without_float64_kernel,
    with_initializers,
)

from parc.ir import from_model
from parc.models import build_model, list_models
from parc.passes.lower import index_limit

TINY = [m.name for m in list_models() if m.params_paper is None]


def _feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random data for the graph inputs: token ids below the vocabulary, labels below the
    class count, float images."""
    graph = from_model(model)
    feeds = {}
    for v in graph.inputs:
        if v.dtype.is_float:  # type: ignore[union-attr]
            feeds[v.name] = rng.standard_normal(v.shape)
        else:
            limit = index_limit(v)
            feeds[v.name] = rng.integers(0, limit, size=v.shape).astype(v.dtype.numpy)  # type: ignore[union-attr]
    return feeds


def _jitter(a: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A generic point near the model's: zero-initialised residual scales put every ReLU after
    a residual Add exactly on its kink, where finite differences average the two sides."""
    spread = float(a.std()) or 1.0
    return a + 0.1 * spread * rng.standard_normal(a.shape)


def _case(name: str, tmp_path) -> tuple[dict, dict, LossFn]:
    """(parameters at a jittered point, parc's gradients there, the loss as a function)."""
    model = to_float64(onnx.load(str(build_model(name, tmp_path / f"{name}.onnx"))))
    runtime = REF if uses_op_without_float64_kernel(model) else ORT
    rng = np.random.default_rng(0)
    feeds = _feeds(model, rng)
    graph = from_model(model)
    names = [p.name for p in graph.params()]
    assert names
    x = {n: _jitter(np.asarray(graph.constants[n].const.numpy(), np.float64), rng) for n in names}
    model = with_initializers(model, x)
    _, grads = parc_gradients(model, names, runtime, loss="loss", feeds=feeds)
    return x, grads, LossFn(model, names, runtime, loss="loss", feeds=feeds)


@pytest.mark.parametrize("name", TINY)
def test_whole_graph_gradient(name, tmp_path):
    """<grad, d> for random unit directions d over all parameters at once."""
    x, grads, f = _case(name, tmp_path)
    assert_directional(grads, f, x, np.random.default_rng(1), n=3, h=1e-5, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", TINY)
def test_every_parameter_gradient(name, tmp_path):
    """One random direction within each parameter tensor: the all-parameter directions are
    dominated by the largest gradients (vgg's classifier outweighs its convolutions 1000:1).
    Finite differences take the better of two steps: 1e-4 can cross a ReLU kink, 1e-5 loses
    digits to rounding where a gradient is 1e-7 of the loss; a wrong gradient fails both."""
    x, grads, f = _case(name, tmp_path)
    rng = np.random.default_rng(2)
    bad = []
    for k in x:
        v = {n: np.zeros_like(a) for n, a in x.items()}
        d = rng.standard_normal(x[k].shape)
        v[k] = d / np.linalg.norm(d)
        analytic = float(np.sum(grads[k] * v[k]))
        scale = max(abs(analytic), 1e-2 * float(np.linalg.norm(grads[k])), 1e-12)
        err = min(abs(fd_directional(f, x, v, h) - analytic) for h in (1e-4, 1e-5)) / scale
        if err > 1e-4:
            bad.append(f"{k}: relative error {err:.3g}")
    assert not bad, "\n".join(bad)
