"""Small builders shared by tests: hand-made ONNX graphs."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

# the mpich wheel's mpiexec beside this Python, else one on PATH; tests that start ranks need it
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (install the mpich wheel)")


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 18, functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8,
                             functions=list(functions))


def tensor(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def inp(name: str, shape, dtype=TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def tiny_training_step(name: str, directory, optimizer=None, precision: str = "fp32") -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(a zoo model's training step, built in `directory`, its products in `precision`; seeded
    feeds for its data inputs: floats standard normal, token ids and labels below the size they
    index)."""
    from parc.autodiff import OptimizerConfig, make_training_step
    from parc.ir import from_model, load, to_onnx
    from parc.models import build_model
    from parc.passes.lower import index_limit

    graph = load(build_model(name, directory / f"{name}.onnx"))
    make_training_step(graph, optimizer or OptimizerConfig("adamw", lr=1e-3, weight_decay=0.01), precision=precision)
    model = to_onnx(graph)
    rng = np.random.default_rng(0)
    feeds = {}
    for v in from_model(model).inputs:  # the data inputs: parameters and state are constants here
        if v.dtype.is_float:  # type: ignore[union-attr]
            feeds[v.name] = rng.standard_normal(v.shape).astype(v.dtype.numpy)  # type: ignore[union-attr]
        else:
            feeds[v.name] = rng.integers(0, index_limit(v), size=v.shape).astype(v.dtype.numpy)  # type: ignore[union-attr]
    return model, feeds


def legacy_gpt_block_model() -> onnx.ModelProto:
    """A PyTorch-legacy-style attention reshape: Shape -> Gather -> Unsqueeze -> Concat -> Reshape,
    a causal mask from ConstantOfShape/Range/Expand of computed shapes, and a Where."""
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["shape"]),
        n("Gather", ["shape", "zero"], ["b"], axis=0),
        n("Gather", ["shape", "one"], ["s"], axis=0),
        n("Unsqueeze", ["b", "axes0"], ["b1"]),
        n("Unsqueeze", ["s", "axes0"], ["s1"]),
        n("Concat", ["b1", "s1", "heads", "head_dim"], ["split_shape"], axis=0),
        n("MatMul", ["x", "w"], ["h"]),
        n("Reshape", ["h", "split_shape"], ["hs"]),
        n("Transpose", ["hs"], ["ht"], perm=[0, 2, 1, 3]),
        n("Concat", ["s1", "s1"], ["mask_shape"], axis=0),
        n("ConstantOfShape", ["mask_shape"], ["ones"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
        n("Trilu", ["ones"], ["tri"], upper=0),
        n("Cast", ["tri"], ["mask"], to=TensorProto.BOOL),
        n("Range", ["zero_s", "s", "one_s"], ["pos"]),
        n("Unsqueeze", ["pos", "axes0"], ["pos1"]),
        n("Concat", ["b1", "s1"], ["pos_shape"], axis=0),
        n("Expand", ["pos1", "pos_shape"], ["pos_b"]),
        n("MatMul", ["ht", "htT"], ["scores"]),
        n("Where", ["mask", "scores", "neg"], ["masked"]),
        n("Softmax", ["masked"], ["probs"], axis=-1),
        n("Cast", ["pos_b"], ["pos_f"], to=TensorProto.FLOAT),
        n("ReduceSum", ["pos_f"], ["pos_sum"], keepdims=0),
        n("Transpose", ["ht"], ["htT"], perm=[0, 1, 3, 2]),
    ]
    rng = np.random.default_rng(0)
    inits = [tensor("zero", np.array(0)), tensor("one", np.array(1)), tensor("axes0", np.array([0])),
             tensor("heads", np.array([2])), tensor("head_dim", np.array([4])),
             tensor("w", rng.standard_normal((8, 8)).astype(np.float32)),
             tensor("zero_s", np.array(0)), tensor("one_s", np.array(1)),
             tensor("neg", np.array(-1e9, dtype=np.float32))]
    # Transpose producing htT comes last in the list: the importer must sort.
    return make_model(nodes, [inp("x", ["batch", "seq", 8])],
                      [inp("probs", None), inp("pos_sum", None)], inits, opset=17)


def parc(*args: str, timeout: float = 600, env: dict[str, str] | None = None):
    """Run the `parc` command in a fresh interpreter, capturing its output; `env`: variables
    set on top of this process's environment."""
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "parc.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env} if env else None)


def assert_one_line_error(res, *needles: str) -> None:
    """Bad input: exit code 2, one `parc: error:` line naming each needle, no traceback, no stdout."""
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("parc: error: ")
    assert "Traceback" not in res.stderr and not res.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]


