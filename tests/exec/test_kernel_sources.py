"""Every CUDA kernel parc writes compiles: the row kernels, the casts, the column sums, and the
kernels fusion generates (flat elementwise trees, row kernels with a tree beside them), compiled
by NVRTC for an H100 (sm_90) on this machine, without a GPU (`tests/nvrtc.py`). What they compute
is checked against NumPy on a GPU (`test_gpu.py`); this catches a source that would not build
before a lent GPU's minutes are spent on it."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from helpers import flat_source_of, loss_softmax_model, masked_softmax_model, tiny_training_step

from parc.exec.engines import gpu
from parc.exec.engines.array import ArrayEngine
from parc.exec.engines.fusion import RowGroup
from parc.exec.engines.tree_kernel import BF16, BFLOAT16, Group
from tests.nvrtc import CompileError, compile_cuda

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the nvidia-cuda-nvrtc wheel is built for Linux")

ROW_OPTIONS = ("--std=c++14", "--fmad=false")


@pytest.mark.parametrize("ctype", ["float", "double"])
def test_the_row_kernels_compile(ctype):
    names = ([f"{k}<{ctype}>" for k in gpu.ROW_KERNELS + gpu.ONE_PASS]
             + [f"{k}_held<{ctype}, {p}>" for k in gpu.ROW_KERNELS for p in gpu.HELD])
    assert compile_cuda(gpu.row_source(), ROW_OPTIONS, names)


def test_the_casts_and_column_sums_compile():
    assert compile_cuda(gpu.cast_source(), ("--std=c++14",))
    assert compile_cuda(gpu.cuda_source("column_sums"), ("--std=c++14",), ["column_sums<float>", "column_sums<double>"])


def test_a_broken_source_is_refused_with_its_log():
    with pytest.raises(CompileError, match="identifier \"undefined_name\" is undefined"):
        compile_cuda(gpu.row_source() + "__global__ void k(float* x) { x[0] = undefined_name; }", ROW_OPTIONS)


def _row_groups(shape, mask_shape, dtype):
    """The masked softmax's two row steps and the arrays their leaves are."""
    engine = ArrayEngine(masked_softmax_model(shape, mask_shape, dtype), fuse=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    env = {"x": x, "dy": x, "y": x, "mask": rng.random(mask_shape) > 0.5, "scale": np.array(0.125, dtype),
           "low": np.array(-1e9, dtype), "zero": np.array(0, dtype)}
    return [s[0] for s in engine._steps if isinstance(s[0], RowGroup)], env


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cols", [6, 100, 200, 400, 1000, 2000, 4000, 8000, 9000])  # each of gpu.HELD, and loops
def test_row_groups_compile(dtype, cols):
    rows, env = _row_groups((2, 3, cols), (3, cols), dtype)
    assert [(r.before is not None, r.after is not None) for r in rows] == [(True, False), (False, True)]
    for row in rows:
        run = row.launch(env)
        assert run is not None and (run.per is None) == (cols > 8192)
        assert compile_cuda(row.source(run), ROW_OPTIONS)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cols", [7, 9000])
def test_a_softmax_storing_through_a_tree_compiles(dtype, cols):
    (row,) = [s[0] for s in ArrayEngine(loss_softmax_model(3, cols, dtype), fuse=True)._steps]
    x = np.zeros((3, cols), dtype)
    run = row.launch({"z": x, "onehot": x, "scale": np.zeros((3, 1), dtype)})
    assert (row.before, row.op) == (None, "Softmax") and (run.per is None) == (cols > 8192)
    assert compile_cuda(row.source(run), ROW_OPTIONS)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_kernels_fusion_makes_for_a_training_step_compile(precision, tmp_path, monkeypatch):
    """The flat kernel of every elementwise tree of gpt-tiny's AdamW step (GELU and its gradient,
    layer normalisation's, the mask's, the optimizer's update; in bf16 the casts up and down
    beside them), and the kernel of every row step with its tree, with the types and leaf modes
    the step's arrays give them."""
    sources = {}

    def record(self, *leaves):
        made = flat_source_of(self, leaves)
        if made is not None:
            sources[made[0]] = made[1]
        return (self.unfused(leaves),)

    def record_row(self, *args):
        run = self.launch(dict(zip(self.leaves, args)))
        assert run is not None
        trees = [t and (t.types, t.modes) for t in (run.before, run.after)]
        sources[("row", self.op, *trees, run.per, run.out)] = self.source(run)
        return row_call(self, *args)

    row_call = RowGroup.__call__
    monkeypatch.setattr(Group, "__call__", record)
    monkeypatch.setattr(RowGroup, "__call__", record_row)
    model, feeds = tiny_training_step("gpt-tiny", tmp_path, precision=precision)
    ArrayEngine(model, fuse=True).run(feeds)
    assert len(sources) > 10 and any("bool" in k[0] for k in sources) and any("head" in k[1] for k in sources)
    assert sum(k[0] == "row" for k in sources) == 3  # attention's softmax, its gradient, the loss's
    if precision == "bf16":  # bfloat16 read by flat kernels and a row's tree before; written by both
        assert any(k[0] != "row" and BF16 in k[0] for k in sources) and any(k[-1] == BF16 for k in sources)
        assert any(k[0] == "row" and k[2] and BF16 in k[2][0] for k in sources)
        assert any(k[0] == "row" and k[-1] == BFLOAT16 for k in sources)
    for source in sources.values():
        assert compile_cuda(source, ROW_OPTIONS)
