"""Op rules: how each op's dims relate (its sharding rule), and what it costs.

A sharding rule names every tensor dim by *factor labels* (outer to inner), einsum style:
MatMul is ``b m k, b k n -> b m n`` with ``k`` reduced by sum. A dim written as a group
``(h d)`` is the merge of two loop dims (Reshape, Tile); splitting the inner label ``d`` splits
that tensor dim strided, which is where Rhino's strided sharding specs (section 4.1) come from.

Splitting label ``L`` over ``n`` devices: every tensor dim whose factors contain ``L`` is viewed
as its factors and cut into ``n`` contiguous pieces along ``L``; tensors without ``L`` are
replicated. If ``L`` is in an output, that output is split the same way; if ``L`` appears only
in inputs, the outputs are partial and combine with ``reduce[L]`` (sum, max, min, prod, mean).
Labels in ``unsplittable`` (softmax axis, normalised dims, sliced or gathered axes) and
labels of size 1 cannot be split. A tensor given as ``None`` is replicated whole (shape
arguments, scalars). ``shape_args`` maps an input that carries an output's shape (Reshape's
``shape``, Expand's ``shape``, ConstantOfShape's input) to that output: a shard gets the local
shape there. ``size_args`` maps an input that lists every output's extent along one axis
(Split's ``split``) to that axis: a shard gets the local extents.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parc.errors import ShapeError
from parc.ir.graph import Node

MIN_OPSET = 13  # parc.ir.importer.MIN_OPSET: every imported model is upgraded to at least this

Dim = tuple[str, ...]
TensorDims = tuple[Dim, ...]
REDUCE_KINDS = ("sum", "max", "min", "prod", "mean")


@dataclass(frozen=True)
class ShardingRule:
    """Per-tensor dim labels of one node, with label sizes and how reduced labels combine."""

    inputs: tuple[TensorDims | None, ...]
    outputs: tuple[TensorDims | None, ...]
    sizes: tuple[tuple[str, int], ...]
    reduce: tuple[tuple[str, str], ...] = ()
    unsplittable: frozenset[str] = frozenset()
    shape_args: tuple[tuple[int, int], ...] = ()
    size_args: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(sorted(dict(self.sizes).items())))
        object.__setattr__(self, "reduce", tuple(sorted(dict(self.reduce).items())))
        object.__setattr__(self, "unsplittable", frozenset(self.unsplittable))
        sizes = dict(self.sizes)
        for kind in dict(self.reduce).values():
            if kind not in REDUCE_KINDS:
                raise ValueError(f"reduce kind {kind!r} not in {REDUCE_KINDS}")
        for t in (*self.inputs, *self.outputs):
            for dim in t or ():
                if len(set(dim)) != len(dim):
                    raise ValueError(f"label repeated in dim {dim}")
                for label in dim:
                    if label not in sizes:
                        raise ValueError(f"label {label!r} has no size")

    def size(self, label: str) -> int:
        return dict(self.sizes)[label]

    @property
    def output_labels(self) -> set[str]:
        return {label for t in self.outputs if t for dim in t for label in dim}

    @property
    def input_labels(self) -> set[str]:
        return {label for t in self.inputs if t for dim in t for label in dim}

    def reduction(self, label: str) -> str | None:
        """How outputs combine when `label` is split: None if they are split, else the kind."""
        if label in self.output_labels:
            return None
        return dict(self.reduce)[label]

    def splittable(self) -> list[str]:
        """Labels that may be split: size > 1, not unsplittable, and in an output or reduced."""
        reduce = dict(self.reduce)
        out = self.output_labels
        return [label for label, size in self.sizes
                if size > 1 and label not in self.unsplittable
                and (label in out or label in reduce)]

    def dim_of(self, tensor: TensorDims | None, label: str) -> int | None:
        """The tensor dim that contains `label`, if any."""
        for d, dim in enumerate(tensor or ()):
            if label in dim:
                return d
        return None

    def check(self, node: Node) -> None:
        """Raise ShapeError unless each dim's factor sizes multiply to the node's shapes."""
        sizes = dict(self.sizes)
        for kind, dims_list, values in (("input", self.inputs, node.inputs),
                                        ("output", self.outputs, node.outputs)):
            for i, dims in enumerate(dims_list):
                if dims is None:
                    continue
                v = values[i] if i < len(values) else None
                if kind == "output" and v is not None and not v.name:
                    continue  # an omitted optional output
                if v is None or v.shape is None:
                    raise ShapeError(f"node '{node.label}': rule labels missing {kind} {i}")
                if len(dims) != len(v.shape):
                    raise ShapeError(f"node '{node.label}' ({node.op_type}): rule gives {kind} {i} "
                                     f"rank {len(dims)}, shape is {v.shape}")
                for d, dim in enumerate(dims):
                    want = int(np.prod([sizes[lbl] for lbl in dim], dtype=np.int64))
                    if want != v.shape[d]:
                        raise ShapeError(f"node '{node.label}' ({node.op_type}): {kind} {i} dim {d} "
                                         f"is {v.shape[d]}, rule labels {dim} give {want}")

    def __str__(self) -> str:
        def fmt(t: TensorDims | None) -> str:
            if t is None:
                return "-"
            return " ".join(d[0] if len(d) == 1 else ("1" if not d else f"({' '.join(d)})") for d in t)
        text = ", ".join(map(fmt, self.inputs)) + " -> " + ", ".join(map(fmt, self.outputs))
        extras = [f"{k}:{v}" for k, v in self.reduce]
        if self.unsplittable:
            extras.append("fixed:" + ",".join(sorted(self.unsplittable)))
        return text + (f" [{' '.join(extras)}]" if extras else "")


class RuleBuilder:
    """Builds a ShardingRule from einsum-like strings checked against a node's shapes.

    ``einsum("b m k, b k n -> b m n", reduce={"k": "sum"})``. Per tensor, space-separated dims:
    a label, a group ``(a b)``, ``1`` (a dim left whole, e.g. a size-1 broadcast dim), or the
    whole tensor ``-`` (replicated). Label sizes come from the node's shapes; a group with one
    unknown label gets the quotient. ``opset`` is the default-domain opset of the node's graph;
    when not given it is parc's minimum (13), which the importer upgrades every model to.
    """

    _TOKEN = re.compile(r"\([^)]*\)|\S+")

    def __init__(self, node: Node, opset: int | None = None) -> None:
        self.node = node
        self.opset = opset if opset is not None else MIN_OPSET
        self._fresh = 0

    def fixed(self) -> str:
        """A fresh label to mark an unsplittable dim."""
        self._fresh += 1
        return f"_{self._fresh}"

    def einsum(self, spec: str, reduce: dict[str, str] | None = None,
               unsplittable: Sequence[str] = (), shape_args: dict[int, int] | None = None,
               sizes: dict[str, int] | None = None,
               size_args: dict[int, int] | None = None) -> ShardingRule:
        lhs, _, rhs = spec.partition("->")
        ins = [self._parse(t) for t in lhs.split(",")] if lhs.strip() else []
        outs = [self._parse(t) for t in rhs.split(",")]
        ins += [None] * (len(self.node.inputs) - len(ins))
        outs = [None if i < len(self.node.outputs) and not self.node.outputs[i].name else dims
                for i, dims in enumerate(outs)]  # omitted optional outputs carry no labels
        known = dict(sizes or {})
        pending: list[tuple[Dim, int]] = []
        for dims_list, values in ((ins, self.node.inputs), (outs, self.node.outputs)):
            for dims, v in zip(dims_list, values):
                if dims is None or v is None:
                    continue
                if v.shape is None or len(v.shape) != len(dims):
                    raise ShapeError(f"node '{self.node.label}' ({self.node.op_type}): rule "
                                     f"'{spec}' expects rank {len(dims)}, got shape {v.shape}")
                pending.extend(zip(dims, v.shape))
        for _ in range(3):  # resolve groups whose other labels got sizes elsewhere
            for dim, extent in pending:
                unknown = [lbl for lbl in dim if lbl not in known]
                if len(unknown) == 1:
                    rest = int(np.prod([known[lbl] for lbl in dim if lbl in known], dtype=np.int64))
                    if rest == 0 or extent % rest:
                        raise ShapeError(f"node '{self.node.label}': dim of size {extent} cannot "
                                         f"hold labels {dim}")
                    known[unknown[0]] = extent // rest
        fixed = set(unsplittable)
        for dim, _ in pending:
            for lbl in dim:
                if lbl not in known:  # an unresolvable group: keep it whole
                    known[lbl] = 1
                if lbl.startswith("_"):
                    fixed.add(lbl)
        rule = ShardingRule(tuple(ins), tuple(outs), tuple(known.items()),
                            tuple((reduce or {}).items()), frozenset(fixed),
                            tuple((shape_args or {}).items()), tuple((size_args or {}).items()))
        rule.check(self.node)
        return rule

    def _parse(self, text: str) -> TensorDims | None:
        text = text.strip()
        if text == "-":
            return None
        dims: list[Dim] = []
        for tok in self._TOKEN.findall(text):
            if tok == "1":
                dims.append(())
            elif tok.startswith("("):
                dims.append(tuple(tok[1:-1].split()))
            elif tok == "_":
                dims.append((self.fixed(),))
            else:
                dims.append((tok,))
        return tuple(dims)


ShardingFn = Callable[[Node, RuleBuilder], "ShardingRule | None"]
CostFn = Callable[[Node], int]


def output_elements(node: Node) -> int:
    """Default FLOPs: one per output element (elementwise ops, data movement counts zero)."""
    return int(sum(v.size for v in node.outputs if v.shape is not None))


def zero_flops(node: Node) -> int:
    return 0


@dataclass(frozen=True)
class OpRule:
    """Everything parc states about one op type (shapes and dtypes come from ONNX's schemas)."""

    op_type: str
    sharding: ShardingFn
    flops: CostFn = output_elements
    notes: str = ""
    aliases: tuple[str, ...] = field(default=())
    # the output is a view of the input (a new shape over the same contiguous buffer): both
    # engines alias it (onnxruntime's kernel shares the buffer, the array engine reshapes a view),
    # so it moves no bytes
    view: bool = False

    def bytes_accessed(self, node: Node) -> tuple[int, int]:
        """(bytes read, bytes written) by one execution of the node."""
        if self.view:
            return 0, 0
        read = sum(v.nbytes for v in node.inputs if v is not None and v.shape is not None)
        written = sum(v.nbytes for v in node.outputs if v.shape is not None)
        return read, written

    def rule_for(self, node: Node, opset: int | None = None) -> ShardingRule | None:
        return self.sharding(node, RuleBuilder(node, opset))


RULES: dict[str, OpRule] = {}


def register(*op_types: str, flops: CostFn = output_elements, notes: str = "",
             view: bool = False) -> Callable[[ShardingFn], ShardingFn]:
    """Decorator: register a sharding function (and FLOP count) for ONNX op types; `view`: the
    output is a view of the input (no bytes move)."""

    def wrap(fn: ShardingFn) -> ShardingFn:
        for op in op_types:
            if op in RULES:
                raise ValueError(f"op {op} registered twice")
            RULES[op] = OpRule(op, fn, flops, notes, view=view)
        return fn

    return wrap


def get_rule(node: Node) -> OpRule | None:
    """The rule for a node's op, or None (the op is then planned replicate-only)."""
    if node.domain not in ("", "ai.onnx"):
        return None
    return RULES.get(node.op_type)


def node_work(node: Node) -> tuple[float, float, Any]:
    """(FLOPs, bytes read and written, the element type it computes in) of one node: what the
    roofline prices. An op without a rule counts one FLOP per output element and no traffic."""
    rule = get_rule(node)
    flops = rule.flops(node) if rule is not None else output_elements(node)
    read, written = rule.bytes_accessed(node) if rule is not None else (0, 0)
    dtype = next((v.dtype for v in node.outputs if v.dtype is not None), None) or "float32"
    return flops, read + written, dtype


MASK_OPS = ("Add", "Where", "Expand", "And", "Or", "Not", "Cast", "Unsqueeze", "Reshape", "Mul", "Sub")
MASK_DEPTH = 5  # producers walked back from a Softmax's input to find the mask it was filled by
UNDERFLOW = -87.0  # float32's exp is 0 or denormal below about this
DATA_DEPTH = 10  # producers walked back from a mask to the data input it was made from


def masked_softmax(node: Node) -> bool:
    """Whether a Softmax's input was filled by a mask that hides some scores: within
    `MASK_DEPTH` producers of `MASK_OPS` back from its input there is a constant that masks part
    of a tensor, a boolean one with both values (a causal triangle: parc's models' Where, a Llama
    export's And) or a float one with entries below `UNDERFLOW` and entries above (a GPT-2
    export's additive mask, folded). A mask made from data alone (a BERT export's padding mask,
    all ones in a batch without padding) is not one: what it hides is not known."""
    if node.op_type != "Softmax" or not node.inputs or node.inputs[0] is None:
        return False
    return _mask_reaches(node.inputs[0], lambda v: v.const is not None and v.size > 1 and _masks_part(v.const.numpy()))


def masked_classes(graph) -> dict[str, str]:
    """The class of each Softmax of `graph` over masked scores (`SoftmaxMasked` or
    `SoftmaxPadded`), by node name: what a module of the graph, without its constants and data
    inputs, is priced by (`parc.passes.timing.module_seconds`)."""
    out = {}
    for n in graph.nodes:
        if n.op_type == "Softmax" and (cls := op_class(n)) in ("SoftmaxMasked", "SoftmaxPadded"):
            out[n.name] = cls
    return out


def padded_softmax(node: Node) -> bool:
    """Whether a Softmax's scores were filled by a mask made from data (`_made_from_data`: a
    BERT export's padding mask, looked up or cast from its `attention_mask` input); `op_class`
    asks `masked_softmax` first, a constant mask's class winning. What such a mask hides depends
    on the batch; the class (`SoftmaxPadded`) is calibrated over padding as
    `parc.exec.data.padding` draws it, the synthetic data `parc run` feeds: ones and then zeros
    at the end of each row."""
    if node.op_type != "Softmax" or not node.inputs or node.inputs[0] is None:
        return False
    return _mask_reaches(node.inputs[0], _made_from_data)


def _made_from_data(value, depth: int = DATA_DEPTH) -> bool:
    """Whether `value` is an integer or boolean data input, or is computed from such inputs by ops
    whose other operands are constants (a mask, not a shape: `Shape` and `Size` end the walk)."""
    if value is None or value.const is not None:
        return False
    p = value.producer
    if p is None:
        return not value.is_param and value.dtype is not None and not value.dtype.is_float
    if depth == 0 or p.op_type in ("Shape", "Size"):
        return False
    live = [i for i in p.inputs if i is not None and i.const is None]
    return bool(live) and all(_made_from_data(i, depth - 1) for i in live)


def _mask_reaches(value, found: Callable) -> bool:
    """Whether within `MASK_DEPTH` producers of `MASK_OPS` back from `value` (a mask, and what
    became of it) there is a value that `found` takes."""
    seen: set[int] = set()

    def walk(v, depth: int) -> bool:
        if v is None or id(v) in seen:
            return False
        seen.add(id(v))
        if found(v):
            return True
        p = v.producer
        return depth > 0 and p is not None and p.op_type in MASK_OPS and any(walk(i, depth - 1) for i in p.inputs)

    return walk(value, MASK_DEPTH)


def _masks_part(a) -> bool:
    if a.dtype == bool:
        return bool(a.any()) and not bool(a.all())
    if a.dtype.kind == "f":
        low = a < UNDERFLOW
        return bool(low.any()) and not bool(low.all())
    return False


def op_class(node: Node) -> str:
    """The class a device's calibration prices the node by (`DeviceSpec.op_efficiency` and
    `memory_op_efficiency`): its op type, except a convolution whose kernel is larger than its
    output (a weight's gradient: the batch is the contracted axis), which runs far below a
    forward one on CPUs, a MatMul whose second operand has batch dims (`BatchMatMul`: many
    small products, as attention's; a weight's [k, n] makes one 2-D product of the rows), and a
    Transpose that moves the last axis (`TransposeLastAxis`: attention's K^T and the gradients'
    transposes, which copy element by element; onnxruntime's CPU kernel runs [32, 4, 16, 16] with
    perm [0, 1, 3, 2] at a tenth of the rate of one that keeps the last axis, moving whole rows),
    and a Softmax of attention's scores after a mask's fill (`SoftmaxMasked`, `masked_softmax`:
    exp underflows there, and onnxruntime's CPU kernel takes a slow path,
    `parc.calibrate.catalogue.MASKED`; a device without the class prices it as a Softmax), or after the
    fill of a mask made from data (`SoftmaxPadded`, `padded_softmax`: a padding mask)."""
    if masked_softmax(node):
        return "SoftmaxMasked"
    if padded_softmax(node):
        return "SoftmaxPadded"
    if node.op_type == "Conv" and len(node.inputs) > 1 and node.inputs[1] is not None:
        w, y = node.inputs[1].shape, node.outputs[0].shape if node.outputs else None
        if w is not None and y is not None and len(w) > 2 and math.prod(w[2:]) > math.prod(y[2:]):
            return "ConvWeightGrad"
    if node.op_type == "MatMul" and len(node.inputs) > 1 and node.inputs[1] is not None:
        b = node.inputs[1].shape
        if b is not None and len(b) > 2 and math.prod(b[:-2]) > 1:
            return "BatchMatMul"
    if node.op_type == "Transpose" and node.inputs and node.inputs[0] is not None and node.inputs[0].shape:
        rank = len(node.inputs[0].shape)
        perm = node.attr("perm")
        last = list(perm)[-1] if perm else 0  # no perm: the dims reversed
        if rank > 1 and last % rank != rank - 1:
            return "TransposeLastAxis"
    return node.op_type


CACHE_LINE = 64  # bytes: a piece shorter than this costs a whole piece to walk (`node_pieces`)
# ops that walk their input row by row: a LayerNormalization's rows are the dims from its axis on;
# a Softmax's or LogSoftmax's (opset 13 on) run along its axis alone, and onnxruntime moves another
# axis last before it walks them; a SoftmaxCrossEntropyLoss's along its class axis (1), the
# LogSoftmax onnxruntime runs it as
ROW_OPS = ("Softmax", "LogSoftmax", "LayerNormalization", "SoftmaxCrossEntropyLoss")
CONV_OPS = ("Conv", "ConvTranspose")  # their pieces are the elements of their lowering (`_conv_pieces`)
# elementwise ops that broadcast their inputs against each other (span by span: `node_pieces`; a
# Where's pieces are its condition's runs instead, `_where_runs`)
BROADCAST_OPS = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Greater",
                 "Less", "GreaterOrEqual", "LessOrEqual", "And", "Or", "Xor", "Mod", "PRelu", "BitShift")


