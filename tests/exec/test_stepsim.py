"""The step simulator (`parc.exec.stepsim`): its rules on small task graphs, against the 1F1B
formula, and on real plans (`parc plan` writes the task times, `parc simulate` replays them)."""

from __future__ import annotations

import json

import pytest

from parc.errors import PlanFormatError
from parc.exec.stepsim import simulate, simulate_graph
from parc.passes.pipeline.plan import one_f_one_b_time
from parc.passes.schedule import pipeline_taskgraph
from parc.plandir.taskgraph import FORMAT, check_taskgraph
from tests.helpers import needs_mpiexec


def _graph(tasks: list[dict], order: dict[int, list[str]], edges=()) -> object:
    ranks = 1 + max(order)
    return check_taskgraph({"format": FORMAT, "ranks": ranks, "micro_batches": 1, "tasks": tasks,
                            "edges": [list(e) for e in edges], "order": {str(r): ids for r, ids in order.items()}})


def _compute(tid: str, rank: int, seconds: float) -> dict:
    return {"id": tid, "kind": "compute", "rank": rank, "module": "", "time_s": seconds}


def _all_reduce(tid: str, group: list[int], seconds: float, **extra) -> dict:
    return {"id": tid, "kind": "collective", "group": group, "op": "all_reduce", "tensor": "g",
            "time_s": seconds, **extra}


def test_a_collective_starts_when_its_last_member_arrives():
    g = _graph([_compute("a0", 0, 1.0), _compute("a1", 1, 3.0), _all_reduce("c", [0, 1], 0.5)],
               {0: ["a0", "c"], 1: ["a1", "c"]})
    sim = simulate(g)
    assert sim.step_time_s == pytest.approx(3.5)
    assert [r.compute_s for r in sim.ranks] == [1.0, 3.0]
    assert [r.comm_s for r in sim.ranks] == [0.5, 0.5]
    assert sim.wait_s == pytest.approx([2.0, 0.0])  # rank 0 waited for rank 1
    assert sim.critical_path == ["a1", "c"]
    assert ("wait" in {kind for _, _, kind, _ in sim.spans[0]}) and sim.spans[0][-1][1] == pytest.approx(3.5)


