"""A NumPy executor for resharding steps: proves the table in `reshard.py` right.

`simulate(steps, shards)` applies each `Collective` to a dict of shards (mesh coordinates ->
array), as the devices of one mesh axis would: a device reads from its peers only what the
collective sends it (a piece for all_gather, the pieces of its destination for all_to_all and
reduce_scatter, everything for all_reduce); local steps read nothing from peers. Mesh shape
comes from the coordinates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from parc.sharding.layout import Coords, devices, exchange, place, positions, reduce_parts
from parc.sharding.reshard import Collective
from parc.sharding.spec import Partial, ShardSpecError, Split


def identity(op: str, dtype: np.dtype) -> object:
    """The value that `op` ignores, in `dtype` (0; lowest and highest value for max and min)."""
    if op == "sum":
        return 0
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return op == "min"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if op == "max" else info.max
    return -np.inf if op == "max" else np.inf


def _take(a: np.ndarray, pos: np.ndarray, dim: int) -> np.ndarray:
    return np.take(a, pos, axis=dim)


def _all_gather(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    full = place(parts, step.src, step.n)  # type: ignore[arg-type]
    return [full.copy() for _ in parts]


def _all_reduce(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    full = reduce_parts(parts, step.src.op)  # type: ignore[union-attr]
    return [full.copy() for _ in parts]


def _reduce_scatter(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    dst: Split = step.dst  # type: ignore[assignment]
    extent = parts[0].shape[dst.dim]
    return [reduce_parts([_take(p, positions(extent, dst, step.n, c), dst.dim) for p in parts],
                         step.src.op)  # type: ignore[union-attr]
            for c in range(step.n)]


def _all_to_all(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    """Every device's side of the step (`layout.exchange`), each part delivered to its peer."""
    src: Split = step.src  # type: ignore[assignment]
    dst: Split = step.dst  # type: ignore[assignment]
    sides = [exchange(src, dst, step.n, p.shape, c) for c, p in enumerate(parts)]
    out = []
    for ex in sides:
        mine = np.empty(ex.shape, dtype=parts[0].dtype)
        for p, (part, side) in enumerate(zip(parts, sides)):
            index = [slice(None)] * mine.ndim
            index[ex.recv_dim] = ex.recv[p]
            mine[tuple(index)] = np.take(part, side.send[len(out)], axis=side.send_dim)
        out.append(mine)
    return out


def _local_slice(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    dst: Split = step.dst  # type: ignore[assignment]
    return [_take(p, positions(p.shape[dst.dim], dst, step.n, c), dst.dim) for c, p in enumerate(parts)]


def _local_partial(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    op = step.dst.op  # type: ignore[union-attr]
    src = step.src
    if not isinstance(src, Split):  # from R: P(sum) keeps the value on coordinate 0
        return [np.zeros_like(p) if op == "sum" and c else p.copy() for c, p in enumerate(parts)]
    out = []
    for c, p in enumerate(parts):
        extent = sum(src.sizes) if src.sizes is not None else p.shape[src.dim] * step.n
        shape = list(p.shape)
        shape[src.dim] = extent
        full = np.full(shape, identity(op, p.dtype), dtype=p.dtype)
        index: list[slice | np.ndarray] = [slice(None)] * p.ndim
        index[src.dim] = positions(extent, src, step.n, c)
        full[tuple(index)] = p
        out.append(full)
    return out


_RUN: dict[str, Callable[[Collective, list[np.ndarray]], list[np.ndarray]]] = {
    "all_gather": _all_gather, "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all, "local_slice": _local_slice, "local_partial": _local_partial,
}


def run_step(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    """One step on the pieces of one group of devices (coordinate order along the step's axis)."""
    return _RUN[step.kind](step, parts)


def simulate(steps: Sequence[Collective], shards: Mapping[Coords, np.ndarray]) -> dict[Coords, np.ndarray]:
    """Apply resharding `steps` to every device's shard; returns the new shards."""
    cur = {tuple(k): np.asarray(v) for k, v in shards.items()}
    if not cur:
        raise ShardSpecError("simulate: no shards given")
    mesh = tuple(max(k[a] for k in cur) + 1 for a in range(len(next(iter(cur)))))
    if set(cur) != set(devices(mesh)):
        raise ShardSpecError(f"simulate: shards given for {sorted(cur)}, not a full mesh {mesh}")
    for step in steps:
        k = step.axis
        if not 0 <= k < len(mesh) or mesh[k] != step.n:
            raise ShardSpecError(f"simulate: step {step} does not fit mesh {mesh}")
        if isinstance(step.src, Partial) and isinstance(step.dst, Partial):
            raise ShardSpecError(f"simulate: step {step} is not one collective")
        new: dict[Coords, np.ndarray] = {}
        for rest in devices(mesh[:k] + mesh[k + 1:]):
            keys = [rest[:k] + (c,) + rest[k:] for c in range(mesh[k])]
            new.update(zip(keys, _RUN[step.kind](step, [cur[key] for key in keys])))
        cur = new
    return cur
