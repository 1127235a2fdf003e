"""Hints as solver pins on one mesh's cost model (Whale 3.1-3.2 over Rhino's search).

A scope is a Whale TaskGraph: the nodes whose *scope name* its regex finds (first scope wins).
A node's scope name is its own name; a backward node's is its forward node's (`parc.forward`);
an optimizer node's is that of its parameter (`parc.param`), i.e. the first forward node that
reads the parameter (or the parameter's own name when none does). Nodes no scope matches take
the `default` request (over every device of the mesh), or are free when it is auto.

On a mesh, a request constrains each of its nodes that reads a parameter (an input that is a
parameter source):
- split(n): a strategy must split at least one parameter input over mesh axes whose sizes
  multiply to n (other axes stay free: Whale's nested data parallelism);
- replicate(n): every parameter input replicated on all axes, and the node's work divided n
  ways (the product of its split axes is n: data parallel over n); a node that cannot divide
  its work with its parameters whole (a parameter's update) runs on every replica instead.
Nodes without parameter inputs stay free: where a scope ends the search picks the layouts, and
the resharding between scopes is Whale's bridge (3.2.3), priced by the edge costs. A node whose
strategies cannot obey its request on this mesh (a LayerNorm cannot split its weight) is left
free with a warning. A request whose n is no product of the mesh's axis sizes makes the mesh
ineligible (`IneligibleMeshError`: the search skips it). Pins fix a tensor's layout: a
source's candidate specs, or the strategies of the node producing the value, equal to the
pinned spec after canonicalisation.
"""

from __future__ import annotations

import difflib
import itertools
import logging
import math
from collections import defaultdict
from collections.abc import Iterable

from parc.errors import ParcError, UsageError
from parc.hints.file import Hints, Pin, Scope
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import FORWARD, phase, step_state
from parc.passes.spmd.costs import CostModel
from parc.passes.spmd.strategies import Strategy
from parc.sharding import Replicated, ShardSpec, ShardSpecError, Split

log = logging.getLogger("parc.hints")

_EXAMPLES = 3  # node names quoted per warning


class IneligibleMeshError(ParcError):
    """The hints cannot hold on this mesh; the search skips it. Carries the mesh shape."""

    def __init__(self, mesh_shape: tuple[int, ...], message: str) -> None:
        super().__init__(message)
        self.mesh_shape = mesh_shape


class PinDivisionError(IneligibleMeshError, UsageError):
    """A pinned spec splits a dim this mesh cannot divide: a UsageError that also lets the search
    skip just this mesh (another mesh shape may divide it)."""


def param_names(graph: Graph) -> set[str]:
    """The trained parameters: a training step lists them in `parc.state`, else `is_param`."""
    state = step_state(graph.metadata)
    if state is not None:
        return set(state.params)
    return {v.name for v in graph.constants.values() if v.is_param}


def scope_names(graph: Graph) -> list[str]:
    """Per node (graph order), the name its scope is matched on (see the module docstring)."""
    owner: dict[str, str] = {}  # parameter -> first forward node reading it
    for n in graph.nodes:
        if phase(n) != FORWARD:
            continue
        for v in n.inputs:
            if v is not None and v.is_const and v.name not in owner:
                owner[v.name] = n.name
    out = []
    for n in graph.nodes:
        if "parc.forward" in n.meta:
            out.append(n.meta["parc.forward"])
        elif "parc.param" in n.meta:
            out.append(owner.get(n.meta["parc.param"], n.meta["parc.param"]))
        else:
            out.append(n.name)
    return out


def assign_scopes(graph: Graph, hints: Hints) -> tuple[list[Scope | None], list[str]]:
    """Per node, the first scope matching its scope name (None: none does); and a warning per
    scope whose regex matches no node."""
    names = scope_names(graph)
    chosen: list[Scope | None] = []
    for name in names:
        chosen.append(next((s for s in hints.scopes if s.regex.search(name)), None))
    warnings = [f"{s.where}.match: '{s.match}' matches no node (scope ignored)"
                for s in hints.scopes if not any(s.regex.search(name) for name in set(names))]
    return chosen, warnings


