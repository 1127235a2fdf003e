"""Rhino Table 1's GPT configurations on its device counts, with 16 GB devices (SPMD-only,
global batch 4): every one gets a feasible plan, the memory fits, and the plan is no worse than
any feasible baseline. gpt-medium alone on one 16 GB device does not fit whole (its fp32 AdamW
state and saved activations need about 21 GiB) and is planned as 4 microbatches, as one would
train it there."""

from __future__ import annotations

import pytest
from bars import GIB, plan, training_step

from parc.cluster import resolve_cluster
from parc.errors import InfeasiblePlanError
from parc.passes.spmd.search import plan_graph

TABLE1 = [("gpt-large", 2), ("gpt-xl", 4), ("gpt-2.7b", 8), ("gpt-6.7b", 16)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "gpus"), TABLE1)
def test_table1_gpt_on_16gb_devices_is_feasible(name, gpus, tmp_path):
    graph = training_step(name, tmp_path, batch=4)
    p = plan(graph, f"{gpus}xv100-16g", time_limit=120)
    assert p.best.memory_bytes <= 16 * GIB
    for base in p.baselines.values():
        if base["feasible"]:
            assert p.best.solution.cost <= base["step_time_s"] * (1 + 1e-6)


@pytest.mark.slow
def test_gpt_medium_on_one_16gb_device_fits_as_microbatches(tmp_path):
    graph = training_step("gpt-medium", tmp_path, batch=4)
    cluster = resolve_cluster("1xv100-16g", None)
    with pytest.raises(InfeasiblePlanError, match="no mesh fits 16.00 GiB"):
        plan_graph(graph, cluster, level="O2", jobs=1)
    p = plan_graph(graph, cluster, level="O2", jobs=1, micro_batches=4)
    assert p.best.memory_bytes <= 16 * GIB
    assert p.to_json()["micro_batches"]["count"] == 4
