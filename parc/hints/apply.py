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
from collections.abc import Iterable

from parc.errors import ParcError, UsageError
from parc.hints.file import Hints, Scope, mesh_text
from parc.ir.graph import Graph, Node, Value
from parc.ir.state import FORWARD, FORWARD_OF, PARAM_OF, phase, step_state

log = logging.getLogger("parc.hints")



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
        if FORWARD_OF in n.meta:
            out.append(n.meta[FORWARD_OF])
        elif PARAM_OF in n.meta:
            out.append(owner.get(n.meta[PARAM_OF], n.meta[PARAM_OF]))
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
        if request is None or where in checked or not param_inputs(node, params):
            continue
        checked.add(where)
        n = request.devices(math.prod(mesh_shape))
        if n not in products:
            raise IneligibleMeshError(mesh_shape, f"{where}: {request.kind}({n}) needs mesh axes whose sizes "
                                      f"multiply to {n}; mesh {mesh_text(mesh_shape)} offers {sorted(products)}")
    for pin in hints.pins:
        what = f"{pin.where}: {pin.tensor} pinned to {pin.spec}"
        if pin.mesh is not None and tuple(pin.mesh) != mesh_shape:
            raise IneligibleMeshError(mesh_shape, f"{what} for mesh {mesh_text(pin.mesh)}, not {mesh_text(mesh_shape)}")
        if len(pin.spec) != len(mesh_shape):
            raise IneligibleMeshError(mesh_shape, f"{what}: {len(pin.spec)} axis specs for the "
                                      f"{len(mesh_shape)}-axis mesh {mesh_text(mesh_shape)}")


def param_inputs(node: Node, params: set[str]) -> list[int]:
    """Positions of the inputs that are parameters (sources: no node produces them)."""
    return [i for i, v in enumerate(node.inputs) if v is not None and v.producer is None and v.name in params]


def warn_once(warnings: Iterable[str], seen: set[str]) -> None:
    """Log each warning not in `seen` (hint_pins repeats the mesh-independent ones per mesh)."""
    for w in warnings:
        if w not in seen:
            seen.add(w)
            log.warning("%s", w)


def did_you_mean(name: str, known: dict[str, Value]) -> str:
    near = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""