def stage_pins(graph: Graph, hints: Hints, count: int) -> dict[str, tuple[int, str]]:
    """Forward node name -> (stage, where) for the nodes a `stage:` scope matches first (Whale's
    pipeline annotation); UsageError for a stage the pipeline does not have."""
    scopes, _ = assign_scopes(graph, hints)
    out = {}
    for node, scope in zip(graph.nodes, scopes):
        if scope is None or scope.stage is None or phase(node) != FORWARD:
            continue
        if scope.stage >= count:
            raise UsageError(f"{scope.where}.stage: stage {scope.stage} for node '{node.name}', but the "
                             f"pipeline has {count} stages (0..{count - 1})")
        out[node.name] = (scope.stage, scope.where)
    return out


def axis_products(mesh_shape: tuple[int, ...]) -> set[int]:
    """The device counts a subset of mesh axes spans (1 for none)."""
    return {math.prod(c) for k in range(len(mesh_shape) + 1) for c in itertools.combinations(mesh_shape, k)}


def check_mesh(graph: Graph, hints: Hints, mesh_shape: tuple[int, ...]) -> None:
    """Raise IneligibleMeshError if the hints cannot hold on a mesh of this shape (a request
    whose n no axes multiply to, a pin for another mesh); cheap: call it before `costs.build`."""
    mesh_shape = tuple(mesh_shape)
    products = axis_products(mesh_shape)
    params = param_names(graph)
    scopes, _ = assign_scopes(graph, hints)
    checked: set[str] = set()
    for node, scope in zip(graph.nodes, scopes):
        request, where = (scope.request, scope.where) if scope is not None else (hints.default, hints.default_where)
        if request is None or where in checked or not _param_inputs(node, params):
            continue
        checked.add(where)
        n = request.devices(math.prod(mesh_shape))
        if n not in products:
            raise IneligibleMeshError(mesh_shape, f"{where}: {request.kind}({n}) needs mesh axes whose sizes "
                                      f"multiply to {n}; mesh {_mesh(mesh_shape)} offers {sorted(products)}")
    for pin in hints.pins:
        what = f"{pin.where}: {pin.tensor} pinned to {pin.spec}"
        if pin.mesh is not None and tuple(pin.mesh) != mesh_shape:
            raise IneligibleMeshError(mesh_shape, f"{what} for mesh {_mesh(pin.mesh)}, not {_mesh(mesh_shape)}")
        if len(pin.spec) != len(mesh_shape):
            raise IneligibleMeshError(mesh_shape, f"{what}: {len(pin.spec)} axis specs for the "
                                      f"{len(mesh_shape)}-axis mesh {_mesh(mesh_shape)}")


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
        inputs = _param_inputs(node, params)
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
        warnings.append(f"{what}: on mesh {_mesh(mesh_shape)} no strategy of {', '.join(nodes[:_EXAMPLES])}{more} "
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
            message = f"{pin.where}: no tensor named {pin.tensor!r} in the graph{_close(pin.tensor, by_name)}"
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


def _param_inputs(node: Node, params: set[str]) -> list[int]:
    """Positions of the inputs that are parameters (sources: no node produces them)."""
    return [i for i, v in enumerate(node.inputs) if v is not None and v.producer is None and v.name in params]


def warn_once(warnings: Iterable[str], seen: set[str]) -> None:
    """Log each warning not in `seen` (hint_pins repeats the mesh-independent ones per mesh)."""
    for w in warnings:
        if w not in seen:
            seen.add(w)
            log.warning("%s", w)


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
        raise PinDivisionError(mesh_shape, f"{where}: mesh {_mesh(mesh_shape)} cannot divide a pinned dim of "
                               f"shape {v.shape} ({e})") from None
    ok = tuple(j for j, c in enumerate(candidates) if _canonical(c, v, mesh_shape) == want)
    if not ok:
        offered = sorted({str(_canonical(c, v, mesh_shape) or c) for c in candidates})
        raise IneligibleMeshError(mesh_shape, f"{where}: no strategy on mesh {_mesh(mesh_shape)} lays it out "
                                  f"so (it may take {', '.join(offered)})")
    return ok


def _canonical(spec: ShardSpec, v: Value, mesh_shape: tuple[int, ...]) -> ShardSpec | None:
    try:
        return spec.canonical(v.shape, mesh_shape)  # type: ignore[arg-type]
    except ShardSpecError:
        return None


def _close(name: str, known: dict[str, Value]) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def _mesh(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))

