"""Normalisations, softmax and losses: normalised dims stay whole, the rest are loop dims."""

from __future__ import annotations

from parc.ir.graph import Node
from parc.ops.base import RuleBuilder, ShardingRule, labels, register


def _per_element(k: int):
    def flops(node: Node) -> int:
        x = node.inputs[0]
        assert x is not None
        return k * x.size
    return flops


def _aligned(shape: tuple[int, ...], names: list[str], extents: tuple[int, ...]) -> str:
    """Labels for a tensor broadcast right-aligned against dims `names` of sizes `extents`."""
    offset = len(names) - len(shape)
    return " ".join(names[offset + d] if shape[d] == extents[offset + d] else "1"
                    for d in range(len(shape)))


@register("LayerNormalization", flops=_per_element(8),
          notes="dims from axis on are normalised (unsplittable); Mean and InvStdDev keep them as 1")
def _layer_norm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    r = x.rank
    axis = node.attr("axis", -1)
    if not -r <= axis < r:
        return None
    axis %= r
    names = labels(r)
    normed = names[axis:]
    specs = [" ".join(names)]
    for i in (1, 2):
        v = node.input(i)
        if v is not None and v.rank > len(normed):
            return None
        specs.append("-" if v is None else _aligned(v.shape, normed, x.shape[axis:]))
    stats = " ".join(names[:axis] + ["1"] * (r - axis))
    outs = [" ".join(names)] + [stats] * (len(node.outputs) - 1)
    return b.einsum(", ".join(specs) + " -> " + ", ".join(outs), unsplittable=normed)


@register("RMSNormalization", flops=_per_element(6), notes="like LayerNormalization")
def _rms_norm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return _layer_norm(node, b)


@register("BatchNormalization", flops=_per_element(5),
          notes="inference: every dim splits, scale/bias/mean/var split with the channel; "
                "training (training_mode=1 or extra outputs): only the channel splits")
def _batch_norm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 2:
        return None
    rest = labels(x.rank - 2, "s")
    training = bool(node.attr("training_mode", 0)) or len(node.outputs) > 1
    xs = " ".join(["n", "c", *rest])
    outs = [xs] + ["c"] * (len(node.outputs) - 1)
    return b.einsum(f"{xs}, c, c, c, c -> " + ", ".join(outs),
                    unsplittable=["n", *rest] if training else [])


@register("InstanceNormalization", flops=_per_element(8), notes="spatial dims normalised (whole)")
def _instance_norm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 3:
        return None
    sp = " ".join(["_"] * (x.rank - 2))
    return b.einsum(f"n c {sp}, c, c -> n c {sp}")


@register("GroupNormalization", flops=_per_element(8),
          notes="channel and spatial dims whole: splitting whole groups would need num_groups=G/n "
                "in each shard")
def _group_norm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 3:
        return None
    sp = " ".join(["_"] * (x.rank - 2))
    return b.einsum(f"n _ {sp}, _, _ -> n _ {sp}")


@register("MeanVarianceNormalization", flops=_per_element(8), notes="normalised axes whole")
def _mvn(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axes = node.attr("axes", [0, 2, 3])
    if any(not -x.rank <= a < x.rank for a in axes):
        return None
    names = labels(x.rank)
    fixed = [names[a % x.rank] for a in axes]
    spec = " ".join(names)
    return b.einsum(f"{spec} -> {spec}", unsplittable=fixed)


@register("LRN", flops=_per_element(8), notes="the channel window crosses channels: channel whole")
def _lrn(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 2:
        return None
    spec = " ".join(["n", "c", *labels(x.rank - 2, "s")])
    return b.einsum(f"{spec} -> {spec}", unsplittable=["c"])


@register("LpNormalization", flops=_per_element(4), notes="the normalised axis is whole")
def _lp_norm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    axis = node.attr("axis", -1)
    if not -x.rank <= axis < x.rank:
        return None
    names = labels(x.rank)
    spec = " ".join(names)
    return b.einsum(f"{spec} -> {spec}", unsplittable=[names[axis % x.rank]])


@register("Softmax", "LogSoftmax", "Hardmax", flops=_per_element(5),
          notes="the axis is whole; before opset 13 the input is coerced to 2-D at axis, so every "
                "dim from axis on is whole")
def _softmax(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    r = x.rank
    if r == 0:
        return None
    axis = node.attr("axis", -1 if b.opset >= 13 else 1)
    if not -r <= axis < r:
        return None
    axis %= r
    names = labels(r)
    fixed = [names[axis]] if b.opset >= 13 else names[axis:]
    spec = " ".join(names)
    return b.einsum(f"{spec} -> {spec}", unsplittable=fixed)


def _loss_rule(node: Node, b: RuleBuilder, weight_index: int) -> ShardingRule | None:
    """Shared by SoftmaxCrossEntropyLoss and NegativeLogLikelihoodLoss.

    scores (N, C, D1..Dk), labels (N, D1..Dk), weights (C). 'none': N and Ds are loop dims;
    'sum': they are reduced by sum; 'mean': by mean only without weights and ignore_index (the
    denominator is then the same count in every shard), else whole.
    """
    x = node.inputs[0]
    assert x is not None
    if x.rank < 2:
        return None
    reduction = node.attr("reduction", "mean")
    rest = labels(x.rank - 2, "d")
    batch = ["n", *rest]
    weighted = node.input(weight_index) is not None
    xs = " ".join(["n", "c", *rest])
    ts = " ".join(batch)
    ws = "c" if weighted else "-"
    extra = [xs] * (len(node.outputs) - 1)  # SoftmaxCrossEntropyLoss's log_prob
    if reduction == "none":
        return b.einsum(f"{xs}, {ts}, {ws} -> " + ", ".join([ts, *extra]), unsplittable=["c"])
    if reduction == "sum":
        kind = "sum"
    elif reduction == "mean" and not weighted and node.attr("ignore_index") is None:
        kind = "mean"
    else:
        kind = None
    if kind is None:
        return b.einsum(f"{xs}, {ts}, {ws} -> " + ", ".join(["", *extra]),
                        unsplittable=["c", *batch])
    return b.einsum(f"{xs}, {ts}, {ws} -> " + ", ".join(["", *extra]), reduce={lbl: kind for lbl in batch},
                    unsplittable=["c"])


@register("SoftmaxCrossEntropyLoss", flops=_per_element(6),
          notes="class dim whole; batch dims loop ('none'), reduced by sum ('sum'), by mean "
                "('mean' without weights or ignore_index), else whole")
def _sce_loss(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return _loss_rule(node, b, 2)


@register("NegativeLogLikelihoodLoss", flops=_per_element(2),
          notes="as SoftmaxCrossEntropyLoss")
def _nll_loss(node: Node, b: RuleBuilder) -> ShardingRule | None:
    return _loss_rule(node, b, 2)

