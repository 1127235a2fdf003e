"""`fusion.flat_layout`: which leaves of an elementwise group the flat kernel reads by the output's
flat index, and how. Checked on the CPU by reading each leaf as the kernel does (i, 0, i % m,
i / m) and comparing with NumPy's broadcasting; the kernel itself is `gpu`-tested."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from parc.exec.engines.tree_kernel import INDEX, Group, Op, extent_args
from parc.ops.fusion import flat_layout


def _read(leaf: np.ndarray, mode: str, extent, n: int) -> np.ndarray:
    """The leaf's elements as the kernels read them: `INDEX`'s C text for the mode, evaluated with
    Python's integer division (the kernels' unsigned 32-bit indices are below 2^30)."""
    i = np.arange(n)
    m, *q = extent_args(mode, extent)
    index = eval(INDEX[mode].format(0).replace("/", "//"), {"i": i, "m0": m, "q0": q[0] if q else None})
    return leaf.reshape(-1)[np.broadcast_to(index, (n,))]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_flat_reads_equal_broadcasting(data):
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=0, max_size=4)))
    leaves = []
    for _ in range(data.draw(st.integers(1, 4))):
        keep = data.draw(st.integers(0, len(shape)))
        s = tuple(d if data.draw(st.booleans()) else 1 for d in shape[len(shape) - keep:])
        leaves.append(np.random.default_rng(len(leaves)).standard_normal(s))
    out = np.broadcast_shapes(*[x.shape for x in leaves])
    layout = flat_layout([x.shape for x in leaves], [True] * len(leaves))
    if layout is None:  # only a leaf broadcast over more than one run of dims
        assert any(not _flat(x.shape, out) for x in leaves)
        return
    got_shape, modes, extents = layout
    assert got_shape == tuple(np.broadcast_shapes(*[x.shape for x in leaves]))
    n = int(np.prod(got_shape))
    for x, m, e in zip(leaves, modes, extents, strict=True):
        np.testing.assert_array_equal(_read(x, m, e, n), np.broadcast_to(x, got_shape).reshape(-1))


def _flat(s, out):
    """Whether a leaf of shape s is the output's shape but for one run of dims of 1."""
    pad = (1,) * (len(out) - len(s)) + tuple(s)
    return any(pad == tuple(out[:a]) + (1,) * (c - a) + tuple(out[c:])
               for a in range(len(out) + 1) for c in range(a, len(out) + 1))


def test_layouts_of_a_training_step():
    assert flat_layout([(8, 1024, 4096), (4096,)], [True, True])[1:] == (("full", "tail"), (33554432, 4096))
    assert flat_layout([(8, 1024, 1), (8, 1024, 4096), ()], [True] * 3)[1:] == (
        ("head", "full", "one"), (4096, 33554432, 1))
    assert flat_layout([(8, 16, 64, 64), (64, 64)], [True, True])[1] == ("full", "tail")
    assert flat_layout([(8, 1, 4), (8, 3, 4)], [True, True])[1:] == (("split", "full"), ((12, 4), 96))
    assert flat_layout([(8, 1, 1, 64), (8, 16, 64, 64)], [True, True])[1:] == (("split", "full"), ((65536, 64), 1 << 19))
    assert flat_layout([(8, 1, 4, 1), (8, 3, 4, 5)], [True, True]) is None  # broadcast over two runs
    assert flat_layout([(3, 4), (3, 4)], [True, False]) is None  # a view: CuPy's kernel
    assert flat_layout([(0, 4)], [True]) is None


def test_flat_source_compiles():
    """The generated kernel, with every leaf mode, compiles for a GPU (NVRTC, `tests/nvrtc.py`)."""
    from tests.nvrtc import compile_cuda

    group = Group([Op(None, "Mul", ("x", "s"), "t", "mul (Mul)"), Op(None, "Erf", ("t",), "e", "erf (Erf)"),
                   Op(None, "Where", ("c", "e", "x"), "y", "where (Where)"), Op(None, "Add", ("y", "h"), "z", "add (Add)"),
                   Op(None, "Sub", ("z", "p"), "w", "sub (Sub)")], np)
    src = group.flat_source(["float", "float", "bool", "float", "float"], ["full", "one", "tail", "head", "split"], "float")
    assert "unsigned int m4, unsigned int q4" in src and "p4[i / m4 * q4 + i % q4]" in src
    assert compile_cuda(src, ("--fmad=false",))
