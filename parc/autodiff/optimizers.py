"""Optimizer update rules written as ONNX ops (PyTorch's definitions)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parc.errors import UsageError
from parc.ir import dtypes
from parc.ir.dtypes import DType
from parc.ir.graph import Graph, Value
from parc.ir.state import PARAM_OF, PHASE
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
        if not self.weight_decay >= 0:
            raise UsageError(f"--weight-decay {self.weight_decay}: expected >= 0")
        if not self.momentum >= 0:  # torch.optim.SGD refuses negative momentum too
            raise UsageError(f"--momentum {self.momentum}: expected >= 0")
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
    """Appends optimizer-phase nodes for one parameter; scalar constants are shared."""

    def __init__(self, graph: Graph, param: Value | None, scalars: dict) -> None:
        self.graph, self.param, self.scalars = graph, param, scalars
        self.prefix = param.name if param is not None else STEP

    def op(self, op_type: str, *inputs: Value, **attrs) -> Value:
        from parc.ir.shapes import infer_types

        g = self.graph
        n = g.add_node(op_type, list(inputs), attrs=attrs,
                       name=g.names.fresh(f"{self.prefix}.update.{op_type}"),
                       output_names=[g.names.fresh(f"{self.prefix}.update.{op_type.lower()}")])
        n.meta[PHASE] = "optimizer"
        if self.param is not None:
            n.meta[PARAM_OF] = self.param.name
        infer_types(n, g.opset)
        return n.outputs[0]

    def scalar(self, x: float, dtype: np.dtype | type | None = None) -> Value:
        """A rank-0 constant of the parameter's dtype, or of `dtype`, shared by all updates."""
        dt = np.dtype(dtype if dtype is not None else self.param.dtype.numpy)  # type: ignore[union-attr]
        key = (float(x), dt.str)
        if key not in self.scalars:
            self.scalars[key] = self.graph.add_constant(
                TensorData.from_array(np.array(x, dt)), self.graph.names.fresh("optimizer.const"))
        return self.scalars[key]


def bias_corrections(graph: Graph, cfg: OptimizerConfig, step: Value, dtype: DType,
                     scalars: dict) -> tuple[Value, Value]:
    """Adam's 1 - b1^t and 1 - b2^t at t = step + 1, for parameters of `dtype`.

    Computed in float64, as PyTorch does (Python floats): in float32, 1 - b2^t is off by ~1e-5
    for thousands of steps from the rounding of b2 = 0.999 alone. Emitted once per dtype.
    """
    e = _Emitter(graph, None, scalars)
    f64 = np.float64
    b1, b2 = cfg.betas
    t = e.op("Add", e.op("Cast", step, to=dtypes.DOUBLE.onnx_type), e.scalar(1, f64))
    c1 = e.op("Cast", e.op("Sub", e.scalar(1, f64), e.op("Pow", e.scalar(b1, f64), t)), to=dtype.onnx_type)
    c2 = e.op("Cast", e.op("Sub", e.scalar(1, f64), e.op("Pow", e.scalar(b2, f64), t)), to=dtype.onnx_type)
    return c1, c2


def apply_update(graph: Graph, cfg: OptimizerConfig, param: Value, grad: Value,
                 state: dict[str, Value], corrections: tuple[Value, Value] | None,
                 scalars: dict) -> tuple[Value, dict[str, Value]]:
    """Emit one parameter's update; returns (new parameter, new state by suffix).

    `corrections` are Adam's bias corrections for the parameter's dtype (`bias_corrections`).
    """
    e = _Emitter(graph, param, scalars)
    g = grad
    if cfg.weight_decay and cfg.name != "adamw":  # coupled L2
        g = e.op("Add", g, e.op("Mul", param, e.scalar(cfg.weight_decay)))
    if cfg.name == "sgd":
        return e.op("Sub", param, e.op("Mul", g, e.scalar(cfg.lr))), {}
    if cfg.name == "momentum":  # v = mu v + g; p -= lr v
        v = e.op("Add", e.op("Mul", state["momentum"], e.scalar(cfg.momentum)), g)
        return e.op("Sub", param, e.op("Mul", v, e.scalar(cfg.lr))), {"momentum": v}
    b1, b2 = cfg.betas
    assert corrections is not None
    c1, c2 = corrections
    m = e.op("Add", e.op("Mul", state["exp_avg"], e.scalar(b1)), e.op("Mul", g, e.scalar(1 - b1)))
    v = e.op("Add", e.op("Mul", state["exp_avg_sq"], e.scalar(b2)),
             e.op("Mul", e.op("Mul", g, g), e.scalar(1 - b2)))
    denom = e.op("Add", e.op("Sqrt", e.op("Div", v, c2)), e.scalar(cfg.eps))
    update = e.op("Div", e.op("Div", m, c1), denom)
    p = param
    if cfg.name == "adamw" and cfg.weight_decay:  # decoupled: p *= 1 - lr wd
        p = e.op("Mul", param, e.scalar(1 - cfg.lr * cfg.weight_decay))
    return e.op("Sub", p, e.op("Mul", update, e.scalar(cfg.lr))), {"exp_avg": m, "exp_avg_sq": v}
