"""`parc verify`'s comparison: the first step's loss is held to float32 round-off."""

from __future__ import annotations

import numpy as np

from parc.exec.verify import FIRST_STEP_RTOL, compare


def _run(losses: list[float]) -> dict:
    return {"outputs": [{"loss": np.float32(x)} for x in losses], "state": {"w": np.ones(3, np.float32)}}


def test_a_wrong_share_of_the_mean_fails_at_the_first_step():
    want = _run([4.86, 4.85])
    off = 1 + 2.8e-4  # an uneven split averaged as if even (gpt-tiny on 2 V100 + 2 P100)
    rows, ok = compare(want, _run([4.86 * off, 4.85]), rtol=1e-3, atol=1e-5)
    assert not ok and not rows[0]["ok"]
    rows, ok = compare(want, _run([4.86, 4.85 * off]), rtol=1e-3, atol=1e-5)  # later steps: the given rtol
    assert ok
    rows, ok = compare(want, _run([4.86 * (1 + FIRST_STEP_RTOL / 4), 4.85]), rtol=1e-3, atol=1e-5)
    assert ok  # round-off passes


def test_adam_bounds_take_a_tensor_of_round_off_gradients_as_round_off():
    """A key bias under softmax has a gradient of zero in exact arithmetic: the reference's
    second moment is round-off throughout that tensor (ViT's export: 1e-9 of the model's largest),
    so no element of it is small against the tensor's own largest. Its elements still get Adam's
    round-off allowance; a tensor of small but real gradients (1e-3 of the largest) does not, nor
    do the rest of the elements of a tensor with a few round-off ones."""
    from parc.exec.verify import _adam_bounds
    from parc.ir.state import StepState

    rng = np.random.default_rng(0)
    state = {"w.exp_avg_sq": rng.uniform(0.5, 1.0, (4, 4)) ** 2 * 1e-4,
             "key_bias.exp_avg_sq": rng.uniform(0.5, 1.0, 4) ** 2 * 1e-4 * 1e-18,
             "small.exp_avg_sq": rng.uniform(0.5, 1.0, 4) ** 2 * 1e-4 * 1e-6,
             "mixed.exp_avg_sq": np.array([1e-4, 1e-4, 1e-4 * 1e-12, 1e-4])}
    record = StepState(params=("w", "key_bias", "small", "mixed"), optimizer={"name": "adamw", "lr": 1e-3})
    bounds = _adam_bounds(record, state, steps=2)
    assert set(bounds) == {"key_bias", "mixed"}
    assert np.all(bounds["key_bias"] == 4e-3)
    assert bounds["mixed"].tolist() == [0.0, 0.0, 4e-3, 0.0]
    sgd = StepState(params=("w", "key_bias"), optimizer={"name": "sgd", "lr": 1e-3})
    assert _adam_bounds(sgd, state, steps=2) == {}
