"""Task times (`parc.passes.timing`): a module priced as the engine on its device runs it. On a
GPU (`DeviceSpec.gpu`) the array engine fuses elementwise trees and returns a Transpose as a view;
the pricing follows the grouping the engine itself makes (`fusion.trees`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from parc.cluster.devices import DEVICES
from parc.exec.engines.array import ArrayEngine
from parc.exec.engines.fusion import Group
from parc.passes.timing import module_seconds

N = 1 << 20  # elements per tensor: 4 MiB in float32


def _module() -> tuple[onnx.ModelProto, dict]:
    """y = relu(x * w + b) + z, Transpose(y), and z * z: one fusible tree of four nodes (each
    intermediate read once), a lone Mul and a Transpose."""
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"]), helper.make_node("Add", ["r", "z"], ["y"]),
             helper.make_node("Transpose", ["y"], ["t"], perm=[1, 0]),
             helper.make_node("Mul", ["z", "z"], ["zz"])]
    shape = [1024, N // 1024]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("x", "w", "b", "z")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape[::-1] if n == "t" else shape)
            for n in ("t", "zz")]
    model = helper.make_model(helper.make_graph(nodes, "m", io, outs), opset_imports=[helper.make_opsetid("", 17)])

    info = {n: (TensorProto.FLOAT, tuple(shape)) for n in ("x", "w", "b", "z", "xw", "h", "r", "y", "zz")}
    info["t"] = (TensorProto.FLOAT, tuple(shape[::-1]))
    return model, info


def test_a_gpu_prices_the_trees_the_engine_fuses_and_transposes_as_views():
    model, info = _module()
    h100 = DEVICES["h100-80g"]
    floor, bw = h100.launch_floor, h100.memory_bandwidth
    tensor = 4 * N
    # the engine's own grouping: Mul, Add, Relu, Add as one tree (each intermediate read once);
    # the lone Mul(z, z) and the Transpose run alone
    engine = ArrayEngine(model, device="cpu", fuse=True)
    groups = [s[0] for s in engine._steps if isinstance(s[0], Group)]
    assert [[o.op for o in g.ops] for g in groups] == [["Mul", "Add", "Relu", "Add"]]
    # the tree reads x, w, b, z and writes y; Mul(z, z) reads z twice and writes zz; the
    # Transpose moves nothing (a launch)
    want = max(5 * tensor / bw, floor) + max(3 * tensor / bw, floor) + floor
    assert module_seconds(model, h100, info) == pytest.approx(want)
    # the same device run by onnxruntime (not a GPU): every node moves its bytes, floors add
    plain = replace(h100, gpu=False)
    unfused = (3 + 3 + 2 + 3 + 2 + 3) * tensor / bw + 6 * floor
    assert module_seconds(model, plain, info) == pytest.approx(unfused)


def test_views_move_no_bytes_but_into_an_output_on_a_cpu():
    from onnx import numpy_helper

    shape = numpy_helper.from_array(np.array([N], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"]), helper.make_node("Unsqueeze", ["y", "ax"], ["u"])]
    ax = numpy_helper.from_array(np.array([0], np.int64), "ax")
    model = helper.make_model(helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, N // 1024])],
        [helper.make_tensor_value_info("u", TensorProto.FLOAT, [1, N])], [shape, ax]),
        opset_imports=[helper.make_opsetid("", 17)])
    info = {"x": (TensorProto.FLOAT, (1024, N // 1024)), "y": (TensorProto.FLOAT, (N,)),
            "u": (TensorProto.FLOAT, (1, N))}
    h100 = DEVICES["h100-80g"]
    assert module_seconds(model, h100, info) == pytest.approx(2 * h100.launch_floor)
    # onnxruntime hands x's buffer to the Reshape, and copies the last view into the module's
    # output (`test_onnxruntime_copies_a_view_into_or_out_of_a_module_output`)
    cpu = DEVICES["cpu"]
    copy = 2 * 4 * N / (cpu.memory_bandwidth * cpu.memory_efficiency)
    assert module_seconds(model, cpu, info) == pytest.approx(2 * cpu.launch_floor + copy)


def test_a_gpu_prices_a_softmax_gradient_as_one_pass():
    """y * (dy - ReduceSum(dy * y, -1, keepdims=1)), as autodiff writes a softmax's gradient, is
    one step of the engine (`fusion.softmax_grad_groups`): priced as one kernel reading dy and y
    and writing the result; the Mul after it reads that result."""
    shape = [1024, N // 1024]
    nodes = [helper.make_node("Mul", ["dy", "y"], ["p"]), helper.make_node("ReduceSum", ["p", "axes"], ["s"]),
             helper.make_node("Sub", ["dy", "s"], ["d"]), helper.make_node("Mul", ["y", "d"], ["dx"]),
             helper.make_node("Mul", ["dx", "two"], ["out"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("dy", "y")]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [-1]), helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    model = helper.make_model(helper.make_graph(nodes, "m", io, [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
                                                inits), opset_imports=[helper.make_opsetid("", 17)])

    info = {n: (TensorProto.FLOAT, tuple(shape)) for n in ("dy", "y", "p", "d", "dx", "out")}
    info["s"] = (TensorProto.FLOAT, (shape[0], 1))
    engine = ArrayEngine(model, device="cpu", fuse=True)
    assert [s[4].rpartition("(")[2] for s in engine._steps] == ["SoftmaxGrad)", "Mul)"]
    h100 = DEVICES["h100-80g"]
    floor, bw, tensor = h100.launch_floor, h100.memory_bandwidth, 4 * N
    want = max(3 * tensor / bw, floor) + max((2 * tensor + 4) / bw, floor)
    assert module_seconds(model, h100, info) == pytest.approx(want)


def test_onnxruntime_copies_a_view_into_or_out_of_a_module_output():
    """r = relu(x), v = Reshape(r), then relu(v): onnxruntime hands r's buffer to the Reshape
    (even where an Add reads r too), but copies it where r, or the view itself, is a module
    output (an output has a buffer of its own); a GPU's array engine returns a view either way."""
    from onnx import numpy_helper

    shape = numpy_helper.from_array(np.array([N], np.int64), "shape")

    def module(outputs: tuple[str, ...], add: bool = True) -> onnx.ModelProto:
        nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["v"]),
                 helper.make_node("Relu", ["v"], ["o"])]
        if add:
            nodes.append(helper.make_node("Add", ["r", "r"], ["a"]))
        return helper.make_model(helper.make_graph(
            nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, N // 1024])],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs], [shape]),
            opset_imports=[helper.make_opsetid("", 17)])


    info = {n: (TensorProto.FLOAT, (1024, N // 1024)) for n in ("x", "r", "a")}
    info.update({n: (TensorProto.FLOAT, (N,)) for n in ("v", "o")})
    cpu = replace(DEVICES["cpu"], launch_floor=0.0)
    tensor, bw = 4 * N, cpu.memory_bandwidth * cpu.memory_efficiency
    assert module_seconds(module(("o", "a")), cpu, info) == pytest.approx((2 + 2 + 3) * tensor / bw)  # no copy
    assert module_seconds(module(("o", "r"), add=False), cpu, info) == pytest.approx((2 + 2 + 2) * tensor / bw)
    assert module_seconds(module(("o", "v"), add=False), cpu, info) == pytest.approx((2 + 2 + 2) * tensor / bw)
    h100 = replace(DEVICES["h100-80g"], launch_floor=0.0)
    assert module_seconds(module(("o", "r"), add=False), h100, info) == \
        pytest.approx(module_seconds(module(("o",), add=False), h100, info))


def test_a_fold_is_an_add_per_summed_value():
    from parc.cluster.cost import compute_time
    from parc.passes.timing import fold_seconds

    cpu = DEVICES["cpu"]
    info = {"g.mb": (TensorProto.FLOAT, (256, 512)), "h.mb": (TensorProto.FLOAT16, (1024,)),
            "loss.mb": (TensorProto.FLOAT, ())}
    add = compute_time(256 * 512, 3 * 4 * 256 * 512, cpu, "float32", "Add", queued=True)
    assert fold_seconds({"g": ["g.mb", "sum"]}, info, cpu) == pytest.approx(add)
    half = compute_time(1024, 3 * 2 * 1024, cpu, "float16", "Add", queued=True)
    both = fold_seconds({"g": ["g.mb", "sum"], "h": ["h.mb", "sum"], "loss": ["loss.mb", "last"],
                         "y": ["g.mb", "concat", 0]}, info, cpu)
    assert both == pytest.approx(add + half)  # a `last` keeps its value; a `concat` joins once, at the end
    assert fold_seconds({}, info, cpu) == 0.0


def test_a_softmax_the_graph_says_is_masked_is_priced_as_one():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1024, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1024, 1024])
    model = helper.make_model(helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="sm")], "m", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])

    info = {n: (TensorProto.FLOAT, (1024, 1024)) for n in ("x", "y")}
    cpu = replace(DEVICES["cpu"], memory_op_efficiency={"Softmax": 0.5, "SoftmaxMasked": 0.05, "SoftmaxPadded": 0.25})
    plain = module_seconds(model, cpu, info)
    assert module_seconds(model, cpu, info, {"sm": "SoftmaxMasked", "other": "SoftmaxPadded"}) > 5 * plain
    assert module_seconds(model, cpu, info, {"sm": "SoftmaxPadded"}) == pytest.approx(2 * plain, rel=0.01)
    assert module_seconds(model, cpu, info, {"other": "SoftmaxMasked"}) == plain


