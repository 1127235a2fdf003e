"""Mixed devices on one mesh (hetero.py): uneven strategies, per-device costs and the mesh's
balance (the balancers themselves: tests/solver/test_solver_balance.py)."""

from __future__ import annotations

import numpy as np
import pytest

from parc.cluster import enumerate_meshes, resolve_cluster
from parc.cluster.work import of_graph
from parc.ir import importer
from parc.passes.spmd.costs import build, even_choice, per_device, work_fractions
from parc.sharding.spec import Split
from tests.helpers import parc

MIXED = resolve_cluster("2xv100-32g+2xp100-16g", None)


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hetero") / "gpt.onnx"
    # batch 256: at 64 the step is so small that its kernels take no longer than their launch
    # (the engine fuses the elementwise ones), and the devices all computing it whole beats any split
    assert parc("models", "build", "gpt-tiny", "--set", "batch=256", "--train", "adamw", "-o", str(path)).returncode == 0
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
    # a split node costs its slowest device's piece: with the balance's shares, or equal ones
    work = {d.name: of_graph(gpt, d) for d in MIXED.devices}
    total = {"even": 0.0, "balanced": 0.0}
    for pos in range(len(gpt.nodes)):
        i = model.node_index(pos)
        for j, s in enumerate(model.strategies[pos]):
            if s.split == 1 or s not in uneven or work["p100-16g"][pos] is None:
                continue
            f = work_fractions(s, mesh.shape)
            assert model.problem.comp[i][j] == pytest.approx(
                max(work[d.name][pos].seconds(d, fr) for fr, d in zip(f, MIXED.devices)))
            assert even.problem.comp[i][j] == pytest.approx(
                max(work[d.name][pos].seconds(d, 1 / s.split) for d in MIXED.devices))
            total["even"] += even.problem.comp[i][j]
            total["balanced"] += model.problem.comp[i][j]
    # the shares follow the devices' speed on the whole graph: over its split nodes, the even
    # split (which the P100s set) costs more, though a small node may not (its launch floor and
    # its pieces' walk take as long on either device)
    assert total["even"] > total["balanced"]


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
