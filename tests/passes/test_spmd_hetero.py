"""Mixed devices on one mesh (hetero.py): Whale's Algorithm 1, the exact balance, uneven
strategies and per-device costs."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from parc.cluster import enumerate_meshes, resolve_cluster
from parc.ir import importer
from parc.ops.base import RULES
from parc.passes.spmd.costs import build, even_choice, per_device, work_fractions
from parc.passes.spmd.hetero import balanced_time, exact_balance, label_sizes, split_sizes, whale_balance
from parc.sharding.spec import Split
from tests.helpers import parc

MIXED = resolve_cluster("2xv100-32g+2xp100-16g", None)


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



@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hetero") / "gpt.onnx"
    # batch 64: at 32 the step is so small that the devices all computing it whole beats data
    # parallel over a network, where gradients above a bucket member's size pay a whole latency
    assert parc("models", "build", "gpt-tiny", "--set", "batch=64", "--train", "adamw", "-o", str(path)).returncode == 0
    return importer.load(str(path), {})


def test_a_mixed_mesh_splits_unevenly_and_prices_its_slowest_device(gpt):
    mesh = enumerate_meshes(MIXED, max_dims=1)[0]
    model = build(gpt, mesh, MIXED)
    b = model.balance
    assert b is not None and b.uneven(0)
    assert b.shares[0][0] == b.shares[0][1] > b.shares[0][2] == b.shares[0][3]  # V100s take more
    uneven = [s for strats in model.strategies for s in strats
              if any(isinstance(ax, Split) and ax.sizes is not None for spec in s.outputs for ax in spec)]
    assert uneven
    for s in uneven[:50]:  # every uneven piece list sums to the dim it splits, fastest first
        f = work_fractions(s, mesh.shape)
        assert f.sum() == pytest.approx(1.0) and f[0] >= f[3]
    even = build(gpt, mesh, MIXED, even=True)
    # equal shares, the same strategies: the P100s set the step, so every split node that moves
    # bytes costs more (a view, such as a Reshape, costs its launch either way)
    views = {op for op, rule in RULES.items() if rule.view}
    for pos in range(len(gpt.nodes)):
        i = model.node_index(pos)
        for j, s in enumerate(model.strategies[pos]):
            if s.split > 1 and s in uneven and gpt.nodes[pos].op_type not in views:
                assert even.problem.comp[i][j] > model.problem.comp[i][j]


def test_the_plan_beats_its_even_split_and_reports_each_device(gpt):
    from parc.passes.spmd.search import plan_graph

    plan = plan_graph(gpt, MIXED, level="O2", max_mesh_dims=1, jobs=1)
    d = plan.to_json()
    even = d["baselines"]["even-split"]
    assert even["feasible"] and even["step_time_s"] > d["predicted"]["step_time_s"]
    assert d["predicted"]["devices"] == ["v100-32g", "v100-32g", "p100-16g", "p100-16g"]
    compute, memory = d["predicted"]["compute_s_per_device"], d["predicted"]["memory_bytes_per_device"]
    assert len(compute) == len(memory) == 4 and memory[0] > memory[3]  # the V100s hold more samples
    assert d["balance"]["axes"][0]["optimum"] is not None
    m = plan.best.model
    assert per_device(m, plan.best.solution.choice)[1] == memory
    even_model = build(gpt, m.mesh, MIXED, even=True)
    x = even_choice(m, even_model, plan.best.solution.choice)
    assert even_model.problem.cost(x) == pytest.approx(even["step_time_s"])  # the baseline is that choice
    assert not any("[" in str(even_model.source_specs[k][x[k]]) for k in range(len(m.sources)))


def test_a_homogeneous_mesh_has_no_balance(gpt):
    cluster = resolve_cluster("4xv100-32g", None)
    model = build(gpt, enumerate_meshes(cluster, max_dims=1)[0], cluster)
    assert model.balance is None
    plan_keys = np.array([s.split for strats in model.strategies for s in strats])
    assert plan_keys.max() == 4


def test_the_balance_leaves_highs_single_threaded():
    """HiGHS fixes its thread scheduler at the first solve of a process: a balance solved with
    the default threads made every later threads=1 solve (the stage ILP) fail with an error."""
    import subprocess
    import sys

    code = (
        "import numpy as np\n"
        "from parc.passes.spmd.hetero import exact_balance\n"
        "from parc.passes.pipeline import stages as st\n"
        "assert exact_balance(8, [1.0, 2.0], [100.0, 100.0], 1.0) is not None\n"
        "got = st._stage_ilp(np.full(4, 0.5), [(0, 1), (1, 2), (2, 3)], [1.0, 1.0, 1.0], 2, np.zeros(4, int),"
        " np.ones(4, int), 1.5, 10.0)\n"
        "assert got is not None\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_a_slice_of_several_devices_splits_a_units_activations_over_them():
    """On a 2 x 4 mesh over a V100 node and a P100 node, the node axis balances slices of four
    devices: a sample's activations are spread over the four, so a P100 slice (4 x 16 GiB) holds
    64 samples of 1 GiB, not 16."""
    from parc.passes.spmd.hetero import mesh_balance

    cluster = resolve_cluster("4xv100-32g+4xp100-16g", None)
    mesh = next(m for m in enumerate_meshes(cluster, max_dims=2) if m.shape == (2, 4))
    gib = float(2**30)
    b = mesh_balance(mesh, cluster, {"v100-32g": 1.0, "p100-16g": 1.5}, 100, gib, 0.0)
    axis = b.report["axes"][0]
    assert axis["axis"] == 0 and axis["optimum"] is not None
    assert sum(axis["optimum"]) == 100 and axis["optimum"][1] <= 64
    assert b.shares[0][0] > b.shares[0][1]
