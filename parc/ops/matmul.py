"""Contractions: MatMul, Gemm, Einsum. Contracted labels are reduced by sum."""

from __future__ import annotations

import math
import string

from parc.ir.graph import Node
from parc.ops.base import RuleBuilder, ShardingRule, register


def _batch_dims(shape: tuple[int, ...], out_batch: tuple[int, ...], names: list[str]) -> list[str]:
    """Labels of an operand's leading (broadcast) dims, aligned right with the output's."""
    offset = len(out_batch) - len(shape)
    return [names[offset + d] if shape[d] == out_batch[offset + d] else "1" for d in range(len(shape))]


def _matmul_flops(node: Node) -> int:
    a, b = node.inputs[0], node.inputs[1]
    assert a is not None and b is not None
    k = a.shape[-1]
    return 2 * node.outputs[0].size * k


@register("MatMul", flops=_matmul_flops, notes="numpy matmul: batch dims broadcast; k reduced by sum")
def _matmul(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x, w = node.inputs[0], node.inputs[1]
    y = node.outputs[0]
    assert x is not None and w is not None
    if x.rank == 0 or w.rank == 0:
        return None
    xs = ["m", "k"] if x.rank >= 2 else ["k"]
    ws = ["k", "n"] if w.rank >= 2 else ["k"]
    ys = (["m"] if x.rank >= 2 else []) + (["n"] if w.rank >= 2 else [])
    nb = y.rank - len(ys)
    names = [f"b{i}" for i in range(nb)]
    out_batch = y.shape[:nb]
    xb = _batch_dims(x.shape[: x.rank - len(xs)], out_batch, names)
    wb = _batch_dims(w.shape[: w.rank - len(ws)], out_batch, names)
    spec = (f"{' '.join(xb + xs)}, {' '.join(wb + ws)} -> {' '.join(names + ys)}")
    return b.einsum(spec, reduce={"k": "sum"})


def _gemm_flops(node: Node) -> int:
    a = node.inputs[0]
    assert a is not None
    k = a.shape[0] if node.attr("transA", 0) else a.shape[1]
    c = node.outputs[0].size if node.input(2) is not None else 0
    return 2 * node.outputs[0].size * k + c


@register("Gemm", flops=_gemm_flops,
          notes="k is unsplittable when C is added (beta != 0): each shard would add C once and "
                "the sum over shards would count it n times")
def _gemm(node: Node, b: RuleBuilder) -> ShardingRule | None:
    a, w, c = node.input(0), node.input(1), node.input(2)
    assert a is not None and w is not None
    if a.rank != 2 or w.rank != 2:
        return None
    xa = "k m" if node.attr("transA", 0) else "m k"
    xb = "n k" if node.attr("transB", 0) else "k n"
    y = node.outputs[0].shape
    cs = "-"
    if c is not None:
        offset = 2 - c.rank
        cs = " ".join(("m", "n")[offset + d] if c.shape[d] == y[offset + d] else "1"
                      for d in range(c.rank))
    add_c = c is not None and node.attr("beta", 1.0) != 0.0
    return b.einsum(f"{xa}, {xb}, {cs} -> m n", reduce={"k": "sum"},
                    unsplittable=["k"] if add_c else [])


def parse_einsum(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]] | None:
    """Operand and output subscripts as lists of letters, `...` expanded to numbered labels.

    Ellipsis dims get labels ``e0 e1 ...`` aligned right with the output's ellipsis. Returns
    None for an equation that does not fit the ranks.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        return None
    n_ell = 0
    for t, r in zip(terms, ranks):
        letters = len(t.replace("...", ""))
        if "..." in t:
            n_ell = max(n_ell, r - letters)
        elif letters != r:
            return None
    ell = [f"e{i}" for i in range(n_ell)]
    ops: list[list[str]] = []
    for t, r in zip(terms, ranks):
        head, dots, tail = t.partition("...")
        mid = ell[n_ell - (r - len(head) - len(tail)):] if dots else []
        if any(ch not in string.ascii_letters for ch in head + tail):
            return None
        ops.append(list(head) + mid + list(tail))
    if arrow:
        head, dots, tail = rhs.partition("...")
        out = list(head) + (ell if dots else []) + list(tail)
    else:
        counts: dict[str, int] = {}
        for t in terms:
            for ch in t.replace("...", ""):
                counts[ch] = counts.get(ch, 0) + 1
        out = ell + sorted((ch for ch, c in counts.items() if c == 1))
    return ops, out


def _einsum_flops(node: Node) -> int:
    parsed = parse_einsum(node.attr("equation", ""), [v.rank for v in node.inputs if v is not None])
    if parsed is None:
        return int(node.outputs[0].size)
    ops, _ = parsed
    sizes: dict[str, int] = {}
    for subs, v in zip(ops, node.inputs):
        assert v is not None
        for lbl, extent in zip(subs, v.shape):
            sizes[lbl] = max(sizes.get(lbl, 1), extent)
    return (2 if len(ops) > 1 else 1) * math.prod(sizes.values())


@register("Einsum", flops=_einsum_flops,
          notes="letters only in inputs are reduced by sum; a letter repeated within one operand "
                "(a diagonal) is unsplittable; ellipsis dims broadcast like numpy")
def _einsum(node: Node, b: RuleBuilder) -> ShardingRule | None:
    ins = [v for v in node.inputs if v is not None]
    parsed = parse_einsum(node.attr("equation", ""), [v.rank for v in ins])
    if parsed is None:
        return None
    ops, out = parsed
    y = node.outputs[0]
    if len(out) != y.rank or len(set(out)) != len(out):
        return None
    out_size = dict(zip(out, y.shape))
    sizes: dict[str, set[int]] = {}
    repeated: set[str] = set()
    for subs, v in zip(ops, ins):
        if len(set(subs)) != len(subs):
            repeated.update(s for s in subs if subs.count(s) > 1)
        for lbl, extent in zip(subs, v.shape):
            sizes.setdefault(lbl, set()).add(extent)
    specs = []
    for subs, v in zip(ops, ins):
        dims = []
        for lbl, extent in zip(subs, v.shape):
            full = max(sizes[lbl] | {out_size.get(lbl, 1)})
            dims.append(lbl if extent == full else "1")  # a broadcast size-1 dim
        specs.append(" ".join(dims))
    reduce = {lbl: "sum" for lbl in sizes if lbl not in out}
    spec = ", ".join(specs) + " -> " + " ".join(out)
    return b.einsum(spec, reduce=reduce, unsplittable=list(repeated))


@register("Det", notes="batch dims are loop dims; the matrix dims are whole")
def _det(node: Node, b: RuleBuilder) -> ShardingRule | None:
    x = node.inputs[0]
    assert x is not None
    if x.rank < 2:
        return None
    batch = " ".join(f"b{i}" for i in range(x.rank - 2))
    return b.einsum(f"{batch} _ _ -> {batch}")
