"""The GPU path: NCCL communicators (one rank: NCCL world size 1) and `parc run` / `parc verify`
with the cupy engine on device memory. Skipped without a CUDA GPU and CuPy."""

from __future__ import annotations

import numpy as np
import pytest

from parc.exec.engine_choice import gpu_available
from tests.helpers import bf16_casts_model, loss_softmax_model, masked_softmax_model, parc, tiny_training_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy")]


def test_nccl_collectives_on_one_rank():
    import cupy

    from parc.exec.comm import MpiComm
    from parc.exec.nccl import NcclComm

    comm = NcclComm(MpiComm(timeout=20))
    x = cupy.arange(24, dtype=cupy.float32).reshape(4, 6)
    for got in (comm.all_reduce(x), comm.all_gather(x, 1), comm.reduce_scatter(x, 0),
                comm.all_to_all(x, 0, 1), comm.broadcast(x)):
        np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(x))
    parts = comm.gather_parts(x[:3])
    assert len(parts) == 1 and parts[0].shape == (3, 6)
    (piece,) = comm.exchange([x[1:3].reshape(-1)], [12])  # pieces of any size: to itself
    np.testing.assert_array_equal(cupy.asnumpy(piece), cupy.asnumpy(x[1:3]).reshape(-1))
    assert comm.for_axis((1,), 0) is comm.for_axis((1,), 0)


def test_cupy_engine_trains_and_verifies_on_the_gpu(tmp_path):
    assert parc("models", "build", "gpt-tiny", "-o", str(tmp_path / "m.onnx")).returncode == 0
    assert parc("grad", str(tmp_path / "m.onnx"), "--optimizer", "sgd", "--lr", "0.05",
                "-o", str(tmp_path / "t.onnx")).returncode == 0
    res = parc("plan", str(tmp_path / "t.onnx"), "--devices", "1xh100-80g", "-o", str(tmp_path / "plan"))
    if res.returncode:
        res = parc("plan", str(tmp_path / "t.onnx"), "--devices", "1xa100-80g", "-o", str(tmp_path / "plan"))
    assert res.returncode == 0, res.stderr
    run = parc("run", str(tmp_path / "plan"), "--steps", "5", "--engine", "cupy", "--json")
    assert run.returncode == 0, run.stderr
    ver = parc("verify", str(tmp_path / "plan"), "--engine", "cupy", "--rtol", "1e-3", "--atol", "1e-5")
    assert ver.returncode == 0, ver.stdout + ver.stderr


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 1), (5, 7), (4, 33), (2, 3, 1024), (6, 3000), (1, 50257)])
def test_softmax_kernel_matches_numpy(dtype, shape):
    import cupy

    from parc.exec.engines.gpu import softmax_last

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 8).astype(dtype)
    if shape[-1] > 1:
        x[0, ..., 0] = np.nan  # a NaN makes its row NaN
        x.reshape(-1, shape[-1])[-1, :] = -np.inf  # so does a row of -inf
        x.reshape(-1, shape[-1])[-1, 1] = 0.0
    y = softmax_last(cupy, cupy.asarray(x))
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    want = e / e.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(cupy.asnumpy(y), want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-7)
    strided = cupy.asarray(np.ascontiguousarray(np.swapaxes(x, 0, -1))).swapaxes(0, -1)  # same values
    np.testing.assert_allclose(cupy.asnumpy(softmax_last(cupy, strided)), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 1), (5, 7), (4, 33), (2, 3, 1024), (6, 3000), (3, 50257)])
def test_logsumexp_kernel_matches_numpy(dtype, shape):
    import cupy

    from parc.exec.engines.gpu import logsumexp_last

    rng = np.random.default_rng(4)
    x = (rng.standard_normal(shape) * 8).astype(dtype)
    flat = x.reshape(-1, shape[-1])
    flat[-1, ::2] = -np.inf  # -inf elements add nothing
    if shape[-1] > 1:
        flat[0, -1] = np.nan  # a NaN makes its row NaN
        flat[1 % len(flat), :] += np.linspace(0, 60, shape[-1])  # a row whose max comes late: rescaled sums
    wide = x.astype(np.float64)
    top = np.max(np.where(np.isnan(wide), -np.inf, wide), axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        want = (np.log(np.sum(np.exp(wide - top), axis=-1)) + top[..., 0]).astype(dtype)
    want[np.isneginf(top[..., 0])] = -np.inf  # a row of -inf: log(0)
    want[np.isnan(x).any(axis=-1)] = np.nan
    got = cupy.asnumpy(logsumexp_last(cupy, cupy.asarray(x)))
    assert got.shape == shape[:-1] and got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=1e-6 if dtype == np.float32 else 1e-13, atol=1e-5)


