"""Resharding: the collectives that turn one layout of a tensor into another.

One mesh axis of ``n`` devices, ``B`` the bytes of the tensor the axis acts on (the whole
tensor on a 1-D mesh; on more axes, a device's shard with this axis replicated):

==========  ==========  ================  ===================================================
src         dst         step              bytes received per device
==========  ==========  ================  ===================================================
X           X           none              0 (also Whale's bridge S(d) -> S(d), see below)
R           S(d,..)     local_slice       0
R           P(op)       local_partial     0: P(sum) keeps the value on coordinate 0, zeros
                                          elsewhere; P(max), P(min) keep it everywhere
S(d,..)     P(op)       local_partial     0: own piece, the rest filled with op's identity
S(d,..)     R           all_gather        (n-1)/n B
S(i,..)     S(j,..)     all_to_all        (n-1)/n^2 B for i != j, even; in general what the
                                          device needs minus what it holds (same dim, other
                                          stride or sizes: a permutation)
P(op)       R           all_reduce        2(n-1)/n B
P(op)       S(d,..)     reduce_scatter    (n-1)/n B
P(op)       P(op')      all_reduce + local_partial  2(n-1)/n B
==========  ==========  ================  ===================================================

Uneven splits use the exact counts: all_gather and all_to_all charge the elements a device
needs and does not hold, reduce_scatter ``B - own piece``; `bytes_per_device` is the largest
over devices (the straggler sets the time).

Several axes: each step changes one mesh axis and is a collective among the devices that share
their other coordinates. Axes nest (`spec.py`), so changing axis k is such a 1-D step only if
no later axis splits a dim the step touches (and no later axis holds partials of another op
when axis k reduces; and no later P(sum) when a split becomes P(max/min)). `reshard` searches
(Dijkstra on bytes, weighted per axis) over the states whose axis k is src[k], dst[k] or R;
one always exists: gather the innermost axes first, then slice outermost first. Limits: no
intermediate layouts other than those, no collective over several axes at once (e.g. one
all-to-all on the flattened mesh), and volumes only (the alpha-beta time is the cost model's).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from parc.sharding.layout import Coords, devices, positions
from parc.sharding.spec import AxisSpec, Partial, R, Replicated, ShardSpec, ShardSpecError, Split, as_spec

COMM_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LOCAL_KINDS = ("local_slice", "local_partial")


@dataclass(frozen=True)
class Collective:
    """One resharding step on mesh axis `axis` (`n` devices): `before` becomes `after`."""

    kind: str
    axis: int
    bytes_per_device: float
    n: int
    before: ShardSpec
    after: ShardSpec

    def __post_init__(self) -> None:
        if self.kind not in COMM_KINDS + LOCAL_KINDS:
            raise ShardSpecError(f"unknown collective kind {self.kind!r}")

    @property
    def src(self) -> AxisSpec:
        return self.before[self.axis]

    @property
    def dst(self) -> AxisSpec:
        return self.after[self.axis]

    @property
    def is_local(self) -> bool:
        return self.kind in LOCAL_KINDS

    @property
    def op(self) -> str | None:
        """The reduction (all_reduce, reduce_scatter) or the partial op made (local_partial)."""
        if self.kind == "local_partial":
            return self.dst.op  # type: ignore[union-attr]
        return self.src.op if isinstance(self.src, Partial) else None

    def __str__(self) -> str:
        return (f"{self.kind}[axis {self.axis}, n={self.n}] {self.before} -> {self.after}: "
                f"{self.bytes_per_device:g} B/device")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "bytes_per_device": self.bytes_per_device,
                "n": self.n, "before": self.before.to_json(), "after": self.after.to_json()}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Collective:
        return cls(obj["kind"], obj["axis"], obj["bytes_per_device"], obj["n"],
                   ShardSpec.from_json(obj["before"]), ShardSpec.from_json(obj["after"]))


def step_kind(a: AxisSpec, b: AxisSpec) -> str | None:
    """The one-axis step from `a` to `b` (a != b); None for P -> P' (that goes through R)."""
    if isinstance(a, Replicated):
        return "local_slice" if isinstance(b, Split) else "local_partial"
    if isinstance(a, Split):
        return {Replicated: "all_gather", Split: "all_to_all", Partial: "local_partial"}[type(b)]
    if isinstance(b, Partial):
        return None
    return "all_reduce" if isinstance(b, Replicated) else "reduce_scatter"


