"""What plan.json records of the planned graph: each named value's shape, type and role, and a
training step's roles (its loss, data, and each parameter's gradient, next value and optimizer
state), from `parc grad`'s record and the optimizer nodes' `parc.param` tags, so that no reader
has to guess them from names."""

from __future__ import annotations

from collections.abc import Iterable

from parc.ir.graph import Graph, Value
from parc.ir.state import OPTIMIZER, PARAM_OF, phase, step_state
from parc.plandir.plan import DATA, GRADIENT, NEW, PARAMETER, STATE, VALUE, ParameterRole, StepRoles, Tensor


def step_roles(graph: Graph) -> StepRoles | None:
    """The roles of a training step's values; None for a graph that is not one."""
    record = step_state(graph.metadata)
    if record is None:
        return None
    params = set(record.params)
    new_of = {inp: out for out, inp in record.bindings.items()}  # input -> the output feeding it next step
    state_of: dict[str, dict[str, str]] = {p: {} for p in record.params}
    for n in graph.nodes:
        owner = n.meta.get(PARAM_OF)
        if phase(n) != OPTIMIZER or owner not in state_of:
            continue
        for v in n.inputs:
            if v is not None and v.name in new_of and v.name not in params and v.name != record.step:
                state_of[owner].setdefault(v.name, new_of[v.name])
    bound = set(new_of)
    data = tuple(v.name for v in graph.inputs if v.name not in bound and v.name not in params)
    return StepRoles(record.loss, data,
                     {p: ParameterRole(record.grads.get(p), new_of.get(p), state_of[p]) for p in record.params},
                     dict(record.optimizer) if record.optimizer else None, dict(record.precision))


def tensors(graph: Graph, values: Iterable[Value], roles: StepRoles | None) -> dict[str, Tensor]:
    """Shape, type, bytes and role of each named value of `values`."""
    role: dict[str, str] = {}
    if roles is not None:
        role.update({name: DATA for name in roles.data})
        for p, r in roles.parameters.items():
            role[p] = PARAMETER
            role.update({name: STATE for name in r.state})
            role.update({name: NEW for name in (r.new, *r.state.values()) if name})
            if r.gradient:
                role[r.gradient] = GRADIENT
    else:
        role.update({v.name: DATA for v in graph.inputs})
        role.update({v.name: PARAMETER for v in graph.params()})
    return {v.name: Tensor(tuple(v.shape or ()), str(v.dtype), int(v.nbytes), role.get(v.name, VALUE))
            for v in values if v.name}
