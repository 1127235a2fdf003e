"""Hints as solver pins on one mesh's cost model (Whale 3.1-3.2 over Rhino's search).

`parc.hints` reads the hints and assigns each node its scope's request; here a request and the
pins become the strategy indices the solver may choose on one mesh (see `parc.hints.apply` for
what each request means).
"""

from __future__ import annotations

import math
from collections import defaultdict

from parc.errors import UsageError
from parc.hints.apply import (
    IneligibleMeshError,
    PinDivisionError,
    assign_scopes,
    check_mesh,
    did_you_mean,
    param_inputs,
    param_names,
)
from parc.hints.file import Hints, Pin, mesh_text
from parc.ir.graph import Value
from parc.passes.spmd.costs import CostModel
from parc.passes.spmd.strategies import Strategy
from parc.sharding import Replicated, ShardSpec, ShardSpecError, Split

_EXAMPLES = 3  # node names quoted per warning


def hint_pins(model: CostModel, hints: Hints) -> tuple[dict[int, tuple[int, ...]], list[str]]:
    """The allowed strategy indices per problem node on `model`'s mesh, and warnings.

    Raises IneligibleMeshError when the hints cannot hold on this mesh (skip it; PinDivisionError,
    a pinned dim the mesh cannot divide, is also a UsageError) and UsageError when they can hold
    on no mesh (a pin naming no tensor of the graph).
    """
    graph = model.graph
    cut = 1 if model.micro is not None else 0  # microbatched: mesh axis 0 is time, not devices
    mesh_shape = tuple(model.mesh.shape[cut:])
    check_mesh(graph, hints, mesh_shape)
    scopes, warnings = assign_scopes(graph, hints)
    params = param_names(graph)
    allowed: dict[int, tuple[int, ...]] = {}

    # Scopes and the default: one request per node, on the nodes that read parameters.
    unmet: dict[str, list[str]] = defaultdict(list)
    for pos, (node, scope) in enumerate(zip(graph.nodes, scopes)):
        request, where = (scope.request, scope.where) if scope is not None else (hints.default, hints.default_where)
        inputs = param_inputs(node, params)
        if request is None or not inputs:
            continue
        n = request.devices(math.prod(mesh_shape))
        strategies = model.strategies[pos]
        ok = tuple(j for j, s in enumerate(strategies) if _obeys(s, request.kind, n, inputs, mesh_shape, cut))
        if not ok and request.kind == "replicate":  # e.g. a parameter's update: run it on every replica
            ok = tuple(j for j, s in enumerate(strategies)
                       if _obeys(s, request.kind, None, inputs, mesh_shape, cut))
        if not ok:
            unmet[f"{where}: {request.kind}({n})"].append(node.name)
        elif len(ok) < len(strategies):
            allowed[model.node_index(pos)] = ok
    for what, nodes in unmet.items():
        more = f" and {len(nodes) - _EXAMPLES} more" if len(nodes) > _EXAMPLES else ""
        warnings.append(f"{what}: on mesh {mesh_text(mesh_shape)} no strategy of {', '.join(nodes[:_EXAMPLES])}{more} "
                        f"obeys it; left to the search")

    # Pins: a source's layouts, or the strategies of the node producing the value.
    source_index = {id(v): k for k, v in enumerate(model.sources)}
    producer = {id(v): (pos, k) for pos, node in enumerate(graph.nodes) for k, v in enumerate(node.outputs)}
    by_name = {v.name: v for v in model.sources}
    for node in graph.nodes:
        by_name.update((v.name, v) for v in node.outputs if v.name)
    for pin in hints.pins:
        v = by_name.get(pin.tensor)
        if v is None:
            message = f"{pin.where}: no tensor named {pin.tensor!r} in the graph{did_you_mean(pin.tensor, by_name)}"
            if pin.required:
                raise UsageError(message)
            warnings.append(message + " (pin ignored)")
            continue
        if id(v) in source_index:
            index = source_index[id(v)]
            candidates = model.source_specs[index]
        else:
            pos, k = producer[id(v)]
            index = model.node_index(pos)
            candidates = [s.outputs[k] for s in model.strategies[pos]]
        ok = _pinned(pin, v, [ShardSpec(tuple(c)[cut:]) for c in candidates], mesh_shape)
        before = allowed.get(index)
        if before is not None and not set(before) & set(ok):
            warnings.append(f"{pin.where}: the pin overrides the scope request on {v.name}'s producer "
                            f"(no strategy obeys both)")
            before = None
        allowed[index] = tuple(sorted(set(ok) & set(before))) if before is not None else ok
    return allowed, warnings


def _obeys(s: Strategy, kind: str, n: int | None, inputs: list[int], mesh_shape: tuple[int, ...],
           cut: int = 0) -> bool:
    """split(n): a parameter input cut into n pieces; replicate(n): parameter inputs replicated
    and the work divided n ways (any way when n is None). `mesh_shape` is the device mesh; with
    `cut` 1 the strategy's axis 0 is the microbatch (time) axis, which does not count."""
    specs = [ShardSpec(tuple(s.inputs[i])[cut:]) for i in inputs if s.inputs[i] is not None]
    if kind == "split":
        return any(_split_over(spec, mesh_shape) == n for spec in specs)
    work = s.split if not cut else math.prod(m for label, m in zip(s.labels[cut:], mesh_shape) if label is not None)
    return (n is None or work == n) and all(isinstance(a, Replicated) for spec in specs for a in spec)


def _split_over(spec: ShardSpec, mesh_shape: tuple[int, ...]) -> int:
    """How many pieces a layout cuts a tensor into (the sizes of the axes that split it)."""
    return math.prod(m for a, m in zip(spec, mesh_shape) if isinstance(a, Split))


def _pinned(pin: Pin, v: Value, candidates: list[ShardSpec], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Indices of the candidate layouts equal to the pinned one (canonically)."""
    where = f"{pin.where}: {pin.tensor} pinned to {pin.spec}"
    if v.shape is None:
        raise UsageError(f"{where}: the tensor's shape is unknown")
    try:
        want = pin.spec.canonical(v.shape, mesh_shape)
    except ShardSpecError as e:
        raise PinDivisionError(mesh_shape, f"{where}: mesh {mesh_text(mesh_shape)} cannot divide a pinned dim of "
                               f"shape {v.shape} ({e})") from None
    ok = tuple(j for j, c in enumerate(candidates) if _canonical(c, v, mesh_shape) == want)
    if not ok:
        offered = sorted({str(_canonical(c, v, mesh_shape) or c) for c in candidates})
        raise IneligibleMeshError(mesh_shape, f"{where}: no strategy on mesh {mesh_text(mesh_shape)} lays it out "
                                  f"so (it may take {', '.join(offered)})")
    return ok


def _canonical(spec: ShardSpec, v: Value, mesh_shape: tuple[int, ...]) -> ShardSpec | None:
    try:
        return spec.canonical(v.shape, mesh_shape)  # type: ignore[arg-type]
    except ShardSpecError:
        return None
