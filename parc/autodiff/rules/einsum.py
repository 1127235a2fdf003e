"""Gradient of Einsum: each operand's gradient is an Einsum of dY with the other operands.

The equation is first made explicit: the output term is written out (implicit mode: the
ellipsis, then the labels used once, sorted) and every ellipsis dimension gets a label of its
own, a dimension of size 1 that broadcasts getting a private label. Then for operand i with
term t: labels of t found in no other term and not in the output were summed away, so the
gradient is broadcast along them; a label repeated in t (a diagonal) puts the gradient on the
diagonal by an extra Einsum with identity matrices.
"""

from __future__ import annotations

import string

import numpy as np

from parc.autodiff.context import GradContext
from parc.autodiff.rules.base import grad
from parc.autodiff.rules.common import Grads, inp, unsupported
from parc.ir.graph import Node, Value


def explicit_terms(equation: str, shapes: list[tuple[int, ...]]
                   ) -> tuple[list[list[str]], list[str], dict[str, int]] | str:
    """(input terms, output term, label sizes) with one label per dimension and no ellipsis;
    or a string saying why the equation is not understood."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(shapes):
        return f"{len(terms)} terms for {len(shapes)} operands"
    used = {c for c in eq if c.isalpha()}
    fresh = iter(c for c in string.ascii_letters if c not in used)
    ell_ranks = [len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t]
    e = max(ell_ranks, default=0)
    ell_sizes = [1] * e
    for t, s in zip(terms, shapes):
        if "..." in t:
            r = len(s) - (len(t) - 3)
            start = t.index("...")
            for k in range(r):
                d = s[start + k]
                if d != 1:
                    if ell_sizes[e - r + k] not in (1, d):
                        return "ellipsis dimensions that do not broadcast"
                    ell_sizes[e - r + k] = d
    try:
        ell = [next(fresh) for _ in range(e)]
    except StopIteration:
        return "more than 52 labels"
    sizes: dict[str, int] = dict(zip(ell, ell_sizes))
    out_terms: list[list[str]] = []
    for t, s in zip(terms, shapes):
        labels: list[str] = []
        head, dots, tail = t.partition("...")
        r = len(s) - len(head) - len(tail)
        if (not dots and len(t) != len(s)) or r < 0:
            return f"term {t!r} does not fit a rank-{len(s)} operand"
        labels.extend(head)
        for k in range(r if dots else 0):
            d = s[len(head) + k]
            if d == 1 and ell_sizes[e - r + k] != 1:
                private = next(fresh, None)
                if private is None:
                    return "more than 52 labels"
                sizes[private] = 1
                labels.append(private)
            else:
                labels.append(ell[e - r + k])
        labels.extend(tail)
        for lbl, d in zip(labels, s):
            if sizes.setdefault(lbl, d) != d:
                return f"label {lbl!r} has sizes {sizes[lbl]} and {d}"
        out_terms.append(labels)
    if arrow:
        head, dots, tail = rhs.partition("...")
        output = list(head) + (ell if dots else []) + list(tail)
    else:
        counts = {c: lhs.count(c) for c in used}
        output = ell + sorted(c for c, n in counts.items() if n == 1)
    if any(c not in sizes for c in output):
        return "an output label no input has"
    return out_terms, output, sizes


@grad("Einsum")
def _einsum(ctx: GradContext, node: Node, dys: Grads) -> Grads:
    dy = dys[0]
    assert dy is not None
    operands = [inp(node, i) for i in range(len(node.inputs))]
    parsed = explicit_terms(node.attr("equation"), [tuple(v.shape) for v in operands])  # type: ignore[arg-type]
    if isinstance(parsed, str):
        unsupported(node, f"equation {node.attr('equation')!r}: {parsed}")
    terms, output, sizes = parsed
    used = set(sizes)
    spare = [c for c in string.ascii_letters if c not in used]
    grads: Grads = []
    for i, (x, term) in enumerate(zip(operands, terms)):
        if not ctx.need(i):
            grads.append(None)
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        present = set(output).union(*others)
        unique = list(dict.fromkeys(term))
        kept = [c for c in unique if c in present]
        eq = ",".join("".join(t) for t in [output, *others]) + "->" + "".join(kept)
        g = ctx.op("Einsum", [dy] + [v for j, v in enumerate(operands) if j != i], equation=eq)
        if len(kept) < len(unique):  # labels summed only here: the gradient is constant along them
            missing = [k for k, c in enumerate(unique) if c not in present]
            g = ctx.op("Unsqueeze", [g, ctx.ints(missing)])
            g = ctx.op("Expand", [g, ctx.ints([sizes[c] for c in unique])])
        if len(unique) < len(term):
            g = _onto_diagonal(ctx, g, unique, term, sizes, spare, x)
        grads.append(g)
    return grads


def _onto_diagonal(ctx: GradContext, g: Value, unique: list[str], term: list[str], sizes: dict[str, int],
                   spare: list[str], x: Value) -> Value:
    """g over `unique` labels placed on the diagonals of `term` (which repeats some labels)."""
    if len(spare) < len(term) - len(unique):
        unsupported(ctx.node, "a repeated label beyond the 52 Einsum labels")
    pool = iter(spare)
    seen: set[str] = set()
    target, eyes, factors = [], [], []
    for c in term:
        if c in seen:
            copy = next(pool)
            target.append(copy)
            factors.append(c + copy)
            eyes.append(ctx.const(np.eye(sizes[c], dtype=x.dtype.numpy)))  # type: ignore[union-attr]
        else:
            seen.add(c)
            target.append(c)
    eq = ",".join(["".join(unique), *factors]) + "->" + "".join(target)
    return ctx.op("Einsum", [g, *eyes], equation=eq)
