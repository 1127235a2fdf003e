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
