"""The resharding table: volumes per DESIGN.md, Whale's bridge rule, and a simulated proof.

The property test runs `reshard`'s steps on NumPy shards (`simulate`) for random shapes,
meshes (1-D to 3-D) and spec pairs, and checks that after every step the shards still hold the
tensor, and that the end result is exactly what `split(x, dst)` gives each device.
"""

from __future__ import annotations

import importlib
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shard_strategies import array, meshes, random_split, resolve_partials, shapes, specs

from parc.sharding import (
    Collective,
    ShardSpec,
    ShardSpecError,
    assemble,
    reshard,
    reshard_bytes,
    simulate,
    split,
)
from parc.sharding.spec import R, Split

SHAPE, N, ITEM = (6, 12), 3, 4
B = 6 * 12 * 4  # bytes of the whole tensor


def steps(src: str, dst: str, shape=SHAPE, mesh=(N,), **kw) -> list[tuple[str, float]]:
    return [(s.kind, s.bytes_per_device) for s in reshard(src, dst, shape, ITEM, mesh, **kw)]


@pytest.mark.parametrize("src, dst, want", [
    ("R", "R", []),
    ("S(0)", "S(0)", []),
    ("P(max)", "P(max)", []),
    ("R", "S(1)", [("local_slice", 0)]),
    ("R", "S(1,2)", [("local_slice", 0)]),
    ("R", "P(sum)", [("local_partial", 0)]),
    ("S(0)", "P(sum)", [("local_partial", 0)]),
    ("S(1,1)", "P(min)", [("local_partial", 0)]),
    ("S(0)", "R", [("all_gather", (N - 1) / N * B)]),
    ("S(1,2)", "R", [("all_gather", (N - 1) / N * B)]),
    ("S(0)", "S(1)", [("all_to_all", (N - 1) / N**2 * B)]),
    ("S(1)", "S(0,1)", [("all_to_all", (N - 1) / N**2 * B)]),
    ("P(sum)", "R", [("all_reduce", 2 * (N - 1) / N * B)]),
    ("P(sum)", "S(1)", [("reduce_scatter", (N - 1) / N * B)]),
    ("P(max)", "S(0,1)", [("reduce_scatter", (N - 1) / N * B)]),
    ("P(sum)", "P(max)", [("all_reduce", 2 * (N - 1) / N * B), ("local_partial", 0)]),
])
def test_one_axis_table(src, dst, want):
    assert steps(src, dst) == want


def test_same_dim_stride_change_is_a_permutation_costing_what_is_not_held():
    # 12 columns, 3 devices: S(1) holds {0..3} on device 0, S(1,1) wants {0,3,6,9}: 2 of 4 held
    assert steps("S(1)", "S(1,1)") == [("all_to_all", 2 * 6 * ITEM)]
    # S(1,2) gives device 1 columns {2,3,8,9}; S(1,1) wants {1,4,7,10}: the busiest gets all 4
    assert steps("S(1,2)", "S(1,1)") == [("all_to_all", 4 * 6 * ITEM)]