def node_pieces(node: Node) -> float:
    """How many short contiguous pieces the node walks, each weighted min(1, CACHE_LINE / its
    bytes): a Transpose's runs (the trailing input dims it keeps last, in order; where it moves
    the last axis, the input's rows), the rows a Softmax, LogSoftmax, SoftmaxCrossEntropyLoss or
    LayerNormalization normalises (`ROW_OPS`), and the spans of a broadcast (`_broadcast_span`: x[8, 16, 32] - mean[8, 16, 1]
    walks 128 spans of 32); a convolution's are instead the elements of the matrices its lowering
    builds (`_conv_pieces`), a Where's the runs of its condition (`_where_runs`). 0 for every
    other op, for a broadcast of a scalar, or where a shape is unknown. A CPU engine pays a fixed cost per piece (`DeviceSpec.piece_cost`): onnxruntime
    copies a Transpose's runs of up to 16 float32 (a cache line) in about the same time each
    whatever their length, far under its rate on long runs, and runs of 32 and 64 at about a
    half and a quarter of that, which the weight gives; a GPT-2 export's attention transposes
    (runs of 8) and its softmax gradient's broadcast subtraction (spans of 16) take far longer
    than their bytes at that rate (docs/simulate.md; benchmarks/LOG.md, 2026-11-27, fourth
    session). The roofline's rates are measured on long pieces."""
    if not node.inputs or node.inputs[0] is None:
        return 0.0
    if node.op_type in CONV_OPS:
        return _conv_pieces(node)
    if node.op_type == "Where":
        return _where_runs(node)
    if node.op_type in BROADCAST_OPS:
        y = node.outputs[0] if node.outputs else None
        if y is None or not _known(y):
            return 0.0
        span = _broadcast_span([v.shape for v in node.inputs if v is not None], y.shape)
        if span is None:
            return 0.0
        size, item = math.prod(y.shape), y.dtype.itemsize
    elif node.op_type in ("Transpose", *ROW_OPS):
        x = node.inputs[0]
        if not _known(x):
            return 0.0
        rank, size, item = len(x.shape), math.prod(x.shape), x.dtype.itemsize
        if node.op_type == "Transpose":
            perm = [int(p) for p in (node.attr("perm") or range(rank - 1, -1, -1))]
            if sorted(perm) != list(range(rank)):
                return 0.0
            dims = [d for d in range(rank) if x.shape[d] > 1]  # size-1 dims move nothing
            order = [dims.index(p) for p in perm if x.shape[p] > 1]  # the perm over those
            shape = [x.shape[d] for d in dims]
            kept = 0
            while kept < len(order) and order[len(order) - 1 - kept] == len(order) - 1 - kept:
                kept += 1
            if kept == len(order):
                return 0.0  # nothing moves
            span = math.prod(shape[len(shape) - kept:]) if kept else shape[-1]
        else:  # parc's graphs are at opset 13 or later (the importer upgrades): axis -1 by default
            axis = 1 if node.op_type == "SoftmaxCrossEntropyLoss" else node.attr("axis", -1)
            axis = axis + rank if axis < 0 else axis
            if not 0 <= axis < rank:
                return 0.0
            span = math.prod(x.shape[axis:]) if node.op_type == "LayerNormalization" else x.shape[axis]
    else:
        return 0.0
    return size / span * min(1.0, CACHE_LINE / (span * item))


