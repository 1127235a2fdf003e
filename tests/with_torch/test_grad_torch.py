"""`parc grad` against `torch.autograd.grad` on tiny `transformers` models from both exporters.

Each model is exported by `scripts/export_torch_models.py`, turned into an SGD step with lr = 1
(so `p - p.new` is the gradient), run once in onnxruntime on the saved inputs and the exported
initial parameters, and compared per parameter with torch's gradient of the same loss. Dropout
is off in both: the models are in eval mode when exported and when differentiated.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from parc.autodiff import OptimizerConfig, make_training_step  # noqa: E402
from parc.autodiff.rules import GRADS  # noqa: E402
from parc.errors import UnsupportedOpError  # noqa: E402
from parc.ir import load, to_onnx  # noqa: E402

pytestmark = pytest.mark.torch

MODELS = ("gpt2", "bert", "t5", "llama", "vit")
EXPORTERS = ("legacy", "dynamo")
CASES = [f"{m}-{e}" for m in MODELS for e in EXPORTERS]
RTOL = 1e-4  # |parc - torch| / |torch|, norms over one parameter
# A torch gradient below this fraction of the model's largest is zero in exact arithmetic and
# rounding noise in float32: attention key biases, since softmax(q.(k + b)) does not depend on b
# (q.b is the same for every key). There parc's must be as small: |parc - torch| below the same
# fraction of the largest gradient.
ZERO = 1e-6
# Ops on the loss path with no gradient rule yet, per model: the case is skipped, naming the
# op, until the rule exists (then it runs); any other missing rule fails.
KNOWN_MISSING = {"llama": {"Slice"}, "vit": {"Conv"}}


def _training_step(case: dict) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The SGD (lr = 1) step of the exported model with its gradients as extra outputs, and
    parameter -> gradient name; skips when a known op lacks a gradient rule."""
    graph = load(case["dir"] / case["onnx"], case["dims"])
    try:
        step = make_training_step(graph, OptimizerConfig("sgd", lr=1.0))
    except UnsupportedOpError as e:
        m = re.search(r"\((\w+)\) lies between", str(e))
        op = m.group(1) if m else None
        if op in KNOWN_MISSING.get(case["model"], set()) and op not in GRADS:
            pytest.skip(f"no gradient rule for {op} (on the loss path of {case['model']}): {e}")
        raise
    model = to_onnx(graph)
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(g) for g in step.grads.values())
    return model, step.grads


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def compare(case: dict, script) -> list[dict]:
    """One row per torch parameter with a gradient: parc's (from `p - p.new` and from the
    gradient output) against torch's, as relative errors."""
    model, grads = _training_step(case)
    source = onnx.load(str(case["dir"] / case["onnx"]))
    initial = {t.name: onnx.numpy_helper.to_array(t) for t in source.graph.initializer}
    samples = np.load(case["dir"] / case["inputs"])
    # The exported initial parameters, fed explicitly: the step's parameter inputs keep the
    # exporter's names.
    feeds = {**{k: samples[k] for k in samples.files}, **{p: initial[p] for p in grads}}
    out = _run(model, feeds)

    spec = script.build(case["model"])
    want = script.torch_gradients(spec)
    owners = script.match_parameters(spec, {p: initial[p] for p in grads})
    unmatched = sorted(set(grads) - set(owners))
    assert not unmatched, f"trained initializers that hold no torch parameter: {unmatched}"
    # torch gives an embedding's padding row no gradient from the lookup; the exported Gather
    # does not know the padding id, so that row of a gathered copy is left out of parc's.
    padding = script.padding_rows(spec)
    gathered = {n.input[0] for n in source.graph.node if n.op_type == "Gather"}
    # A tied weight appears as several initializers (the embedding, the LM head's transposed
    # copy); torch's gradient of the one parameter is the sum of theirs.
    by_step: dict[str, np.ndarray] = {}
    by_grad: dict[str, np.ndarray] = {}
    copies: dict[str, list[str]] = {}
    for p, (name, transposed) in owners.items():
        step_g = initial[p].astype(np.float64) - out[f"{p}.new"]
        grad_g = out[grads[p]].astype(np.float64)
        if transposed:
            step_g, grad_g = step_g.T, grad_g.T
        if name in padding and p in gathered and not transposed:
            step_g[padding[name]] = grad_g[padding[name]] = 0
        by_step[name] = by_step.get(name, 0) + step_g
        by_grad[name] = by_grad.get(name, 0) + grad_g
        copies.setdefault(name, []).append(p)

    scale = max(np.linalg.norm(g) for g in want.values())
    rows = []
    for name, w in want.items():
        norm = np.linalg.norm(w)
        if name not in by_step:
            assert norm <= ZERO * scale, f"torch parameter {name} has a gradient but parc trains no copy of it"
            continue
        zero = norm < ZERO * scale
        floor = ZERO * scale if zero else norm  # zero: absolute, at the model's scale
        rows.append({"torch": name, "onnx": copies[name], "zero": zero,
                     "step": np.linalg.norm(by_step[name] - w) / floor,
                     "grad": np.linalg.norm(by_grad[name] - w) / floor})
    np.testing.assert_allclose(out["loss"], np.load(case["dir"] / case["torch_outputs"])["loss"], rtol=1e-5)
    return rows


@pytest.mark.parametrize("case", CASES, indirect=True)
def test_sgd_step_matches_torch_gradients(case, script):
    rows = compare(case, script)
    rel = [r for r in rows if not r["zero"]]
    print(f"{case['model']}-{case['exporter']}: {len(rows)} parameters ({len(rows) - len(rel)} with a zero "
          f"gradient), max relative error {max(r['step'] for r in rel):.2e} (p - p.new), "
          f"{max(r['grad'] for r in rel):.2e} (gradient output)")
    bad = [r for r in rows if not (max(r["step"], r["grad"]) < (1.0 if r["zero"] else RTOL))]
    assert not bad, "\n".join(f"{r['torch']} ({', '.join(r['onnx'])}): p - p.new {r['step']:.2e}, "
                              f"gradient {r['grad']:.2e}" + (" (zero gradient: absolute)" if r["zero"] else "")
                              for r in bad)
    # Every tied copy is trained: the LM head's transposed copy of the embedding is there.
    if case["model"] in ("gpt2", "bert", "t5"):
        assert any(len(r["onnx"]) == 2 for r in rows), "the tied embedding should appear twice"