@pytest.mark.parametrize("classes", [7, 1000, 50257])
@pytest.mark.parametrize(("reduction", "weighted", "ignore", "log_prob"), [
    ("mean", False, None, False), ("mean", False, -100, False), ("sum", True, 2, True), ("none", True, -1, True),
    ("mean", True, 0, False)])
def test_softmax_cross_entropy_on_the_gpu_matches_onnxruntime(classes, reduction, weighted, ignore, log_prob):
    """SoftmaxCrossEntropyLoss over [samples, classes] takes the one-pass kernel on a GPU."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from parc.exec.engines.array import ArrayEngine
    from parc.exec.runner import to_host
    from tests.helpers import inp, make_model

    samples = 37
    rng = np.random.default_rng(5)
    scores = (rng.standard_normal((samples, classes)) * 4).astype(np.float32)
    labels = rng.integers(0, classes, samples).astype(np.int64)
    if ignore is not None:
        labels[::5] = ignore
    feeds = {"scores": scores, "labels": labels}
    ins = [inp("scores", [samples, classes]), inp("labels", [samples], TensorProto.INT64)]
    if weighted:
        feeds["w"] = rng.uniform(0.5, 2, classes).astype(np.float32)
        ins.append(inp("w", [classes]))
    attrs = {"reduction": reduction, **({"ignore_index": ignore} if ignore is not None else {})}
    outs = ["loss", "log_prob"] if log_prob else ["loss"]
    node = helper.make_node("SoftmaxCrossEntropyLoss", list(feeds), outs, **attrs)
    model = make_model([node], ins, [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ArrayEngine(model, device="gpu").run(feeds)
    for name, ref in zip(outs, want):
        a = to_host(got[name])
        assert a.shape == ref.shape and a.dtype == ref.dtype
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [1, 5, 4096 * 4 + 3])
def test_bfloat16_casts_round_as_ml_dtypes(size):
    import cupy
    import ml_dtypes

    from parc.exec.engines.gpu import cast_bfloat16

    rng = np.random.default_rng(6)
    x = (rng.standard_normal(size) * 10.0 ** rng.integers(-40, 39, size)).astype(np.float32)
    special = np.array([np.nan, -np.inf, np.inf, -0.0, 3.4028235e38, 1e-45, 1.00390625, 1.01171875], np.float32)
    x[:len(special)] = special[:size]
    want = x.astype(ml_dtypes.bfloat16)
    got = cast_bfloat16(cupy, cupy.asarray(x), np.dtype(ml_dtypes.bfloat16))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(cupy.asnumpy(got).astype(np.float32), want.astype(np.float32))  # NaN == NaN here
    back = cast_bfloat16(cupy, got, np.dtype(np.float32))
    np.testing.assert_array_equal(cupy.asnumpy(back), want.astype(np.float32))
    if size > 1:  # a strided view (one element is contiguous whatever its stride), which CuPy casts itself
        strided = cupy.asarray(np.stack([x, x], 1))[:, 0]
        assert cast_bfloat16(cupy, strided, np.dtype(ml_dtypes.bfloat16)) is None
    assert cast_bfloat16(cupy, cupy.asarray(x.astype(np.float64)), np.dtype(ml_dtypes.bfloat16)) is None


def test_tf32_sets_compute_type_and_math_mode():
    import cupy
    from cupy._core import _routines_linalg as linalg
    from cupy.cuda import cublas, device

    from parc.exec.engines.gpu import enable_tf32

    old = cupy._core.get_compute_type(np.float32)
    try:
        enable_tf32(cupy)
        assert cupy._core.get_compute_type(np.float32) == linalg.COMPUTE_TYPE_TF32
        assert cublas.getMathMode(device.get_cublas_handle()) == 3
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal((4, 256, 512)), rng.standard_normal((4, 512, 64))
        got = cupy.asnumpy(cupy.asarray(a, np.float32) @ cupy.asarray(b, np.float32))
        err = float(np.abs(got - a @ b).max())
        assert 1e-4 < err < 1.0  # TF32's 10-bit mantissa shows; float32 would be ~1e-5
    finally:
        cupy._core.set_compute_type(np.float32, old)
        cublas.setMathMode(device.get_cublas_handle(), 0)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("name", ["gpt-tiny", "unet-tiny", "moe-tiny"])
def test_fused_kernels_equal_unfused_on_the_gpu(name, optimizer, tmp_path, capfd):
    import cupy

    from parc.autodiff import OptimizerConfig
    from parc.exec.engines.array import ArrayEngine
    from parc.exec.engines.tree_kernel import Group

    model, feeds = tiny_training_step(name, tmp_path, OptimizerConfig(optimizer, lr=1e-3, weight_decay=0.01))
    fused, plain = ArrayEngine(model, device="gpu", fuse=True), ArrayEngine(model, device="gpu", fuse=False)
    got, want = fused.run(feeds), plain.run(feeds)
    assert "could not fuse" not in capfd.readouterr().err
    groups = [s[0] for s in fused._steps if isinstance(s[0], Group)]
    trees = [g for g in groups if len(g.ops) > 1]  # lone nodes are groups too, some of integers
    assert trees and all(g._kernels and all(k is not None for k in g._kernels.values()) for g in trees)
    assert sum(bool(g._flats) for g in groups) > len(groups) // 2  # most run the flat kernel
    # --fmad=false: each operation of a tree rounds as CuPy's own kernel does; the softmax gradient's
    # row sums (one step when fused) and the row kernels' sums are added in another order, a few ulps.
    # SGD moves a parameter by lr times its gradient, so those ulps stay ulps. AdamW's first step
    # moves it by lr times a gradient over its own magnitude: where a gradient is rounding noise
    # (a sum that cancels to ~1e-10) the step is any value up to lr (6.5e-6 seen on an H200), so
    # AdamW is held to 10% of lr: a wrong update formula is off by lr.
    atol = 1e-7 if optimizer == "sgd" else 1e-4
    for k in want:
        np.testing.assert_allclose(cupy.asnumpy(got[k]), cupy.asnumpy(want[k]), rtol=1e-6, atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "lead"), [((8, 1024, 64), 1), ((8, 1024, 64), 2), ((3, 5), 1), ((70000, 3), 1),
                                             ((2, 3, 4, 5), 3), ((1, 7), 1), ((9000, 4096), 1)])
def test_sum_over_leading_axes_matches_numpy(dtype, shape, lead):
    import cupy

    from parc.exec.engines.gpu import sum_leading

    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    got = cupy.asnumpy(sum_leading(cupy, cupy.asarray(x), lead))
    want = x.astype(np.float64).sum(axis=tuple(range(lead)))
    assert got.shape == want.shape and got.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-3)
    # a non-contiguous input is summed from a contiguous copy
    t = cupy.asarray(np.ascontiguousarray(np.swapaxes(x, 0, -1))).swapaxes(0, -1)
    np.testing.assert_allclose(cupy.asnumpy(sum_leading(cupy, t, lead)), want, rtol=1e-4, atol=1e-3)


def test_out_of_gpu_memory_is_one_line_and_exit_1(tmp_path):
    """CuPy's pool held to 4 MiB (CUPY_GPU_MEMORY_LIMIT): gpt-tiny's step at batch 64 (about
    20 MiB) runs out of device memory; the run ends with one line saying so, exit 1."""
    assert parc("models", "build", "gpt-tiny", "--set", "batch=64", "-o", str(tmp_path / "m.onnx")).returncode == 0
    assert parc("grad", str(tmp_path / "m.onnx"), "--optimizer", "adamw", "-o", str(tmp_path / "t.onnx")).returncode == 0
    assert parc("plan", str(tmp_path / "t.onnx"), "--devices", "1xa100-80g", "-o", str(tmp_path / "plan")).returncode == 0
    res = parc("run", str(tmp_path / "plan"), "--steps", "2", "--engine", "cupy", timeout=300,
               env={"CUPY_GPU_MEMORY_LIMIT": str(4 << 20)})
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert "out of GPU memory at step 1, in " in lines[0] and "Traceback" not in res.stderr, res.stderr


def test_profile_measures_the_gpu_and_plan_reads_its_calibration(tmp_path):
    from parc.calibrate import gpu_device_type
    from parc.cluster import load_constants, parse_devices

    out = tmp_path / "gpu.yaml"
    res = parc("profile", "-o", str(out), "--engine", "cupy", "--seconds", "0.02", timeout=300)
    assert res.returncode == 0, res.stderr
    assert "CuPy" in out.read_text().splitlines()[0]
    device = gpu_device_type()
    spec = load_constants(out).apply(parse_devices(f"1x{device}")).devices[0]
    assert 1e12 < spec.peak("float32") < 2e15 and 1e11 < spec.memory_bandwidth < 2e13
    assert 1e-7 < spec.launch_floor < 1e-3


def test_tight_pool_gives_back_pieces_before_it_grows():
    """Eight freed 64 MiB blocks cannot hold one of 256 MiB: CuPy's pool would then hold 256 MiB
    more, the TightPool at least 256 MiB less (the pieces go back first); its high-water mark
    is what it held with the pieces; the arrays stay usable."""
    import cupy

    from parc.exec.engines.gpu import TightPool

    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    tight = TightPool(cupy)
    try:
        cupy.cuda.set_allocator(tight.malloc)
        pieces = [cupy.ones(16 << 20, cupy.float32) for _ in range(8)]
        held = pool.total_bytes()
        assert held >= 512 << 20
        del pieces
        big = cupy.full(64 << 20, 2.0, cupy.float32)
        assert pool.total_bytes() <= held - (256 << 20)
        assert tight.high >= held
        assert float(big.sum()) == 2.0 * (64 << 20)
    finally:
        cupy.cuda.set_allocator(pool.malloc)  # CuPy's default
        pool.set_limit(size=0)
        pool.free_all_blocks()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 1), (4, 33), (2, 3, 1024), (6, 3000)])
def test_softmax_gradient_and_layer_norm_kernels_match_numpy(dtype, shape):
    import cupy

    from parc.exec.engines.gpu import layer_norm_last, softmax_grad_last

    rng = np.random.default_rng(2)
    x, dy = rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)
    e = np.exp(x - x.max(-1, keepdims=True))
    y = (e / e.sum(-1, keepdims=True)).astype(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-14}
    got = cupy.asnumpy(softmax_grad_last(cupy, cupy.asarray(dy), cupy.asarray(y)))
    np.testing.assert_allclose(got, y * (dy - (dy * y).sum(-1, keepdims=True)), **tol)
    for axis in sorted({len(shape) - 1, 1}):
        axes = tuple(range(axis, len(shape)))
        scale, bias = rng.standard_normal(shape[axis:]).astype(dtype), rng.standard_normal(shape[axis:]).astype(dtype)
        mean = x.mean(axis=axes, keepdims=True)
        inv = 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
        for b in (bias, None):
            out = layer_norm_last(cupy, cupy.asarray(x), axis, 1e-5, cupy.asarray(scale),
                                  None if b is None else cupy.asarray(b))
            want = (x - mean) * inv * scale + (0 if b is None else b)
            np.testing.assert_allclose(cupy.asnumpy(out[0]), want, rtol=1e-4 if dtype == np.float32 else 1e-11,
                                       atol=1e-5 if dtype == np.float32 else 1e-12)
            assert out[1].shape == mean.shape and out[2].shape == inv.shape
            np.testing.assert_allclose(cupy.asnumpy(out[1]), mean, rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(cupy.asnumpy(out[2]), inv, rtol=1e-4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, "bfloat16"])
@pytest.mark.parametrize(("sa", "sb", "ta", "tb"), [
    ((2, 3, 64, 32), (2, 3, 32, 48), False, False), ((2, 3, 64, 32), (2, 3, 32, 48), True, False),
    ((2, 3, 64, 32), (2, 3, 32, 48), False, True), ((2, 3, 64, 32), (2, 3, 32, 48), True, True),
    ((4, 64, 32), (32, 48), False, False), ((64, 32), (5, 32, 48), True, False),
    ((1, 3, 7, 5), (2, 1, 5, 9), False, True), ((2, 3, 1, 5), (2, 3, 5, 1), False, False),
    ((2, 64, 3, 32), (2, 3, 32, 48), "heads", False)])
def test_strided_batched_matmul_matches_numpy(dtype, sa, sb, ta, tb):
    """One cublasGemmStridedBatchedEx over transposed views and broadcast batches, no copies."""
    import cupy

    from parc.exec.engines.gpu import batched_matmul

    rng = np.random.default_rng(3)
    dtype = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(__import__("ml_dtypes").bfloat16)

    def operand(shape, transposed):
        if transposed == "heads":  # [B, S, H, D] read as [B, H, S, D]: B calls of H matrices
            x = rng.standard_normal(shape).astype(dtype)
            return x.transpose(0, 2, 1, 3), cupy.asarray(x).transpose(0, 2, 1, 3)
        x = rng.standard_normal(shape[:-2] + (shape[-1], shape[-2]) if transposed else shape).astype(dtype)
        return (np.swapaxes(x, -1, -2) if transposed else x), (cupy.asarray(x).swapaxes(-1, -2) if transposed
                                                               else cupy.asarray(x))
    (a, ga), (b, gb) = operand(sa, ta), operand(sb, tb)
    got = batched_matmul(cupy, ga, gb)
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))  # of the rounded inputs
    assert got is not None and got.shape == want.shape and got.dtype == dtype
    tol = {"float64": 1e-12, "float32": 1e-5, "float16": 2**-10, "bfloat16": 2**-7}[dtype.name]
    # half types accumulate in float32 and round the result once: within one unit of the result
    np.testing.assert_allclose(cupy.asnumpy(got).astype(np.float64), want, rtol=tol, atol=tol * 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape", "mask_shape"), [
    ((2, 3, 4, 6), (4, 6)), ((2, 2, 64, 1024), (64, 1024)), ((3, 3000), (3, 3000)), ((2, 5, 40), (2, 5, 1)),
    ((2, 8192), (1, 8192)), ((2, 9000), (2, 9000)), ((2, 3, 4, 6), (2, 1, 1, 6)), ((2, 3, 64, 64), (2, 1, 1, 64)),
    ((2, 3, 4, 6), (2, 1, 4, 1))])
def test_row_groups_equal_their_parts_on_the_gpu(dtype, shape, mask_shape, monkeypatch):
    """A softmax with the scale and mask before it, and its gradient with theirs after it, as one
    kernel each (`fusion.RowGroup`), against the trees and the row kernels run apart
    (`PARC_CUPY_ROWS=0`: the same row kernels, so the gradient's row sums are added in the same
    order): the same to the bit (each element is computed by the same C text, with
    --fmad=false). Rows over 8,192 take the looping kernels; a padding mask [B, 1, 1, S] is read
    by `flat_layout`'s "split" index; a mask broadcast over two runs of dims runs
    apart in both."""
    import cupy

    from parc.exec.engines.array import ArrayEngine
    from parc.exec.engines.fusion import RowGroup

    rng = np.random.default_rng(5)
    x = (rng.standard_normal(shape) * 8).astype(dtype)
    x.reshape(-1, shape[-1])[0, 1] = np.nan  # a NaN makes its row NaN
    feeds = {"x": x, "mask": rng.random(mask_shape) > 0.3, "dy": rng.standard_normal(shape).astype(dtype)}
    model = masked_softmax_model(shape, mask_shape, dtype)
    fused = ArrayEngine(model, device="gpu", fuse=True)
    monkeypatch.setenv("PARC_CUPY_ROWS", "0")
    apart = ArrayEngine(model, device="gpu", fuse=True)
    assert not any(isinstance(s[0], RowGroup) for s in apart._steps)
    got, want = fused.run(feeds), apart.run(feeds)
    rows = [s[0] for s in fused._steps if isinstance(s[0], RowGroup)]
    one_kernel = mask_shape != (2, 1, 4, 1)
    assert [(r.before is not None, r.after is not None) for r in rows] == [(True, False), (False, True)]
    assert [bool(r._kernels) for r in rows] == [one_kernel] * 2
    for k in ("y", "g"):
        np.testing.assert_array_equal(cupy.asnumpy(got[k]), cupy.asnumpy(want[k]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cols", [7, 1000, 9000, 51200])
def test_a_softmax_storing_through_its_tree_equals_the_two_on_the_gpu(dtype, cols):
    """A loss's gradient, (Softmax(z) - onehot) * scale, as one kernel (`RowGroup` "out" of a
    Softmax; rows over 8,192 loop) against the softmax and the tree run apart: the same bits."""
    import cupy

    from parc.exec.engines.array import ArrayEngine

    rng = np.random.default_rng(6)
    feeds = {"z": (rng.standard_normal((5, cols)) * 4).astype(dtype),
             "onehot": np.eye(cols, dtype=dtype)[rng.integers(0, cols, 5)], "scale": rng.random((5, 1)).astype(dtype)}
    model = loss_softmax_model(5, cols, dtype)
    fused, apart = ArrayEngine(model, device="gpu", fuse=True), ArrayEngine(model, device="gpu", fuse=False)
    got, want = fused.run(feeds)["g"], apart.run(feeds)["g"]
    assert fused._steps[0][0]._kernels
    np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))


def test_casts_to_and_from_bfloat16_in_trees_equal_the_casts_alone_on_the_gpu():
    """A product's bfloat16 output cast up into the tree reading it, the tree's root cast down to
    bfloat16 (`fusion.cast_kind`): the fused kernels read and write bfloat16's bits as
    `gpu.cast_bfloat16` does, so the result equals the unfused engine's to the bit."""
    import cupy

    from parc.exec.engines.array import ArrayEngine
    from parc.exec.engines.tree_kernel import Group

    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((64, 96)).astype(np.float32), "w": rng.standard_normal((96, 96)).astype(np.float32),
             "b": rng.standard_normal(96).astype(np.float32)}
    feeds["x"][0, :3] = [np.nan, np.inf, 1 + 2 ** -8]  # a NaN, an infinity, a tie to even
    model = bf16_casts_model((64, 96), 96)
    fused, apart = ArrayEngine(model, device="gpu", fuse=True), ArrayEngine(model, device="gpu", fuse=False)
    got, want = fused.run(feeds), apart.run(feeds)
    trees = [s[0] for s in fused._steps if isinstance(s[0], Group) and any(o.cast for o in s[0].ops) and len(s[0].ops) > 1]
    assert len(trees) == 2 and all(g._flats for g in trees)  # the flat kernel ran them
    for k in ("z", "r"):
        np.testing.assert_array_equal(cupy.asnumpy(got[k]), cupy.asnumpy(want[k]))