def _conv_pieces(node: Node) -> float:
    """The elements of the matrices onnxruntime's CPU convolution builds around its products, per
    image and group. A Conv expands its input into columns (im2col: C/g x kernel rows by the
    output's positions), copying each row of the output's last dim as one run, and a run costs at
    least a cache line's worth of elements (`CACHE_LINE`): its pieces are the elements plus
    CACHE_LINE / itemsize per run. A pointwise Conv (a 1x1 kernel, unit strides, no padding) is
    multiplied as it is: none. A ConvTranspose writes its product's columns (M/g x kernel rows by
    the input's positions) and folds them into the output (col2im). Their cost per element is the
    class's piece cost (`DeviceSpec.piece_cost`), fitted with its rate
    (`parc.calibrate.fit.fit_conv_pieces`). A GEMM with few rows is bound by its expanded
    operand: unet-tiny's weight gradients (kernels of 32 x 32 over outputs of 3 x 3: runs of 3)
    take about the same time whatever their output channels; over the convolutions of its plans,
    elements + 16 per run fitted with one rate and one cost leave a far smaller error than the
    elements and the weights read again per image (benchmarks/LOG.md, 2026-11-28, eighth
    session). 0 where a shape is unknown."""
    if len(node.inputs) < 2 or node.inputs[1] is None or not node.outputs or node.outputs[0] is None:
        return 0.0
    x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
    if not (_known(x) and _known(w) and _known(y)) or len(x.shape) < 3 or len(w.shape) != len(x.shape):
        return 0.0
    batch, channels, kernel = x.shape[0], x.shape[1], math.prod(w.shape[2:])
    if node.op_type == "ConvTranspose":
        return float(batch * w.shape[1] * node.attr("group", 1) * kernel * math.prod(x.shape[2:]))
    if kernel == 1 and all(int(s) == 1 for s in node.attr("strides") or ()) \
            and not any(int(p) for p in node.attr("pads") or ()):  # an auto_pad pads a 1x1 kernel by 0
        return 0.0
    rows = batch * channels * kernel  # the expanded input's rows, over every image and group
    runs = rows * math.prod(y.shape[2:-1])
    return float(rows * math.prod(y.shape[2:]) + runs * CACHE_LINE / x.dtype.itemsize)