def test_a_send_overlaps_its_senders_compute_and_a_recv_waits_for_it():
    tasks = [_compute("f", 0, 1.0), {"id": "s", "kind": "send", "rank": 0, "peer": 1, "tensor": "x", "time_s": 0.0},
             _compute("more", 0, 2.0),
             {"id": "r", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x", "time_s": 0.5}, _compute("g", 1, 1.0)]
    sim = simulate(_graph(tasks, {0: ["f", "s", "more"], 1: ["r", "g"]}, [("f", "s"), ("s", "r"), ("r", "g")]))
    assert sim.step_time_s == pytest.approx(3.0)  # rank 0: 1 + 2 (its send went on meanwhile)
    assert sim.ranks[1].end_s == pytest.approx(2.5)  # 1 (send posted) + 0.5 transfer + 1
    assert sim.ranks[0].hidden_s == pytest.approx(0.5) and sim.ranks[1].comm_s == pytest.approx(0.5)
    assert sim.critical_path == ["f", "more"]


def test_a_rank_ends_when_its_sends_have_arrived():
    tasks = [_compute("f", 0, 1.0), {"id": "s", "kind": "send", "rank": 0, "peer": 1, "tensor": "x", "time_s": 0.0},
             _compute("late", 1, 3.0), {"id": "r", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x", "time_s": 0.5}]
    sim = simulate(_graph(tasks, {0: ["f", "s"], 1: ["late", "r"]}, [("f", "s"), ("s", "r")]))
    # the message moves once rank 1 posts its recv (at 3), so rank 0's send completes at 3.5
    assert sim.ranks[0].end_s == pytest.approx(3.5) and sim.step_time_s == pytest.approx(3.5)
    assert sim.critical_path == ["late", "s"]  # task ids: the send waited for rank 1's recv


def test_the_critical_path_passes_a_collective_once():
    tasks = [_compute("a0", 0, 3.0), _compute("a1", 1, 1.0), _all_reduce("c", [0, 1], 0.5), _compute("b1", 1, 5.0)]
    sim = simulate(_graph(tasks, {0: ["a0", "c"], 1: ["a1", "c", "b1"]}))
    assert sim.critical_path == ["a0", "c", "b1"] and sim.step_time_s == pytest.approx(8.5)


@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 4), (4, 8), (3, 2)])
def test_uniform_1f1b_matches_the_formula(stages, micro):
    doc = pipeline_taskgraph(stages, micro)
    for t in doc["tasks"]:
        t["time_s"] = {"forward": 1.0, "backward": 2.0, "apply": 0.25}.get(t.get("phase"), 0.0)
    sim = simulate(check_taskgraph(doc))
    step, bubble = one_f_one_b_time([3.0] * stages, [0.25] * stages, micro)
    assert sim.step_time_s == pytest.approx(step)
    assert sim.bubble_s == pytest.approx(bubble)


def test_the_handoff_is_paid_by_the_first_communication_after_compute():
    tasks = [_compute("a0", 0, 1.0), _compute("a1", 1, 1.0),
             _all_reduce("c1", [0, 1], 0.1, handoff_s=0.5), _all_reduce("c2", [0, 1], 0.1, handoff_s=0.5)]
    sim = simulate(_graph(tasks, {0: ["a0", "c1", "c2"], 1: ["a1", "c1", "c2"]}))
    assert sim.step_time_s == pytest.approx(1.0 + 0.6 + 0.1)
    assert [r.comm_s for r in sim.ranks] == pytest.approx([0.7, 0.7]) and sim.wait_s == pytest.approx([0.0, 0.0])


def test_a_rank_folds_each_microbatch_after_its_last_task_of_it():
    doc = {"format": FORMAT, "ranks": 2, "micro_batches": 2, "folds": {"0": 0.25},
           "tasks": [{**_compute("f0", 0, 1.0), "micro_batch": 0},
                     {"id": "s0", "kind": "send", "rank": 0, "peer": 1, "tensor": "x", "micro_batch": 0, "time_s": 0.0},
                     {**_compute("f1", 0, 1.0), "micro_batch": 1},
                     {"id": "s1", "kind": "send", "rank": 0, "peer": 1, "tensor": "x", "micro_batch": 1, "time_s": 0.0},
                     _compute("apply", 0, 0.5),
                     {"id": "r0", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x", "micro_batch": 0, "time_s": 0.0},
                     {"id": "r1", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x", "micro_batch": 1, "time_s": 0.0}],
           "edges": [["s0", "r0"], ["s1", "r1"]],
           "order": {"0": ["f0", "s0", "f1", "s1", "apply"], "1": ["r0", "r1"]}}
    g = check_taskgraph(doc)
    assert g.folds == {0: 0.25} and check_taskgraph(g.to_json()).folds == g.folds
    sim = simulate(g)
    # rank 0: f0, its send posted, the fold of microbatch 0, f1 (whose send rank 1 gets at 2.25),
    # the fold of microbatch 1, the optimizer
    assert sim.step_time_s == pytest.approx(1.0 + 0.25 + 1.0 + 0.25 + 0.5)
    assert sim.ranks[0].compute_s == pytest.approx(3.0) and sim.ranks[1].end_s == pytest.approx(2.25)
    folds = [(a, b) for a, b, kind, label in sim.spans[0] if label.endswith("(fold)")]
    assert folds == [pytest.approx((1.0, 1.25)), pytest.approx((2.25, 2.5))]


@pytest.mark.parametrize("folds", [{"0": -1.0}, {"2": 0.1}, {"x": 0.1}, [0.1]])
def test_bad_folds_are_refused(folds):
    doc = {"format": FORMAT, "ranks": 1, "tasks": [_compute("a", 0, 1.0)], "order": {"0": ["a"]}, "folds": folds}
    with pytest.raises(PlanFormatError, match="folds: expected"):
        check_taskgraph(doc)


def _shared_pipeline(hosts: list[list[int]] | None) -> object:
    """Two ranks, a send between them: rank 1 computes only after rank 0 is done. Each compute
    task takes 2 s with both ranks computing, 1 s alone."""
    tasks = [{**_compute("f", 0, 2.0), "shared_s": {"1": 1.0}},
             {"id": "s", "kind": "send", "rank": 0, "peer": 1, "tensor": "x", "time_s": 0.0},
             {"id": "r", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x", "time_s": 0.5},
             {**_compute("g", 1, 2.0), "shared_s": {"1": 1.0}}]
    doc = {"format": FORMAT, "ranks": 2, "tasks": tasks, "edges": [["f", "s"], ["s", "r"], ["r", "g"]],
           "order": {"0": ["f", "s"], "1": ["r", "g"]}, **({"hosts": hosts} if hosts is not None else {})}
    return check_taskgraph(doc)


def test_a_rank_computing_alone_on_a_shared_host_takes_its_time_alone():
    assert simulate(_shared_pipeline([[0, 1]])).step_time_s == pytest.approx(1.0 + 0.5 + 1.0, rel=1e-3)
    # without hosts the task graph's times stand: every rank computing at once
    assert simulate(_shared_pipeline(None)).step_time_s == pytest.approx(2.0 + 0.5 + 2.0)


def test_ranks_computing_at_once_on_a_shared_host_take_their_full_time():
    def both(hosts):
        tasks = [{**_compute("a", 0, 2.0), "shared_s": {"1": 1.0}}, {**_compute("b", 1, 2.0), "shared_s": {"1": 1.0}},
                 _all_reduce("c", [0, 1], 0.5)]
        return check_taskgraph({"format": FORMAT, "ranks": 2, "tasks": tasks, "hosts": hosts,
                                "order": {"0": ["a", "c"], "1": ["b", "c"]}})

    assert simulate(both([[0, 1]])).step_time_s == pytest.approx(2.5)


def test_a_recv_pays_no_handoff():
    # a message already sent is there when the receiver comes from compute: no wait for a core
    tasks = [_compute("f", 0, 1.0), {"id": "s", "kind": "send", "rank": 0, "peer": 1, "tensor": "x", "time_s": 0.0},
             _compute("g", 1, 2.0),
             {"id": "r", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x", "time_s": 0.5, "handoff_s": 0.9}]
    sim = simulate(_graph(tasks, {0: ["f", "s"], 1: ["g", "r"]}, [("f", "s"), ("s", "r")]))
    assert sim.step_time_s == pytest.approx(2.5) and sim.ranks[1].comm_s == pytest.approx(0.5)


def _crowded(computing: list[int]) -> object:
    """Four ranks on one host, each compute task 4 s with all four computing, 2 s with two or
    fewer (two cores); the ranks in `computing` compute, then ranks 0 and 1 all-reduce with a
    1 s handoff."""
    tasks = [{**_compute(f"a{r}", r, 4.0), "shared_s": {"2": 2.0}} for r in computing]
    tasks.append(_all_reduce("c", [0, 1], 0.5, handoff_s=1.0))
    order = {r: ([f"a{r}"] if r in computing else []) + (["c"] if r < 2 else []) for r in range(4)}
    tasks += [_compute(f"idle{r}", r, 0.0) for r in range(4) if not order[r]]
    order = {r: ids or [f"idle{r}"] for r, ids in order.items()}
    return check_taskgraph({"format": FORMAT, "ranks": 4, "tasks": tasks, "hosts": [[0, 1, 2, 3]],
                            "order": {str(r): ids for r, ids in order.items()}})


def test_a_collective_pays_the_handoff_as_far_as_its_host_was_crowded():
    # every rank computing: 4 s, then the whole handoff, as parc profile measured it
    assert simulate(_crowded([0, 1, 2, 3])).step_time_s == pytest.approx(4.0 + 1.0 + 0.5, rel=1e-3)
    # only the two members computing, on two cores: their time alone, and no handoff
    assert simulate(_crowded([0, 1])).step_time_s == pytest.approx(2.0 + 0.5, rel=1e-3)
    # three computing: between (the curve at 3 is halfway from 2 s to 4 s)
    three = simulate(_crowded([0, 1, 2]))
    assert three.step_time_s == pytest.approx(3.0 + 0.5 + 0.5, rel=1e-3)


def test_a_task_overlapping_part_of_its_neighbours_work_settles_between_its_times():
    # rank 1 computes 1 s (2 s shared) while rank 0 computes longer: rank 0's task has a
    # neighbour for part of its span, so it ends between its time alone and its shared time
    tasks = [{**_compute("long", 0, 4.0), "shared_s": {"1": 2.0}}, {**_compute("short", 1, 2.0), "shared_s": {"1": 1.0}},
             _all_reduce("c", [0, 1], 0.0)]
    g = check_taskgraph({"format": FORMAT, "ranks": 2, "tasks": tasks, "hosts": [[0, 1]],
                         "order": {"0": ["long", "c"], "1": ["short", "c"]}})
    # processor sharing: both at half speed until "short" is done (2 s, 1/2 of "long"), then
    # "long" alone: 1 s more
    assert simulate(g).step_time_s == pytest.approx(3.0, rel=1e-3)


@pytest.mark.parametrize(("hosts", "shared"), [([[0, 0]], None), ([[0], [3]], None), ([0, 1], None),
                                               (None, {"0": 1.0}), (None, {"1": -1.0}), (None, [1.0])])
def test_bad_hosts_or_shared_times_are_refused(hosts, shared):
    tasks = [{**_compute("a", 0, 1.0), **({"shared_s": shared} if shared is not None else {})}, _compute("b", 1, 1.0)]
    doc = {"format": FORMAT, "ranks": 2, "tasks": tasks, "order": {"0": ["a"], "1": ["b"]},
           **({"hosts": hosts} if hosts is not None else {})}
    with pytest.raises(PlanFormatError, match="hosts: expected" if hosts is not None else "shared_s: expected"):
        check_taskgraph(doc)


def test_a_task_without_time_is_refused_with_how_to_fix():
    g = _graph([{"id": "a", "kind": "compute", "rank": 0, "module": ""}], {0: ["a"]})
    with pytest.raises(PlanFormatError, match="plan it again"):
        simulate(g)


def test_json_has_stable_keys_and_expands_a_stage_graph():
    doc = pipeline_taskgraph(2, 2)
    for t in doc["tasks"]:
        t["time_s"] = 1.0 if t["kind"] == "compute" else 0.0
    doc["granularity"] = "stage"
    doc["stages"] = [{"id": 0, "ranks": [0], "devices": [0, 1, 2]}, {"id": 1, "ranks": [1], "devices": [3, 4, 5]}]
    out = simulate_graph(check_taskgraph(doc)).to_json()
    assert {"step_time_s", "bubble_s", "exposed_comm_s", "hidden_comm_s", "ranks", "timeline",
            "critical_path", "granularity"} <= set(out)
    assert [r["rank"] for r in out["ranks"]] == [0, 1, 2, 3, 4, 5]
    assert [r["stage"] for r in out["ranks"]] == [0, 0, 0, 1, 1, 1]
    assert set(out["timeline"]) == {"0", "3"} and out["granularity"] == "stage"


@pytest.fixture(scope="module")
def gpt_train(tmp_path_factory):
    from click.testing import CliRunner

    from parc.cli.main import cli

    path = tmp_path_factory.mktemp("sim") / "g.train.onnx"
    res = CliRunner().invoke(cli, ["models", "build", "gpt-tiny", "--set", "batch=8", "--train", "momentum",
                                   "-o", str(path)])
    assert res.exit_code == 0, res.output
    return path


def _plan(model, out, *args):
    from click.testing import CliRunner

    from parc.cli.main import cli

    res = CliRunner().invoke(cli, ["plan", str(model), "-o", str(out), *args])
    assert res.exit_code == 0, res.output
    return json.loads((out / "plan.json").read_text())


@pytest.mark.parametrize("args", [["--devices", "2xcpu"], ["--devices", "4xcpu", "--pipeline", "2"]])
def test_plans_carry_task_times_and_their_simulation(gpt_train, tmp_path, args):
    from click.testing import CliRunner

    from parc.cli.main import cli

    plan = _plan(gpt_train, tmp_path / "p", *args)
    tg = json.loads((tmp_path / "p" / "taskgraph.json").read_text())
    assert all(t["time_s"] > 0 for t in tg["tasks"] if t["kind"] in ("compute", "collective", "recv"))
    # every rank of a pipeline folds its microbatches' gradients into the step's sums
    assert (sorted(tg.get("folds", {})) == [str(r) for r in range(tg["ranks"])]
            and all(s > 0 for s in tg["folds"].values())) == (tg["micro_batches"] > 1)
    res = CliRunner().invoke(cli, ["simulate", str(tmp_path / "p"), "--json"])
    assert res.exit_code == 0, res.output
    sim = json.loads(res.output)
    assert sim["step_time_s"] == pytest.approx(plan["simulation"]["step_time_s"])
    # the same cost model, replayed instead of summed: close to the planner's own figure
    assert sim["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=0.15)
    assert sim["critical_path"] and sim["granularity"] == "task"


def test_a_pipeline_on_a_host_of_fewer_cpus_prices_its_stages_computing_alone(gpt_train, tmp_path):
    from tests.cluster.test_cluster_file import SHARED

    calib = tmp_path / "calib.yaml"
    calib.write_text("cpus: 2\n" + SHARED)  # 4 ranks of 1 thread each on 2 CPUs
    plan = _plan(gpt_train, tmp_path / "p", "--devices", "4xcpu", "--pipeline", "2", "--calibration", str(calib))
    doc = json.loads((tmp_path / "p" / "taskgraph.json").read_text())
    assert doc["hosts"] == [[0, 1, 2, 3]]
    computes = [t for t in doc["tasks"] if t["kind"] == "compute"]
    # 2 ranks computing get twice the FLOP/s of 4 in that calibration
    assert computes and all(0 < t["shared_s"]["2"] < t["time_s"] for t in computes)
    shared = simulate(check_taskgraph(doc))
    del doc["hosts"]
    assert shared.step_time_s < simulate(check_taskgraph(doc)).step_time_s
    assert plan["simulation"]["step_time_s"] == pytest.approx(shared.step_time_s)


def test_a_plan_without_programs_simulates_per_stage_and_does_not_run(gpt_train, tmp_path):
    from click.testing import CliRunner

    from parc.cli.main import cli

    plan = _plan(gpt_train, tmp_path / "p", "--devices", "4xcpu", "--pipeline", "2", "--no-programs")
    assert not (tmp_path / "p" / "rank_0").exists()
    res = CliRunner().invoke(cli, ["simulate", str(tmp_path / "p"), "--json"])
    sim = json.loads(res.output)
    assert sim["granularity"] == "stage" and len(sim["ranks"]) == 4
    assert sim["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=0.15)
    res = CliRunner().invoke(cli, ["run", str(tmp_path / "p"), "--steps", "1"])
    assert res.exit_code == 2 and "--no-programs" in res.output


def test_simulate_names_a_missing_or_old_plan(tmp_path):
    from click.testing import CliRunner

    from parc.cli.main import cli

    res = CliRunner().invoke(cli, ["simulate", str(tmp_path / "nowhere")])
    assert res.exit_code == 2 and "no such plan directory" in res.output


def test_an_older_plan_without_task_times_is_one_line_saying_plan_again(gpt_train, tmp_path):
    from tests.helpers import assert_one_line_error, parc

    _plan(gpt_train, tmp_path / "p", "--devices", "2xcpu")
    path = tmp_path / "p" / "taskgraph.json"
    doc = json.loads(path.read_text())
    for t in doc["tasks"]:
        t.pop("time_s", None)
    path.write_text(json.dumps(doc))
    assert_one_line_error(parc("simulate", str(tmp_path / "p")), "time_s", "plan it again")


@pytest.mark.parametrize(("text", "needle"), [
    ("devices:\n  cpu: {fp32_tflop: 1}\n", "fp32_tflop"),
    ("devices:\n  cpu: {fp32_tflops: 0}\n", "fp32_tflops"),
    ("links:\n  shm: {latency_us: -3}\n", "latency"),
    ("sharing:\n  \"4\": {devices: {cpu: {bandwidth_gbs: -1}}}\n", "bandwidth_gbs"),
])
def test_a_bad_calibration_file_is_one_line_naming_the_key(gpt_train, tmp_path, text, needle):
    from tests.helpers import assert_one_line_error, parc

    bad = tmp_path / "calib.yaml"
    bad.write_text(text)
    res = parc("plan", str(gpt_train), "--devices", "2xcpu", "--calibration", str(bad), "-o", str(tmp_path / "p"))
    assert_one_line_error(res, "calib.yaml", needle)
    assert not (tmp_path / "p").exists()
    assert_one_line_error(parc("plan", str(gpt_train), "--devices", "2xcpu", "--calibration",
                               str(tmp_path / "none.yaml"), "-o", str(tmp_path / "p")), "--calibration")


@needs_mpiexec
@pytest.mark.parametrize("args", [["--devices", "4xcpu", "--pipeline", "2"],
                                  ["--devices", "2xcpu", "--micro-batches", "2"]])
def test_predicted_peak_memory_is_what_the_runner_counts(gpt_train, tmp_path, args):
    from tests.helpers import parc

    _plan(gpt_train, tmp_path / "p", *args)
    sim = json.loads(parc("simulate", str(tmp_path / "p"), "--json").stdout)
    res = parc("run", str(tmp_path / "p"), "--steps", "3", "--json")
    assert res.returncode == 0, res.stderr
    measured = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")][-1]
    assert [r["peak_bytes"] for r in sim["ranks"]] == measured["peak_bytes_per_rank"]
