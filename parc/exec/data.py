"""Training data for `parc run` and `parc verify`: synthetic (seeded) or from an npz file.

Every rank builds the same whole batch for a step and keeps its piece (`Rank.data_piece`), so
the data a plan sees does not depend on how it is split. Synthetic data is a pool of `POOL`
batches drawn from `numpy.random.default_rng((seed, k))` and cycled (step s uses batch
s mod POOL): floats standard normal, integers uniform below the smallest table they index
(token ids, class labels), and a boolean input, an integer one that indexes no table or a 0/1 one
of two or more dims (an attention mask, which an export may look up in a table of two; token type
ids) as padding: along its last axis ones and then zeros, with at most an eighth of each row
padded (`padding`). A model can fit so few batches, so the loss falls: a smoke test of
training, not a dataset. An npz file holds one array per data input
with a leading step axis (``[steps, *shape]``) or exactly the input's shape (the same batch
every step); names, shapes and dtypes are checked before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from onnx import helper

from parc.errors import UsageError
from parc.plandir import Program


def data_inputs(program: Program) -> list[dict]:
    """The data residents of a rank program (name, shape, dtype, high), in graph order."""
    return [r for r in program.residents if r["kind"] == "data"]


def step_inputs(program: Program) -> list[dict]:
    """The data inputs of the whole step, in graph order: every rank draws the same whole batch
    from them (a pipeline stage's program lists the whole step's, though it reads only some)."""
    return list(program.data_inputs or data_inputs(program))


POOL = 4  # synthetic batches, cycled


def synthetic(inputs: Sequence[Mapping], seed: int, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng((seed, step % POOL))
    out = {}
    for r in inputs:
        dtype = helper.tensor_dtype_to_np_dtype(r["dtype"])
        shape = tuple(r["shape"])
        if np.issubdtype(dtype, np.floating):
            out[r["name"]] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_ or not r.get("high") or (r["high"] == 2 and len(shape) >= 2):
            out[r["name"]] = padding(rng, shape).astype(dtype)
        else:
            out[r["name"]] = rng.integers(0, r["high"], size=shape).astype(dtype)
    return out


PADDED = 8  # a synthetic mask pads at most 1/PADDED of a row


def padding(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A 0/1 mask as a batch's padding: each row (the last axis) holds ones, then zeros for up to
    1/`PADDED` of its length. A mask drawn 0/1 at random, as these inputs were, hides scores in
    the middle of every sentence, which no tokenizer writes, and onnxruntime's softmax runs about
    five times as slow over one (every hidden score underflows) as over scores without padding."""
    if not shape:
        return np.ones((), dtype=np.int64)
    n = shape[-1]
    kept = n - rng.integers(0, n // PADDED + 1, size=shape[:-1])
    return (np.arange(n) < np.maximum(kept, 1)[..., None]).astype(np.int64)


class NpzData:
    """Batches from an npz file (see the module docstring)."""

    def __init__(self, path: str | Path, inputs: Sequence[Mapping]) -> None:
        p = Path(path)
        try:
            self.arrays = dict(np.load(p, allow_pickle=False))
        except FileNotFoundError:
            raise UsageError(f"--data {p}: no such file") from None
        except (OSError, ValueError) as e:
            raise UsageError(f"--data {p}: not an npz file ({str(e).splitlines()[0]})") from None
        want = {r["name"]: r for r in inputs}
        missing = sorted(set(want) - set(self.arrays))
        extra = sorted(set(self.arrays) - set(want))
        if missing:
            raise UsageError(f"--data {p}: no array for input '{missing[0]}' (the model reads "
                             f"{', '.join(sorted(want))})")
        if extra:
            raise UsageError(f"--data {p}: array '{extra[0]}' is not an input of the model "
                             f"(inputs: {', '.join(sorted(want))})")
        self.steps = None
        for name, r in want.items():
            a, shape = self.arrays[name], tuple(r["shape"])
            dtype = helper.tensor_dtype_to_np_dtype(r["dtype"])
            if a.dtype != dtype:
                raise UsageError(f"--data {p}: '{name}' has dtype {a.dtype}, the model expects {np.dtype(dtype)}")
            if a.shape == shape:
                continue
            if a.shape[1:] != shape:
                raise UsageError(f"--data {p}: '{name}' has shape {a.shape}, the model expects {shape} "
                                 f"or [steps, {', '.join(map(str, shape))}]")
            if self.steps is not None and a.shape[0] != self.steps:
                raise UsageError(f"--data {p}: '{name}' has {a.shape[0]} steps, another input {self.steps}")
            self.steps = a.shape[0]
        for name, r in want.items():
            high, a = r.get("high"), self.arrays[name]
            if high and np.issubdtype(a.dtype, np.integer) and a.size and (a.min() < 0 or a.max() >= high):
                raise UsageError(f"--data {p}: '{name}' has values outside [0, {high})")
        self.shapes = {name: tuple(r["shape"]) for name, r in want.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        out = {}
        for name, a in self.arrays.items():
            out[name] = a if a.shape == self.shapes[name] else a[step % a.shape[0]]
        return out
