"""Optimizer update rules written as ONNX ops (PyTorch's definitions)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parc.autodiff.context import PHASE
from parc.errors import UsageError
from parc.ir.graph import Graph, Value
from parc.ir.tensor import TensorData

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
STEP = "parc.step"


@dataclass(frozen=True)
class OptimizerConfig:
    """An optimizer and its hyper-parameters (the defaults are PyTorch's)."""

    name: str = "sgd"
    lr: float = 1e-3
    weight_decay: float = 0.0  # L2 added to the gradient (sgd, momentum, adam); decoupled (adamw)
    momentum: float = 0.9  # momentum only
    betas: tuple[float, float] = (0.9, 0.999)  # adam, adamw
    eps: float = 1e-8  # adam, adamw

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise UsageError(f"--optimizer {self.name}: expected one of {', '.join(OPTIMIZERS)}")
        if not self.lr > 0:
            raise UsageError(f"--lr {self.lr}: expected a positive learning rate")
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay {self.weight_decay}: expected >= 0")
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise UsageError(f"--betas {b1},{b2}: expected two numbers in [0, 1)")
        if not self.eps > 0:
            raise UsageError(f"--eps {self.eps}: expected a positive number")

    @property
    def state_names(self) -> tuple[str, ...]:
        """Per-parameter state tensors, suffixes of the parameter's name."""
        return {"sgd": (), "momentum": ("momentum",), "adam": ("exp_avg", "exp_avg_sq"),
                "adamw": ("exp_avg", "exp_avg_sq")}[self.name]

    @property
    def uses_step(self) -> bool:
        return self.name in ("adam", "adamw")

    def to_json(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


class _Emitter:
    """Appends optimizer-phase nodes for one parameter."""

    def __init__(self, graph: Graph, param: Value) -> None:
        self.graph, self.param = graph, param

    def op(self, op_type: str, *inputs: Value, **attrs) -> Value:
        from parc.passes.fold_shapes import infer_types

        g = self.graph
        n = g.add_node(op_type, list(inputs), attrs=attrs,
                       name=g.names.fresh(f"{self.param.name}.update.{op_type}"),
                       output_names=[g.names.fresh(f"{self.param.name}.update.{op_type.lower()}")])
        n.meta[PHASE] = "optimizer"
        n.meta["parc.param"] = self.param.name
        infer_types(n, g.opset)
        return n.outputs[0]

    def scalar(self, x: float) -> Value:
        assert self.param.dtype is not None
        return self.graph.add_constant(TensorData.from_array(np.array(x, self.param.dtype.numpy)),
                                       self.graph.names.fresh(f"{self.param.name}.update.const"))


def apply_update(graph: Graph, cfg: OptimizerConfig, param: Value, grad: Value,
                 state: dict[str, Value], step: Value | None) -> tuple[Value, dict[str, Value]]:
    """Emit one parameter's update; returns (new parameter, new state by suffix).

    `step` is the float count of steps taken before this one (Adam's bias correction uses
    step + 1).
    """
    e = _Emitter(graph, param)
    g = grad
    if cfg.weight_decay and cfg.name != "adamw":  # coupled L2
        g = e.op("Add", g, e.op("Mul", param, e.scalar(cfg.weight_decay)))
    if cfg.name == "sgd":
        return e.op("Sub", param, e.op("Mul", g, e.scalar(cfg.lr))), {}
    if cfg.name == "momentum":  # v = mu v + g; p -= lr v
        v = e.op("Add", e.op("Mul", state["momentum"], e.scalar(cfg.momentum)), g)
        return e.op("Sub", param, e.op("Mul", v, e.scalar(cfg.lr))), {"momentum": v}
    b1, b2 = cfg.betas
    assert step is not None
    m = e.op("Add", e.op("Mul", state["exp_avg"], e.scalar(b1)), e.op("Mul", g, e.scalar(1 - b1)))
    v = e.op("Add", e.op("Mul", state["exp_avg_sq"], e.scalar(b2)),
             e.op("Mul", e.op("Mul", g, g), e.scalar(1 - b2)))
    t = e.op("Add", step, e.scalar(1))
    c1 = e.op("Sub", e.scalar(1), e.op("Pow", e.scalar(b1), t))  # bias corrections
    c2 = e.op("Sub", e.scalar(1), e.op("Pow", e.scalar(b2), t))
    denom = e.op("Add", e.op("Sqrt", e.op("Div", v, c2)), e.scalar(cfg.eps))
    update = e.op("Div", e.op("Div", m, c1), denom)
    p = param
    if cfg.name == "adamw" and cfg.weight_decay:  # decoupled: p *= 1 - lr wd
        p = e.op("Mul", param, e.scalar(1 - cfg.lr * cfg.weight_decay))
    return e.op("Sub", p, e.op("Mul", update, e.scalar(cfg.lr))), {"exp_avg": m, "exp_avg_sq": v}
