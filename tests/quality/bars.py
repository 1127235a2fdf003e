"""Shared measures for the planner's quality bars: build a training step, plan it, and read
off the gradient synchronisation volume and the strategies of named nodes."""

from __future__ import annotations

import json
from collections import Counter

from parc.autodiff import OptimizerConfig, make_training_step
from parc.cluster import resolve_cluster
from parc.ir.graph import Graph
from parc.ir.importer import load
from parc.models import build_model
from parc.passes.spmd.search import Plan, plan_graph

GIB = 2**30
REDUCTIONS = ("all_reduce", "reduce_scatter")


def training_step(name: str, tmp_path, **overrides) -> Graph:
    """The AdamW training step of zoo model `name` with config overrides (sparse weights)."""
    cfg = {"weights": "sparse", **{k: str(v) for k, v in overrides.items()}}
    graph = load(build_model(name, tmp_path / f"{name}.onnx", cfg), {})
    make_training_step(graph, OptimizerConfig("adamw"))
    return graph


def plan(graph: Graph, devices: str = "8xv100-32g", mem_gib: float | None = None, *,
         max_mesh_dims: int = 1, time_limit: float = 60.0) -> Plan:
    """`parc plan -O3` through the library on `devices`, flat mesh only unless told."""
    budget = mem_gib * GIB if mem_gib is not None else None
    return plan_graph(graph, resolve_cluster(devices, None), level="O3", memory_budget=budget,
                      max_mesh_dims=max_mesh_dims, time_limit=time_limit)


def gradient_values(graph: Graph) -> set[str]:
    """Values that hold a parameter's gradient: each trained parameter's `.grad` and, walking
    back through backward nodes, every input of the same size (the weight-gradient MatMul's
    partial sums before a Reshape, the two halves of a tied weight's gradient); activation
    gradients, which carry the batch, are left out."""
    grads = set(json.loads(graph.metadata["parc.state"])["grads"].values())
    by_name = {v.name: v for n in graph.nodes for v in n.outputs if v.name}
    found: set[str] = set()
    todo = [by_name[name] for name in grads if name in by_name]
    while todo:
        v = todo.pop()
        if v.name in found:
            continue
        found.add(v.name)
        n = v.producer
        if n is None or n.meta.get("parc.phase") != "backward":
            continue
        todo.extend(u for u in n.inputs if u is not None and u.producer is not None and u.size == v.size)
    return found


def gradient_sync_bytes(p: Plan) -> float:
    """Bytes per device all-reduced or reduce-scattered for parameter gradients in plan `p`
    (plan.json's `communication`)."""
    grads = gradient_values(p.best.model.graph)
    return sum(c["bytes_per_device"] for e in p.communication() if e["value"] in grads
               for c in e["collectives"] if c["kind"] in REDUCTIONS)


def data_parallel_sync_bytes(graph: Graph, devices: int) -> float:
    """Pure data parallelism's gradient sync: a ring all-reduce of every trained parameter's
    gradient, 2(n-1)/n of its bytes received per device (the `reshard` convention)."""
    params = json.loads(graph.metadata["parc.state"])["params"]
    nbytes = {v.name: v.nbytes for v in graph.constants.values()}
    return 2 * (devices - 1) / devices * sum(nbytes[name] for name in params)


def collective_bytes(p: Plan) -> Counter:
    """Bytes per device by collective kind over the plan's whole communication."""
    out: Counter = Counter()
    for e in p.communication():
        for c in e["collectives"]:
            out[c["kind"]] += c["bytes_per_device"]
    return out


def strategies(p: Plan, prefix: str = "", op_type: str | None = None,
               phase: str | None = "forward") -> dict[str, str]:
    """Chosen strategy (label per mesh axis) of each node whose name starts with `prefix`."""
    m, x = p.best.model, p.best.solution.choice
    return {n.name: str(m.strategies[pos][x[m.node_index(pos)]]) for pos, n in enumerate(m.graph.nodes)
            if n.name.startswith(prefix) and (op_type is None or n.op_type == op_type)
            and (phase is None or n.meta.get("parc.phase") == phase)}
