"""What each device holds under a ShardSpec: local shapes, global indices, split and assemble.

Everything here follows one primitive, `positions`: the level positions (see `spec.py`) a
device holds along the dim an axis splits. Mesh axes apply in order, axis 0 first, so a
device's shard is the global tensor cut by axis 0, then by axis 1, and so on; `assemble`
undoes the cuts from the last axis back, reducing partial axes with their op.

`split` turns a whole array into shards; for a partial axis it must choose summands: P(sum)
gives the value to the device at coordinate 0 of that axis and zeros to the others, P(max)
and P(min) give every device the value (both exact for any dtype; the same choice as the
free R -> P step of `reshard`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from parc.sharding.spec import Partial, ShardSpec, ShardSpecError, Split, as_spec, level_extents

Coords = tuple[int, ...]


def positions(extent: int, ax: Split, n: int, c: int) -> np.ndarray:
    """Sorted level positions device `c` of `n` holds along a dim of level extent `extent`."""
    if ax.sizes is not None:
        start = sum(ax.sizes[:c])
        return np.arange(start, start + ax.sizes[c])
    s = ax.stride if ax.stride is not None else extent // n
    if s * n == extent:
        return np.arange(c * s, (c + 1) * s)
    return np.arange(extent).reshape(-1, n, s)[:, c, :].ravel()


@dataclass(frozen=True)
class Exchange:
    """An all_to_all between two splits as device `c` of the axis runs it on its own piece: the
    positions of its piece it sends each peer, and where what each peer sends lands."""

    send_dim: int  # the dim `send` indexes in the piece held
    send: tuple[np.ndarray, ...]  # per peer q: local positions along send_dim of what q gets
    recv_dim: int  # the dim `recv` indexes in the piece made
    recv: tuple[np.ndarray, ...]  # per peer p: positions along recv_dim that p's part fills
    parts: tuple[tuple[int, ...], ...]  # per peer p: the shape of the part p sends
    shape: tuple[int, ...]  # the piece made


def exchange(src: Split, dst: Split, n: int, shape: Sequence[int], c: int) -> Exchange:
    """Device `c`'s side of an all_to_all from `src` to `dst` among `n` devices, its piece of
    `shape` (strided and uneven splits included; `simulator._all_to_all` is the same step on
    every device at once). Each device sends each peer only the positions the peer needs."""
    i, j = src.dim, dst.dim
    shape = tuple(int(e) for e in shape)
    level_i = sum(src.sizes) if src.sizes is not None else shape[i] * n
    held = [positions(level_i, src, n, p) for p in range(n)]

    if i == j:
        need = [positions(level_i, dst, n, q) for q in range(n)]
        common = [np.intersect1d(held[p], need[c], assume_unique=True) for p in range(n)]
        send = tuple(np.searchsorted(held[c], np.intersect1d(held[c], need[q], assume_unique=True))
                     for q in range(n))
        recv = tuple(np.searchsorted(need[c], m) for m in common)
        parts = tuple(_resized(shape, {i: len(m)}) for m in common)
        return Exchange(i, send, i, recv, parts, _resized(shape, {i: len(need[c])}))
    need = [positions(shape[j], dst, n, q) for q in range(n)]  # the piece holds dim j whole
    parts = tuple(_resized(shape, {i: len(h), j: len(need[c])}) for h in held)
    return Exchange(j, tuple(need), i, tuple(held), parts, _resized(shape, {i: level_i, j: len(need[c])}))


def _resized(shape: tuple[int, ...], extents: Mapping[int, int]) -> tuple[int, ...]:
    return tuple(extents.get(d, e) for d, e in enumerate(shape))


def devices(mesh_shape: Sequence[int]) -> list[Coords]:
    """Every device's coordinates, in row-major order."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _check_coords(spec: ShardSpec, mesh_shape: tuple[int, ...], coords: Sequence[int]) -> Coords:
    coords = tuple(coords)
    if len(coords) != len(mesh_shape) or any(not 0 <= c < n for c, n in zip(coords, mesh_shape)):
        raise ShardSpecError(f"sharding spec {spec} on mesh {mesh_shape}: no device at coordinates {coords}")
    return coords


def local_shape(global_shape: Sequence[int], spec: ShardSpec | str, mesh_shape: Sequence[int],
                coords: Sequence[int]) -> tuple[int, ...]:
    """The shape of the shard that the device at `coords` holds."""
    spec, shape, mesh = as_spec(spec), tuple(global_shape), tuple(mesh_shape)
    level_extents(spec, shape, mesh)
    coords = _check_coords(spec, mesh, coords)
    out = list(shape)
    for ax, n, c in zip(spec.axes, mesh, coords):
        if isinstance(ax, Split):
            out[ax.dim] = ax.sizes[c] if ax.sizes is not None else out[ax.dim] // n
    return tuple(out)