def test_uneven_volumes_are_the_busiest_devices():
    row = 12 * ITEM
    assert steps("S(0,[1,2,3])", "R") == [("all_gather", 5 * row)]
    assert steps("P(sum)", "S(0,[1,2,3])") == [("reduce_scatter", 5 * row)]
    assert steps("R", "S(0,[1,2,3])") == [("local_slice", 0)]
    # rows {0} {1,2} {3,4,5} -> {0,1} {2,3} {4,5}: devices 0 and 1 each miss one row
    assert steps("S(0,[1,2,3])", "S(0)") == [("all_to_all", 1 * row)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_volumes_follow_design_md(n):
    """all-reduce 2(n-1)/n B, all-gather and reduce-scatter (n-1)/n B, all-to-all (n-1)/n^2 B."""
    shape, b = (8, 16), 8 * 16 * 2
    assert reshard("S(0)", "R", shape, 2, (n,))[0].bytes_per_device == (n - 1) / n * b
    assert reshard("S(0)", "S(1)", shape, 2, (n,))[0].bytes_per_device == (n - 1) / n**2 * b
    assert reshard("P(sum)", "R", shape, 2, (n,))[0].bytes_per_device == pytest.approx(2 * (n - 1) / n * b)
    assert reshard("P(sum)", "S(0)", shape, 2, (n,))[0].bytes_per_device == (n - 1) / n * b


def test_whale_3_2_3_bridge_gather_then_split_on_same_dim_is_free():
    """Whale 3.2.3: a bridge gathers a scope's outputs on dim d and the next scope partitions its
    inputs on d; when the dims agree Whale removes both. Here: S(d) -> S(d) needs no step, and a
    tensor gathered to R reaches S(d) by a local slice; only the unfused bridge pays a gather."""
    for d in (0, 1):
        assert reshard(f"S({d})", f"S({d})", SHAPE, ITEM, (N,)) == []
        assert steps("R", f"S({d})") == [("local_slice", 0)]
        unfused = reshard(f"S({d})", "R", SHAPE, ITEM, (N,)) + reshard("R", f"S({d})", SHAPE, ITEM, (N,))
        assert [s.kind for s in unfused] == ["all_gather", "local_slice"]
    # on a 2-D mesh, the dim that stays split on its axis costs nothing while the other moves
    assert steps("S(0)S(1)", "S(0)R", mesh=(3, 2)) == [("all_gather", (2 - 1) / 2 * B / 3)]
    assert reshard("S(0)S(1)", "S(0)S(1)", SHAPE, ITEM, (3, 2)) == []


def test_gather_before_all_to_all():
    # axis 0 cannot move S(0) -> S(1) while axis 1 splits dim 1 inside it: gather axis 1 first
    kinds = [(s.kind, s.axis) for s in reshard("S(0)S(1)", "S(1)R", (8, 12), ITEM, (2, 2))]
    assert kinds == [("all_gather", 1), ("all_to_all", 0)]


def test_mixed_partials_reduce_the_inner_axis_first():
    # P(max)P(sum): the value is the max over axis 0 of sums over axis 1
    assert [(s.kind, s.axis) for s in reshard("P(max)P(sum)", "RR", (8, 12), ITEM, (2, 2))] == [
        ("all_reduce", 1), ("all_reduce", 0)]
    # a split cannot become P(max) by an identity fill while an inner P(sum) would add the fills
    kinds = [(s.kind, s.axis) for s in reshard("S(0)P(sum)", "P(max)R", (8, 12), ITEM, (2, 2))]
    assert kinds == [("all_reduce", 1), ("local_partial", 0)]


def test_axis_weights_pick_the_order():
    # gather on the expensive axis while the data there is smallest
    assert [s.axis for s in reshard("S(0)S(1)", "RR", (8, 8), 4, (2, 2), axis_weights=(1, 10))] == [1, 0]
    assert [s.axis for s in reshard("S(0)S(1)", "RR", (8, 8), 4, (2, 2), axis_weights=(10, 1))] == [0, 1]
    assert reshard_bytes("S(0)S(1)", "RR", (8, 8), 4, (2, 2), axis_weights=(1, 10)) == 64 * 10 + 128
    with pytest.raises(ShardSpecError, match="1 axis weights for a mesh of shape"):
        reshard("S(0)S(1)", "RR", (8, 8), 4, (2, 2), axis_weights=(1,))


def test_non_canonical_specs_of_one_layout_need_nothing():
    assert reshard("S(1,4)", "S(1)", SHAPE, ITEM, (N,)) == []
    assert reshard("S(0,[2,2,2])", "S(0)", SHAPE, ITEM, (N,)) == []
    assert reshard("S(0)P(sum)", "RR", SHAPE, ITEM, (1, 1)) == []


def test_bad_specs_are_reported():
    with pytest.raises(ShardSpecError, match=r"sharding spec S\(0\) on mesh \(4,\) for shape \(6, 12\)"):
        reshard("S(0)", "R", SHAPE, ITEM, (4,))


def test_collective_json_and_text():
    (step,) = reshard("P(sum)", "S(1)", SHAPE, ITEM, (N,))
    assert Collective.from_json(json.loads(json.dumps(step.to_json()))) == step
    assert str(step) == "reduce_scatter[axis 0, n=3] P(sum) -> S(1): 192 B/device"
    assert step.op == "sum" and not step.is_local
    with pytest.raises(ShardSpecError, match="unknown collective kind"):
        Collective("broadcast", 0, 0.0, 2, ShardSpec("R"), ShardSpec("R"))


def test_simulate_rejects_steps_that_do_not_fit():
    (step,) = reshard("S(0)", "R", SHAPE, ITEM, (N,))
    shards = split(np.zeros(SHAPE), "S(0)", (2,))
    with pytest.raises(ShardSpecError, match="does not fit mesh"):
        simulate([step], shards)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_reshard_is_correct_on_random_specs(data):
    shape, mesh = data.draw(shapes(), label="shape"), data.draw(meshes(3), label="mesh")
    src = data.draw(specs(shape, mesh), label="src")
    dst = data.draw(specs(shape, mesh), label="dst")
    x = array(data, shape)
    plan = reshard(src, dst, shape, 8, mesh)
    assert plan == reshard(src, dst, shape, 8, mesh)  # deterministic
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="summands seed"))
    state, shards = src.canonical(shape, mesh), random_split(x, src, mesh, rng)
    np.testing.assert_array_equal(assemble(shards, src, mesh), x)
    for step in plan:
        assert step.before == state and step.n == mesh[step.axis]
        # local steps are free; only a degenerate uneven all_to_all may move nothing
        assert step.bytes_per_device == 0 if step.is_local else (step.bytes_per_device > 0 or step.kind == "all_to_all")
        assert all(step.before[k] == step.after[k] for k in range(len(mesh)) if k != step.axis)
        shards = simulate([step], shards)
        np.testing.assert_array_equal(assemble(shards, step.after, mesh), x)  # every step keeps x
        state = step.after
    assert state == dst.canonical(shape, mesh)
    np.testing.assert_array_equal(assemble(shards, dst, mesh), x)
    got, full = resolve_partials(shards, dst, mesh)  # partial summands are not unique; their totals are
    want = split(x, full, mesh)
    for coords in want:
        np.testing.assert_array_equal(got[coords], want[coords])
    if not dst.is_partial:
        for coords, shard in split(x, dst, mesh).items():
            np.testing.assert_array_equal(shards[coords], shard)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reshard_floats_with_partials_is_exact(data):
    # the free R/S -> P steps create one nonzero summand per element, so floats stay exact
    shape, mesh = data.draw(shapes(2)), data.draw(meshes(2))
    src, dst = data.draw(specs(shape, mesh)), data.draw(specs(shape, mesh))
    x = array(data, shape).astype(np.float32) / 7
    shards = simulate(reshard(src, dst, shape, 4, mesh), split(x, src, mesh))
    np.testing.assert_array_equal(assemble(shards, dst, mesh), x)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_even_split_volumes_are_the_same_on_every_device(data):
    """The planner's fast path: with even splits, all-reduce, reduce-scatter and all-gather move
    the same bytes to every device, so one device's volume is the step's."""
    from parc.sharding.reshard import _Steps

    shape, mesh = data.draw(shapes()), data.draw(meshes())
    before = data.draw(specs(shape, mesh, uneven=False))
    after = data.draw(specs(shape, mesh, uneven=False))
    steps = _Steps(shape, mesh, 4)
    for c in reshard(before, after, shape, 4, mesh):
        if c.kind in ("all_reduce", "reduce_scatter", "all_gather"):
            k = c.axis
            full = 0.0
            for coords in steps.devices:
                held, need = steps.local(c.before, coords), steps.local(c.after, coords)
                touched = {x.dim for x in (c.before[k], c.after[k]) if hasattr(x, "dim")}
                h, m = int(np.prod(held)), int(np.prod(need))
                if c.kind == "all_reduce":
                    v = 2 * (c.n - 1) / c.n * h
                elif c.kind == "reduce_scatter":
                    v = h - m
                else:
                    v = m - int(np.prod([steps.overlap(c.before, c.after, d, coords) if d in touched else e
                                         for d, e in enumerate(need)]))
                full = max(full, float(v))
            assert c.bytes_per_device == full * 4