def masked_softmax_model(shape, mask_shape, dtype=np.float32, opset: int = 18) -> onnx.ModelProto:
    """Attention's softmax and its gradient as parc's GPT and autodiff write them, over x of
    `shape`: y = Softmax(Where(mask, x * 0.125, -1e9)), dx = y * (dy - ReduceSum(dy * y, [-1])),
    g = Where(mask, dx, 0) * 0.125; outputs y and g. `mask` is a bool input of `mask_shape`."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    n = helper.make_node
    nodes = [n("Mul", ["x", "scale"], ["xs"]), n("Where", ["mask", "xs", "low"], ["xm"]),
             n("Softmax", ["xm"], ["y"], axis=-1), n("Mul", ["dy", "y"], ["p"]),
             n("ReduceSum", ["p", "axes"], ["s"], keepdims=1), n("Sub", ["dy", "s"], ["d"]),
             n("Mul", ["y", "d"], ["dx"]), n("Where", ["mask", "dx", "zero"], ["dm"]), n("Mul", ["dm", "scale"], ["g"])]
    inputs = [inp("x", list(shape), elem), inp("mask", list(mask_shape), TensorProto.BOOL), inp("dy", list(shape), elem)]
    consts = [tensor("scale", np.array(0.125, dtype)), tensor("low", np.array(-1e9, dtype)),
              tensor("zero", np.array(0, dtype)), tensor("axes", np.array([-1], np.int64))]
    return make_model(nodes, inputs, [inp("y", None, elem), inp("g", None, elem)], consts, opset=opset)


def loss_softmax_model(rows: int, cols: int, dtype=np.float32) -> onnx.ModelProto:
    """A classification loss's gradient as parc's autodiff writes it: g = (Softmax(z) - onehot) *
    scale, the one-hot labels [rows, cols] and the scale [rows, 1] inputs; output g."""
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    n = helper.make_node
    nodes = [n("Softmax", ["z"], ["y"], axis=-1), n("Sub", ["y", "onehot"], ["d"]), n("Mul", ["d", "scale"], ["g"])]
    inputs = [inp("z", [rows, cols], elem), inp("onehot", [rows, cols], elem), inp("scale", [rows, 1], elem)]
    return make_model(nodes, inputs, [inp("g", None, elem)])


def bf16_casts_model(shape=(4, 8), width: int = 8) -> onnx.ModelProto:
    """Mixed precision as `parc grad --precision bf16` writes it: y = MatMul(Cast(x, bf16),
    Cast(w, bf16)) in bfloat16, then Cast(y, float) + b, times 2, Cast to bfloat16 for a second
    MatMul, whose output is cast back to float (the output z); and r = Cast(Cast(x, bf16), float)
    * x, a value rounded to bfloat16 and back (output r)."""
    n = helper.make_node
    bf, f = TensorProto.BFLOAT16, TensorProto.FLOAT
    nodes = [n("Cast", ["x"], ["xl"], to=bf), n("Cast", ["w"], ["wl"], to=bf), n("MatMul", ["xl", "wl"], ["yl"]),
             n("Cast", ["yl"], ["y"], to=f), n("Add", ["y", "b"], ["h"]), n("Mul", ["h", "two"], ["h2"]),
             n("Cast", ["h2"], ["hl"], to=bf), n("MatMul", ["hl", "wl"], ["zl"]), n("Cast", ["zl"], ["z"], to=f),
             n("Cast", ["xl"], ["xr"], to=f), n("Mul", ["xr", "x"], ["r"])]
    inputs = [inp("x", list(shape)), inp("w", [shape[-1], width]), inp("b", [width])]
    return make_model(nodes, inputs, [inp("z", None), inp("r", None)], [tensor("two", np.float32(2))])


def flat_source_of(group, leaves) -> tuple[tuple, str] | None:
    """(a key, the CUDA source) of the flat kernel a fusion `Group` would build for these leaves
    (NumPy arrays standing for the device's), or None where it would not build one."""
    from parc.exec.engines import gpu, tree_kernel

    plan = group.flat([a.dtype for a in leaves], [a.shape for a in leaves], tree_kernel.readable(leaves))
    if plan is None:
        return None
    dtype, types, _shape, modes, _extents = plan
    out = tree_kernel.BF16 if group.out_dtype(dtype) == tree_kernel.BFLOAT16 else ""
    return (types, modes, group.body("float"), out), group.flat_source(types, modes, gpu.CTYPES[dtype], out)
