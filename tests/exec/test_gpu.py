"""The GPU path: NCCL communicators (one rank: NCCL world size 1) and `parc run` / `parc verify`
with the cupy engine on device memory. Skipped without a CUDA GPU and CuPy."""

from __future__ import annotations

import numpy as np
import pytest

from parc.exec.runner import gpu_available
from tests.helpers import parc

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
