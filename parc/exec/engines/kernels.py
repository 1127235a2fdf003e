"""What every kernel module shares: the node a kernel is made for, and its helpers.

A kernel module maps op types to makers. A maker takes a `NodeInfo` (attributes parsed, opset,
the array module) and returns the kernel: a function from the node's input arrays (None for an
absent optional input) to a tuple of its outputs. Makers do the per-node work once (attribute
defaults, opset variants, validation) and raise `Unsupported` for semantics the engine does not
implement, so that a model is refused when the engine is built rather than computed wrongly.
Kernels use only `xp` calls, so the same code runs on NumPy and on CuPy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

Kernel = Callable[..., Sequence[Any]]
Maker = Callable[["NodeInfo"], Kernel]


class Unsupported(Exception):
    """A maker's refusal; the message says which attribute or input value is not implemented."""


@dataclass(frozen=True)
class NodeInfo:
    """One node as a maker sees it."""

    name: str
    op: str
    attrs: Mapping[str, Any]  # attribute values as onnx.helper gives them; strings decoded
    opset: int  # of the default domain
    inputs: tuple[str, ...]  # "" where an optional input is absent
    outputs: tuple[str, ...]  # "" where an optional output is not wanted
    xp: ModuleType  # numpy or cupy
    consts: Mapping[str, np.ndarray]  # host values of inputs that are constants of the graph

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)

    def has_input(self, i: int) -> bool:
        return i < len(self.inputs) and self.inputs[i] != ""

    def wants_output(self, i: int) -> bool:
        return i < len(self.outputs) and self.outputs[i] != ""

    def const(self, i: int) -> np.ndarray | None:
        """Input i's value when it is a graph constant (shape, axes, pads given as initializers)."""
        return self.consts.get(self.inputs[i]) if self.has_input(i) else None

    @property
    def on_gpu(self) -> bool:
        return self.xp is not np

    def host(self, a: Any) -> np.ndarray:
        """An array's values in host memory, for the small inputs that shape a result."""
        if self.on_gpu and not isinstance(a, (np.ndarray, np.generic)):
            return a.get()
        return np.asarray(a)  # a host input (HOST_INPUTS), or any value on the CPU

    def ints(self, a: Any) -> list[int]:
        """A 1-D (or scalar) integer input as a list of Python ints."""
        return [int(v) for v in self.host(a).reshape(-1)]


# Inputs that kernels read only through `NodeInfo.host` (shapes, axes, pads, counts), by op:
# where such an input is a graph constant, the engine passes its host copy, so that a GPU run
# does not copy it back from the device at every step.
HOST_INPUTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Split": (1,), "Squeeze": (1,),
    "Unsqueeze": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "TopK": (1,), "OneHot": (1,),
    "CumSum": (1,), "CumProd": (1,), "Trilu": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    **{op: (1,) for op in ("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceSumSquare "
                           "ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp").split()},
}


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def norm_axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(sorted(norm_axis(int(a), rank) for a in axes))


def fix_negative(xp: ModuleType, idx: Any, size: int) -> Any:
    """ONNX index tensors may count from the end; the array libraries' fancy indexing on CuPy
    wraps instead of checking, so negative indices are made positive explicitly."""
    return xp.where(idx < 0, idx + size, idx)


def scatter_reduce(xp: ModuleType, out: Any, index: tuple, values: Any, reduction: str) -> None:
    """out[index] (op)= values with repeated indices accumulated (ScatterND, ScatterElements)."""
    if reduction == "none":
        out[index] = values
    elif xp is np:
        {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}[reduction].at(
            out, index, values)
    else:
        import cupyx

        {"add": cupyx.scatter_add, "max": cupyx.scatter_max, "min": cupyx.scatter_min}[reduction](
            out, index, values)


def check_reduction(n: NodeInfo) -> str:
    reduction = n.attr("reduction", "none")
    allowed = ("none", "add", "max", "min") if n.on_gpu else ("none", "add", "mul", "max", "min")
    if reduction not in allowed:
        raise Unsupported(f"reduction={reduction!r}" + (" on the GPU" if n.on_gpu else ""))
    return reduction


def special(xp: ModuleType) -> ModuleType:
    """scipy.special or cupyx.scipy.special (erf, expit), imported on first use."""
    if xp is np:
        import scipy.special

        return scipy.special
    import cupyx.scipy.special

    return cupyx.scipy.special