def test_a_wheres_constant_mask_is_priced_by_its_runs():
    """A module's boolean initializer is the Where's condition: a causal triangle broadcast over the
    batch changes rarely, a random mask at every other element."""
    shape = (16, 64, 64)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)
    zero = helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])

    info = {n: (TensorProto.FLOAT, shape) for n in ("x", "y")}
    cpu = replace(DEVICES["cpu"], memory_op_efficiency={"Where": 0.5}, op_piece={"Where": 7e-9})

    def priced(mask: np.ndarray) -> float:
        m = helper.make_tensor("m", TensorProto.BOOL, mask.shape, mask.ravel().tolist())
        graph = helper.make_graph([helper.make_node("Where", ["m", "x", "zero"], ["y"])], "g", [x], [y], [m, zero])
        return module_seconds(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), cpu, info)

    causal = priced(np.tri(64, 64, dtype=bool))
    noisy = priced(np.random.default_rng(0).random((64, 64)) > 0.5)
    runs = 16 * 64 * 64 / 2
    assert noisy - causal == pytest.approx(7e-9 * (runs - 16 * 127), rel=0.05)


def test_a_weight_gradients_transpose_costs_nothing_on_a_cpu():
    """MatMul(Transpose(x), dy), as `parc grad` writes a weight's gradient: onnxruntime's CPU
    optimizer packs x transposed inside the product (MatmulTransposeFusion), so the module costs
    its MatMul alone. A Transpose another node also reads, one whose result is a module output,
    one of a Transpose (merged with it first) and a batched one (attention's) stay priced."""
    from parc.cluster.cost import compute_time
    from parc.passes.timing import fused_into_products

    def module(extra_reader=False, of_transpose=False, as_output=False, batched=False):
        shape = [4, 256, 512] if batched else [256, 512]
        perm = [0, 2, 1] if batched else [1, 0]
        nodes = [helper.make_node("Transpose", ["x0" if of_transpose else "x"], ["xt"], perm=perm),
                 helper.make_node("MatMul", ["xt", "dy"], ["g"])]
        if of_transpose:
            nodes.insert(0, helper.make_node("Transpose", ["x"], ["x0"], perm=perm))
        if extra_reader:
            nodes.append(helper.make_node("Relu", ["xt"], ["r"]))
        t = [*shape[:-2], shape[-1], shape[-2]]
        io = [helper.make_tensor_value_info("x", TensorProto.FLOAT, t if of_transpose else shape),
              helper.make_tensor_value_info("dy", TensorProto.FLOAT, [*shape[:-1], 512])]
        outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                for n in ("g", *(("r",) if extra_reader else ()), *(("xt",) if as_output else ()))]
        return helper.make_model(helper.make_graph(nodes, "m", io, outs), opset_imports=[helper.make_opsetid("", 17)])

    assert fused_into_products(module()) == {0}
    for kind in ("extra_reader", "as_output", "batched"):
        assert fused_into_products(module(**{kind: True})) == set(), kind
    assert fused_into_products(module(of_transpose=True)) == set()
    info = {"x": (TensorProto.FLOAT, (256, 512)), "xt": (TensorProto.FLOAT, (512, 256)),
            "dy": (TensorProto.FLOAT, (256, 512)), "g": (TensorProto.FLOAT, (512, 512)),
            "r": (TensorProto.FLOAT, (512, 256))}
    cpu = DEVICES["cpu"]
    alone = compute_time(2 * 512 * 256 * 512, 4 * (2 * 256 * 512 + 512 * 512), cpu, "float32", "MatMul", queued=True)
    assert module_seconds(module(), cpu, info) == pytest.approx(alone)
    assert module_seconds(module(extra_reader=True), cpu, info) > alone
