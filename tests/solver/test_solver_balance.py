"""Load balance over mixed devices (parc/solver/balance.py, Whale 3.3.1): Algorithm 1, the
exact balance against brute force, and the rounding of shares to a dim's pieces."""

from __future__ import annotations

import itertools
import random

import pytest

from parc.solver.balance import balanced_time, exact_balance, label_sizes, split_sizes, whale_balance


def test_algorithm1_starts_from_flop_capacity():
    assert whale_balance(30, [2.0, 1.0], [1e9, 1e9], 1.0) == [20, 10]
    assert sum(whale_balance(7, [3.0, 2.0, 2.0], [1e9] * 3, 1.0)) == 7


def test_algorithm1_shifts_the_overload_to_the_least_loaded_free_device():
    # device 0 would hold 20 units of 4 bytes (80 > 60): 5 units go to the free device
    assert whale_balance(30, [2.0, 1.0], [60.0, 100.0], 4.0) == [15, 15]
    # two free devices: the valley is the one with the lowest FLOP utilisation (load / flops)
    assert whale_balance(40, [2.0, 1.0, 1.0], [40.0, 100.0, 100.0], 1.0, fixed=[0.0, 0.0, 0.0]) == [20, 10, 10]
    # the whole excess (8) goes to one valley (the first of the tied ones), as Whale's shift_load
    # does; the optimum spreads it
    assert whale_balance(40, [2.0, 1.0, 1.0], [12.0, 100.0, 100.0], 1.0) == [12, 18, 10]
    assert exact_balance(40, [0.5, 1.0, 1.0], [12.0, 100.0, 100.0], 1.0) == [12, 14, 14]
    # no room anywhere: the free device fills up and leaves the list; the overload stays
    assert whale_balance(30, [2.0, 1.0], [60.0, 50.0], 4.0) == [18, 12]


@pytest.mark.parametrize("seed", range(30))
def test_exact_balance_is_the_optimum_and_algorithm1_never_beats_it(seed):
    rng = random.Random(seed)
    n, units = rng.randint(2, 3), rng.randint(3, 12)
    t = [rng.uniform(0.5, 3.0) for _ in range(n)]
    mem = [rng.uniform(2.0, 12.0) for _ in range(n)]
    a = rng.uniform(0.5, 1.5)
    best = None
    for load in itertools.product(range(units + 1), repeat=n):
        if sum(load) == units and all(x * a <= m for x, m in zip(load, mem)):
            v = balanced_time(load, t)
            best = v if best is None else min(best, v)
    got = exact_balance(units, t, mem, a)
    if best is None:
        assert got is None
        return
    assert got is not None and sum(got) == units and all(x * a <= m * (1 + 1e-9) for x, m in zip(got, mem))
    assert balanced_time(got, t) == pytest.approx(best, rel=1e-9)
    flops = [1.0 / x for x in t]
    whale = whale_balance(units, flops, mem, a)
    if all(x * a <= m for x, m in zip(whale, mem)):
        assert balanced_time(whale, t) >= best * (1 - 1e-9)


def test_split_sizes():
    assert split_sizes(32, [0.3, 0.3, 0.2, 0.2]) == (10, 10, 6, 6)  # 9.6, 9.6, 6.4, 6.4: largest remainders
    assert sum(split_sizes(1000, [0.6, 0.4])) == 1000
    assert split_sizes(3, [0.25] * 4) is None  # too small for a piece each
    assert split_sizes(8, [0.25] * 4) is None  # even: no uneven split
    assert min(split_sizes(5, [0.97, 0.01, 0.01, 0.01])) >= 1


def test_a_flattened_batch_is_cut_where_the_batch_is():
    """[B*S, H] pieces are the batch's pieces times S (a Reshape's output meets its consumer's
    input); rounded apart they differ: 32768 * 0.073 -> 2392 rows, not 5 * 512."""
    shares = [0.073] * 8 + [0.052] * 8
    cut = (5,) * 8 + (3,) * 8  # the batch of 64 by the exact balance
    assert label_sizes(64, shares, cut) == cut
    assert label_sizes(64 * 512, shares, cut) == tuple(c * 512 for c in cut) != split_sizes(64 * 512, shares)
    assert label_sizes(1000, shares, cut) == split_sizes(1000, shares)  # not whole batches
    assert label_sizes(64 * 512, shares, None) == split_sizes(64 * 512, shares)  # no batch cut
    # moe-tiny's batch of 16 on 2 V100 + 2 P100: 16 * 0.279 rounds to an even 4 each; the
    # exact balance cuts it 5, 5, 3, 3, and its flattened dims follow
    assert split_sizes(16, [0.279, 0.279, 0.221, 0.221]) is None
    assert label_sizes(64, [0.279, 0.279, 0.221, 0.221], (5, 5, 3, 3)) == (20, 20, 12, 12)
    # an even batch cut: other extents keep their own rounding (tensor parallel on a small batch)
    assert label_sizes(512, [0.6, 0.4], (2, 2)) == split_sizes(512, [0.6, 0.4]) == (307, 205)


def test_the_balance_leaves_highs_single_threaded():
    """HiGHS fixes its thread scheduler at the first solve of a process: a balance solved with
    the default threads made every later threads=1 solve (the stage ILP) fail with an error."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from parc.solver.balance import exact_balance\n"
        "from parc.solver.stages import stage_ilp\n"
        "assert exact_balance(8, [1.0, 2.0], [100.0, 100.0], 1.0) is not None\n"
        "got = stage_ilp(np.full(4, 0.5), [(0, 1), (1, 2), (2, 3)], [1.0, 1.0, 1.0], 2, np.zeros(4, int),"
        " np.ones(4, int), 1.5, 10.0)\n"
        "assert got is not None\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