def _random_key(rng, extent: int, mesh: tuple[int, ...]) -> tuple:
    """A device's pieces along one dim: per mesh axis, no split, or an even, strided or uneven one."""
    axes, length = [], extent
    for n in mesh:
        kind = rng.random()
        if kind < 0.3 or length % n:
            axes.append(None)
            continue
        if kind < 0.55:
            ax = Split(0)
        elif kind < 0.85:
            ax = Split(0, stride=int(rng.choice([s for s in range(1, length // n + 1) if length % (n * s) == 0])))
        else:
            cuts = np.sort(rng.choice(np.arange(1, length), n - 1, replace=False)) if length > n else np.arange(1, n)
            ax = Split(0, sizes=tuple(int(b - a) for a, b in zip([0, *cuts], [*cuts, length])))
        c = int(rng.integers(n))
        axes.append((ax, c))
        length = ax.sizes[c] if ax.sizes is not None else length // n
    return extent, mesh, tuple(axes)


@pytest.mark.parametrize("seed", range(6))
def test_overlap_of_pieces_equals_the_index_sets(seed):
    """The overlap of two devices' pieces (contiguous by arithmetic, interleaved on blocks of
    their common unit) is the size of the intersection of their index sets."""
    reshard_mod = importlib.import_module("parc.sharding.reshard")
    rng = np.random.default_rng(seed)
    for _ in range(300):
        mesh = tuple(int(n) for n in rng.choice([2, 3, 4], rng.integers(1, 4)))
        extent = int(rng.choice([1, 2, 3, 6])) * math.prod(mesh) * int(rng.choice([1, 2, 4, 6, 10]))
        a, b = _random_key(rng, extent, mesh), _random_key(rng, extent, mesh)
        want = len(np.intersect1d(reshard_mod._dim_index(a), reshard_mod._dim_index(b)))
        assert reshard_mod._overlap.__wrapped__(a, b) == want, (a, b)


def _all_to_all_by_device(steps, before, after, k) -> float:
    """The volume the busiest device receives in an all-to-all, one device at a time (the
    definition `_Steps._least_overlap` computes for every device at once)."""
    touched = {x.dim for x in (before[k], after[k]) if isinstance(x, Split)}
    worst = 0
    for coords in steps.devices:
        need = steps.local(after, coords)
        held = math.prod(steps.overlap(before, after, d, coords) if d in touched else e for d, e in enumerate(need))
        worst = max(worst, math.prod(need) - held)
    return worst * steps.dtype_bytes


@pytest.mark.parametrize("seed", range(40))
def test_all_to_all_volume_for_all_devices_at_once_equals_device_by_device(seed):
    from parc.sharding.reshard import _canonical, _Steps, step_kind

    rng = np.random.default_rng(seed)
    mesh = [(2, 2), (2, 3), (4, 2), (2, 2, 2), (3, 2)][seed % 5]
    shape = (24, 12)

    def axis(n, length):
        kind = rng.integers(4)
        if kind == 0:
            return R
        d = int(rng.integers(2))
        if kind == 3:
            strides = [s for s in range(1, shape[d] // n + 1) if shape[d] % (n * s) == 0 and s < shape[d] // n]
            if strides:
                return Split(d, stride=int(rng.choice(strides)))
        return Split(d)

    checked = 0
    for _ in range(200):
        k = int(rng.integers(len(mesh)))
        base = [axis(n, 0) for n in mesh]
        a, b = list(base), list(base)
        a[k], b[k] = Split(0), Split(1)
        if rng.integers(2):
            a[k], b[k] = b[k], a[k]
        before, after = (_canonical(ShardSpec(tuple(x)), shape, mesh) for x in (a, b))
        if before is None or after is None or step_kind(before[k], after[k]) != "all_to_all":
            continue
        steps = _Steps(shape, mesh, 4)
        assert steps.bytes("all_to_all", before, after, k) == _all_to_all_by_device(steps, before, after, k), \
            (before, after, k, mesh)
        checked += 1
    assert checked >= 5
