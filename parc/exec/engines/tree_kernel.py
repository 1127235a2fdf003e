"""One elementwise tree as one step of the array engine (`Group`), and its kernels.

The trees are the op layer's (`parc.ops.fusion.trees`): elementwise nodes whose intermediates
nobody else sees. A group's kernel has the group's nodes as C statements, one local variable per
intermediate (`Group.body`): each input is read once and only the root's value is written. Where
every leaf can be read by the output's flat index (`flat_layout`) that is the flat kernel, each
thread loading its leaves' elements ahead; else CuPy's `ElementwiseKernel`, which broadcasts its
inputs as ONNX does, so the tree's leaves may have any shapes that broadcast.

The kernel is compiled for the float type of the group's inputs at its first run; it is built
with `--fmad=false`, so that each operation rounds as CuPy's own kernel for it would (no fused
multiply-add), and the fused and unfused runs agree to the bit. A group whose inputs have other
types than the one it was made for (float16, integers, mixed float types) runs its nodes one by
one, as does every group on NumPy, where there is nothing to gain but the tests run the same
grouping. `PARC_CUPY_KERNELS=0` turns fusion off. Casts between float32 and bfloat16 join trees
at their edges (`cast_kind`): a bfloat16 leaf is read as its float value, a root cast to
bfloat16 is stored rounded (flat kernels only).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from onnx import TensorProto

from parc.exec.engines import gpu
from parc.exec.engines.elementwise import DTYPES
from parc.exec.engines.gpu import CTYPES
from parc.ops.fusion import OPS, flat_layout

BF16 = "bf16"  # a leaf's or an output's type in the kernels' sources: bfloat16's bits, computed in float
BFLOAT16 = DTYPES[TensorProto.BFLOAT16]
FLAT_THREADS, FLAT_PER = 256, 4  # the flat kernel's block, and the elements each thread loads ahead
FLAT_MAX_BLOCKS = 1 << 16  # blocks loop over the rest
# each `flat_layout` mode's index of a leaf's element for the output's element i (C, 32-bit)
INDEX = {"full": "i", "one": "0", "tail": "i % m{0}", "head": "i / m{0}", "split": "i / m{0} * q{0} + i % q{0}"}


def pointee(t: str) -> str:
    """A leaf's or an output's element type in C."""
    return "unsigned short" if t == BF16 else t


def leaf_value(t: str, expr: str) -> str:
    """The value of a leaf's element `expr` in the kernels' float type."""
    return f"bf16_value({expr})" if t == BF16 else expr


@dataclass
class Op:
    """One node of a group: its kernel (for the unfused run), input keys, output key and type."""

    kernel: Any
    op: str
    inputs: tuple[str, ...]
    output: str
    label: str
    cast: str = ""  # a Cast's `cast_kind`: "up" or "down"


@dataclass
class Group:
    """A tree of elementwise nodes run as one step; `ops` in the graph's order, the root last."""

    ops: list[Op]
    xp: Any
    leaves: tuple[str, ...] = ()
    _kernels: dict[tuple, Any] = field(default_factory=dict)
    _flats: dict[tuple, Any] = field(default_factory=dict)
    _launches: dict[tuple, Any] = field(default_factory=dict)
    _failed: bool = False

    def __post_init__(self) -> None:
        made = {o.output for o in self.ops}
        self.leaves = tuple(dict.fromkeys(k for o in self.ops for k in o.inputs if k not in made))

    @property
    def output(self) -> str:
        return self.ops[-1].output

    @property
    def label(self) -> str:
        if len(self.ops) == 1:  # one node, run by the flat kernel: it keeps its own label
            return self.ops[0].label
        return f"{self.ops[-1].label.rpartition(' (')[0]} and {len(self.ops) - 1} more (Fused)"

    def __call__(self, *leaves: Any) -> tuple[Any]:
        if self._failed or self.xp is np:
            return (self.unfused(leaves),)
        try:
            key = tuple((a.dtype, a.shape, a.flags.c_contiguous) for a in leaves)
        except AttributeError:  # not all device arrays
            key = None
        launch = self._launches.get(key) if key is not None else None
        if launch is None:
            launch = self._prepare(leaves)
            if key is not None:
                self._launches[key] = launch
        try:
            return (launch(*leaves),)
        except Exception as e:  # CuPy compiles at the first call
            if type(e).__name__ != "CompileException":
                raise
            self._refuse(e)
            return (self.unfused(leaves),)

    def _prepare(self, leaves: Sequence[Any]) -> Any:
        """How leaves of these types and layouts run: the flat kernel where every leaf is read by
        a flat index (`flat_layout`), else CuPy's ElementwiseKernel (which broadcasts anything),
        else the nodes one by one."""
        plan = self.flat([getattr(a, "dtype", None) for a in leaves], [a.shape for a in leaves], readable(leaves))
        if plan is None:
            kernel = self._kernel(leaves)  # None for a group with casts, or types it cannot take
            return kernel if kernel is not None else lambda *xs: self.unfused(xs)
        dtype, types, shape, modes, extents = plan
        out = self.out_dtype(dtype)
        flat = self._flats.get((types, modes))
        if flat is None:
            flat = self._flats[(types, modes)] = self.xp.RawKernel(
                self.flat_source(types, modes, CTYPES[dtype], BF16 if out == BFLOAT16 else ""), "parc_flat",
                options=("--fmad=false",))
        n = math.prod(shape)
        grid = (min(-(-n // (FLAT_THREADS * FLAT_PER)), FLAT_MAX_BLOCKS),)
        args = (np.uint32(n), *(np.uint32(v) for mode, e in zip(modes, extents) for v in extent_args(mode, e)))
        xp = self.xp
        copy = [i for i, a in enumerate(leaves) if not a.flags.c_contiguous]  # small views (`readable`)

        def launch(*xs: Any) -> Any:
            if copy:
                xs = tuple(xp.ascontiguousarray(a) if i in copy else a for i, a in enumerate(xs))
            y = xp.empty(shape, out)
            flat(grid, (FLAT_THREADS,), (*xs, y, *args))
            return y
        return launch

    def flat_source(self, types: Sequence[str], modes: Sequence[str], ctype: str, out: str = "") -> str:
        """The flat kernel: each thread loads FLAT_PER elements of every leaf (strided by the block,
        so loads coalesce, and all issued before any is used), then runs the group's body on each.
        `out`: BF16 where the root is a cast to bfloat16, else the output is of `ctype`."""
        params = ", ".join([f"const {pointee(t)}* __restrict__ p{i}" for i, t in enumerate(types)]
                           + [f"{pointee(out or ctype)}* __restrict__ o", "unsigned int n"]
                           + [f"unsigned int {e}" for i, m in enumerate(modes) for e in extent_names(i, m)])
        held = " ".join(f"{pointee(t)} a{i}[{FLAT_PER}];" for i, t in enumerate(types))
        loads = " ".join(f"a{i}[j] = p{i}[{INDEX[m].format(i)}];" for i, m in enumerate(modes))
        names = " ".join(f"const {ctype if t == BF16 else t} in{i} = {leaf_value(t, f'a{i}[j]')};" for i, t in enumerate(types))
        prelude = gpu.cuda_source("bf16") if BF16 in (*types, out) else ""
        return f"""{prelude}typedef {ctype} T;
extern "C" __global__ void parc_flat({params}) {{
    for (unsigned int at = blockIdx.x * blockDim.x * {FLAT_PER}u + threadIdx.x; at < n;
         at += gridDim.x * blockDim.x * {FLAT_PER}u) {{
        {held}
        #pragma unroll
        for (int j = 0; j < {FLAT_PER}; ++j) {{
            const unsigned int i = at + j * blockDim.x;
            if (i < n) {{ {loads} }}
        }}
        #pragma unroll
        for (int j = 0; j < {FLAT_PER}; ++j) {{
            const unsigned int i = at + j * blockDim.x;
            if (i < n) {{
                {names}
                T out;
                {{
{self.body(ctype)}
                }}
                o[i] = {"bf16_bits(out)" if out == BF16 else "out"};
            }}
        }}
    }}
}}
"""

    def _refuse(self, e: Exception) -> None:
        """A compiler's refusal is parc's bug, said once; the nodes still run, one by one."""
        self._failed = True
        print(f"parc: could not fuse {self.label}: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr)

    def unfused(self, leaves: Sequence[Any]) -> Any:
        """The group's nodes one by one (NumPy, or types the kernel was not made for)."""
        env = dict(zip(self.leaves, leaves))
        for o in self.ops:
            env[o.output] = o.kernel(*[env[k] for k in o.inputs])[0]
        return env[self.output]

    def _kernel(self, leaves: Sequence[Any]) -> Any:
        types = tuple(getattr(a, "dtype", None) for a in leaves)
        if types not in self._kernels:
            self._kernels[types] = self._compile(types)
        return self._kernels[types]

    def types(self, dtypes: Sequence[Any]) -> tuple[np.dtype, tuple[str, ...]] | None:
        """(the group's float type, each leaf's C type or BF16) for leaves of `dtypes`, or None
        where a kernel of the group cannot take them: Where's conditions must be bool leaves, the
        leaves of casts up bfloat16 leaves read by those casts only, the others of one float type
        of CTYPES (float32 where the group casts)."""
        conditions = {o.inputs[0] for o in self.ops if o.op == "Where"}
        low = {o.inputs[0] for o in self.ops if o.cast == "up"}
        floats = {t for k, t in zip(self.leaves, dtypes) if k not in conditions | low}
        casts = low or self.ops[-1].cast == "down"
        dtype = next(iter(floats)) if floats else np.dtype(np.float32)
        if len(floats) > 1 or dtype not in CTYPES or (casts and dtype != np.float32):
            return None
        if any(t != np.dtype(np.bool_) for k, t in zip(self.leaves, dtypes) if k in conditions):
            return None
        if any(t != BFLOAT16 for k, t in zip(self.leaves, dtypes) if k in low):
            return None
        if any(k in low for o in self.ops if o.cast != "up" for k in o.inputs):
            return None  # a bfloat16 leaf read as it is
        if conditions & ({o.output for o in self.ops} | low):
            return None  # a condition computed inside the group (the ops here make floats only)
        return dtype, tuple("bool" if k in conditions else BF16 if k in low else CTYPES[dtype] for k in self.leaves)

    def flat(self, dtypes: Sequence[Any], shapes: Sequence[tuple[int, ...]], contiguous: Sequence[bool]) -> tuple | None:
        """(float type, each leaf's C type, output shape, each leaf's mode and extent) where a
        flat kernel of the group takes leaves of these types and layouts (`types`,
        `flat_layout`), else None."""
        found = self.types(dtypes)
        layout = flat_layout(shapes, contiguous) if found is not None else None
        return None if layout is None else (*found, *layout)

    def out_dtype(self, dtype: np.dtype) -> np.dtype:
        """The root's type, for a group computing in `dtype`."""
        return BFLOAT16 if self.ops[-1].cast == "down" else dtype

    def _compile(self, types: tuple) -> Any:
        found = self.types(types)
        if found is None or any(o.cast for o in self.ops):  # CuPy's kernels and bfloat16: flat kernels only
            return None
        dtype, ctypes = found  # parameters take NumPy's type names ("float" would be float64)
        params = ", ".join(f"{'bool' if c == 'bool' else dtype.name} in{i}" for i, c in enumerate(ctypes))
        try:
            return self.xp.ElementwiseKernel(params, f"{dtype.name} out", self.body(CTYPES[dtype]),
                                             f"parc_fused_{len(self.ops)}", options=("--fmad=false",))
        except Exception as e:
            self._refuse(e)
            return None

    def body(self, ctype: str) -> str:
        """The kernel's C body: one local per node, the root's value stored."""
        names = {k: f"in{i}" for i, k in enumerate(self.leaves)}
        lines = [f"typedef {ctype} T;"]
        for j, o in enumerate(self.ops):
            names[o.output] = f"t{j}"
            lines.append(f"T t{j} = {OPS[o.op][1].format(*(names[k] for k in o.inputs))};")
        lines.append(f"out = t{len(self.ops) - 1};")
        return "\n".join(lines)


def readable(leaves: Sequence[Any], n: int | None = None) -> list[bool]:
    """Which leaves the flat index may read (`flat_layout`'s `contiguous`): a contiguous array, or
    a view of at most half the output's `n` elements (the broadcast of T5's relative position
    bias, a transposed [1, H, S, S]), which the kernel's launch copies first: the copy is small
    beside the kernel's own traffic. None stands for an array the kernel is handed."""
    if n is None:
        n = math.prod(np.broadcast_shapes(*[a.shape for a in leaves if a is not None]))
    return [a is None or a.flags.c_contiguous or 2 * a.size <= n for a in leaves]


def extent_args(mode: str, extent) -> tuple[int, ...]:
    """A leaf's extent as its kernel arguments: m, and q for "split" (`flat_layout`)."""
    return tuple(extent) if mode == "split" else (extent,)


def extent_names(j: int, mode: str, prefix: str = "") -> list[str]:
    """The names of a leaf's extent arguments, in `extent_args`' order."""
    return [f"{prefix}m{j}", *([f"{prefix}q{j}"] if mode == "split" else [])]