RUNS_EXACT = 1 << 22  # a broadcast condition of up to this many output elements has its runs counted exactly
# (constant, output shape) -> runs: the planner asks for a node's pieces once per strategy, and
# counting a large mask's runs walks all of its elements
_RUNS: dict[tuple[int, tuple], tuple[object, float]] = {}
RUNS_KEPT = 256


def _where_runs(node: Node) -> float:
    """The runs of equal condition a Where walks in its output's order: onnxruntime's CPU kernel
    picks each element's source by a branch, which the processor mispredicts where the condition
    changes (a Where over a random mask takes many times as long an element as one over a causal
    triangle broadcast across the batch: docs/simulate.md). A constant condition's runs are counted
    (a condition broadcast over leading dims: its own runs times the copies); one within
    `MASK_DEPTH` producers of `MASK_OPS` from a constant (a mask sliced or cast from a buffer) as
    a causal triangle's, two a row of the last dim; a condition made from data (a ReLU's gradient)
    as a random one, half the elements. 0 where a shape is unknown."""
    if len(node.inputs) < 3 or not node.outputs or node.outputs[0] is None or not _known(node.outputs[0]):
        return 0.0
    shape = node.outputs[0].shape
    size, cond = math.prod(shape), node.inputs[0]
    if cond is None:
        return 0.0
    if cond.const is not None and cond.shape is not None and len(cond.shape) <= len(shape):
        key = (id(cond.const), tuple(shape))
        if key not in _RUNS:
            if len(_RUNS) >= RUNS_KEPT:
                _RUNS.clear()
            a = np.asarray(cond.const.numpy()) != 0
            a = a.reshape((1,) * (len(shape) - a.ndim) + a.shape)
            lead = 0
            while lead < len(shape) and a.shape[lead] == 1 and shape[lead] > 1:
                lead += 1
            if a.shape[lead:] == tuple(shape[lead:]) or size > RUNS_EXACT:  # copies of the whole (or as if)
                runs = float(_runs(a.ravel()) * (size // max(a.size, 1)))
            else:
                runs = float(_runs(np.broadcast_to(a, shape).ravel()))
            _RUNS[key] = (cond.const, runs)  # the constant kept alive while its id is a key
        return _RUNS[key][1]
    if _mask_reaches(cond, lambda v: v.const is not None):
        return 2.0 * size / shape[-1]
    return size / 2.0


def _runs(flat: np.ndarray) -> int:
    return 1 + int(np.count_nonzero(flat[1:] != flat[:-1])) if flat.size else 0


def _known(v) -> bool:
    return v.dtype is not None and bool(v.shape) and all(isinstance(d, int) and d > 0 for d in v.shape)


def _broadcast_span(shapes: list, out: tuple) -> int | None:
    """Elements of the innermost run of `out`'s dims over which every input that is not a scalar
    is either whole or broadcast throughout: onnxruntime's CPU kernels walk a broadcast span by
    span. None where no input broadcasts (one span: the whole output) or a shape is unknown."""
    if any(s is None or any(not isinstance(d, int) for d in s) for s in shapes):
        return None
    rank = len(out)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes if math.prod(s) > 1]  # scalars stream
    if not padded or all(s == tuple(out) for s in padded):
        return None
    pattern, span = None, 1
    for j in range(rank - 1, -1, -1):
        if out[j] == 1:
            continue
        here = tuple(s[j] == out[j] for s in padded)
        if pattern is None:
            pattern = here
        elif here != pattern:
            break
        span *= out[j]
    return span if span < math.prod(out) else None


def sharding_rule(node: Node, opset: int | None = None) -> ShardingRule | None:
    """The node's sharding rule, or None if it has none or its shapes are unknown.

    `opset` (the graph's default-domain opset) matters only for ops whose meaning changed
    (Softmax before 13); it defaults to parc's minimum, 13.
    """
    rule = get_rule(node)
    if rule is None or any(v.shape is None for v in node.outputs if v.name):
        return None
    if any(v is not None and v.shape is None for v in node.inputs):
        return None
    return rule.rule_for(node, opset)


def const_ints(node: Node, i: int) -> list[int] | None:
    """Input i as a list of ints if it is a known constant; None if absent or not constant."""
    v = node.input(i)
    if v is None or v.const is None:
        return None
    return [int(x) for x in np.asarray(v.const.numpy()).reshape(-1)]


def const_array(node: Node, i: int) -> np.ndarray | None:
    """Input i as a NumPy array if it is a known constant; None if absent or not constant."""
    v = node.input(i)
    if v is None or v.const is None:
        return None
    return np.asarray(v.const.numpy())


def axes_of(node: Node, input_index: int = 1, attr: str = "axes") -> list[int] | None:
    """Axes from the attribute (older opsets) or the constant input (newer), normalised."""
    axes = node.attr(attr)
    if axes is None:
        axes = const_ints(node, input_index)
    if axes is None:
        return None
    rank = node.inputs[0].rank
    return sorted({a % rank for a in axes}) if rank else []


def labels(n: int, prefix: str = "d") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def axis_attr(node: Node, rank: int, default: int = 0, name: str = "axis") -> int | None:
    """The node's axis attribute normalised to [0, rank), or None if out of range."""
    axis = node.attr(name, default)
    return axis % rank if -rank <= axis < rank else None


def same_dims_except(node: Node, b: RuleBuilder, fixed: set[int]) -> ShardingRule:
    """Input 0 and output 0 share a loop label per dim, except `fixed` dims (whole in both);
    other inputs are replicated."""
    x = node.inputs[0]
    assert x is not None
    names = labels(x.rank)
    xs = " ".join("_" if d in fixed else names[d] for d in range(x.rank))
    ys = " ".join("_" if d in fixed else names[d] for d in range(x.rank))
    return b.einsum(f"{xs} -> {ys}")
