"""`fusion.flat_layout`: which leaves of an elementwise group the flat kernel reads by the output's
flat index, and how. Checked on the CPU by reading each leaf as the kernel does (i, 0, i % m,
i / m) and comparing with NumPy's broadcasting; the kernel itself is `gpu`-tested."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parc.exec.engines.fusion import Group, Op, flat_layout


def _read(leaf: np.ndarray, mode: str, extent: int, n: int) -> np.ndarray:
    i = np.arange(n)
    index = {"full": i, "one": np.zeros(n, int), "tail": i % extent, "head": i // extent}[mode]
    return leaf.reshape(-1)[index]


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
    if layout is None:  # only a leaf that is not the output's leading or trailing dims
        assert any(not _flat(x.shape, out) for x in leaves)
        return
    got_shape, modes, extents = layout
    assert got_shape == tuple(np.broadcast_shapes(*[x.shape for x in leaves]))
    n = int(np.prod(got_shape))
    for x, m, e in zip(leaves, modes, extents, strict=True):
        np.testing.assert_array_equal(_read(x, m, e, n), np.broadcast_to(x, got_shape).reshape(-1))


def _flat(s, out):
    pad = (1,) * (len(out) - len(s)) + tuple(s)
    return any(pad == (1,) * k + tuple(out[k:]) or pad == tuple(out[:k]) + (1,) * (len(out) - k)
               for k in range(len(out) + 1))


def test_layouts_of_a_training_step():
    assert flat_layout([(8, 1024, 4096), (4096,)], [True, True])[1:] == (("full", "tail"), (33554432, 4096))
    assert flat_layout([(8, 1024, 1), (8, 1024, 4096), ()], [True] * 3)[1:] == (
        ("head", "full", "one"), (4096, 33554432, 1))
    assert flat_layout([(8, 16, 64, 64), (64, 64)], [True, True])[1] == ("full", "tail")
    assert flat_layout([(8, 1, 4), (8, 3, 4)], [True, True]) is None  # broadcast in the middle
    assert flat_layout([(3, 4), (3, 4)], [True, False]) is None  # a view: CuPy's kernel
    assert flat_layout([(0, 4)], [True]) is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_flat_source_is_valid_cuda_syntax(tmp_path):
    """The generated kernel parses as C++ (CUDA's qualifiers stubbed): the GPU compiles the same text."""
    group = Group([Op(None, "Mul", ("x", "s"), "t", "mul (Mul)"), Op(None, "Erf", ("t",), "e", "erf (Erf)"),
                   Op(None, "Where", ("c", "e", "x"), "y", "where (Where)")], np)
    src = group.flat_source(["float", "float", "bool"], ["full", "one", "tail"], "float")
    stub = ("#include <cmath>\n#define __global__\n#define __restrict__\nstruct D { unsigned x; };\n"
            "D threadIdx, blockIdx, blockDim, gridDim;\nusing std::erf;\n")
    (tmp_path / "k.cpp").write_text(stub + src)
    gxx = subprocess.run(["g++", "-std=c++14", "-fsyntax-only", "-Wno-unknown-pragmas", str(tmp_path / "k.cpp")],
                         capture_output=True, text=True)
    assert gxx.returncode == 0, gxx.stderr
