"""taskgraph.json: the format, its validation, and a hand-made two-stage 1F1B pipeline."""

from __future__ import annotations

import copy
import json

import pytest

from parc.errors import PlanFormatError
from parc.passes.schedule import one_f_one_b, pipeline_taskgraph
from parc.plandir.taskgraph import check_taskgraph, load_taskgraph


def test_one_f_one_b_orders():
    assert one_f_one_b(2, 4) == [
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)],
    ]
    for stages, m in [(1, 3), (3, 2), (4, 8)]:
        for s, steps in enumerate(one_f_one_b(stages, m)):
            assert sorted(steps) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
            in_flight = peak = 0
            for what, _ in steps:
                in_flight += 1 if what == "F" else -1
                peak = max(peak, in_flight)
            assert peak == min(stages - s, m)  # 1F1B bounds the activations a stage keeps


def test_two_stage_pipeline_round_trips_and_runs(tmp_path):
    doc = pipeline_taskgraph(2, 4)
    path = tmp_path / "taskgraph.json"
    path.write_text(json.dumps(doc))
    tg = load_taskgraph(path)
    assert tg.ranks == 2 and tg.micro_batches == 4 and len(tg.stages) == 2
    assert check_taskgraph(tg.to_json()).tasks.keys() == tg.tasks.keys()
    computes = [tid for tid in tg.order[0] if tg.tasks[tid]["kind"] == "compute"]
    assert computes == ["s0.fwd.0", "s0.fwd.1", "s0.bwd.0", "s0.fwd.2", "s0.bwd.1", "s0.fwd.3", "s0.bwd.2",
                        "s0.bwd.3", "s0.apply"]
    kinds = {t["kind"] for t in tg.tasks.values()}
    assert kinds == {"compute", "send", "recv"}


def _broken(mutate):
    doc = copy.deepcopy(pipeline_taskgraph(2, 2))
    mutate(doc)
    return doc


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(format="parc.taskgraph/9"), r"unknown format 'parc.taskgraph/9'"),
    (lambda d: d["tasks"].append(dict(d["tasks"][0])), r"appears twice"),
    (lambda d: d["tasks"][0].update(kind="compile"), r"unknown kind 'compile'"),
    (lambda d: d["tasks"][0].pop("module"), r"missing module"),
    (lambda d: d["tasks"][0].update(rank=7), r"rank 7 out of range 0..1"),
    (lambda d: d["edges"].append(["s0.fwd.0", "nowhere"]), r"between known task ids"),
    (lambda d: d["edges"].append(["s0.bwd.0", "s0.fwd.0"]), r"cycle"),
    (lambda d: d["order"]["0"].pop(), r"order of rank 0: must list each of its tasks once; missing"),
    (lambda d: d["tasks"].remove(next(t for t in d["tasks"] if t["id"] == "s1.recv_act.1"))
     or d["order"]["1"].remove("s1.recv_act.1")
     or d.update(edges=[e for e in d["edges"] if "s1.recv_act.1" not in e]), r"send of 'act0' .* no matching recv"),
    # stage 1 waits for a gradient before computing the forward that produces it
    (lambda d: d["order"]["0"].insert(0, d["order"]["0"].pop(d["order"]["0"].index("s0.recv_grad.0"))),
     r"deadlock: rank 0 is stuck at task 's0.recv_grad.0'"),
])
def test_bad_task_graphs_are_refused_with_one_line(mutate, message):
    with pytest.raises(PlanFormatError, match=message) as e:
        check_taskgraph(_broken(mutate))
    assert "\n" not in str(e.value)


def test_a_collective_runs_only_when_its_whole_group_reaches_it():
    doc = {"format": "parc.taskgraph/1", "ranks": 2,
           "tasks": [{"id": "a0", "kind": "compute", "rank": 0, "module": "rank_0/a.onnx"},
                     {"id": "a1", "kind": "compute", "rank": 1, "module": "rank_1/a.onnx"},
                     {"id": "ar", "kind": "collective", "group": [0, 1], "op": "all_reduce", "tensor": "g"}],
           "edges": [["a0", "ar"], ["a1", "ar"]],
           "order": {"0": ["a0", "ar"], "1": ["a1", "ar"]}}
    assert len(check_taskgraph(doc).tasks) == 3
    doc["order"]["1"] = ["ar", "a1"]
    with pytest.raises(PlanFormatError, match="deadlock"):
        check_taskgraph(doc)


def test_transfers_between_two_ranks_must_come_in_the_same_order_on_both():
    """NCCL's send/recv has no tags: the receiver's k-th receive from a rank gets that rank's
    k-th send to it, so the two orders must agree."""
    def doc(recv_order):
        return {"format": "parc.taskgraph/1", "ranks": 2,
                "tasks": [{"id": "a", "kind": "compute", "rank": 0, "module": "rank_0/a.onnx"},
                          {"id": "sx", "kind": "send", "rank": 0, "peer": 1, "tensor": "x"},
                          {"id": "sy", "kind": "send", "rank": 0, "peer": 1, "tensor": "y"},
                          {"id": "rx", "kind": "recv", "rank": 1, "peer": 0, "tensor": "x"},
                          {"id": "ry", "kind": "recv", "rank": 1, "peer": 0, "tensor": "y"},
                          {"id": "b", "kind": "compute", "rank": 1, "module": "rank_1/b.onnx"}],
                "edges": [["a", "sx"], ["a", "sy"], ["rx", "b"], ["ry", "b"]],
                "order": {"0": ["a", "sx", "sy"], "1": [*recv_order, "b"]}}
    assert len(check_taskgraph(doc(["rx", "ry"])).tasks) == 6
    with pytest.raises(PlanFormatError, match=r"rank 0 sends 'x' .* to rank 1 as its transfer 0, but rank 1 "
                                              r"receives 'y' .*same order on both"):
        check_taskgraph(doc(["ry", "rx"]))