def shard_index(global_shape: Sequence[int], spec: ShardSpec | str, mesh_shape: Sequence[int],
                coords: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Per tensor dim, the global indices (in local order) the device at `coords` holds.

    ``x[np.ix_(*shard_index(...))]`` is the device's shard (before any partial reduction).
    """
    spec, shape, mesh = as_spec(spec), tuple(global_shape), tuple(mesh_shape)
    level_extents(spec, shape, mesh)
    return _index(shape, spec, mesh, _check_coords(spec, mesh, coords))


def _index(shape: tuple[int, ...], spec: ShardSpec, mesh: tuple[int, ...], coords: Coords) -> tuple[np.ndarray, ...]:
    """`shard_index` without the checks (the spec is known to be valid)."""
    index = [np.arange(e) for e in shape]
    for ax, n, c in zip(spec.axes, mesh, coords):
        if isinstance(ax, Split):
            index[ax.dim] = index[ax.dim][positions(len(index[ax.dim]), ax, n, c)]
    return tuple(index)


def split(array: np.ndarray, spec: ShardSpec | str, mesh_shape: Sequence[int]) -> dict[Coords, np.ndarray]:
    """Every device's shard of `array`, keyed by mesh coordinates."""
    array = np.asarray(array)
    spec, mesh = as_spec(spec), tuple(mesh_shape)
    level_extents(spec, array.shape, mesh)
    shards: dict[Coords, np.ndarray] = {(): array}
    for ax, n in zip(spec.axes, mesh):
        shards = {key + (c,): _cut(a, ax, n, c) for key, a in shards.items() for c in range(n)}
    return {key: np.array(a) for key, a in shards.items()}


def _cut(a: np.ndarray, ax, n: int, c: int) -> np.ndarray:
    if isinstance(ax, Split):
        return np.take(a, positions(a.shape[ax.dim], ax, n, c), axis=ax.dim)
    if isinstance(ax, Partial) and ax.op == "sum" and c != 0:
        return np.zeros_like(a)
    return a


def reduce_parts(parts: Sequence, op: str, xp=np):
    """Combine partial values with `op` (sum, max, min) in the order given, keeping the dtype
    (`xp`: numpy, or cupy for a rank's device arrays)."""
    combine = {"sum": xp.add, "max": xp.maximum, "min": xp.minimum}[op]
    out = xp.array(parts[0], copy=True)
    for part in parts[1:]:
        combine(out, part, out=out)
    return out


def place(parts: Sequence[np.ndarray], ax: Split, n: int) -> np.ndarray:
    """The level tensor whose pieces under `ax` are `parts` (one per device of the axis)."""
    d = ax.dim
    extent = sum(p.shape[d] for p in parts)
    shape = list(parts[0].shape)
    shape[d] = extent
    out = np.empty(shape, dtype=parts[0].dtype)
    for c, p in enumerate(parts):
        pos = positions(extent, ax, n, c)
        if len(pos) != p.shape[d] or p.shape[:d] + p.shape[d + 1:] != parts[0].shape[:d] + parts[0].shape[d + 1:]:
            raise ShardSpecError(f"shard {c} of {ax} has shape {p.shape}; expected {len(pos)} along dim {d} "
                                 f"and the other dims of {parts[0].shape}")
        index: list[slice | np.ndarray] = [slice(None)] * len(shape)
        index[d] = pos
        out[tuple(index)] = p
    return out


def assemble(shards: Mapping[Coords, np.ndarray], spec: ShardSpec | str, mesh_shape: Sequence[int]) -> np.ndarray:
    """The global tensor from every device's shard: the inverse of `split`.

    Split axes concatenate (at the positions the layout gives), partial axes reduce with their
    op, replicated axes must agree (ShardSpecError if replicas differ).
    """
    spec, mesh = as_spec(spec), tuple(mesh_shape)
    if len(spec.axes) != len(mesh):
        raise ShardSpecError(f"sharding spec {spec} on mesh {mesh}: {len(spec.axes)} axis specs for a "
                             f"{len(mesh)}-axis mesh")
    if set(shards) != set(devices(mesh)):
        raise ShardSpecError(f"sharding spec {spec} on mesh {mesh}: shards given for {sorted(shards)}, "
                             f"expected one per device")
    level: dict[Coords, np.ndarray] = {k: np.asarray(v) for k, v in shards.items()}
    for k in reversed(range(len(mesh))):
        ax, n = spec.axes[k], mesh[k]
        merged: dict[Coords, np.ndarray] = {}
        for key in devices(mesh[:k]):
            parts = [level[key + (c,)] for c in range(n)]
            if isinstance(ax, Split):
                merged[key] = place(parts, ax, n)
            elif isinstance(ax, Partial):
                merged[key] = reduce_parts(parts, ax.op)
            else:
                for c, p in enumerate(parts[1:], 1):
                    if p.shape != parts[0].shape or not np.array_equal(p, parts[0], equal_nan=p.dtype.kind in "fc"):
                        raise ShardSpecError(f"sharding spec {spec} on mesh {mesh}: mesh axis {k} is "
                                             f"replicated but the devices {key + (0,)} and {key + (c,)} differ")
                merged[key] = parts[0]
        level = merged
    return level[()]
