"""Repeated nodes and no-op Casts removed from an ONNX module, by onnxruntime's own rules.

`parc plan` writes every rank's modules simplified (`parc.passes.emit`) before it prices them
(`parc.passes.timing`), so the nodes priced are the nodes written, and onnxruntime's graph
optimizer, which applies the same rules when it loads a module, finds none of these left:

- `eliminate_common_subexpressions`: a node that computes what an earlier one computes (same op,
  attributes and inputs, where equal initializers of up to `SHARED_CONST` elements count as one
  value) is removed and its readers read the earlier node's outputs: onnxruntime's
  CommonSubexpressionElimination after its ConstantSharing. `parc grad`'s recomputation repeats
  forward nodes in the backward pass (`parc.autodiff.recompute`), so a module holding both has
  them twice.
- `eliminate_noop_casts`: a Cast to the type its input already has is removed and its readers
  read its input (onnxruntime's CastElimination).

Neither touches a node whose result is a module output or is read inside a subgraph (it keeps
its name), a node of another domain, a random op (`parc.ir.evaluate.NONDETERMINISTIC`: each run draws anew) or a node
with a subgraph. The module stays valid and in topological order (a removed node's readers come
after the node that replaces it); the model given is never changed.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from parc.ir.evaluate import NONDETERMINISTIC

log = logging.getLogger("parc.passes")  # every pass logs under one name, wherever it lives

SHARED_CONST = 1  # initializers of up to this many elements are one value wherever equal (ConstantSharing)
_DEFAULT_DOMAINS = ("", "ai.onnx")
_SUBGRAPHS = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


class Removed(NamedTuple):
    """How many nodes `simplify` removed, by pass."""

    common: int  # repeats of an earlier node
    casts: int  # Casts to their input's type


def simplify(model: onnx.ModelProto, dtypes: Mapping[str, int] | None = None) -> tuple[onnx.ModelProto, Removed]:
    """`model` with its repeated nodes and its no-op Casts removed, until neither pass finds more
    (a Cast removed can make two of its readers repeats), and how many of each went. `dtypes`:
    the ONNX element type of each value, where known (a module declares only its inputs' and
    outputs'); `model` itself where nothing was removed."""
    common = casts = 0
    while True:
        model, a = eliminate_common_subexpressions(model)
        model, b = eliminate_noop_casts(model, dtypes)
        common, casts = common + a, casts + b
        if not b:
            return model, Removed(common, casts)


def eliminate_common_subexpressions(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """`model` without the nodes that repeat an earlier one, and how many went (see the module
    docstring); `model` itself where none did."""
    graph = model.graph
    pinned = _pinned(graph)
    fed = {v.name for v in graph.input}  # an initializer that is also an input can be fed: not a constant
    shareable = {t.name: ("const", t.data_type, tuple(t.dims), numpy_helper.to_array(t).tobytes())
                 for t in graph.initializer if _small(t) and t.name not in fed}
    rename: dict[str, str] = {}

    def key_of(name: str) -> object:
        name = rename.get(name, name)
        return shareable.get(name, name)

    first: dict[tuple, list[str]] = {}  # a computation -> the outputs of the node that made it first
    gone: set[int] = set()
    for i, n in enumerate(graph.node):
        if n.domain not in _DEFAULT_DOMAINS or n.op_type in NONDETERMINISTIC or pinned.intersection(n.output) \
                or any(a.type in _SUBGRAPHS for a in n.attribute):
            continue
        key = (n.op_type, tuple(key_of(x) for x in n.input), tuple(sorted(a.SerializeToString() for a in n.attribute)))
        kept = first.get(key)
        if kept is None:
            first[key] = list(n.output)
        elif [bool(o) for o in kept] == [bool(o) for o in n.output]:  # the same outputs present
            rename.update({o: k for o, k in zip(n.output, kept) if o})
            gone.add(i)
    return _without(model, gone, rename, "common subexpressions"), len(gone)


def eliminate_noop_casts(model: onnx.ModelProto,
                         dtypes: Mapping[str, int] | None = None) -> tuple[onnx.ModelProto, int]:
    """`model` without its Casts to the type their input has, and how many went; `dtypes`: each
    value's ONNX element type, where known (the module's declared types are added); `model`
    itself where none went."""
    graph = model.graph
    pinned = _pinned(graph)
    types = dict(dtypes or {})
    types.update({v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)
                  if v.type.tensor_type.elem_type})
    types.update({t.name: t.data_type for t in graph.initializer})
    rename: dict[str, str] = {}
    gone: set[int] = set()
    for i, n in enumerate(graph.node):
        if n.op_type != "Cast" or n.domain not in _DEFAULT_DOMAINS or len(n.input) != 1 or len(n.output) != 1:
            continue
        to = next((a.i for a in n.attribute if a.name == "to"), None)
        src = rename.get(n.input[0], n.input[0])
        if to is not None and types.get(src) == to and n.output[0] not in pinned:
            rename[n.output[0]] = src
            gone.add(i)
    return _without(model, gone, rename, "no-op casts"), len(gone)


def _small(t: onnx.TensorProto) -> bool:
    return t.data_location != onnx.TensorProto.EXTERNAL and int(np.prod(t.dims)) <= SHARED_CONST


def _pinned(graph: onnx.GraphProto) -> set[str]:
    """The values a rewrite must keep by name: the graph's outputs and what its subgraphs read."""
    return {v.name for v in graph.output} | _read_in_subgraphs(graph)


def _read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    names: set[str] = set()
    for n in graph.node:
        for a in n.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                names.update(x for m in g.node for x in m.input if x)
                names |= _read_in_subgraphs(g)
    return names


def _without(model: onnx.ModelProto, gone: Collection[int], rename: Mapping[str, str], what: str) -> onnx.ModelProto:
    """A copy of `model` without the nodes at `gone`, their readers reading `rename[value]`, and
    without the initializers only they read; `model` itself where `gone` is empty."""
    if not gone:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    nodes = [n for i, n in enumerate(graph.node) if i not in gone]
    for n in nodes:
        for k, name in enumerate(n.input):
            if name in rename:
                n.input[k] = rename[name]
    read_before = {x for n in model.graph.node for x in n.input}
    keep = {x for n in nodes for x in n.input} | _pinned(graph) | {v.name for v in graph.input}
    inits = [t for t in graph.initializer if t.name in keep or t.name not in read_before]
    infos = [v for v in graph.value_info if v.name not in rename]
    del graph.node[:], graph.initializer[:], graph.value_info[:]
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
    graph.value_info.extend(infos)
    log.debug("%s: %d %s removed", graph.name, len(gone), what)
    return out
