"""`parc run --trace FILE`: every rank's tasks of the last step, measured, beside the prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parc.errors import UsageError
from parc.exec import trace
from parc.plandir.taskgraph import load_taskgraph
from tests.helpers import assert_one_line_error, needs_mpiexec, parc

pytestmark = needs_mpiexec
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """gpt-tiny's SGD step as 2 stages of one rank each (sends and receives between them)."""
    d = tmp_path_factory.mktemp("trace")
    assert parc("models", "build", "gpt-tiny", "-o", str(d / "m.onnx")).returncode == 0
    assert parc("grad", str(d / "m.onnx"), "--optimizer", "sgd", "-o", str(d / "t.onnx")).returncode == 0
    res = parc("plan", str(d / "t.onnx"), "--devices", "2xcpu", "--pipeline", "2", "--jobs", "1", "-o", str(d / "plan"))
    assert res.returncode == 0, res.stderr
    return d / "plan"


def test_every_task_of_every_rank_is_traced_with_its_prediction(pipeline, tmp_path):
    out = tmp_path / "t.json"
    res = parc("run", str(pipeline), "--steps", "2", "--trace", str(out))
    assert res.returncode == 0, res.stderr
    body = json.loads(out.read_text())
    assert body["otherData"] == {"format": trace.FORMAT, "step": 2}
    names = {e["pid"]: e["args"]["name"] for e in body["traceEvents"] if e["ph"] == "M"}
    assert names == {0: "rank 0 (stage 0)", 1: "rank 1 (stage 1)"}
    graph = load_taskgraph(pipeline / "taskgraph.json")
    tasks = graph.tasks
    measured = trace.load(out)
    for rank in (0, 1):
        order = list(graph.order[rank])
        events = measured[rank]
        folds = [e for e in events if e[0].startswith(trace.FOLD)]
        ids = [e[0] for e in events if e[0] != trace.SEND_COMPLETION and e not in folds]
        assert ids == order  # each task once, in the rank's order
        # each microbatch's fold into the step's sums, beside what the task graph prices it at
        assert [e[0] for e in folds] == [f"{trace.FOLD} mb{k}" for k in range(graph.micro_batches)]
        assert graph.micro_batches > 1 and graph.folds[rank] > 0
        assert all(e[1] == "compute" and e[3] == pytest.approx(graph.folds[rank], rel=1e-6, abs=1e-9) for e in folds)
        for task_id, kind, seconds, predicted in events:
            assert seconds >= 0
            if task_id != trace.SEND_COMPLETION and task_id.split()[0] != trace.FOLD:
                assert kind == tasks[task_id]["kind"]
                assert predicted == pytest.approx(tasks[task_id].get("time_s", 0.0), rel=1e-6, abs=1e-9)
        xs = [e for e in body["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
        assert all(a["ts"] + a["dur"] <= b["ts"] + 0.01 for a, b in zip(xs, xs[1:]))  # one after another (us)
    # a trace parc wrote is replaced by the next run's
    assert parc("run", str(pipeline), "--steps", "1", "--trace", str(out)).returncode == 0
    assert json.loads(out.read_text())["otherData"]["step"] == 1


def test_a_trace_path_parc_cannot_or_should_not_write_is_one_line(pipeline, tmp_path):
    mine = tmp_path / "notes.json"
    mine.write_text('{"mine": true}')
    for path, says in ((tmp_path, "is a directory"), (tmp_path / "no" / "t.json", "does not exist"),
                       (mine, "not a trace parc wrote")):
        res = parc("run", str(pipeline), "--steps", "1", "--trace", str(path))
        assert_one_line_error(res, says)
    assert mine.read_text() == '{"mine": true}'


def test_a_compute_task_on_a_shared_host_shows_the_simulations_time():
    order = [{"id": "a", "kind": "compute", "rank": 0, "module": "", "time_s": 2.0},
             {"id": "b", "kind": "compute", "rank": 0, "module": "", "time_s": 3.0}]
    events = trace.rank_events(0, None, order, [(0, 0.0, 1.0), (1, 1.0, 2.0)], simulated={"a": 1.25})
    assert [e["args"]["predicted_ms"] for e in events if e["ph"] == "X"] == [1250.0, 3000.0]


def test_collective_seconds_take_each_collective_from_its_last_members_start(tmp_path):
    """What `parc profile` fits the links' step ratio on: rank 0 waited 300 us in c0 for rank 1,
    which ended last; c1 started together; a compute task is not a collective."""
    events = [{"name": "c0", "cat": "collective", "ph": "X", "pid": 0, "ts": 0.0, "dur": 500.0},
              {"name": "c0", "cat": "collective", "ph": "X", "pid": 1, "ts": 300.0, "dur": 210.0},
              {"name": "c1", "cat": "collective", "ph": "X", "pid": 0, "ts": 1000.0, "dur": 40.0},
              {"name": "c1", "cat": "collective", "ph": "X", "pid": 1, "ts": 1000.0, "dur": 30.0},
              {"name": "m0", "cat": "compute", "ph": "X", "pid": 0, "ts": 2000.0, "dur": 999.0}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"format": trace.FORMAT}}))
    assert trace.collective_seconds(path) == pytest.approx({"c0": 210e-6, "c1": 40e-6})
    path.write_text(json.dumps({"traceEvents": events}))  # not one parc wrote
    with pytest.raises(UsageError, match="not a trace"):
        trace.collective_seconds(path)
