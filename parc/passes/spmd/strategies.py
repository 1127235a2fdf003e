"""Candidate strategies per node (Rhino 4.3.3): which op-rule label each mesh axis splits.

A node's strategy assigns each mesh axis one splittable label of its sharding rule, or none
(that axis replicates the node). The same label on two axes is a nested split. From the
labels follow the ShardSpec each input must have and the one each output gets (partial when
the label is reduced). Ops without a rule have one strategy: replicated everywhere.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from parc.ir.graph import Node, Value
from parc.ops import sharding_rule
from parc.ops.base import ShardingRule
from parc.sharding import P, R, S, ShardSpec, ShardSpecError, shard_spec_for_labels
from parc.solver.balance import label_sizes

MAX_STRATEGIES = 32  # per node; label combinations beyond this are dropped, largest splits kept


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: the label per mesh axis and the specs that follow from it."""

    labels: tuple[str | None, ...]
    inputs: tuple[ShardSpec | None, ...]  # None: the input is absent
    outputs: tuple[ShardSpec, ...]
    split: int  # how many ways the node's work is divided (product of split axes)

    def __str__(self) -> str:
        return "x".join(label or "-" for label in self.labels)


def replicated(mesh_shape: tuple[int, ...]) -> ShardSpec:
    return ShardSpec((R,) * len(mesh_shape))


def node_strategies(node: Node, mesh_shape: tuple[int, ...],
                    first: tuple[str | None, ...] | None = None) -> list[Strategy]:
    """Every label assignment whose splits divide the labels' sizes (replicated first).

    `first`, when given, is the labels mesh axis 0 may take (the microbatch axis: see costs)."""
    rule = sharding_rule(node)
    if rule is None:
        return [_replicated_strategy(node, mesh_shape)] if first is None or None in first else []
    options: list[list[str | None]] = [[None] + rule.splittable() for _ in mesh_shape]
    found: list[Strategy] = []
    for labels in itertools.product(*options):
        if not _divides(rule, labels, mesh_shape):
            continue
        try:
            found.append(_strategy(node, rule, labels, mesh_shape))
        except ShardSpecError:
            continue  # e.g. a partial kind (prod, mean) no ShardSpec expresses
    found.sort(key=lambda s: (s.labels != (None,) * len(mesh_shape), -s.split, str(s)))
    found = found[:MAX_STRATEGIES]
    # Partial sums pass through on a flat mesh of devices, and on the microbatch axis (axis 0
    # when `first` is given). On multi-axis device meshes they multiply near-equal choices: a
    # training step's ILP then ends at its time limit far from the optimum it reaches without
    # them (docs/plan.md). A flat device mesh behind the microbatch axis keeps them: without, a
    # gradient a linear op reads after its reduction (a bias's, through a Reshape) was all-reduced
    # in every microbatch instead of once after their sum.
    device_axes = len(mesh_shape) - (first is not None)
    axes = range(len(mesh_shape)) if device_axes <= 1 else (0,) if first is not None else ()
    found += partial_variants(node, found, mesh_shape, axes)
    if first is not None:
        found = [s for s in found if s.labels[0] in first]
    return found


# Ops linear in the inputs listed: partial sums pass through them (GSPMD's "unreduced" values),
# so gradient contributions can be summed before the one reduction they need.
LINEAR: dict[str, tuple[tuple[int, ...], ...]] = {
    "Add": ((0, 1),), "Sub": ((0, 1),), "Sum": ((),), "Neg": ((0,),), "Identity": ((0,),),
    "Reshape": ((0,),), "Transpose": ((0,),), "Squeeze": ((0,),), "Unsqueeze": ((0,),),
    "Flatten": ((0,),), "ReduceSum": ((0,),), "Expand": ((0,),), "Mul": ((0,), (1,)),
    "MatMul": ((0,), (1,)), "Div": ((0,),), "Cast": ((0,),),
    # linear in data and updates together: with reduction "add" always, with "none" where the
    # indices are unique (ONNX leaves duplicates undefined there); a Gather's gradient
    "ScatterND": ((0, 2),), "ScatterElements": ((0, 2),),
}
LINEAR_REDUCTIONS = ("none", "add")  # the scatters' reductions that keep them linear
PARTIAL = "+"  # the label of a mesh axis along which a strategy passes partial sums through
MAX_PARTIAL = 8  # partial variants per node


