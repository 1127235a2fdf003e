"""Property check of a sharding rule: run the node whole and split, and compare.

`check_rule` runs one node in ONNX Runtime on given inputs, then for each splittable label
and each shard count `n` that divides it runs the `n` shards on their pieces of the inputs
(cut as base.py's module docstring says), recombines the shard outputs (concatenate split
outputs, reduce partial ones, compare replicated ones) and compares with the whole run. It
returns failure messages; an empty list means the rule held on these inputs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.errors import ParcError, first_line
from parc.ir.graph import Node
from parc.ops.base import ShardingRule, TensorDims, sharding_rule


class ReferenceRunError(ParcError):
    """The unsharded node does not run in ONNX Runtime on the given inputs (nothing to check)."""


# -- splitting and merging arrays ---------------------------------------------------------------

def _factor_view(shape: Sequence[int], dims: TensorDims, rule: ShardingRule, label: str,
                 local: bool = False, n: int = 1) -> tuple[list[int], list[int]]:
    """The array's shape with every dim holding `label` expanded into its factors.

    Returns (view shape, axes of `label` in that view). With `local`, the label's extent is
    divided by `n` (the shape of one shard's view).
    """
    if len(dims) != len(shape):
        raise ValueError(f"rule gives rank {len(dims)}, array has shape {tuple(shape)}")
    view: list[int] = []
    axes: list[int] = []
    for extent, dim in zip(shape, dims):
        if label not in dim:
            view.append(extent)
            continue
        sizes = [rule.size(lbl) for lbl in dim]
        full = int(np.prod(sizes, dtype=np.int64))
        want = full // n if local else full
        if extent != want:
            raise ValueError(f"dim of size {extent} does not match labels {dim} "
                             f"({'local ' if local else ''}size {want})")
        for lbl, size in zip(dim, sizes):
            if lbl == label:
                axes.append(len(view))
                view.append(size // n if local else size)
            else:
                view.append(size)
    return view, axes


def local_shape(shape: Sequence[int], dims: TensorDims | None, label: str, n: int) -> tuple[int, ...]:
    """The shape of one shard of a tensor when `label` is split `n` ways."""
    if dims is None:
        return tuple(shape)
    return tuple(extent // n if label in dim else extent for extent, dim in zip(shape, dims))


def split_array(a: np.ndarray, dims: TensorDims | None, rule: ShardingRule, label: str,
                n: int, k: int) -> np.ndarray:
    """Shard `k` of `n` of `a` when `label` is split: contiguous along the label's factor.

    A label that is an inner factor of a group dim gives a strided piece of that tensor dim.
    A tensor without the label (or `dims` None) is returned whole.
    """
    a = np.asarray(a)
    if dims is None or not any(label in dim for dim in dims):
        return a
    size = rule.size(label)
    if size % n:
        raise ValueError(f"label {label} of size {size} does not split {n} ways")
    view, axes = _factor_view(a.shape, dims, rule, label)
    piece = size // n
    index = [slice(None)] * len(view)
    for ax in axes:
        index[ax] = slice(k * piece, (k + 1) * piece)
    out = a.reshape(view)[tuple(index)]
    return np.ascontiguousarray(out).reshape(local_shape(a.shape, dims, label, n))


def merge_arrays(parts: Sequence[np.ndarray], dims: TensorDims | None, rule: ShardingRule,
                 label: str, n: int) -> np.ndarray:
    """Inverse of `split_array`: put the `n` shards back together along the label's factor."""
    if len(parts) != n:
        raise ValueError(f"expected {n} parts, got {len(parts)}")
    if dims is None or not any(label in dim for dim in dims):
        return np.asarray(parts[0])
    holders = [d for d, dim in enumerate(dims) if label in dim]
    if len(holders) > 1:
        raise ValueError(f"label {label} is in dims {holders} of one tensor; shards do not merge "
                         f"by concatenation")
    full_shape = tuple(extent * n if label in dim else extent
                       for extent, dim in zip(np.shape(parts[0]), dims))
    views = []
    for p in parts:
        view, axes = _factor_view(np.shape(p), dims, rule, label, local=True, n=n)
        views.append(np.asarray(p).reshape(view))
    return np.concatenate(views, axis=axes[0]).reshape(full_shape)


def combine_partial(parts: Sequence[np.ndarray], kind: str) -> np.ndarray:
    """Reduce shard outputs that are partial in `kind` (sum, max, min, prod, mean)."""
    stack = np.stack([np.asarray(p) for p in parts])
    if kind == "sum":
        return stack.sum(axis=0, dtype=stack.dtype)
    if kind == "max":
        return stack.max(axis=0)
    if kind == "min":
        return stack.min(axis=0)
    if kind == "prod":
        return stack.prod(axis=0, dtype=stack.dtype)
    if kind == "mean":
        return (stack.sum(axis=0, dtype=np.float64) / len(parts)).astype(stack.dtype)
    raise ValueError(f"unknown reduce kind {kind!r}")


# -- running one node in ONNX Runtime -----------------------------------------------------------

class _NodeRunner:
    """Runs one node on NumPy inputs, caching one ORT session per input signature."""

    def __init__(self, node: Node, opset: dict[str, int]) -> None:
        import onnxruntime as ort

        self.node = node
        self.opsets = [helper.make_opsetid(d, _runtime_opset(node, d, v)) for d, v in sorted(opset.items())]
        self.proto = self._proto(node)
        self.options = ort.SessionOptions()
        self.options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        self.options.intra_op_num_threads = 1
        self.options.inter_op_num_threads = 1
        self.options.log_severity_level = 4  # errors come back as exceptions
        self.sessions: dict[tuple, object] = {}

    @staticmethod
    def _proto(node: Node) -> onnx.NodeProto:
        from parc.ir.exporter import node_proto

        proto = node_proto(node)
        del proto.metadata_props[:]
        del proto.input[:]
        del proto.output[:]
        proto.input.extend(f"x{i}" if v is not None else "" for i, v in enumerate(node.inputs))
        proto.output.extend(f"y{i}" if v.name else "" for i, v in enumerate(node.outputs))
        return proto

    def run(self, arrays: Sequence[np.ndarray | None], fixed: Sequence[bool]) -> list[np.ndarray | None]:
        """Run on `arrays` (one per node input); inputs marked `fixed` become initializers.

        Returns one array per node output, None for omitted optional outputs.
        """
        import onnxruntime as ort

        key = tuple((a.dtype.str, a.shape, f and _identity(a)) if a is not None else None
                    for a, f in zip(arrays, fixed))
        session = self.sessions.get(key)
        if session is None:
            inputs, inits = [], []
            for i, (a, f) in enumerate(zip(arrays, fixed)):
                if a is None:
                    continue
                if f:
                    inits.append(numpy_helper.from_array(a, f"x{i}"))
                else:
                    elem = helper.np_dtype_to_tensor_dtype(a.dtype)
                    inputs.append(helper.make_tensor_value_info(f"x{i}", elem, list(a.shape)))
            outputs = [onnx.ValueInfoProto(name=name) for name in self.proto.output if name]
            graph = helper.make_graph([self.proto], "check", inputs, outputs, initializer=inits)
            model = helper.make_model(graph, opset_imports=self.opsets)
            model.ir_version = helper.find_min_ir_version_for(self.opsets, ignore_unknown=True)
            session = ort.InferenceSession(model.SerializeToString(), self.options,
                                           providers=["CPUExecutionProvider"])
            self.sessions[key] = session
        feeds = {f"x{i}": a for i, (a, f) in enumerate(zip(arrays, fixed)) if a is not None and not f}
        results = iter(session.run(None, feeds))  # type: ignore[attr-defined]
        return [np.asarray(next(results)) if name else None for name in self.proto.output]


def _identity(a: np.ndarray) -> bytes | int:
    """What tells two initializer values apart: small ones by value, large (IR constants,
    alive for the whole check) by object."""
    return a.tobytes() if a.nbytes <= 4096 else id(a)


def _runtime_opset(node: Node, domain: str, version: int) -> int:
    """The opset to run the node under: one where its op is the same as at `version`.

    ONNX Runtime may not know the newest opsets yet, so the op's defining version is preferred.
    """
    if domain not in ("", "ai.onnx") or node.domain not in ("", "ai.onnx"):
        return version
    try:
        since = onnx.defs.get_schema(node.op_type, version, "").since_version
    except onnx.defs.SchemaError:
        return version
    return max(since, min(version, 13))  # any opset in [since, version] means the same


# -- the check ---------------------------------------------------------------------------------

def _tolerances(dtype: np.dtype, rtol: float, atol: float) -> tuple[float, float]:
    if dtype in (np.float16,) or dtype.name == "bfloat16":
        return max(rtol, 1e-2), max(atol, 1e-2)
    return rtol, atol


def compare(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> str | None:
    """None if equal (exact for integers and bools, close for floats), else what differs."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if want.size == 0:
        return None
    if not np.issubdtype(want.dtype, np.inexact):
        bad = got != want
        if bad.any():
            return f"{int(bad.sum())} of {want.size} elements differ (exact dtype {want.dtype})"
        return None
    rtol, atol = _tolerances(want.dtype, rtol, atol)
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(w)
    scale = max(1.0, float(np.abs(w[finite]).max())) if finite.any() else 1.0
    close = np.isclose(g, w, rtol=rtol, atol=atol * scale, equal_nan=True)
    if close.all():
        return None
    err = np.abs(g - w)[~close]
    return (f"{int((~close).sum())} of {want.size} elements differ, max abs error "
            f"{float(np.nanmax(err)) if np.isfinite(err).any() else float('nan'):.3g}")


def _input_arrays(node: Node, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray | None]:
    arrays: list[np.ndarray | None] = []
    for i, v in enumerate(node.inputs):
        a = inputs[i] if i < len(inputs) else None
        if v is None:
            arrays.append(None)
            continue
        if a is None:
            if v.const is None:
                raise ValueError(f"node '{node.label}': no data for input {i} ('{v.name}')")
            a = v.const.numpy()
        arrays.append(np.asarray(a))
    return arrays


def check_rule(node: Node, inputs: Sequence[np.ndarray | None], opset: dict[str, int], *,
               rule: ShardingRule | None = None, labels: Sequence[str] | None = None,
               ns: Sequence[int] = (2, 3, 4), rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """Check that splitting each label of the node's rule computes the same outputs.

    `inputs` has one array per node input (None for omitted inputs and for constants, whose
    value is taken from the IR). `rule` defaults to the node's registered rule; `labels` to its
    splittable labels (labels given explicitly are tried even if marked unsplittable). Returns
    failure messages, empty if the rule held; a node without a rule gives no failures. Raises
    ReferenceRunError if the whole node does not run in ONNX Runtime.
    """
    rule = rule if rule is not None else sharding_rule(node, opset.get("", opset.get("ai.onnx")))
    if rule is None:
        return []
    arrays = _input_arrays(node, inputs)
    runner = _NodeRunner(node, opset)
    const = [v is not None and v.const is not None for v in node.inputs]
    try:
        full = runner.run(arrays, const)
    except Exception as e:  # ORT raises its own exception types
        raise ReferenceRunError(f"node '{node.label}' ({node.op_type}) does not run in onnxruntime: "
                                f"{first_line(e)}") from None
    ins = list(rule.inputs) + [None] * (len(node.inputs) - len(rule.inputs))
    outs = list(rule.outputs) + [None] * (len(node.outputs) - len(rule.outputs))
    shape_args = dict(rule.shape_args)
    size_args = dict(rule.size_args)
    failures: list[str] = []
    for label in (labels if labels is not None else rule.splittable()):
        size = rule.size(label)
        for n in ns:
            if n > size or size % n:
                continue
            where = f"{node.op_type} '{node.label}' rule [{rule}]: label {label} (size {size}) split {n} ways"
            failures.extend(f"{where}: {m}" for m in
                            _check_split(runner, rule, label, n, arrays, const, full, ins, outs,
                                         shape_args, size_args, rtol, atol))
    return failures


def _check_split(runner: _NodeRunner, rule: ShardingRule, label: str, n: int,
                 arrays: list[np.ndarray | None], const: list[bool], full: list[np.ndarray | None],
                 ins: list[TensorDims | None], outs: list[TensorDims | None],
                 shape_args: dict[int, int], size_args: dict[int, int], rtol: float,
                 atol: float) -> list[str]:
    split_out = label in rule.output_labels
    kind = dict(rule.reduce).get(label)
    if not split_out and kind is None:
        return ["label is in no output and has no reduce kind"]
    shard_outputs: list[list[np.ndarray | None]] = []
    for k in range(n):
        local: list[np.ndarray | None] = []
        fixed: list[bool] = []
        for i, a in enumerate(arrays):
            if a is None:
                local.append(None)
                fixed.append(False)
            elif i in shape_args:
                j = shape_args[i]
                local.append(np.array(local_shape(full[j].shape, outs[j], label, n),  # type: ignore[union-attr]
                                      dtype=np.int64))
                fixed.append(True)
            elif i in size_args:  # every output's local extent along one axis (Split's sizes)
                axis = size_args[i]
                local.append(np.array([local_shape(full[j].shape, outs[j], label, n)[axis]  # type: ignore[union-attr]
                                       for j in range(len(outs))], dtype=np.int64))
                fixed.append(True)
            else:
                try:
                    local.append(split_array(a, ins[i], rule, label, n, k))
                except ValueError as e:
                    return [f"input {i}: {e}"]
                fixed.append(const[i] and (ins[i] is None or not any(label in d for d in ins[i])))
        try:
            shard_outputs.append(runner.run(local, fixed))
        except Exception as e:  # ORT raises its own exception types
            return [f"shard {k} does not run in onnxruntime: {first_line(e)}"]
    failures = []
    for j, want in enumerate(full):
        if want is None:
            continue  # an omitted optional output
        parts = [s[j] for s in shard_outputs]
        dims = outs[j]
        holds = dims is not None and any(label in d for d in dims)
        if kind is not None and not holds:  # an output without the label is partial
            got = combine_partial(parts, kind)
        elif holds:
            expect = local_shape(want.shape, dims, label, n)
            wrong = [p.shape for p in parts if p.shape != expect]
            if wrong:
                failures.append(f"output {j}: shard shape {wrong[0]}, expected {expect}")
                continue
            try:
                got = merge_arrays(parts, dims, rule, label, n)
            except ValueError as e:
                failures.append(f"output {j}: {e}")
                continue
        else:  # replicated output: every shard must compute all of it
            diffs = [(k, compare(p, want, rtol, atol)) for k, p in enumerate(parts)]
            failures.extend(f"output {j} (replicated) on shard {k}: {d}" for k, d in diffs if d)
            continue
        diff = compare(got, want, rtol, atol)
        if diff:
            how = f"combined by {kind}" if kind else "merged"
            failures.append(f"output {j} {how}: {diff}")
    return failures

