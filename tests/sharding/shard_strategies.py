"""Hypothesis strategies for the sharding tests: shapes, meshes and valid specs for them."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from parc.sharding import PARTIAL_OPS, P, R, S, ShardSpec, split
from parc.sharding.spec import Split

EXTENTS = st.sampled_from([1, 2, 3, 4, 6, 8, 12])


def shapes(max_rank: int = 3):
    return st.lists(EXTENTS, min_size=1, max_size=max_rank).map(tuple)


def meshes(max_axes: int = 2):
    one_d = st.integers(1, 4).map(lambda n: (n,))
    two_d = st.tuples(st.integers(1, 3), st.integers(1, 3))
    three_d = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 2))
    return st.one_of([one_d, two_d, three_d][:max_axes])


def _divisors(m: int) -> list[int]:
    return [s for s in range(1, m + 1) if m % s == 0]


@st.composite
def specs(draw, shape: tuple[int, ...], mesh: tuple[int, ...], partial: bool = True,
          uneven: bool = True) -> ShardSpec:
    """A valid spec: built axis by axis from the extents the earlier axes leave."""
    extents = [{e} for e in shape]
    axes = []
    for n in mesh:
        options = [("R", None)]
        if partial:
            options.append(("P", None))
        for d, es in enumerate(extents):
            g = math.gcd(*es)
            if g % n == 0 and g > 0:
                options.append(("S", d))
                options.append(("Sstride", d))
            if uneven and len(es) == 1:
                options.append(("Suneven", d))
        kind, d = draw(st.sampled_from(options))
        if kind == "R":
            axes.append(R)
        elif kind == "P":
            axes.append(P(draw(st.sampled_from(PARTIAL_OPS))))
        elif kind == "S":
            axes.append(S(d))
        elif kind == "Sstride":
            g = math.gcd(*extents[d])
            axes.append(S(d, draw(st.sampled_from(_divisors(g // n)))))
        else:
            (e,) = extents[d]
            cuts = sorted(draw(st.lists(st.integers(0, e), min_size=n - 1, max_size=n - 1)))
            sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, e]))
            axes.append(S(d, sizes=sizes))
        if kind.startswith("S"):
            ax = axes[-1]
            extents[d] = ({ax.sizes[c] for c in range(n)} if ax.sizes is not None
                          else {e // n for e in extents[d]})
    spec = ShardSpec(tuple(axes))
    spec.check(shape, mesh)
    return spec


def array(data, shape: tuple[int, ...]) -> np.ndarray:
    """Distinct-ish integers, so that a misplaced element shows."""
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    return np.random.default_rng(seed).integers(-1000, 1000, size=shape)


def resolve_partials(shards: dict, spec: ShardSpec, mesh: tuple[int, ...]) -> tuple[dict, ShardSpec]:
    """Every device's shard after reducing each partial axis (innermost first), and the spec
    with those axes replicated: what a device holds once the partial values are complete."""
    shards = dict(shards)
    for k in reversed(range(len(mesh))):
        ax = spec[k]
        if not isinstance(ax, type(P())):
            continue
        reduce = {"sum": np.sum, "max": np.max, "min": np.min}[ax.op]
        for key in list(shards):
            if key[k] == 0:
                group = [key[:k] + (c,) + key[k + 1:] for c in range(mesh[k])]
                total = reduce(np.stack([shards[g] for g in group]), axis=0)
                for g in group:
                    shards[g] = total
        spec = spec.replace(k, R)
    return shards, spec


def random_split(x: np.ndarray, spec: ShardSpec, mesh: tuple[int, ...], rng: np.random.Generator) -> dict:
    """Like `split`, but partial axes get random summands (any valid decomposition), so that a
    wrong reduction order shows; integer arrays only."""
    shards = {(): x}
    for ax, n in zip(spec, mesh):
        nxt = {}
        for key, a in shards.items():
            if isinstance(ax, type(P())):
                parts = _random_partial(a, ax.op, n, rng)
            else:
                one = split(a, ShardSpec((ax,)), (n,))
                parts = [one[(c,)] for c in range(n)]
            nxt.update({key + (c,): p for c, p in enumerate(parts)})
        shards = nxt
    return shards


def _random_partial(a: np.ndarray, op: str, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    if op == "sum":
        rest = rng.integers(-100, 100, size=(n - 1, *a.shape))
        return [a - rest.sum(axis=0), *rest]
    sign = -1 if op == "max" else 1
    parts = a + sign * rng.integers(0, 100, size=(n, *a.shape))
    winner = rng.integers(0, n, size=a.shape)  # the device that holds the exact value
    np.put_along_axis(parts, winner[None], a[None], axis=0)
    return list(parts)


def split_of(draw, extent: int, n: int, dim: int) -> Split | None:
    """An even, strided or uneven split of `extent` over n devices (None when none fits)."""
    kinds = []
    if extent % n == 0:
        kinds.append(Split(dim))
        kinds += [Split(dim, s) for s in range(1, extent // n) if extent % (s * n) == 0]
    if extent >= n:
        kinds.append("uneven")
    if not kinds:
        return None
    kind = draw(st.sampled_from(kinds))
    if kind != "uneven":
        return kind
    cuts = sorted(draw(st.lists(st.integers(0, extent), min_size=n - 1, max_size=n - 1)))
    return Split(dim, sizes=tuple(b - a for a, b in zip([0, *cuts], [*cuts, extent])))