def test_fused_bf16_training_step_equals_unfused_on_the_gpu(tmp_path, capfd):
    import cupy

    from parc.autodiff import OptimizerConfig
    from parc.exec.engines.array import ArrayEngine

    model, feeds = tiny_training_step("gpt-tiny", tmp_path, OptimizerConfig("sgd", lr=1e-3), precision="bf16")
    fused, plain = ArrayEngine(model, device="gpu", fuse=True), ArrayEngine(model, device="gpu", fuse=False)
    got, want = fused.run(feeds), plain.run(feeds)
    assert "could not fuse" not in capfd.readouterr().err
    # SGD moves each float32 master weight by lr times its gradient; a kernel that read or wrote
    # bfloat16 wrongly would be off by about lr, rounding (a sum in another order) by far less
    for k in want:
        np.testing.assert_allclose(cupy.asnumpy(got[k]).astype(np.float32), cupy.asnumpy(want[k]).astype(np.float32),
                                   rtol=1e-6, atol=1e-5)


def test_a_view_among_a_row_steps_leaves_is_copied_and_read_on_the_gpu(monkeypatch):
    """Scores plus a bias that is a transposed view ([S, S] of a [S, S] input, as T5's relative
    position bias), scaled, then a softmax: the row step copies the small view and reads it by the
    flat index; the result equals the parts run apart, to the bit."""
    import cupy
    from onnx import helper as h

    from parc.exec.engines.array import ArrayEngine
    from parc.exec.engines.fusion import RowGroup
    from tests.helpers import inp, make_model, tensor

    nodes = [h.make_node("Transpose", ["b"], ["bt"], perm=[1, 0]), h.make_node("Add", ["x", "bt"], ["s"]),
             h.make_node("Mul", ["s", "two"], ["t"]), h.make_node("Softmax", ["t"], ["y"], axis=-1)]
    model = make_model(nodes, [inp("x", [2, 3, 64, 64]), inp("b", [64, 64])], [inp("y", None)],
                       [tensor("two", np.float32(2))])
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal((2, 3, 64, 64)).astype(np.float32), "b": rng.standard_normal((64, 64)).astype(np.float32)}
    fused = ArrayEngine(model, device="gpu", fuse=True)
    monkeypatch.setenv("PARC_CUPY_ROWS", "0")
    apart = ArrayEngine(model, device="gpu", fuse=True)
    got, want = fused.run(feeds)["y"], apart.run(feeds)["y"]
    (row,) = [s[0] for s in fused._steps if isinstance(s[0], RowGroup)]
    assert row._kernels
    np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))
