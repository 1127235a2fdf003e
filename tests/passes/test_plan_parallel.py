"""The mesh search in parallel processes: the same plan as in-process, errors as serially."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from helpers import assert_one_line_error, inp, make_model, parc, tensor
from onnx import helper

from parc.cluster import parse_devices
from parc.errors import InfeasiblePlanError, UsageError
from parc.hints import Hints, Pin, Request, Scope
from parc.ir.importer import from_model
from parc.passes.spmd import pool
from parc.passes.spmd.search import plan_graph
from parc.sharding import ShardSpec
from parc.solver import MemoryBudgetError

pytestmark = pytest.mark.skipif(not pool.can_fork(), reason="needs the fork start method")


def mlp_model():
    """x[8,16] @ w1[16,32] -> Relu -> @ w2[32,16]: a two-layer MLP."""
    n = helper.make_node
    rng = np.random.default_rng(0)
    return make_model([n("MatMul", ["x", "w1"], ["h"], name="fc1"), n("Relu", ["h"], ["a"], name="act"),
                       n("MatMul", ["a", "w2"], ["y"], name="fc2")],
                      [inp("x", [8, 16])], [inp("y", [8, 16])],
                      [tensor("w1", rng.standard_normal((16, 32)).astype(np.float32)),
                       tensor("w2", rng.standard_normal((32, 16)).astype(np.float32))])


@pytest.fixture()
def graph():
    return from_model(mlp_model())


def plan_doc(graph, **kw) -> dict:
    doc = plan_graph(graph, parse_devices("4xa100-80g"), time_limit=10, **kw).to_json()
    doc["solver"].pop("time_s")  # wall time: the one key allowed to differ
    return doc


def test_two_processes_give_the_serial_plan(graph):
    calls = []
    serial = plan_doc(graph, jobs=1)
    parallel = plan_doc(graph, jobs=2, progress=lambda *a: calls.append((os.getpid(), *a)))
    assert json.dumps(parallel, sort_keys=True) == json.dumps(serial, sort_keys=True)
    assert [m["shape"] for m in serial["solver"]["meshes"]] == [[4], [2, 2]]
    assert list(serial["baselines"]) == ["data-parallel", "zero-3", "megatron-tp2"]
    # progress from this process, once per job (per mesh: cost model, plan, baselines)
    assert {c[0] for c in calls} == {os.getpid()}
    assert [c[2] for c in calls] == list(range(1, 8)) and {c[3] for c in calls} == {7}


def test_errors_in_workers_read_as_serially(graph):
    cluster = parse_devices("4xa100-80g")
    cases = [
        (InfeasiblePlanError, {"memory_budget": 100.0}),
        (UsageError, {"hints": Hints(pins=(Pin("nosuch", ShardSpec("S(0)")),))}),
        (UsageError, {"hints": Hints(scopes=(Scope("fc", Request("split", 3)),))}),  # no mesh eligible
    ]
    for error, kw in cases:
        messages = []
        for jobs in (1, 2):
            with pytest.raises(error) as info:
                plan_graph(graph, cluster, time_limit=10, jobs=jobs, **kw)
            messages.append(str(info.value))
        assert messages[0] == messages[1], messages


def fails_on(graph, job):
    if job >= 2:
        raise MemoryBudgetError(float(job), 1.0)  # its __init__ takes numbers: not picklable by args
    return graph.nodes[job]  # comes back as the parent's own node


def test_pool_returns_the_parents_objects_and_raises_the_first_failure(graph):
    assert pool.run_jobs(fails_on, graph, [0, 1], 2) == graph.nodes[:2]
    assert all(a is b for a, b in zip(pool.run_jobs(fails_on, graph, [1, 0], 2), graph.nodes[1::-1]))
    for processes in (1, 2):
        with pytest.raises(MemoryBudgetError, match="need 3 per device") as info:
            pool.run_jobs(fails_on, graph, [0, 3, 1, 2], processes)
        assert info.value.need == 3.0 and info.value.budget == 1.0


def test_follow_up_jobs_run_after_their_parent_job(graph):
    def then(job, result):
        return [job + 10] if job < 10 else []

    for processes in (1, 2):
        out = pool.run_jobs(lambda g, job: job * 2, graph, [0, 1], processes, then)
        assert sorted(out) == [0, 2, 20, 22] and out[:2] == [0, 2]


def test_jobs_option(tmp_path):
    import onnx

    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    assert_one_line_error(parc("plan", str(path), "--devices", "4xa100-80g", "--jobs", "0", "-o",
                               str(tmp_path / "p")), "--jobs 0")
    res = parc("plan", str(path), "--devices", "4xa100-80g", "--jobs", "2", "-o", str(tmp_path / "q"))
    assert res.returncode == 0, res.stderr
    assert json.loads((tmp_path / "q" / "plan.json").read_text())["mesh"]["shape"] in ([4], [2, 2])


def slow_unless_first(graph, job):
    if job == 0:
        raise UsageError("job 0 failed")
    import time

    time.sleep(60)


def test_a_failure_stops_the_later_jobs(graph):
    import time

    t0 = time.perf_counter()
    with pytest.raises(UsageError, match="job 0 failed"):
        pool.run_jobs(slow_unless_first, graph, [0, 1, 2], 2)
    assert time.perf_counter() - t0 < 30


def test_the_shared_minimum_reaches_across_forked_workers():
    """What a forked worker offers, the parent and later workers see: the least value wins."""
    best = pool.SharedMinimum()
    best.offer(5.0)

    def offer(_graph, x):
        best.offer(x)
        return best.value

    seen = pool.run_jobs(offer, from_model(mlp_model()), [7.0, 3.0, 4.0], 2)
    # each job sees the least offered so far: two workers race, so job 0 may see job 1's 3.0
    # and job 2 may run before job 1 offers
    assert best.value == 3.0 and seen[1] == 3.0
    assert seen[0] in (3.0, 5.0) and seen[2] in (3.0, 4.0)


def test_gap_over_meshes():
    """The plan's gap over every mesh tried: the least proven bound counts; meshes the hints skip
    or whose least-memory choice does not fit do not; a mesh without a bound makes it unknown."""
    from parc.passes.spmd.search import gap_over_meshes

    chosen = {"shape": [8], "feasible": True, "step_time_s": 1.0, "lower_bound_s": 0.99}
    beaten = {"shape": [2, 4], "feasible": True, "step_time_s": 1.5, "lower_bound_s": 1.2}
    assert gap_over_meshes(1.0, [chosen, beaten]) == pytest.approx(0.01)
    close = {"shape": [4, 2], "feasible": True, "step_time_s": 1.3, "lower_bound_s": 0.9}
    assert gap_over_meshes(1.0, [chosen, beaten, close]) == pytest.approx(0.1)
    ruled_out = [{"shape": [2, 4], "feasible": False, "skipped": "hint"},
                 {"shape": [4, 2], "feasible": False, "proven": True}]
    assert gap_over_meshes(1.0, [chosen, *ruled_out]) == pytest.approx(0.01)
    assert gap_over_meshes(1.0, [chosen, {"shape": [4, 2], "feasible": False, "proven": False}]) is None
    assert gap_over_meshes(1.0, [chosen, {**beaten, "lower_bound_s": None}]) is None


def _timed(graph, job):
    """A job (name, seconds): sleeps, then names itself and the process that ran it."""
    import time

    time.sleep(job[1])
    return job[0], os.getpid()


def test_a_spare_job_runs_on_an_idle_worker_and_counts_once_needed(graph):
    """A spare job runs while a worker idles; its result reaches `then`; a follow-up that is
    the same job object waits for it (or keeps its result) instead of running it again."""
    spare_job = ("spare", 0.2)
    offered, seen = [], []

    def spare():
        if offered:
            return None
        offered.append(spare_job)
        return spare_job

    def then(job, result):
        seen.append(job[0])
        return [spare_job] if job[0] == "slow" else []

    out = pool.run_jobs(_timed, graph, [("slow", 1.0)], 2, then, spare)
    assert [r[0] for r in out] == ["slow", "spare"] and seen.count("spare") == 1
    assert out[0][1] != out[1][1]  # beside the slow job, in the other worker
    offered.clear(), seen.clear()
    out = pool.run_jobs(_timed, graph, [("slow", 1.0)], 1, then, spare)  # no idle worker: run when needed
    assert [r[0] for r in out] == ["slow", "spare"] and offered == [] and seen == ["slow", "spare"]


def test_spare_jobs_nobody_needs_are_stopped(graph):
    """A spare job still running when every needed job is done is stopped, not waited for, and
    is not one of the results."""
    import time

    jobs = iter([("long", 60.0)])
    t0 = time.perf_counter()
    out = pool.run_jobs(_timed, graph, [("short", 0.5)], 2, lambda job, r: [], lambda: next(jobs, None))
    assert [r[0] for r in out] == ["short"] and time.perf_counter() - t0 < 30
