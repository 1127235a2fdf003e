"""What devices hold: local shapes, global indices, split and assemble (strided, uneven, nested)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from shard_strategies import array, meshes, resolve_partials, shapes, specs, split_of

from parc.sharding import (
    Partial,
    R,
    Replicated,
    ShardSpec,
    ShardSpecError,
    assemble,
    devices,
    local_shape,
    shard_index,
    split,
)
from parc.sharding.layout import exchange
from parc.sharding.reshard import Collective
from parc.sharding.simulator import run_step

props = settings(max_examples=80, deadline=None)


def rows(spec: str, shape, mesh, coords) -> list[int]:
    return shard_index(shape, spec, mesh, coords)[0].tolist()


def test_rhino_figure_3_contiguous_and_strided_rows():
    # a 4x2 tensor on 2 devices: contiguous rows {0,1} | {2,3}; stride 1 rows {0,2} | {1,3}
    assert [rows("S(0)", (4, 2), (2,), (c,)) for c in range(2)] == [[0, 1], [2, 3]]
    assert [rows("S(0,1)", (4, 2), (2,), (c,)) for c in range(2)] == [[0, 2], [1, 3]]
    assert shard_index((4, 2), "S(1)", (2,), (1,))[1].tolist() == [1]


def test_stride_views_the_dim_as_outer_devices_stride():
    # D=12, n=2, s=2: (12/(2*2), 2, 2) = (3, 2, 2); device c holds [:, c, :]
    assert rows("S(0,2)", (12,), (2,), (0,)) == [0, 1, 4, 5, 8, 9]
    assert rows("S(0,2)", (12,), (2,), (1,)) == [2, 3, 6, 7, 10, 11]
    want = np.arange(12).reshape(3, 2, 2)[:, 1, :].ravel().tolist()
    assert rows("S(0,2)", (12,), (2,), (1,)) == want


def test_uneven_split_and_empty_pieces():
    assert [rows("S(0,[1,0,3])", (4, 5), (3,), (c,)) for c in range(3)] == [[0], [], [1, 2, 3]]
    assert local_shape((4, 5), "S(0,[1,0,3])", (3,), (1,)) == (0, 5)
    x = np.arange(20).reshape(4, 5)
    shards = split(x, "S(0,[1,0,3])", (3,))
    assert shards[(1,)].shape == (0, 5)
    np.testing.assert_array_equal(assemble(shards, "S(0,[1,0,3])", (3,)), x)


def test_nested_split_axis_0_outermost():
    # S(0)S(0) on a 2x3 mesh: dim 0 cut in 2, each half in 3
    got = {c: rows("S(0)S(0)", (12,), (2, 3), c) for c in devices((2, 3))}
    assert got[(0, 0)] == [0, 1] and got[(0, 2)] == [4, 5] and got[(1, 0)] == [6, 7]
    # a strided inner split is strided within the outer piece
    assert rows("S(0)S(0,1)", (12,), (2, 3), (1, 1)) == [7, 10]


def test_partial_split_gives_exact_summands():
    x = np.arange(6).reshape(2, 3)
    sums = split(x, "P(sum)", (3,))
    np.testing.assert_array_equal(sums[(0,)], x)
    assert not sums[(1,)].any() and not sums[(2,)].any()
    assert all(np.array_equal(s, x) for s in split(x, "P(max)", (3,)).values())
    np.testing.assert_array_equal(assemble(sums, "P(sum)", (3,)), x)


def test_assemble_catches_diverging_replicas():
    shards = {(0,): np.zeros(2), (1,): np.ones(2)}
    with pytest.raises(ShardSpecError, match=r"mesh axis 0 is replicated but the devices \(0,\) and \(1,\) differ"):
        assemble(shards, "R", (2,))
    with pytest.raises(ShardSpecError, match="expected one per device"):
        assemble({(0,): np.zeros(2)}, "R", (2,))


def test_bad_coordinates():
    with pytest.raises(ShardSpecError, match=r"no device at coordinates \(2,\)"):
        local_shape((4,), "S(0)", (2,), (2,))


@props
@given(st.data())
def test_split_assemble_round_trip(data):
    shape, mesh = data.draw(shapes()), data.draw(meshes(3))
    spec = data.draw(specs(shape, mesh))
    x = array(data, shape)
    shards = split(x, spec, mesh)
    assert set(shards) == set(devices(mesh))
    np.testing.assert_array_equal(assemble(shards, spec, mesh), x)
    for coords, shard in shards.items():
        assert shard.shape == local_shape(shape, spec, mesh, coords)


@props
@given(st.data())
def test_shard_index_is_what_split_gives(data):
    shape, mesh = data.draw(shapes()), data.draw(meshes(3))
    spec = data.draw(specs(shape, mesh))
    x = array(data, shape)
    complete, full_spec = resolve_partials(split(x, spec, mesh), spec, mesh)
    holders = np.zeros(shape, dtype=int)
    for coords, shard in complete.items():
        index = shard_index(shape, spec, mesh, coords)
        np.testing.assert_array_equal(shard, x[np.ix_(*index)])
        assert all(np.all(np.diff(i) > 0) for i in index)  # local order is global order
        holders[np.ix_(*index)] += 1
    # every element lives on exactly the devices of the axes that do not split it
    copies = math.prod(n for ax, n in zip(full_spec, mesh) if isinstance(ax, Replicated | Partial))
    assert (holders == copies).all()
    assert full_spec == ShardSpec(tuple(R if isinstance(a, Partial) else a for a in spec))


@props
@given(st.data())
def test_each_devices_exchange_gives_its_piece_under_the_destination(data):
    """`exchange` on each device's own piece, every device's parts delivered, gives each device
    its piece of the whole under the destination split (strided and uneven splits, one dim or
    two); the simulator's all_to_all, which runs every device's side, gives the same."""
    n = data.draw(st.integers(2, 4), label="n")
    shape = tuple(data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=3), label="shape"))
    i = data.draw(st.integers(0, len(shape) - 1), label="i")
    j = data.draw(st.integers(0, len(shape) - 1), label="j")
    src, dst = split_of(data.draw, shape[i], n, i), split_of(data.draw, shape[j], n, j)
    assume(src is not None and dst is not None)
    whole = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    parts = [split(whole, ShardSpec((src,)), (n,))[(c,)] for c in range(n)]
    want = [split(whole, ShardSpec((dst,)), (n,))[(c,)] for c in range(n)]
    sides = [exchange(src, dst, n, parts[c].shape, c) for c in range(n)]
    for q, ex in enumerate(sides):
        got = np.full(ex.shape, np.nan, dtype=np.float32)
        for p, side in enumerate(sides):
            sent = np.take(parts[p], side.send[q], axis=side.send_dim)
            assert sent.shape == ex.parts[p]
            index = [slice(None)] * len(shape)
            index[ex.recv_dim] = ex.recv[p]
            got[tuple(index)] = sent
        np.testing.assert_array_equal(got, want[q])
    step = Collective("all_to_all", 0, 0.0, n, ShardSpec((src,)), ShardSpec((dst,)))
    for got, piece in zip(run_step(step, parts), want):
        np.testing.assert_array_equal(got, piece)