def partial_variants(node: Node, base: list[Strategy], mesh_shape: tuple[int, ...],
                     axes=None) -> list[Strategy]:
    """For a linear op, each strategy that replicates mesh axes K (a non-empty set of axes in
    `axes`, default all) also taken with P(sum) on K for one linear group of its inputs and for
    its outputs (the rest replicated): a microbatch's gradient contribution partial along time
    and over the devices both (P on two axes) sums first and is reduced once."""
    groups = LINEAR.get(node.op_type) if node.domain in ("", "ai.onnx") else None
    if not groups or any(v.dtype is None or not v.dtype.is_float for v in node.outputs):
        return []
    if node.op_type.startswith("Scatter") and node.attr("reduction", "none") not in LINEAR_REDUCTIONS:
        return []
    if node.op_type == "Cast" and not all(v is not None and v.dtype is not None and v.dtype.is_float
                                          for v in node.inputs[:1]):
        return []
    out: list[Strategy] = []
    for s in base:
        free = [k for k, label in enumerate(s.labels)
                if label is None and mesh_shape[k] > 1 and (axes is None or k in axes)]
        for count in range(1, len(free) + 1):
            for ks in itertools.combinations(free, count):
                for group in groups:
                    linear = group or tuple(range(len(node.inputs)))
                    try:
                        ins = tuple(None if spec is None else _partial(spec, ks) if i in linear else spec
                                    for i, spec in enumerate(s.inputs))
                        outs = tuple(_partial(spec, ks) for spec in s.outputs)
                    except ShardSpecError:
                        continue
                    labels = tuple(PARTIAL if j in ks else lab for j, lab in enumerate(s.labels))
                    out.append(Strategy(labels, ins, outs, s.split))
                    if len(out) >= MAX_PARTIAL:
                        return out
    return out


def _partial(spec: ShardSpec, axes: tuple[int, ...]) -> ShardSpec:
    for k in axes:
        spec = spec.replace(k, P("sum"))
    return spec


def _divides(rule: ShardingRule, labels: tuple[str | None, ...], mesh_shape: tuple[int, ...]) -> bool:
    need: dict[str, int] = {}
    for label, n in zip(labels, mesh_shape):
        if label is not None:
            need[label] = need.get(label, 1) * n
    return all(rule.size(label) % k == 0 for label, k in need.items())


def _strategy(node: Node, rule: ShardingRule, labels: tuple[str | None, ...],
              mesh_shape: tuple[int, ...]) -> Strategy:
    ins = tuple(None if v is None else
                (shard_spec_for_labels(rule.inputs[i], rule, labels, mesh_shape)
                 if i < len(rule.inputs) and rule.inputs[i] is not None else replicated(mesh_shape))
                for i, v in enumerate(node.inputs))
    outs = tuple(shard_spec_for_labels(rule.outputs[i], rule, labels, mesh_shape, output=True)
                 if i < len(rule.outputs) and rule.outputs[i] is not None else replicated(mesh_shape)
                 for i in range(len(node.outputs)))
    split = math.prod(n for label, n in zip(labels, mesh_shape) if label is not None)
    return Strategy(tuple(labels), ins, outs, split)


def _replicated_strategy(node: Node, mesh_shape: tuple[int, ...]) -> Strategy:
    rep = replicated(mesh_shape)
    return Strategy((None,) * len(mesh_shape), tuple(None if v is None else rep for v in node.inputs),
                    tuple(rep for _ in node.outputs), 1)


