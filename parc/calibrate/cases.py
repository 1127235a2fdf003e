"""A model's own products and convolutions as benchmark cases (`parc profile --model`): read from
its ONNX files, the shapes that hold most of each class's FLOPs kept, and split as each rank of a
plan that splits the batch runs them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from parc.calibrate.catalogue import PRODUCTS, SPLIT
from parc.calibrate.graphs import case
from parc.errors import ParcError, UsageError
from parc.ir.dtypes import DType
from parc.ir.importer import from_model, read_model, symbolic_dims
from parc.ops.base import op_class

GEMM_ATTRS = ("transA", "transB")  # a Gemm's attributes that shape its work (alpha and beta do not)
# a convolution's attributes that shape its work (what `model_cases` tells cases apart by)
CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "output_padding", "output_shape", "pads", "strides")
COVER = 0.95  # the share of a class's FLOPs whose shapes `parc profile --model` measures


def _batch_sizes(graph) -> set[int]:
    """The sizes a step's batch takes in its tensors: the products of each leading run of dims of
    the graph's integer inputs (token ids, labels: [B, S] gives B and B x S), or of its first
    input's where it has none."""
    ints = [v for v in graph.inputs if v.shape and v.dtype is not None and v.dtype.numpy.kind in "iu"]
    sizes = set()
    for v in ints or graph.inputs[:1]:
        prod = 1
        for d in v.shape or ():
            prod *= d
            sizes.add(prod)
    return sizes


def _product_split(a: tuple, b: tuple, attrs: dict, batch: set[int]) -> list[list[int]] | None:
    """The dims of a product's operands that hold the batch, [dims of a, dims of b], where the
    batch is: a leading dim of both (attention's [B, heads, S, d]) or of `a` alone (a projection
    of [B, S, h] by a weight), the rows of `a` ([B x S, h] by a weight), or the contracted dim (a
    weight's gradient, [B x S, h] transposed times [B x S, o]); None where no dim is a batch size."""
    if len(a) < 2 or len(b) < 2:
        return None
    if len(a) > 2 and a[0] in batch:
        return [[0], [0] if len(b) == len(a) and b[0] == a[0] else []]
    ta, tb = attrs.get("transA", 0), attrs.get("transB", 0)
    rows, inner = (len(a) - 1, len(a) - 2) if ta else (len(a) - 2, len(a) - 1)
    b_inner = len(b) - 1 if tb else len(b) - 2
    if len(a) == 2 and a[rows] in batch:
        return [[rows], []]
    if a[inner] in batch and b[b_inner] == a[inner]:
        return [[inner], [b_inner]]
    return None


def model_cases(paths: Sequence[str | Path], dims: Mapping[str, int] | None = None) -> dict[str, list[tuple]]:
    """The float32 products (MatMul, Gemm) and convolutions of the ONNX models at `paths` (a
    training step from `parc grad` has its gradients' too), by class (`parc.ops.op_class`): one
    case (first operand's shape, second's, attributes, how many nodes have it) per distinct shape.
    A convolution's speed depends on its shape far more than a matmul's (onnxruntime on a CPU runs
    input gradients and weight gradients far slower than a forward one), and a small model's
    products run faster than the built-in cases' larger ones, so a model's classes are best
    measured on its own shapes. A product's case says where its batch is (`SPLIT`, for
    `rank_cases`). `dims`: values of the models' symbolic dims (`--dim`)."""
    f32 = DType.from_numpy(np.float32)
    found: dict[tuple, list] = {}
    dims = dict(dims or {})
    bound: set[str] = set()
    for path in paths:
        try:
            model = read_model(path)
            names = set(symbolic_dims(model)) & set(dims)  # each model binds the dims it has
            graph = from_model(model, {name: dims[name] for name in names}, base_dir=Path(path).parent,
                               source=str(path))
        except ParcError as e:
            raise UsageError(f"--model: {e}") from None
        bound |= names
        batch = _batch_sizes(graph)
        for n in graph.nodes:
            if n.op_type not in ("Conv", "ConvTranspose", "MatMul", "Gemm") or len(n.inputs) < 2:
                continue
            x, w = n.inputs[0], n.inputs[1]
            if x is None or w is None or x.shape is None or w.shape is None or x.dtype != f32 or w.dtype != f32:
                continue
            if n.op_type in ("MatMul", "Gemm"):
                attrs = {a: n.attr(a) for a in GEMM_ATTRS if n.attr(a)} if n.op_type == "Gemm" else {}
                split = _product_split(tuple(x.shape), tuple(w.shape), attrs, batch)
                if split is not None:
                    attrs[SPLIT] = split
            else:
                attrs = {a: n.attr(a) for a in CONV_ATTRS if a in n.attrs}
            key = (op_class(n), tuple(x.shape), tuple(w.shape), repr(sorted(attrs.items())))
            found.setdefault(key, [key[0], key[1], key[2], attrs, 0])[4] += 1
    if set(dims) - bound:
        raise UsageError(f"--dim {', '.join(sorted(set(dims) - bound))}: no --model file has a symbolic dim of "
                         "that name")
    out: dict[str, list[tuple]] = {}
    for cls, x, w, attrs, count in found.values():
        out.setdefault(cls, []).append((x, w, attrs, count))
    return out


