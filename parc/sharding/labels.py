"""Sharding specs from op-rule labels: what splitting a label does to each tensor (Rhino 4.1).

`parc/ops/base.py` names a tensor dim by factor labels, outer to inner. Splitting label ``L``
of the group ``(f1 .. L .. fk)`` over ``n`` devices cuts ``L`` into ``n`` contiguous pieces, so
device ``c`` holds, for every index of the outer factors, one run of
``size(L)/n * prod(inner factors)`` consecutive elements: the strided split

    S(d, stride = size(L)/n * prod(inner))          (S(d) when prod(outer) == 1)

of a dim of extent ``prod(outer) * size(L) * prod(inner)`` viewed as
``(prod(outer), n, stride)``, which is exactly `spec.py`'s definition. A fused QKV weight
``[H, (t h)]`` with ``t = 3`` split on ``h`` is ``S(1, H/n)``: q, k and v stay together.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from parc.ops.base import ShardingRule, TensorDims
from parc.sharding.spec import PARTIAL_OPS, AxisSpec, Partial, R, ShardSpec, ShardSpecError, Split


def axis_spec_for_label(dims: TensorDims | None, rule: ShardingRule, label: str, n: int, *,
                        output: bool = False) -> AxisSpec:
    """The layout on one mesh axis of a tensor labelled `dims` when `rule`'s `label` is split `n` ways.

    A tensor holding the label is split (strided when the label is not the outermost factor of
    its dim). One without it is replicated, except an `output` when the rule reduces the label:
    then it is partial, P(the rule's reduce kind). A mean over equal shares is P(sum) of the
    devices' means divided by n (the lowering scales them). With n == 1 the result is R.
    """
    if label not in dict(rule.sizes):
        raise ShardSpecError(f"rule [{rule}] has no label {label!r}")
    size = rule.size(label)
    where = f"rule [{rule}]: label {label} (size {size}) split {n} ways"
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ShardSpecError(f"{where}: the device count must be an int >= 1")
    if size % n:
        raise ShardSpecError(f"{where}: {size} is not divisible by {n}")
    holders = [d for d, dim in enumerate(dims or ()) if label in dim]
    if len(holders) > 1:
        raise ShardSpecError(f"{where}: the label is in dims {holders} of one tensor; one axis spec "
                             f"splits one dim")
    if n == 1:
        return R
    if not holders:
        if not output:
            return R
        kind = dict(rule.reduce).get(label)
        if kind is None:
            if label in rule.output_labels:
                return R  # computed whole on every device (the label is split in another output)
            raise ShardSpecError(f"{where}: the label is in no output and has no reduce kind")
        if kind == "mean":
            return Partial("sum")  # equal shares: each device's mean, divided by n, sums to the mean
        if kind not in PARTIAL_OPS:
            raise ShardSpecError(f"{where}: outputs would be partial by {kind}; partial specs are "
                                 f"{', '.join(PARTIAL_OPS)}")
        return Partial(kind)
    d = holders[0]
    dim = dims[d]  # type: ignore[index]
    i = dim.index(label)
    outer = math.prod(rule.size(f) for f in dim[:i])
    inner = math.prod(rule.size(f) for f in dim[i + 1:])
    return Split(d, None if outer == 1 else size // n * inner)


def split_label(rule: ShardingRule, label: str, n: int) -> ShardingRule:
    """The rule a device sees after `label` is split `n` ways (the label's size divided by n)."""
    sizes = dict(rule.sizes)
    if sizes[label] % n:
        raise ShardSpecError(f"rule [{rule}]: label {label} (size {sizes[label]}) is not divisible by {n}")
    sizes[label] //= n
    return dataclasses.replace(rule, sizes=tuple(sizes.items()))


def shard_spec_for_labels(dims: TensorDims | None, rule: ShardingRule, labels: Sequence[str | None],
                          mesh_shape: Sequence[int], *, output: bool = False) -> ShardSpec:
    """The ShardSpec of a tensor when mesh axis k splits `labels[k]` (None: that axis replicates).

    Axes nest in mesh order, so axis k sees the rule with the earlier axes' labels already
    divided (the same label on two axes is a nested split of it).
    """
    if len(labels) != len(mesh_shape):
        raise ShardSpecError(f"{len(labels)} labels for a mesh of shape {tuple(mesh_shape)}")
    axes: list[AxisSpec] = []
    for label, n in zip(labels, mesh_shape):
        if label is None:
            axes.append(R)
            continue
        axes.append(axis_spec_for_label(dims, rule, label, n, output=output))
        rule = split_label(rule, label, n)
    return ShardSpec(tuple(axes))