def tensor_specs(v: Value, mesh_shape: tuple[int, ...], wanted: list[ShardSpec]) -> list[ShardSpec]:
    """Layouts a source tensor (input, parameter, state) may take: replicated, each even split of
    one dim per axis, and whatever its consumers ask for (strided splits included); a source
    can be laid out any way at no communication cost."""
    specs = {replicated(mesh_shape): None}
    assert v.shape is not None
    for d, extent in enumerate(v.shape):
        for k, n in enumerate(mesh_shape):
            if n > 1 and extent % n == 0:
                axes = [R] * len(mesh_shape)
                axes[k] = S(d)
                specs[ShardSpec(tuple(axes))] = None
    for spec in wanted:
        if spec is not None and not any(getattr(a, "op", None) for a in spec):
            specs[spec] = None
    return list(specs)[:MAX_STRATEGIES]


def uneven_strategies(node: Node, strats: list[Strategy], mesh_shape: tuple[int, ...],
                      shares: tuple[tuple[float, ...], ...], uneven_axes: set[int],
                      cuts: tuple[tuple[int, ...] | None, ...]) -> list[Strategy]:
    """Each of node's strategies with every label split along an axis of `uneven_axes` cut in
    proportion to that axis's `shares` (`S(d,[sizes])` on every tensor holding it), kept as it
    is where that cannot be expressed: the label on two axes, held inside a dim (a strided
    piece), sharing a dim with a label another axis splits, or too small to give every device a
    piece. A label's pieces are `label_sizes`: where the batch is cut (`cuts`, per axis), when
    its extent holds whole batches."""
    rule = sharding_rule(node)
    if rule is None:
        return strats
    return [_uneven(rule, s, mesh_shape, shares, uneven_axes, cuts) for s in strats]


def _uneven(rule: ShardingRule, s: Strategy, mesh_shape: tuple[int, ...], shares: tuple[tuple[float, ...], ...],
            uneven_axes: set[int], cuts: tuple[tuple[int, ...] | None, ...]) -> Strategy:
    if not any(k in uneven_axes and lab not in (None, PARTIAL) for k, lab in enumerate(s.labels)):
        return s
    split_labels = [lab for lab in s.labels if lab not in (None, PARTIAL)]
    tensors = [d for d in (*rule.inputs, *rule.outputs) if d is not None]
    axes = list(zip(range(len(mesh_shape)), s.labels))
    ins, outs = list(s.inputs), list(s.outputs)
    changed = False
    for k, label in axes:
        if k not in uneven_axes or label in (None, PARTIAL) or split_labels.count(label) > 1:
            continue
        sizes = label_sizes(rule.size(label), shares[k], cuts[k])
        if sizes is None:
            continue
        ok = True
        for dims in tensors:
            for dim in dims:
                if label in dim and (dim.index(label) != 0 or any(o in dim for o in split_labels if o != label)):
                    ok = False  # strided, or another axis cuts the same dim
        if not ok:
            continue

        ins = [_cut(spec, rule.inputs[i] if i < len(rule.inputs) else None, rule, label, k, sizes)
               for i, spec in enumerate(ins)]
        outs = [_cut(spec, rule.outputs[i] if i < len(rule.outputs) else None, rule, label, k, sizes)
                for i, spec in enumerate(outs)]
        changed = True
    return Strategy(s.labels, tuple(ins), tuple(outs), s.split) if changed else s


def _cut(spec: ShardSpec | None, dims, rule: ShardingRule, label: str, k: int,
         sizes: tuple[int, ...]) -> ShardSpec | None:
    """spec with mesh axis k's split of `label` cut into `sizes` (scaled by the dim's inner factors)."""
    if spec is None or dims is None:
        return spec
    held = [d for d, dim in enumerate(dims) if label in dim]
    if not held:
        return spec
    inner = math.prod(rule.size(f) for f in dims[held[0]][1:])
    return spec.replace(k, S(held[0], sizes=tuple(z * inner for z in sizes)))
