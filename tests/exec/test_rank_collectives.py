"""A rank's collectives between even, strided and uneven layouts, run on thread ranks, give what
the simulator's steps give (`parc.sharding.simulator.run_step`, the definition `parc verify`
checks whole plans against): the all_to_alls and reduce_scatters that send each peer only what
it keeps (`Rank._pieces_to_all`, `Rank._scatter_partial`) and the gathers."""

from __future__ import annotations

import math
import threading

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from parc.exec.runner import Rank
from parc.exec.threads import ThreadComm, _World
from parc.sharding import PARTIAL_OPS, Partial, R, ShardSpec, split
from parc.sharding.reshard import Collective
from parc.sharding.simulator import run_step
from tests.sharding.shard_strategies import split_of


def _on_threads(step: Collective, parts: list[np.ndarray]) -> list[np.ndarray]:
    """Each of step.n thread ranks runs the step's collective on its part, as `Rank.step` does."""
    world = _World(step.n, timeout=20.0)
    out: list = [None] * step.n
    errors: list[BaseException] = []

    def body(c: int) -> None:
        rank = Rank.__new__(Rank)  # only what a collective reads: the steps, the comm, the arrays
        rank.steps, rank.comm, rank.xp, rank._exchanges = {"s": step}, ThreadComm(world, c), np, {}
        try:
            for _ in range(2):  # the second call runs from the cached exchange
                out[c] = rank._collective({"id": "s", "group": list(range(step.n))}, parts[c])
        except BaseException as e:
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=body, args=(c,), daemon=True) for c in range(step.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_ranks_collective_gives_the_simulators_step(data):
    n = data.draw(st.integers(2, 4), label="n")
    shape = tuple(data.draw(st.lists(st.integers(1, 10), min_size=1, max_size=3), label="shape"))
    kind = data.draw(st.sampled_from(["all_to_all", "reduce_scatter", "all_gather"]), label="kind")
    i = data.draw(st.integers(0, len(shape) - 1), label="i")
    j = data.draw(st.integers(0, len(shape) - 1), label="j")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    if kind == "reduce_scatter":
        src, dst = Partial(data.draw(st.sampled_from(PARTIAL_OPS), label="op")), split_of(data.draw, shape[j], n, j)
        assume(dst is not None)
        # small integers: a sum is exact in any order
        parts = [rng.integers(-8, 8, size=shape).astype(np.float32) for _ in range(n)]
    else:
        src = split_of(data.draw, shape[i], n, i)
        dst = split_of(data.draw, shape[j], n, j) if kind == "all_to_all" else R
        assume(src is not None and dst is not None and src != dst)  # a step changes the layout
        whole = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
        parts = [split(whole, ShardSpec((src,)), (n,))[(c,)] for c in range(n)]
    step = Collective(kind, 0, 0.0, n, ShardSpec((src,)), ShardSpec((dst,)))
    for got, want in zip(_on_threads(step, parts), run_step(step, parts)):
        assert got.shape == want.shape
        np.testing.assert_array_equal(got, want)