def measurable_cases(cases: Mapping[str, list[tuple]], counts: Sequence[int]) -> tuple[dict[str, list[tuple]], str]:
    """(the cases of `cases` (`model_cases`) that hold `COVER` of each class's FLOPs, the largest
    first: the rest are small shapes that cost a benchmark each and little of a step; what was
    kept, for the file's header). Every kept case is built at every rank count's share
    (`rank_cases`) first, so that one onnxruntime cannot take is a one-line error before minutes
    of measuring, not a failure halfway."""
    def flops(cls: str, x: tuple, w: tuple, attrs: dict, k: int) -> float:
        try:
            return case(cls, x, w, attrs)[1]
        except Exception as e:  # onnx's inference refuses it
            shown = {a: v for a, v in attrs.items() if a != SPLIT}
            raise UsageError(f"--model: cannot measure the {cls} of operands {list(x)} and {list(w)} "
                             f"({shown}) on {k} rank(s): {str(e).strip().splitlines()[0]}") from None

    kept: dict[str, list[tuple]] = {}
    said = []
    for cls, items in cases.items():
        work = [count * flops(cls, x, w, attrs, 1) for x, w, attrs, count in items]
        order = sorted(range(len(items)), key=lambda i: -work[i])
        total, running = sum(work), 0.0
        for i in order:
            if running >= COVER * total and kept.get(cls):
                break
            kept.setdefault(cls, []).append(items[i])
            running += work[i]
        said.append(f"{cls}: {sum(c for *_, c in items)} nodes, {len(items)} shapes, the {len(kept[cls])} largest "
                    f"measured ({running / max(total, 1e-30):.0%} of its FLOPs)")
    for k in counts:
        for cls, items in rank_cases(kept, k).items():
            for x, w, attrs, _ in items:
                flops(cls, x, w, attrs, k)
    return kept, "; ".join(said)


def write_cases(path: Path, cases: Mapping[str, list[tuple]]) -> None:
    """`cases` for the ranks of a profiling job (`read_cases`): the parent reads the models once."""
    path.write_text(json.dumps({cls: [[list(x), list(w), attrs, count] for x, w, attrs, count in items]
                                for cls, items in cases.items()}))


def read_cases(path: str | Path | None) -> dict[str, list[tuple]]:
    """The cases `write_cases` wrote at `path` (None: no model's cases)."""
    if path is None:
        return {}
    return {cls: [(tuple(x), tuple(w), attrs, count) for x, w, attrs, count in items]
            for cls, items in json.loads(Path(path).read_text()).items()}


def rank_cases(cases: Mapping[str, list[tuple]], k: int) -> dict[str, list[tuple]]:
    """`cases` (`model_cases`) as each of `k` ranks runs them when the plan splits the batch: a
    product's batch dims (`SPLIT`; one without runs whole), a forward or input-gradient
    convolution's input rows (dim 0), a weight gradient's contracted batch (dim 1 of both operands:
    N, and g x N for the input of a grouped one, whose g groups each contract the batch). The class
    is `op_class`'s (a kernel larger than its output): a forward convolution whose kernel covers
    more than its output (a 4x4 kernel on a 4x4 input) is split as a weight gradient, and a weight
    gradient of a 1x1 output as a forward one; both are rare, and only this calibration's split is
    off for them."""
    def part(n: int) -> int:
        return max(1, -(-n // k))

    def divided(shape: tuple, at: list[int]) -> tuple:
        return tuple(part(d) if i in at else d for i, d in enumerate(shape))

    out: dict[str, list[tuple]] = {}
    for cls, items in cases.items():
        for x, w, attrs, count in items:
            group = attrs.get("group", 1)
            if cls in PRODUCTS:
                at_x, at_w = attrs.get(SPLIT) or ([], [])
                x, w = divided(x, at_x), divided(w, at_w)
            elif cls == "ConvWeightGrad" and len(x) > 2 and x[1] == group * w[1]:
                x, w = (x[0], group * part(w[1]), *x[2:]), (w[0], part(w[1]), *w[2:])
            elif cls != "ConvWeightGrad":
                x = (part(x[0]), *x[1:])
            out.setdefault(cls, []).append((x, w, attrs, count))
    return out
