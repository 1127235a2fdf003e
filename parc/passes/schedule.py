"""The schedule: each rank's static task order (Rhino 6.2), a compiler decision.

The pipeline's schedule (1F1B, PipeDream-flush) orders each stage's forward and backward steps
over the microbatches; `pipeline_taskgraph` builds the task graph of single-rank stages in that
order, and `stage_taskgraph` is that graph with the planner's figures per stage (what a plan
written without programs is simulated on). The lowering of full plans orders each rank's
module, collective and transfer tasks with the same `one_f_one_b`. taskgraph.json's format and
checks are `parc.plandir.taskgraph`'s; the executor and the simulator only read it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from parc.plandir.taskgraph import FORMAT, STAGE

SCHEDULES = ("1f1b",)  # the schedules this module orders


def one_f_one_b(stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """The 1F1B (PipeDream-flush) order of each stage: ("F" | "B", micro-batch) steps.

    Stage s runs min(stages - s - 1, M) forwards to fill the pipeline, then alternates one
    forward and one backward, then drains the remaining backwards (Rhino 6.2's static schedule)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"one_f_one_b: need stages >= 1 and micro_batches >= 1, got {stages}, {micro_batches}")
    out = []
    for s in range(stages):
        warm = min(stages - s - 1, micro_batches)
        steps = [("F", k) for k in range(warm)]
        f, b = warm, 0
        while b < micro_batches:
            if f < micro_batches:
                steps.append(("F", f))
                f += 1
            steps.append(("B", b))
            b += 1
        out.append(steps)
    return out


def pipeline_taskgraph(stages: int, micro_batches: int) -> dict[str, Any]:
    """A pipeline of `stages` single-rank stages over `micro_batches` micro-batches, ordered
    1F1B: per stage and micro-batch a forward and a backward compute task, activations sent
    forward and their gradients sent back between neighbouring stages, and one apply task per
    stage after its last backward. The form the pipeline planner will emit."""
    tasks, edges = [], []

    def add(**t) -> str:
        tasks.append(t)
        return t["id"]

    fwd, bwd, recv_f, recv_b = {}, {}, {}, {}
    for s in range(stages):
        for k in range(micro_batches):
            common = {"rank": s, "stage": s, "micro_batch": k}
            if s > 0:
                recv_f[s, k] = add(id=f"s{s}.recv_act.{k}", kind="recv", peer=s - 1, tensor=f"act{s - 1}", **common)
            fwd[s, k] = add(id=f"s{s}.fwd.{k}", kind="compute", module=f"rank_{s}/forward.onnx",
                            phase="forward", **common)
            if s + 1 < stages:
                recv_b[s, k] = add(id=f"s{s}.recv_grad.{k}", kind="recv", peer=s + 1, tensor=f"grad{s}", **common)
            bwd[s, k] = add(id=f"s{s}.bwd.{k}", kind="compute", module=f"rank_{s}/backward.onnx",
                            phase="backward", **common)
    sends_f, sends_b = {}, {}
    for s in range(stages):
        for k in range(micro_batches):
            common = {"rank": s, "stage": s, "micro_batch": k}
            if s + 1 < stages:
                sends_f[s, k] = add(id=f"s{s}.send_act.{k}", kind="send", peer=s + 1, tensor=f"act{s}", **common)
                edges += [[fwd[s, k], sends_f[s, k]], [sends_f[s, k], recv_f[s + 1, k]], [recv_f[s + 1, k], fwd[s + 1, k]]]
                edges += [[recv_b[s, k], bwd[s, k]]]
            if s > 0:
                sends_b[s, k] = add(id=f"s{s}.send_grad.{k}", kind="send", peer=s - 1, tensor=f"grad{s - 1}", **common)
                edges += [[bwd[s, k], sends_b[s, k]], [sends_b[s, k], recv_b[s - 1, k]]]
            edges.append([fwd[s, k], bwd[s, k]])
    applies = {s: add(id=f"s{s}.apply", kind="compute", rank=s, stage=s, micro_batch=None, phase="apply",
                      module=f"rank_{s}/apply.onnx") for s in range(stages)}
    for s in range(stages):
        edges += [[bwd[s, k], applies[s]] for k in range(micro_batches)]
    order = {}
    for s, steps in enumerate(one_f_one_b(stages, micro_batches)):
        ids = []
        for what, k in steps:
            if what == "F":
                ids += ([recv_f[s, k]] if s > 0 else []) + [fwd[s, k]] + ([sends_f[s, k]] if s + 1 < stages else [])
            else:
                ids += ([recv_b[s, k]] if s + 1 < stages else []) + [bwd[s, k]] + ([sends_b[s, k]] if s > 0 else [])
        order[str(s)] = ids + [applies[s]]
    return {"format": FORMAT, "ranks": stages, "micro_batches": micro_batches,
            "stages": [{"id": s, "ranks": [s]} for s in range(stages)],
            "tasks": tasks, "edges": edges, "order": order}


@dataclass(frozen=True)
class StageTimes:
    """One stage's figures from the planner, per microbatch: what its simulated rank spends."""

    devices: tuple[int, ...]  # the stage's devices (global ranks)
    mesh: tuple[int, ...]  # its device mesh
    forward_s: float  # a microbatch's forward (with its collectives)
    backward_s: float  # a microbatch's backward (with its collectives)
    apply_s: float  # the optimizer, once a step
    send_s: float  # what it sends per microbatch, both directions together


def stage_taskgraph(stages: Sequence[StageTimes], micro_batches: int) -> dict[str, Any]:
    """The stage-level task graph of a plan written without programs (`--no-programs`): one
    simulated rank per stage standing for its devices (they run the same program), 1F1B over the
    microbatches (`pipeline_taskgraph`) with the planner's figures per stage. A middle stage's
    sends are split evenly between its activations and their gradients; the first and last
    stages send one way."""
    count = len(stages)
    doc = pipeline_taskgraph(count, micro_batches)

    def send_s(stage: int) -> float:
        return stages[stage].send_s / ((stage + 1 < count) + (stage > 0))

    for t in doc["tasks"]:
        st = stages[t["rank"]]
        if t["kind"] == "compute":
            t["time_s"] = {"forward": st.forward_s, "backward": st.backward_s, "apply": st.apply_s}[t["phase"]]
        else:  # a send and its recv take the sending stage's time
            t["time_s"] = send_s(t["rank"] if t["kind"] == "send" else t["peer"])
    doc["granularity"] = STAGE
    doc["stages"] = [{"id": k, "ranks": [k], "devices": list(st.devices), "mesh": list(st.mesh)}
                     for k, st in enumerate(stages)]
    return doc


def one_mesh_taskgraph(devices: Sequence[int], mesh: Sequence[int], compute_s: float, comm_s: float) -> dict[str, Any]:
    """The stage-level task graph of a one-mesh plan written without programs: one simulated rank
    for all its devices, its compute, then its communication as one collective."""
    return {"format": FORMAT, "ranks": 1, "micro_batches": 1, "granularity": STAGE,
            "stages": [{"id": 0, "ranks": [0], "devices": [int(d) for d in devices], "mesh": list(mesh)}],
            "tasks": [{"id": "step", "kind": "compute", "rank": 0, "module": "", "time_s": float(compute_s)},
                      {"id": "communication", "kind": "collective", "group": [0], "op": "all_reduce",
                       "tensor": "", "time_s": float(comm_s)}],
            "edges": [["step", "communication"]], "order": {"0": ["step", "communication"]}}
