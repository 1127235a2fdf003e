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
from parc.exec.engines.tree_kernel import Group
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


def _softmax_gradient_module(shape: list[int]) -> tuple[onnx.ModelProto, dict]:
    nodes = [helper.make_node("Mul", ["dy", "y"], ["p"]), helper.make_node("ReduceSum", ["p", "axes"], ["s"]),
             helper.make_node("Sub", ["dy", "s"], ["d"]), helper.make_node("Mul", ["y", "d"], ["dx"]),
             helper.make_node("Mul", ["dx", "two"], ["out"])]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("dy", "y")]
    inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [-1]), helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    model = helper.make_model(helper.make_graph(nodes, "m", io, [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)],
                                                inits), opset_imports=[helper.make_opsetid("", 17)])
    info = {n: (TensorProto.FLOAT, tuple(shape)) for n in ("dy", "y", "p", "d", "dx", "out")}
    info["s"] = (TensorProto.FLOAT, (shape[0], 1))
    return model, info


def test_a_gpu_prices_a_softmax_gradient_as_one_pass():
    """y * (dy - ReduceSum(dy * y, -1, keepdims=1)), as autodiff writes a softmax's gradient, is
    one step of the engine (`fusion.softmax_grad_groups`), which takes in the Mul reading it
    (`fusion.RowGroup`): priced as one kernel reading dy and y and writing the Mul's result."""
    model, info = _softmax_gradient_module([1024, N // 1024])
    engine = ArrayEngine(model, device="cpu", fuse=True)
    assert [s[4].rpartition("(")[2] for s in engine._steps] == ["SoftmaxGrad)"]
    h100 = replace(DEVICES["h100-80g"], launch_floor=0.0)
    bw, tensor = h100.memory_bandwidth, 4 * N
    assert module_seconds(model, h100, info) == pytest.approx((3 * tensor + 4) / bw)
    # rows longer than the row kernel holds in registers (8,192): the looping kernel, one step too
    model, info = _softmax_gradient_module([64, N // 64])
    assert module_seconds(model, h100, info) == pytest.approx((3 * tensor + 4) / bw)
    # over another axis than the last: the gradient, then the Mul
    model.graph.initializer[0].CopyFrom(helper.make_tensor("axes", TensorProto.INT64, [1], [0]))
    assert module_seconds(model, h100, info) == pytest.approx((3 * tensor + 2 * tensor + 4) / bw)


def test_a_gpu_prices_a_softmax_with_the_tree_before_it_as_one_pass():
    """Attention's scale and mask, its softmax, the softmax's gradient and the mask's and scale's
    gradients (`masked_softmax_model`): two kernels on a GPU (`fusion.RowGroup`). The first reads
    x and the mask and writes y; the second reads dy and y and the mask and writes g. A padding
    mask [B, 1, 1, S] (one run of dims broadcast, `flat_layout`'s "split") too. Where the mask is
    broadcast over two runs ([B, 1, S, 1]) the flat index cannot read it: the trees and the row
    kernels run apart."""
    from helpers import masked_softmax_model

    shape, mask = (8, 4, 256, 256), (256, 256)
    model = masked_softmax_model(shape, mask)
    f = TensorProto.FLOAT
    info = {k: (f, shape) for k in ("x", "dy", "xs", "xm", "y", "p", "d", "dx", "dm", "g")}
    info.update({"mask": (TensorProto.BOOL, mask), "s": (f, shape[:-1] + (1,))})
    h100 = replace(DEVICES["h100-80g"], launch_floor=0.0)
    bw, tensor, scalar = h100.memory_bandwidth, 4 * np.prod(shape), 4
    masked = np.prod(mask)
    fused = (2 * tensor + masked + 2 * scalar) + (3 * tensor + masked + 2 * scalar)
    assert module_seconds(model, h100, info) == pytest.approx(fused / bw)
    padding = (8, 1, 1, 256)
    info["mask"] = (TensorProto.BOOL, padding)
    fused = (2 * tensor + 2048 + 2 * scalar) + (3 * tensor + 2048 + 2 * scalar)
    assert module_seconds(masked_softmax_model(shape, padding), h100, info) == pytest.approx(fused / bw)
    rows = (8, 1, 256, 1)  # the tree before: x, scale, mask, low -> xm; then the softmax; the
    info["mask"] = (TensorProto.BOOL, rows)  # gradient; then the tree after it
    apart = (tensor + 2 * scalar + 2048 + tensor) + 2 * tensor + 3 * tensor + (tensor + 2048 + 2 * scalar + tensor)
    assert module_seconds(masked_softmax_model(shape, rows), h100, info) == pytest.approx(apart / bw)


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

    assert _folded(module()) == {0}
    for kind in ("extra_reader", "as_output", "batched"):
        assert _folded(module(**{kind: True})) == set(), kind
    assert _folded(module(of_transpose=True)) == set()
    info = {"x": (TensorProto.FLOAT, (256, 512)), "xt": (TensorProto.FLOAT, (512, 256)),
            "dy": (TensorProto.FLOAT, (256, 512)), "g": (TensorProto.FLOAT, (512, 512)),
            "r": (TensorProto.FLOAT, (512, 256))}
    cpu = DEVICES["cpu"]
    alone = compute_time(2 * 512 * 256 * 512, 4 * (2 * 256 * 512 + 512 * 512), cpu, "float32", "MatMul", queued=True)
    assert module_seconds(module(), cpu, info) == pytest.approx(alone)
    assert module_seconds(module(extra_reader=True), cpu, info) > alone


def _fusion_module():
    """A module with each fusion `fused_into_products` knows and a near miss of each."""
    f = TensorProto.FLOAT
    consts = [helper.make_tensor(n, f, [], [v]) for n, v in (("two", 2.0), ("three", 3.0))]
    consts.append(helper.make_tensor("row", f, [64], [2.0] * 64))
    nodes = [
        helper.make_node("Tanh", ["x"], ["t1"], name="tanh"),
        helper.make_node("Mul", ["t1", "three"], ["m3"], name="mul_by_three"),  # read by a product
        helper.make_node("Relu", ["m3"], ["m3r"], name="relu_of_m3"),  # and by more than products
        helper.make_node("MatMul", ["t1", "w"], ["p"], name="product"),
        helper.make_node("Mul", ["p", "three"], ["ps"], name="scale_after"),  # the product's only reader
        helper.make_node("MatMul", ["m3", "w"], ["q"], name="product_read_twice"),
        helper.make_node("Div", ["q", "two"], ["qs"], name="div_after_shared"),  # q is read twice
        helper.make_node("Relu", ["q"], ["qr"], name="relu"),
        helper.make_node("Div", ["x", "three"], ["xs"], name="div_before"),  # read only by a product
        helper.make_node("Div", ["x", "two"], ["xs_out"], name="div_before_an_output"),  # a module output too
        helper.make_node("MatMul", ["xs_out", "w"], ["r2"], name="product_of_an_output"),
        helper.make_node("MatMul", ["xs", "w"], ["r"], name="product_of_scaled"),
        helper.make_node("Mul", ["x", "row"], ["xr"], name="mul_by_a_row"),  # not a scalar
        helper.make_node("MatMul", ["xr", "w"], ["s"], name="product_of_row"),
    ]
    shape = [32, 64]
    io = [helper.make_tensor_value_info("x", f, shape), helper.make_tensor_value_info("w", f, [64, 64])]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("ps", "qs", "qr", "r", "s", "m3r", "xs_out", "r2")]
    model = helper.make_model(helper.make_graph(nodes, "m", io, outs, consts),
                              opset_imports=[helper.make_opsetid("", 17)])
    return model, ("x", "w", "t1", "m3", "p", "q", "xs", "xr")


def test_what_onnxruntime_folds_into_a_product_costs_nothing():
    """A scalar scale of a product's result or operand: gone from onnxruntime's optimized graph,
    priced at 0."""

    model, names = _fusion_module()
    removed = {model.graph.node[i].name for i in _folded(model)}
    assert removed == {"scale_after", "div_before"}
    info = {n: (TensorProto.FLOAT, (32, 64)) for n in names}
    info["w"] = (TensorProto.FLOAT, (64, 64))
    cpu = DEVICES["cpu"]
    whole = module_seconds(model, cpu, info)
    kept = helper.make_model(helper.make_graph([n for n in model.graph.node if n.name not in removed], "m",
                                               model.graph.input, model.graph.output, model.graph.initializer),
                             opset_imports=[helper.make_opsetid("", 17)])
    assert whole == pytest.approx(module_seconds(kept, cpu, info))


def test_onnxruntime_removes_every_node_priced_as_fused():
    """The other way round: whatever `fused_into_products` prices at 0 is absent from the graph
    onnxruntime's CPU optimizer writes, for the module above and for gpt-tiny's one-rank step
    (simplified first, as `parc plan` writes its modules: `parc.ir.simplify`)."""
    import onnxruntime as ort

    from parc.ir.simplify import simplify

    def optimized_names(model, tmp) -> set[str]:
        opts = ort.SessionOptions()
        opts.optimized_model_filepath = str(tmp)
        opts.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return {n.name for n in onnx.load(str(tmp)).graph.node}

    import tempfile
    from pathlib import Path

    model, _ = _fusion_module()
    with tempfile.TemporaryDirectory() as d:
        left = optimized_names(model, Path(d) / "a.onnx")
        removed = {model.graph.node[i].name for i in _folded(model)}
        assert removed and not removed & left
        assert {"mul_by_three", "div_after_shared", "mul_by_a_row", "div_before_an_output"} <= left
        # a training step: its weight gradients' transposes
        import subprocess
        import sys

        step = Path(d) / "g.train.onnx"
        subprocess.run([sys.executable, "-m", "parc.cli.main", "models", "build", "gpt-tiny", "--train", "momentum",
                        "-o", str(step)], check=True, capture_output=True)
        model = onnx.load(str(step))
        typed = onnx.shape_inference.infer_shapes(model).graph
        dtypes = {v.name: v.type.tensor_type.elem_type for v in (*typed.value_info, *typed.input, *typed.output)}
        model, _ = simplify(model, dtypes)
        removed = {model.graph.node[i].name for i in _folded(model)}
        assert len(removed) > 10 and not removed & optimized_names(model, Path(d) / "b.onnx")


def test_reads_of_values_the_caches_no_longer_hold_cost_the_cold_rate():
    """With a cold bandwidth, a module pays for its inputs (touched by an earlier task), for a
    value read back after more than the cache share of traffic and for writing its outputs,
    beyond the elementwise stream's rate; not for a value read right after it was written.
    Without one, nothing more."""
    from parc.cluster.work import far_bytes
    from parc.ir.dtypes import DType
    from parc.ir.graph import Node, Value

    mib = 1 << 20

    def v(name: str, n: int) -> Value:
        return Value(name, DType.from_numpy(np.dtype(np.float32)), (n * mib // 4,))

    x, a, big, y, z = v("x", 1), v("a", 1), v("big", 64), v("y", 64), v("z", 1)
    # x (input) -> a, then 128 MiB of traffic (big in and out), then a read back with a fresh z
    nodes = [Node("Relu", [x], [a]), Node("Relu", [big], [y]), Node("Add", [a, z], [v("out", 1)])]
    assert sum(far_bytes(nodes, share=100 * mib)) == (1 + 64 + 1 + 1) * mib  # x, big, z first read; a after 129 MiB
    assert sum(far_bytes(nodes, share=200 * mib)) == (1 + 64 + 1) * mib  # a still held
    assert sum(far_bytes(nodes, share=200 * mib, gone={1})) == (1 + 1) * mib  # the big node does not run
    # the module's outputs are written into memory the caches do not hold (a step keeps them)
    assert sum(far_bytes(nodes, share=200 * mib, outputs={"out", "y"})) == (1 + 64 + 1 + 1 + 64) * mib
    assert sum(far_bytes(nodes, share=200 * mib, gone={1}, outputs={"out", "y"})) == (1 + 1 + 1) * mib
    unknown = Value("u", x.dtype, (None, 4))  # a dim the lowering does not know: no traffic
    assert sum(far_bytes([Node("Add", [unknown, x], [v("w", 1)])], share=100 * mib)) == mib

    model, info = _module()
    cpu = replace(DEVICES["h100-80g"], gpu=False)
    plain = module_seconds(model, cpu, info)
    cold = replace(cpu, cold_bandwidth=cpu.memory_bandwidth / 4, cache_share=1e12)
    assert cold.cold_cost() == pytest.approx(3 / cpu.memory_bandwidth)
    # the module's inputs x, w, b, z are read from afar and its outputs t, zz written there (6
    # tensors); nothing is read back far
    assert module_seconds(model, cold, info) == pytest.approx(plain + 6 * 4 * N * cold.cold_cost())
    assert replace(cpu, cold_bandwidth=0.0).cold_cost() == 0.0


def test_a_gpu_prices_a_softmax_gradient_reading_its_bfloat16_dy_as_one_pass():
    """In a bf16 step the softmax gradient's dy is a product's bfloat16 output cast up: the cast is
    the tree before the row step (`fusion.RowGroup`), so the kernel reads dy's two bytes an element
    and y's four, and writes the gradient; no float32 dy goes to memory."""
    shape = [1024, N // 1024]
    f, bf = TensorProto.FLOAT, TensorProto.BFLOAT16
    nodes = [helper.make_node("Cast", ["dyl"], ["dy"], to=f), helper.make_node("Mul", ["dy", "y"], ["p"]),
             helper.make_node("ReduceSum", ["p", "axes"], ["s"]), helper.make_node("Sub", ["dy", "s"], ["d"]),
             helper.make_node("Mul", ["y", "d"], ["dx"])]
    io = [helper.make_tensor_value_info("dyl", bf, shape), helper.make_tensor_value_info("y", f, shape)]
    model = helper.make_model(helper.make_graph(nodes, "m", io, [helper.make_tensor_value_info("dx", f, shape)],
                                                [helper.make_tensor("axes", TensorProto.INT64, [1], [-1])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    info = {n: (f, tuple(shape)) for n in ("y", "dy", "p", "d", "dx")}
    info.update({"dyl": (bf, tuple(shape)), "s": (f, (shape[0], 1))})
    h100 = replace(DEVICES["h100-80g"], launch_floor=0.0)
    assert module_seconds(model, h100, info) == pytest.approx((2 * N + 4 * N + 4 * N) / h100.memory_bandwidth)


def _folded(model) -> set[int]:
    """`parc.cluster.work.fused_into_products` over an ONNX module's nodes."""
    from parc.cluster.work import fused_into_products
    from parc.passes.timing import module_nodes

    nodes, consts = module_nodes(model)
    return fused_into_products(nodes, {o.name for o in model.graph.output}, consts,
                               {t.name for t in model.graph.initializer})