def blocked(state: ShardSpec, k: int, a: AxisSpec, b: AxisSpec) -> str | None:
    """Why changing axis k of `state` from `a` to `b` is not a 1-D step (None if it is)."""
    touched = {x.dim for x in (a, b) if isinstance(x, Split)}
    for j in range(k + 1, len(state)):
        inner = state[j]
        if isinstance(inner, Split) and inner.dim in touched:
            return f"mesh axis {j} splits dim {inner.dim} inside axis {k}"
        if isinstance(inner, Partial):
            if isinstance(a, Partial) and inner.op != a.op:
                return f"mesh axis {j} holds P({inner.op}) inside the P({a.op}) being reduced"
            if isinstance(a, Split) and isinstance(b, Partial) and b.op != "sum" and inner.op == "sum":
                return f"mesh axis {j} holds P(sum): the {b} fill would be summed"
    return None


class _Steps:
    """Volumes of steps between states of one tensor on one mesh (index sets memoised by extent).

    A step on axis k changes only the dims its src and dst split; on every other dim a device
    holds the same indices before and after, so only the touched dims need index arrays, and
    those depend only on the coordinates of the axes that split them.
    """

    def __init__(self, shape: tuple[int, ...], mesh: tuple[int, ...], dtype_bytes: int) -> None:
        self.shape, self.mesh, self.dtype_bytes = shape, mesh, dtype_bytes
        self.devices = devices(mesh)
        self.volumes: dict[tuple, float] = {}

    def _key(self, spec: ShardSpec, d: int, coords: Coords) -> tuple:
        """What a device's indices along dim d depend on: the dim's extent, the mesh, and the
        axes that split d with their coordinates (shared by every tensor with that extent)."""
        return (self.shape[d], self.mesh,
                tuple((ax, c) if isinstance(ax, Split) and ax.dim == d else None for ax, c in zip(spec, coords)))

    def dim_index(self, spec: ShardSpec, d: int, coords: Coords) -> np.ndarray:
        """The global indices along dim `d` the device at `coords` holds under `spec`."""
        return _dim_index(self._key(spec, d, coords))

    def overlap(self, before: ShardSpec, after: ShardSpec, d: int, coords: Coords) -> int:
        return _overlap(self._key(before, d, coords), self._key(after, d, coords))

    def local(self, spec: ShardSpec, coords: Coords) -> list[int]:
        out = list(self.shape)
        for ax, n, c in zip(spec, self.mesh, coords):
            if isinstance(ax, Split):
                out[ax.dim] = ax.sizes[c] if ax.sizes is not None else out[ax.dim] // n
        return out

    def bytes(self, kind: str, before: ShardSpec, after: ShardSpec, k: int) -> float:
        """Bytes the busiest device receives in the step (0 for local steps)."""
        if kind in LOCAL_KINDS:
            return 0.0
        key = (kind, before, after, k)
        if key not in self.volumes:
            self.volumes[key] = self._bytes(kind, before, after, k)
        return self.volumes[key]

    def _bytes(self, kind: str, before: ShardSpec, after: ShardSpec, k: int) -> float:
        n, worst = self.mesh[k], 0.0
        touched = {x.dim for x in (before[k], after[k]) if isinstance(x, Split)}
        devices = self.devices
        if not _uneven(before) and not _uneven(after):
            if kind != "all_to_all":
                devices = devices[:1]  # even splits: every device receives the same volume
            else:
                need = math.prod(self.local(after, devices[0]))
                return (need - self._least_overlap(before, after, touched)) * self.dtype_bytes
        for coords in devices:
            held, need = self.local(before, coords), self.local(after, coords)
            h, m = math.prod(held), math.prod(need)
            if kind == "all_reduce":
                v = 2 * (n - 1) / n * h
            elif kind == "reduce_scatter":
                v = h - m
            else:  # all_gather, all_to_all: what the device needs and does not hold
                v = m - math.prod(self.overlap(before, after, d, coords) if d in touched else e
                                  for d, e in enumerate(need))
            worst = max(worst, float(v))
        return worst * self.dtype_bytes


    def _least_overlap(self, before: ShardSpec, after: ShardSpec, touched: set[int]) -> int:
        """The fewest elements any device holds both before and after (even splits), for every
        device at once: along each touched dim, which piece of each layout holds each index
        (`_owners`), so a 2-D histogram gives every (held piece, needed piece) pair's overlap,
        and a device's overlap is the product over dims of its pair's. Linear in the dims'
        extents and the devices, where one device at a time is quadratic (4,096 devices)."""
        mesh = self.mesh
        coords = np.indices(mesh).reshape(len(mesh), -1)  # every device, row-major
        overlap = np.ones(coords.shape[1], dtype=np.int64)
        for d, extent in enumerate(self.shape):
            if d not in touched:
                overlap *= self.local(after, (0,) * len(mesh))[d]
                continue
            split = [[j for j, ax in enumerate(spec) if isinstance(ax, Split) and ax.dim == d] for spec in (before, after)]
            unit = math.gcd(*(_unit(self._key(spec, d, (0,) * len(mesh))) for spec in (before, after)))
            owners = [_owners(extent // unit, tuple((spec[j], mesh[j]) for j in axes), unit)
                      for spec, axes in zip((before, after), split)]
            sizes = [math.prod(mesh[j] for j in axes) for axes in split]
            pairs = np.bincount(owners[0] * sizes[1] + owners[1], minlength=sizes[0] * sizes[1])
            piece = [np.ravel_multi_index(coords[axes], [mesh[j] for j in axes]) if axes else 0 for axes in split]
            overlap *= unit * pairs[np.asarray(piece[0]) * sizes[1] + np.asarray(piece[1])]
        return int(overlap.min())


@lru_cache(maxsize=8)  # as `_dim_index`: a dim may be 50M long
def _owners(extent: int, levels: tuple[tuple[Split, int], ...], unit: int) -> np.ndarray:
    """For each index of a dim of `extent` (blocks of `unit`), the piece holding it under even
    splits `levels` (outermost first), pieces numbered row-major over the levels' coordinates.
    Arithmetic, as `positions` cuts a level: with runs of s (the stride, or the share of a
    contiguous split) dealt to n devices in turn, position p goes to (p // s) % n, where it is
    position (p // (s n)) s + p % s of its piece."""
    pos = np.arange(extent, dtype=np.int64)  # each index's position in its piece
    owner = np.zeros(extent, dtype=np.int64)
    length = extent
    for ax, n in levels:
        s = ax.stride // unit if ax.stride is not None else length // n
        owner = owner * n + (pos // s) % n
        pos = (pos // (s * n)) * s + pos % s
        length //= n
    owner.flags.writeable = False
    return owner


@lru_cache(maxsize=1 << 12)
def _steps(shape: tuple[int, ...], mesh: tuple[int, ...], dtype_bytes: int) -> _Steps:
    return _Steps(shape, mesh, dtype_bytes)


@lru_cache(maxsize=8)  # only interleaved (strided) pieces get here, and a dim may be 50M long (vgg19)
def _dim_index(key: tuple) -> np.ndarray:
    extent, mesh, axes = key
    index = np.arange(extent)
    for n, entry in zip(mesh, axes):
        if entry is not None:
            ax, c = entry
            index = index[positions(len(index), ax, n, c)]
    index.flags.writeable = False
    return index


@lru_cache(maxsize=1 << 16)
def _overlap(before: tuple, after: tuple) -> int:
    a, b = _range(before), _range(after)
    if a is not None and b is not None:  # contiguous pieces: no index arrays (a dim may be millions long)
        return max(0, min(a[0] + a[1], b[0] + b[1]) - max(a[0], b[0]))
    unit = math.gcd(_unit(before), _unit(after))  # both are unions of aligned blocks of `unit`
    before, after = _scaled(before, unit), _scaled(after, unit)
    held = np.zeros(before[0], dtype=bool)  # a mask, not a sort: linear in the dim's extent / unit
    held[_dim_index(before)] = True
    return unit * int(np.count_nonzero(held[_dim_index(after)]))


def _unit(key: tuple) -> int:
    """The largest u such that the indices `_dim_index(key)` holds are whole blocks [k u, (k+1) u):
    the gcd of the extent and of every level's piece length (a strided split's stride, an even
    split's share, an uneven split's sizes). By induction over the levels, every piece is a run
    of whole u-blocks of the level before, so of the dim."""
    extent, mesh, axes = key
    unit, length = extent, extent
    for n, entry in zip(mesh, axes):
        if entry is None:
            continue
        ax, c = entry
        if ax.sizes is not None:
            unit = math.gcd(unit, *ax.sizes)
            length = ax.sizes[c]
        else:
            size = ax.stride if ax.stride is not None else length // n
            unit = math.gcd(unit, size)
            length = length // n
    return max(unit, 1)


def _scaled(key: tuple, unit: int) -> tuple:
    """The same pieces with every block of `unit` indices as one (overlaps shrink by `unit`)."""
    if unit == 1:
        return key
    extent, mesh, axes = key
    scaled = tuple(None if entry is None else
                   (Split(entry[0].dim, entry[0].stride // unit if entry[0].stride is not None else None,
                          tuple(e // unit for e in entry[0].sizes) if entry[0].sizes is not None else None),
                    entry[1]) for entry in axes)
    return extent // unit, mesh, scaled


def _range(key: tuple) -> tuple[int, int] | None:
    """(start, length) of the indices `_dim_index(key)` holds when they are one contiguous run
    (even and uneven splits; a strided split that interleaves is not): what `positions` gives,
    without the arrays. vgg19's cost model on a 2-D mesh held 10+ GB of cached index arrays."""
    extent, mesh, axes = key
    start, length = 0, extent
    for n, entry in zip(mesh, axes):
        if entry is None:
            continue
        ax, c = entry
        if ax.sizes is not None:
            first, size = sum(ax.sizes[:c]), ax.sizes[c]
        else:
            size = ax.stride if ax.stride is not None else length // n
            if size * n != length:
                return None
            first = c * size
        start, length = start + first, size
    return start, length


def _uneven(spec: ShardSpec) -> bool:
    return any(isinstance(ax, Split) and ax.sizes is not None for ax in spec)


@lru_cache(maxsize=1 << 16)  # the planner's searches revisit the same states of one tensor
def _canonical(spec: ShardSpec, shape: tuple[int, ...], mesh: tuple[int, ...]) -> ShardSpec | None:
    try:
        return spec.canonical(shape, mesh)
    except ShardSpecError:
        return None


@lru_cache(maxsize=1 << 14)  # a pure function of hashable arguments; the planner asks repeatedly
def _plan(src: ShardSpec, dst: ShardSpec, shape: tuple[int, ...], dtype_bytes: int,
          mesh: tuple[int, ...], weights: tuple[float, ...]) -> tuple[Collective, ...]:
    src, dst = src.canonical(shape, mesh), dst.canonical(shape, mesh)
    if src == dst:
        return ()
    steps = _steps(shape, mesh, dtype_bytes)
    options = [tuple(dict.fromkeys((src[k], dst[k], R))) for k in range(len(mesh))]
    best: dict[ShardSpec, tuple[float, int]] = {src: (0.0, 0)}
    back: dict[ShardSpec, tuple[ShardSpec, Collective]] = {}
    order = itertools.count()
    heap: list[tuple[float, int, int, ShardSpec]] = [(0.0, 0, next(order), src)]
    while heap:
        cost, nsteps, _, state = heapq.heappop(heap)
        if state == dst:
            break
        if (cost, nsteps) > best[state]:
            continue
        for k, opts in enumerate(options):
            for opt in opts:
                nxt = _canonical(state.replace(k, opt), shape, mesh)
                if nxt is None or nxt == state or any(nxt[j] != state[j] for j in range(len(mesh)) if j != k):
                    continue
                kind = step_kind(state[k], nxt[k])
                if kind is None or blocked(state, k, state[k], nxt[k]):
                    continue
                step = Collective(kind, k, steps.bytes(kind, state, nxt, k), mesh[k], state, nxt)
                reached = (cost + weights[k] * step.bytes_per_device, nsteps + 1)
                if nxt not in best or reached < best[nxt]:
                    best[nxt], back[nxt] = reached, (state, step)
                    heapq.heappush(heap, (*reached, next(order), nxt))
    assert dst in back, f"no resharding path {src} -> {dst}"  # gather-all then slice always exists
    path: list[Collective] = []
    state = dst
    while state != src:
        state, step = back[state]
        path.append(step)
    return tuple(reversed(path))


def reshard(src: ShardSpec | str, dst: ShardSpec | str, shape: Sequence[int], dtype_bytes: int,
            mesh_shape: Sequence[int], axis_weights: Sequence[float] | None = None) -> list[Collective]:
    """The cheapest sequence of steps that turns layout `src` of a `shape` tensor into `dst`.

    Both specs are checked and canonicalised for the shape and mesh (ShardSpecError if they do
    not fit); equal layouts need no step. The plan minimises the sum over steps of
    ``axis_weights[axis] * bytes_per_device`` (default weight 1 per axis), then the step count.
    Local steps (slices, partial fills) appear in the list with 0 bytes: they change the data.
    """
    mesh = tuple(mesh_shape)
    weights = tuple(float(w) for w in axis_weights) if axis_weights is not None else (1.0,) * len(mesh)
    if len(weights) != len(mesh):
        raise ShardSpecError(f"{len(weights)} axis weights for a mesh of shape {mesh}")
    return list(_plan(as_spec(src), as_spec(dst), tuple(shape), int(dtype_bytes), mesh, weights))


def reshard_bytes(src: ShardSpec | str, dst: ShardSpec | str, shape: Sequence[int], dtype_bytes: int,
                  mesh_shape: Sequence[int], axis_weights: Sequence[float] | None = None) -> float:
    """The weighted bytes per device of `reshard(...)`: what the planner's edge cost starts from."""
    steps = reshard(src, dst, shape, dtype_bytes, mesh_shape, axis_weights)
    weights = tuple(axis_weights) if axis_weights is not None else (1.0,) * len(tuple(mesh_shape))
    return sum(weights[s.axis] * s.bytes_per_device for s in steps)
