"""Build a training step from a forward graph: forward, backward and optimizer in one program.

Signature of the result: inputs = data inputs + parameters + optimizer state (+ step counter),
each parameter and state tensor an initializer that is also a graph input; outputs = loss + new
parameters + new state (+ next step). Model metadata `parc.state` records which output feeds
which input on the next step, the parameters, their gradients, the optimizer and the loss.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import numpy as np

from parc.autodiff.context import PHASE
from parc.autodiff.engine import differentiate
from parc.autodiff.optimizers import STEP, OptimizerConfig, apply_update, bias_corrections
from parc.autodiff.precision import autocast, low_type
from parc.autodiff.recompute import recompute_elementwise
from parc.errors import UsageError
from parc.ir.graph import Graph, Node, Value
from parc.ir.shapes import fold_shapes
from parc.ir.state import STATE_KEY, StepState, write_step_state
from parc.ir.tensor import TensorData

log = logging.getLogger("parc.grad")
MIN_OPSET = 16  # ScatterND with reduction="add" (embedding gradients)


@dataclass(frozen=True)
class TrainingStep:
    """What make_training_step decided: names only, for callers and tests."""

    loss: str
    params: tuple[str, ...]
    grads: dict[str, str]  # parameter -> gradient value
    bindings: dict[str, str]  # output -> input it feeds next step


def pick_loss(graph: Graph, name: str | None) -> Value:
    """The loss output: `name`, else the output called `loss`, else the only scalar float one."""
    outs = {v.name: v for v in graph.outputs}
    if name is not None:
        if name not in outs:
            raise UsageError(f"--loss {name}: no graph output of that name (outputs: {', '.join(outs)})")
        return outs[name]
    if "loss" in outs:
        return outs["loss"]
    scalars = [v for v in graph.outputs if v.dtype is not None and v.dtype.is_float and v.size == 1]
    if len(scalars) != 1:
        found = ", ".join(v.name for v in scalars) or "none"
        raise UsageError(f"no output named 'loss' and {len(scalars)} scalar float outputs ({found}); "
                         f"name the loss with --loss OUTPUT")
    return scalars[0]


def pick_params(graph: Graph, include: str | None, frozen: str | None) -> list[Value]:
    """Parameters (float initializers read in a differentiable position), narrowed by regexes."""
    def compile_(flag: str, pattern: str | None) -> re.Pattern | None:
        try:
            return re.compile(pattern) if pattern is not None else None
        except re.error as e:
            raise UsageError(f"{flag} {pattern!r}: not a regular expression ({e})") from None

    inc, frz = compile_("--params", include), compile_("--frozen", frozen)
    if inc is not None:
        for v in graph.constants.values():
            if inc.search(v.name) and v.dtype is not None and not v.dtype.is_float and v.uses:
                raise UsageError(f"--params {include!r} matches '{v.name}', a {v.dtype} tensor: "
                                 f"integer tensors cannot be trained")
    params = [v for v in graph.params()
              if (inc is None or inc.search(v.name)) and (frz is None or not frz.search(v.name))]
    if not params:
        raise UsageError("no parameters to train (check --params/--frozen)")
    return params


def make_training_step(graph: Graph, optimizer: OptimizerConfig, *, loss: str | None = None,
                       params: str | None = None, frozen: str | None = None,
                       recompute: bool = True, precision: str = "fp32",
                       loss_scale: float | None = None) -> TrainingStep:
    """Turn a forward graph with a scalar loss into a training step, in place; `recompute`:
    cheap elementwise values the backward pass reads are recomputed there, not kept
    (`parc.autodiff.recompute`); `precision` "bf16" or "fp16": matrix products compute in it,
    with float32 master weights, and the loss's gradient is scaled by `loss_scale` (default:
    DEFAULT_LOSS_SCALE for fp16, 1 otherwise) and each gradient unscaled before the optimizer
    (`parc.autodiff.precision`)."""
    if STATE_KEY in graph.metadata:
        raise UsageError("the model is already a training step (it has parc.state metadata)")
    if graph.opset.get("", 0) < MIN_OPSET:
        graph.opset[""] = MIN_OPSET  # every op's opset-13 form means the same at 16
    scale = _loss_scale(precision, loss_scale)
    loss_v = pick_loss(graph, loss)
    split_masked_means(graph)
    trainable = pick_params(graph, params, frozen)
    products = autocast(graph, precision)
    if precision != "fp32" and not products:
        raise UsageError(f"--precision {precision}: the model has no matrix product (MatMul, Gemm, Conv, "
                         "ConvTranspose, Einsum) of float32 inputs that can compute in it")
    for n in graph.nodes:
        n.meta[PHASE] = "forward"
    grads = differentiate(graph, loss_v, trainable, seed_scale=scale)
    if recompute:
        recompute_elementwise(graph)
    dropped = [p.name for p in trainable if p.name not in grads]
    if dropped:
        log.warning("%d parameters do not affect the loss and are left untrained: %s",
                    len(dropped), ", ".join(dropped[:5]) + (" ..." if len(dropped) > 5 else ""))
    trained = [p for p in trainable if p.name in grads]
    for p in trained:  # gradients are named values, so a step splits into compute and apply
        g = grads[p.name]
        if scale != 1:  # unscaled before anything reads it: exact, the scale is a power of two
            n = graph.add_node("Mul", [g, _const(graph, np.array(1 / scale, g.dtype.numpy))],  # type: ignore[union-attr]
                               name=graph.names.fresh(f"{p.name}.unscale"))
            n.meta[PHASE] = "backward"
            _type(graph, n)
            g = n.outputs[0]
        grads[p.name] = _rename(graph, g, f"{p.name}.grad")

    step_in = step_out = None
    scalars: dict = {}
    corrections: dict = {}  # dtype -> Adam's bias corrections, emitted once
    if optimizer.uses_step:
        step_in = graph.add_constant(TensorData.from_array(np.array(0, np.int64)), STEP)
        n = graph.add_node("Add", [step_in, _const(graph, np.array(1, np.int64))],
                           name=graph.names.fresh("parc.step.increment"), output_names=[f"{STEP}.next"])
        n.meta[PHASE] = "optimizer"
        _type(graph, n)
        step_out = n.outputs[0]

    bindings: dict[str, str] = {}
    new_outputs = [loss_v]
    for p in trained:
        state = {}
        for suffix in optimizer.state_names:
            data = TensorData.zeros_of(p.dtype, p.shape)  # type: ignore[arg-type]
            state[suffix] = graph.add_constant(data, f"{p.name}.{suffix}")
        c = None
        if step_in is not None:
            if p.dtype not in corrections:
                corrections[p.dtype] = bias_corrections(graph, optimizer, step_in, p.dtype, scalars)
            c = corrections[p.dtype]
        new_p, new_state = apply_update(graph, optimizer, p, grads[p.name], state, c, scalars)
        new_p = _rename(graph, new_p, f"{p.name}.new")
        new_outputs.append(new_p)
        bindings[new_p.name] = p.name
        graph.input_constants.append(p)
        for suffix, v in new_state.items():
            v = _rename(graph, v, f"{p.name}.{suffix}.new")
            new_outputs.append(v)
            bindings[v.name] = state[suffix].name
            graph.input_constants.append(state[suffix])
    if step_in is not None and step_out is not None:
        new_outputs.append(step_out)
        bindings[step_out.name] = step_in.name
        graph.input_constants.append(step_in)
    graph.outputs = new_outputs
    fold_shapes(graph, typed=True)  # constant-only backward nodes (zeros, the loss seed's scaling)
    record = StepState(bindings, tuple(p.name for p in trained), {p.name: grads[p.name].name for p in trained},
                       optimizer.to_json(), loss_v.name, STEP if step_in is not None else None,
                       {} if precision == "fp32" else {"compute": precision, "products": products, "loss_scale": scale})
    write_step_state(graph.metadata, record)
    return TrainingStep(loss_v.name, record.params, dict(record.grads), bindings)


DEFAULT_LOSS_SCALE = 1024.0  # fp16's static loss scale: gradients down to ~6e-11 survive the cast


def _loss_scale(precision: str, given: float | None) -> float:
    low_type(precision)  # a clear error for an unknown precision
    scale = given if given is not None else DEFAULT_LOSS_SCALE if precision == "fp16" else 1.0
    if not (scale > 0 and math.isfinite(scale) and math.log2(scale).is_integer()):
        raise UsageError(f"--loss-scale {given}: expected a power of two (1, 2, 4, ..., 1024, ...), so "
                         "that scaling and unscaling the gradients is exact")
    return scale


MASKED_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")


def split_masked_means(graph: Graph) -> int:
    """Rewrite each SoftmaxCrossEntropyLoss / NegativeLogLikelihoodLoss that takes the mean over
    the labels not ignored (`ignore_index`, no class weights) as its sum over those labels
    divided by their count: ReduceSum(Cast(labels != ignore_index)). The value is the same,
    but both parts are sums, so the batch can be split (across devices and microbatches: each
    part is summed, then divided once); the mean itself is not a mean of equal shares. Returns
    how many were rewritten."""
    from onnx import helper

    done = 0
    out: list = []
    for n in graph.nodes:
        if (n.op_type not in MASKED_LOSSES or n.domain not in ("", "ai.onnx") or n.attr("ignore_index") is None
                or n.attr("reduction", "mean") != "mean" or n.input(2) is not None or not n.outputs[0].name):
            out.append(n)
            continue
        labels, loss = n.inputs[1], n.outputs[0]
        assert labels is not None and labels.dtype is not None and loss.dtype is not None
        total = Value(graph.names.fresh(f"{loss.name}.sum"))
        attrs = {k: v for k, v in n.attrs.items() if k != "reduction"}
        attrs["reduction"] = helper.make_attribute("reduction", "sum")
        summed = Node(n.op_type, list(n.inputs), [total, *n.outputs[1:]], attrs, graph.names.fresh(f"{n.name}.sum"),
                      n.domain)
        ignore = _const(graph, np.array(n.attr("ignore_index"), labels.dtype.numpy))
        steps = [summed]

        equal = _append(graph, steps, n.name, "Equal", [labels, ignore])
        valid = _append(graph, steps, n.name, "Cast", [_append(graph, steps, n.name, "Not", [equal])],
                        to=loss.dtype.onnx_type)
        count = _append(graph, steps, n.name, "ReduceSum", [valid], keepdims=0)
        n.detach()
        steps.append(Node("Div", [total, count], [loss], {}, graph.names.fresh(f"{n.name}.mean"), ""))
        for m in steps:
            m.meta.update(n.meta)
            _type(graph, m)
        out.extend(steps)
        done += 1
    graph.nodes = out
    return done


def _append(graph: Graph, steps: list, base: str, op_type: str, inputs: list, **attrs) -> Value:
    """A new node (not yet in the graph) appended to `steps`; its one output."""
    from onnx import helper

    v = Value(graph.names.fresh(f"{base}.{op_type.lower()}_out"))
    steps.append(Node(op_type, inputs, [v], {k: helper.make_attribute(k, a) for k, a in attrs.items()},
                      graph.names.fresh(f"{base}.{op_type.lower()}"), ""))
    return v


def _rename(graph: Graph, v: Value, name: str) -> Value:
    """Give a node output a stable name (gradients, new parameters); constants and inputs
    keep theirs behind an Identity."""
    if name in graph.names.used:
        raise UsageError(f"the model already has a value named '{name}'")
    graph.names.claim(name)
    if v.producer is not None and v not in graph.outputs:
        v.name = name
        return v
    n = graph.add_node("Identity", [v], name=graph.names.fresh(f"{name}.identity"), output_names=[name])
    n.meta[PHASE] = v.producer.meta.get(PHASE, "backward") if v.producer else "backward"
    _type(graph, n)
    return n.outputs[0]


def _const(graph: Graph, a: np.ndarray) -> Value:
    return graph.add_constant(TensorData.from_array(a), graph.names.fresh("parc.const"))


def _type(graph: Graph, node) -> None:
    from parc.ir.shapes import infer_types

    infer_types(node, graph.opset)
