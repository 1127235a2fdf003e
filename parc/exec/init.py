"""Seeded, plan-independent initialization of parameters (Rhino 6.3's distributed init).

With `parc run --init seeded --seed S`, each rank draws only its own shard of every parameter,
and the whole tensors are the same whatever the plan: element i of parameter `name` is
``mean + std * z(S, name, i)``, where i is the element's flat index in the whole tensor and z a
standard normal made from a counter-based hash (splitmix64 of the seed, the name and i, then
Box-Muller). So no rank ever holds more than its shard, and a 1-rank run, a data-parallel run and
a tensor-parallel run start from identical parameters. `mean` and `std` are the source tensor's
(recorded at plan time); parameters with zero spread (LayerNorm scales, zero biases) keep their
source values.
"""

from __future__ import annotations

import hashlib

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _key(seed: int, name: str) -> np.uint64:
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return np.uint64(int.from_bytes(digest[:8], "little"))


def normal_at(seed: int, name: str, flat_index: np.ndarray) -> np.ndarray:
    """Standard normals for the given flat indices of tensor `name` (float64)."""
    i = np.asarray(flat_index, dtype=np.uint64)
    key = _key(seed, name)
    with np.errstate(over="ignore"):
        a = _splitmix64(key ^ (i * np.uint64(2)))
        b = _splitmix64(key ^ (i * np.uint64(2) + np.uint64(1)))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53  # in (0, 1)
    u2 = (b >> np.uint64(11)).astype(np.float64) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def seeded_shard(seed: int, name: str, shape: tuple[int, ...], index: tuple[np.ndarray, ...],
                 mean: float, std: float, dtype) -> np.ndarray:
    """The shard at `index` (per-dim global indices, as `shard_index` gives) of the seeded tensor."""
    if not shape:
        return np.asarray(mean + std * normal_at(seed, name, np.zeros(1, np.int64))[0], dtype=dtype)
    flat = np.ravel_multi_index(np.ix_(*index), shape)
    return (mean + std * normal_at(seed, name, flat)).astype(dtype)


def init_stats(array: np.ndarray) -> dict[str, float]:
    """The mean and standard deviation a seeded init draws with (float64, in chunks)."""
    flat = np.asarray(array).reshape(-1)
    if flat.size == 0 or flat.dtype.kind != "f":
        return {"mean": 0.0, "std": 0.0}
    total, squares = 0.0, 0.0
    for start in range(0, flat.size, 1 << 24):
        chunk = flat[start:start + (1 << 24)].astype(np.float64)
        total += float(chunk.sum())
        squares += float(np.square(chunk).sum())
    mean = total / flat.size
    return {"mean": mean, "std": float(np.sqrt(max(squares / flat.size - mean * mean, 0.0)))}
