"""Elementwise fusion in the array engine (parc/exec/engines/fusion.py).

On NumPy a group runs its nodes one by one, so these tests pin the grouping (which nodes join,
which stay apart, where the group runs, what it frees) and the kernel text; `tests/exec/test_gpu.py`
runs the compiled kernels against the unfused engine on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    bf16_casts_model,
    inp,
    loss_softmax_model,
    make_model,
    masked_softmax_model,
    tensor,
    tiny_training_step,
)
from onnx import TensorProto, helper

from parc.exec.engines.array import ArrayEngine
from parc.exec.engines.fusion import RowGroup
from parc.exec.engines.tree_kernel import BF16, Group
from parc.ops.fusion import cast_kind, fusible, trees

n = helper.make_node


def _groups(engine: ArrayEngine) -> list[Group]:
    return [s[0] for s in engine._steps if isinstance(s[0], Group)]


def _chain_model():
    """y = sqrt(x * x + 1) / (x + b); z = y * 2 read twice (Add and an output), w = Where(c, z, -z)."""
    nodes = [n("Mul", ["x", "x"], ["xx"]), n("Add", ["xx", "one"], ["s"]), n("Sqrt", ["s"], ["r"]),
             n("Add", ["x", "b"], ["d"]), n("Div", ["r", "d"], ["y"]), n("Mul", ["y", "two"], ["z"]),
             n("Neg", ["z"], ["nz"]), n("Where", ["c", "z", "nz"], ["w"]), n("ReduceSum", ["w"], ["total"]),
             n("Exp", ["total"], ["e"])]
    return make_model(nodes, [inp("x", [2, 3]), inp("b", [3]), inp("c", [2, 3], TensorProto.BOOL)],
                      [inp("w", None), inp("z", None), inp("e", None)],
                      [tensor("one", np.float32(1)), tensor("two", np.float32(2))])


def _feeds(rng):
    return {"x": rng.standard_normal((2, 3)).astype(np.float32), "b": np.float32([3, 4, 5]),
            "c": rng.standard_normal((2, 3)) > 0}


def test_groups_are_trees_of_single_reader_values():
    engine = ArrayEngine(_chain_model(), fuse=True)
    groups = _groups(engine)
    # x*x+1 -> sqrt -> / (x+b) -> *2 is one tree; z has two readers (Neg, Where) and is an output,
    # so Neg and Where start a new one; ReduceSum is not elementwise; Exp alone is no group
    assert [[o.op for o in g.ops] for g in groups] == [["Mul", "Add", "Sqrt", "Add", "Div", "Mul"], ["Neg", "Where"]]
    assert groups[0].leaves == ("x", "one", "b", "two")
    assert groups[1].leaves == ("z", "c")
    assert len(engine._steps) == 4  # two groups, ReduceSum, Exp
    got = engine.run(_feeds(np.random.default_rng(0)))
    want = ArrayEngine(_chain_model(), fuse=False).run(_feeds(np.random.default_rng(0)))
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_kernel_body_is_one_local_per_node():
    group = _groups(ArrayEngine(_chain_model(), fuse=True))[0]
    assert group.body("float").splitlines() == [
        "typedef float T;", "T t0 = in0 * in0;", "T t1 = t0 + in1;", "T t2 = sqrt(t1);", "T t3 = in0 + in2;",
        "T t4 = t2 / t3;", "T t5 = t4 * in3;", "out = t5;"]
    where = _groups(ArrayEngine(_chain_model(), fuse=True))[1]
    assert where.body("double").splitlines()[-2:] == ["T t1 = in1 ? in0 : t0;", "out = t1;"]


def test_graph_outputs_and_shared_values_are_not_absorbed():
    nodes = [n("Add", ["x", "x"], ["a"]), n("Mul", ["a", "x"], ["m"]), n("Sub", ["m", "a"], ["s"])]
    model = make_model(nodes, [inp("x", [4])], [inp("s", None)])
    # a is read by Mul and Sub: Mul stays alone with its own tree, Sub takes Mul's
    groups = _groups(ArrayEngine(model, fuse=True))
    assert [[o.op for o in g.ops] for g in groups] == [["Mul", "Sub"]]
    model = make_model(nodes, [inp("x", [4])], [inp("s", None), inp("m", None)])
    assert _groups(ArrayEngine(model, fuse=True)) == []


def test_fusion_is_off_on_numpy_by_default():
    assert _groups(ArrayEngine(_chain_model())) == []


@pytest.mark.parametrize("name", ["gpt-tiny", "unet-tiny"])
def test_training_step_fused_equals_unfused(name, tmp_path):
    model, feeds = tiny_training_step(name, tmp_path)
    fused, plain = ArrayEngine(model, fuse=True), ArrayEngine(model, fuse=False)
    assert len(fused._steps) < 0.7 * len(plain._steps)
    got, want = fused.run(feeds), plain.run(feeds)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def _softmax_grad_model(axis: int):
    """dx = y * (dy - ReduceSum(dy * y, [axis], keepdims=1)), as autodiff writes a softmax's gradient."""
    nodes = [n("Softmax", ["x"], ["y"], axis=axis), n("Mul", ["dy", "y"], ["p"]),
             n("ReduceSum", ["p", "axes"], ["s"], keepdims=1), n("Sub", ["dy", "s"], ["d"]),
             n("Mul", ["y", "d"], ["dx"]), n("Mul", ["dx", "two"], ["out"])]
    return make_model(nodes, [inp("x", [2, 3, 5]), inp("dy", [2, 3, 5])], [inp("out", None)],
                      [tensor("axes", np.array([axis], np.int64)), tensor("two", np.float32(2))])


@pytest.mark.parametrize("axis", [-1, 2, 1])
def test_softmax_gradient_is_one_step(axis):
    """The four nodes of a softmax's gradient run as one step (on a GPU one pass per row over the
    last axis), which takes in the Mul reading it (`RowGroup`, "out")."""
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 3, 5)).astype(np.float32),
             "dy": rng.standard_normal((2, 3, 5)).astype(np.float32)}
    fused = ArrayEngine(_softmax_grad_model(axis), fuse=True)
    labels = [s[4] for s in fused._steps]
    assert labels == ["node '#0 (y)' (Softmax)", "node '#4 (dx)' and 4 more (SoftmaxGrad)"], labels
    row = fused._steps[1][0]
    assert isinstance(row, RowGroup) and row.before is None and [o.op for o in row.after.ops] == ["Mul"]
    assert row.output == "dx" and row.leaves == ("dy", "y", "two")
    got, want = fused.run(feeds)["out"], ArrayEngine(_softmax_grad_model(axis), fuse=False).run(feeds)["out"]
    np.testing.assert_array_equal(got, want)


def test_a_softmax_gradient_whose_parts_are_read_elsewhere_is_left_alone():
    model = _softmax_grad_model(-1)
    model.graph.output.append(helper.make_empty_tensor_value_info("s"))  # the row sums are an output too
    assert not any("SoftmaxGrad" in s[4] for s in ArrayEngine(model, fuse=True)._steps)


def _masked_feeds(shape, mask_shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": (rng.standard_normal(shape) * 8).astype(dtype), "mask": rng.random(mask_shape) > 0.3,
            "dy": rng.standard_normal(shape).astype(dtype)}


def test_a_softmax_takes_in_the_tree_before_it_and_its_gradient_the_tree_after_it():
    """Attention's scale and mask before its softmax, and their gradients after the softmax's
    gradient, join the row steps (`RowGroup`): two steps for nine nodes, and the same values."""
    model = masked_softmax_model((2, 3, 4, 6), (4, 6))
    fused = ArrayEngine(model, fuse=True)
    assert [s[4] for s in fused._steps] == ["node '#2 (y)' and 2 more (Softmax)", "node '#6 (dx)' and 5 more (SoftmaxGrad)"]
    into, out = fused._steps[0][0], fused._steps[1][0]
    assert ([o.op for o in into.before.ops], into.after, into.leaves) == (["Mul", "Where"], None, ("x", "scale", "mask", "low"))
    assert (out.before, [o.op for o in out.after.ops], out.output) == (None, ["Where", "Mul"], "dx")
    assert out.leaves == ("dy", "y", "mask", "zero", "scale")
    feeds = _masked_feeds((2, 3, 4, 6), (4, 6))
    got, want = fused.run(feeds), ArrayEngine(model, fuse=False).run(feeds)
    for k in ("y", "g"):
        np.testing.assert_array_equal(got[k], want[k])


def test_a_tree_read_elsewhere_or_an_output_stays_apart_from_the_softmax():
    model = masked_softmax_model((2, 6), (2, 6))
    model.graph.output.append(helper.make_empty_tensor_value_info("xm"))  # the softmax's input is an output
    model.graph.output.append(helper.make_empty_tensor_value_info("dx"))  # so is the gradient
    steps = ArrayEngine(model, fuse=True)._steps
    assert not any(isinstance(s[0], RowGroup) for s in steps)
    assert [s[4] for s in steps][-1] == "node '#8 (g)' and 1 more (Fused)"


@pytest.mark.parametrize(("shape", "mask_shape", "want"), [
    ((2, 3, 4, 6), (4, 6), (("full", "one", "tail", "one"), 6, 32, 1, 4)),  # a warp a row, 4 rows a block
    ((1, 2, 64, 1024), (64, 1024), (("full", "one", "tail", "one"), 1024, 128, 8, 1)),
    ((3, 3000), (3, 3000), (("full", "one", "full", "one"), 3000, 256, 16, 1)),
    ((2, 8192), (1, 8192), (("full", "one", "tail", "one"), 8192, 256, 32, 1)),
    ((2, 5, 40), (2, 5, 1), (("full", "one", "head", "one"), 40, 128, 1, 1)),  # a row's own mask value
    ((2, 8193), (2, 8193), (("full", "one", "full", "one"), 8193, 256, None, 1)),  # longer than registers hold: loops
    ((2, 3, 4, 6), (2, 1, 1, 6), (("full", "one", "split", "one"), 6, 32, 1, 4)),  # a padding mask [B, 1, 1, S]
    ((2, 3, 4, 6), (2, 1, 4, 1), None),  # broadcast over two runs of dims: the flat index cannot read it
])
def test_a_row_group_launches_where_its_kernel_applies(shape, mask_shape, want):
    """`RowGroup.launch` on NumPy arrays: each leaf's mode, the row length, threads, elements a
    thread holds, rows a block; None where the kernel does not apply (the tree and the softmax then
    run one after the other, as on NumPy)."""
    engine = ArrayEngine(masked_softmax_model(shape, mask_shape), fuse=True)
    feeds = _masked_feeds(shape, mask_shape)
    env = {"scale": np.array(0.125, np.float32), "low": np.array(-1e9, np.float32), **feeds}
    run = engine._steps[0][0].launch(env)
    got = None if run is None else (run.before.modes, run.cols, run.threads, run.per, run.each)
    assert got == want
    if run is not None:
        assert run.before.types == ("float", "float", "bool", "float") and run.shape == shape and run.after is None
        assert [k for k, _ in run.before.reads] == ["x", "scale", "mask", "low"]


def test_a_softmax_over_another_axis_or_before_opset_13():
    from parc.ops.fusion import softmax_columns

    assert softmax_columns(-1, 18)((2, 3, 5)) == 5 and softmax_columns(2, 18)((2, 3, 5)) == 5
    assert softmax_columns(1, 18)((2, 3, 5)) is None  # the kernels take the last axis only
    assert softmax_columns(1, 11)((2, 3, 5)) == 15  # before opset 13: the input as [2, 15]
    assert softmax_columns(-1, 11)((2, 3, 5)) == 5 and softmax_columns(-1, 18)(()) is None
    nodes = [n("Mul", ["x", "two"], ["xs"]), n("Softmax", ["xs"], ["y"], axis=1)]
    for opset in (11, 18):  # opset 11: over [2, 15]; opset 18: over axis 1 (NumPy's, not a row kernel)
        model = make_model(nodes, [inp("x", [2, 3, 5])], [inp("y", None)], [tensor("two", np.float32(2))], opset=opset)
        fused = ArrayEngine(model, fuse=True)
        assert isinstance(fused._steps[0][0], RowGroup)
        x = np.random.default_rng(opset).standard_normal((2, 3, 5)).astype(np.float32)
        run = fused._steps[0][0].launch({"x": x, "two": np.float32(2)})
        assert (run.cols if run else None) == (15 if opset == 11 else None)
        np.testing.assert_array_equal(fused.run({"x": x})["y"], ArrayEngine(model, fuse=False).run({"x": x})["y"])


def _loss_feeds(rows, cols, dtype=np.float32):
    rng = np.random.default_rng(1)
    onehot = np.eye(cols, dtype=dtype)[rng.integers(0, cols, rows)]
    return {"z": (rng.standard_normal((rows, cols)) * 4).astype(dtype), "onehot": onehot,
            "scale": rng.random((rows, 1)).astype(dtype)}


@pytest.mark.parametrize("cols", [7, 9000])
def test_a_softmax_hands_its_output_to_the_tree_reading_it(cols):
    """A loss's gradient, (Softmax(z) - onehot) * scale: the softmax stores each element through
    the Sub and the Mul (`RowGroup` "out"), registers-held rows or looping ones."""
    model = loss_softmax_model(3, cols)
    fused = ArrayEngine(model, fuse=True)
    (row,) = [s[0] for s in fused._steps]
    assert (row.before, row.op, row.output, row.leaves) == (None, "Softmax", "y", ("z", "onehot", "scale"))
    feeds = _loss_feeds(3, cols)
    run = row.launch(feeds)
    assert (run.after.modes, run.per, run.before) == (("full", "full", "head"), 1 if cols == 7 else None, None)
    assert [k for k, _ in run.after.reads] == ["onehot", "scale"]
    np.testing.assert_array_equal(fused.run(feeds)["g"], ArrayEngine(model, fuse=False).run(feeds)["g"])


def test_a_training_steps_loss_and_attention_take_in_their_trees(tmp_path):
    """gpt-tiny's AdamW step: each layer's attention softmax takes in its scale and mask, its
    gradient their gradients, and the loss's softmax (in the backward pass) its one-hot Sub and
    the scale."""
    model, _ = tiny_training_step("gpt-tiny", tmp_path)
    rows = [s[0] for s in ArrayEngine(model, fuse=True)._steps if isinstance(s[0], RowGroup)]
    def ops(g):
        return g and tuple(o.op for o in g.ops)

    kinds = sorted((r.op, ops(r.before) or (), ops(r.after) or ()) for r in rows)
    assert kinds == [("Softmax", (), ("Sub", "Mul"))] + [("Softmax", ("Mul", "Where"), ())] * 2 \
        + [("SoftmaxGrad", (), ("Where", "Mul"))] * 2


def test_cast_kinds():
    assert cast_kind("Cast", 1, [True]) == "up" and cast_kind("Cast", 16, [False]) == "down"
    assert cast_kind("Cast", 10, [False]) == "other" and cast_kind("Cast", 1, [False]) == "other"  # float16; a no-op
    assert cast_kind("Mul", None, [False, True]) == "bf16" and cast_kind("Mul", None, [False, False]) == ""
    assert fusible("Cast", ["x"], [(0, "y")], "up") and fusible("Cast", ["x"], [(0, "y")], "down")
    assert not fusible("Cast", ["x"], [(0, "y")], "other") and not fusible("Cast", ["x"], [(0, "y")])
    assert not fusible("Mul", ["a", "b"], [(0, "y")], "bf16") and fusible("Mul", ["a", "b"], [(0, "y")])
    # a cast to bfloat16 ends its tree: the Mul reading it starts its own
    steps = [(True, ["x", "x"], "a"), ("root", ["a"], "al"), (True, ["al"], "ar"), (True, ["ar", "x"], "m")]
    assert trees(steps, ["m"]) == [[0, 1], [2, 3]]


def test_casts_between_float_and_bfloat16_join_the_trees_beside_them():
    """A product's bfloat16 output cast up joins the tree reading it (read as float), and a tree's
    cast down to bfloat16 is its root (stored rounded): `Group.types` gives the bfloat16 leaves
    and `out_dtype` the root's type. Nodes on bfloat16 values stay out of trees."""
    model = bf16_casts_model()
    fused = ArrayEngine(model, fuse=True)
    groups = {tuple((o.op, o.cast) for o in g.ops): g for g in _groups(fused)}
    assert set(groups) == {(("Cast", "up"), ("Add", ""), ("Mul", ""), ("Cast", "down")), (("Cast", "up"), ("Mul", ""))}
    tree = groups[(("Cast", "up"), ("Add", ""), ("Mul", ""), ("Cast", "down"))]
    from parc.exec.engines.tree_kernel import BFLOAT16
    f32 = np.dtype(np.float32)
    assert tree.leaves == ("yl", "b", "two")
    assert tree.types([BFLOAT16, f32, f32]) == (f32, (BF16, "float", "float")) and tree.out_dtype(f32) == BFLOAT16
    assert tree.types([f32, f32, f32]) is None  # the cast's leaf must be bfloat16
    assert tree.types([BFLOAT16, np.dtype(np.float64), np.dtype(np.float64)]) is None  # casts compute in float32
    source = tree.flat_source((BF16, "float", "float"), ("full", "tail", "one"), "float", BF16)
    assert "const unsigned short* __restrict__ p0" in source and "const float in0 = bf16_value(a0[j]);" in source
    assert "unsigned short* __restrict__ o" in source and "o[i] = bf16_bits(out);" in source
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "w": rng.standard_normal((8, 8)).astype(np.float32),
             "b": rng.standard_normal(8).astype(np.float32)}
    got, want = fused.run(feeds), ArrayEngine(model, fuse=False).run(feeds)
    for k in ("z", "r"):
        np.testing.assert_array_equal(got[k], want[k])


def test_a_bf16_training_steps_casts_join_its_trees(tmp_path):
    """gpt-tiny's bf16 AdamW step: products' outputs cast up and tree roots cast down are in
    trees (attention's scale gradient and the loss's gradient, cast down for their products, in
    the row steps before them), and the fused step equals the unfused on NumPy."""
    model, feeds = tiny_training_step("gpt-tiny", tmp_path, precision="bf16")
    fused = ArrayEngine(model, fuse=True)
    steps = [s[0] for s in fused._steps]
    trees = [t for s in steps for t in ([s.before, s.after] if isinstance(s, RowGroup) else [s]) if isinstance(t, Group)]
    casts = [o.cast for t in trees for o in t.ops if o.op == "Cast"]
    assert casts.count("up") >= 8 and casts.count("down") >= 4
    rows = sorted(((r.op, r.before and tuple((o.op, o.cast) for o in r.before.ops), tuple(o.op for o in r.after.ops))
                   for r in steps if isinstance(r, RowGroup) and r.after and r.after.ops[-1].cast == "down"), key=str)
    # the gradient's dy is the product's output cast up: the tree before the row
    assert rows == [("Softmax", None, ("Sub", "Mul", "Cast"))] + [("SoftmaxGrad", (("Cast", "up"),), ("Where", "Mul", "Cast"))] * 2
    got, want = fused.run(feeds), ArrayEngine(model, fuse=False).run(feeds)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_row_steps_run_apart_under_parc_cupy_rows_0(monkeypatch):
    model = masked_softmax_model((2, 6), (2, 6))
    assert sum(isinstance(s[0], RowGroup) for s in ArrayEngine(model, fuse=True)._steps) == 2
    monkeypatch.setenv("PARC_CUPY_ROWS", "0")
    steps = ArrayEngine(model, fuse=True)._steps
    assert not any(isinstance(s[0], RowGroup) for s in steps)
    assert [s[4].rpartition("(")[2] for s in steps] == ["Fused)", "Softmax)", "SoftmaxGrad)", "Fused)"]


def test_a_row_step_whose_kernel_does_not_compile_runs_its_parts(capfd):
    """A compiler's refusal (CuPy raises it at the kernel's first call) is said once, on stderr;
    the tree and the row kernel then run one after the other, with the same values."""
    class CompileException(Exception):
        pass

    class Refusing:  # NumPy, with CuPy's RawKernel that fails to compile
        def __getattr__(self, name):
            return getattr(np, name)

        def RawKernel(self, *args, **kwargs):  # noqa: N802 (CuPy's name)
            def launch(*a):
                raise CompileException("parc.cu(1): error: made up")
            return launch

    model = masked_softmax_model((2, 3, 4, 6), (4, 6))
    fused = ArrayEngine(model, fuse=True)
    for s in fused._steps:
        s[0].xp = Refusing()
        for tree in (s[0].before, s[0].after):
            if tree is not None:
                tree.xp = s[0].xp
    feeds = _masked_feeds((2, 3, 4, 6), (4, 6))
    want = ArrayEngine(model, fuse=False).run(feeds)
    for _ in range(2):
        got = fused.run(feeds)
        for k in ("y", "g"):
            np.testing.assert_array_equal(got[k], want[k])
    err = capfd.readouterr().err
    assert err.count("could not fuse the Softmax row step with its trees: CompileException") == 1
    assert err.count("could not fuse the SoftmaxGrad row step") == 1


def test_a_small_view_among_the_leaves_is_read_after_a_copy():
    """A leaf that is a view (T5's relative position bias, transposed, broadcast over the batch) is
    read by the flat index once copied, where it has at most half the output's elements; a view
    as large as the output is not (the kernel would copy as much as it computes)."""
    engine = ArrayEngine(masked_softmax_model((2, 3, 4, 6), (4, 6)), fuse=True)
    feeds = _masked_feeds((2, 3, 4, 6), (4, 6))
    env = {"scale": np.array(0.125, np.float32), "low": np.array(-1e9, np.float32), **feeds}
    env["mask"] = np.ascontiguousarray(feeds["mask"].T).T  # the same values, a transposed view
    assert not env["mask"].flags.c_contiguous
    run = engine._steps[0][0].launch(env)
    assert run is not None and run.before.modes == ("full", "one", "tail", "one")
    env["x"] = np.ascontiguousarray(np.swapaxes(feeds["x"], 0, 1)).swapaxes(0, 1)  # the scores themselves a view
    assert engine._steps[0][0].launch(env) is None


class _Recording:
    """NumPy with CuPy's RawKernel recording each launch: (source, grid, block, arguments)."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        return getattr(np, name)

    def RawKernel(self, source, name, options=()):  # noqa: N802 (CuPy's name)
        def launch(grid, block, args):
            self.launches.append((source, grid, block, args))
        return launch


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_row_steps_arguments_are_its_parameters_in_order(precision, tmp_path):
    """Every row step of gpt-tiny's step, launched with a recording RawKernel: each argument is
    what its parameter's name in the generated source says (a tree's leaf `bp{j}`/`ap{j}` is
    that tree's leaf j; `x`, `dy`, `y` the row's inputs; `bm{j}`, `bq{j}`, ... leaf j's extent
    arguments), and the launch is found once for a step's leaf layouts, then reused."""
    import re

    model, feeds = tiny_training_step("gpt-tiny", tmp_path, precision=precision)
    engine = ArrayEngine(model, fuse=True)
    rows = [s[0] for s in engine._steps if isinstance(s[0], RowGroup)]
    assert len(rows) == 5
    xp = _Recording()
    seen = {}

    def spy(self, *args):
        seen[id(self)] = (self, dict(zip(self.leaves, args)))
        return RowGroup.__call__(self, *args)

    for row in rows:  # each row step's own leaves, from a NumPy run
        row.__class__ = type("Spied", (RowGroup,), {"__call__": spy})
    engine.run(feeds)
    for row, env in seen.values():
        row.__class__, row.xp = RowGroup, xp
        for _ in range(2):
            row(*[env[k] for k in row.leaves])
        assert len(row._launches) == 1 and len(row._kernels) == 1
        source, _grid, _block, args = xp.launches[-1]
        params = re.search(r"parc_row\((.*?)\) \{", source, re.S).group(1).split(", ")
        assert len(params) == len(args)
        run = row.launch(env)
        extents = {f"{side}{letter}{row_tree.leaves.index(k)}": v
                   for side, tree, row_tree in (("b", run.before, row.before), ("a", run.after, row.after)) if tree
                   for k, e in tree.reads for letter, v in zip("mq", e)}
        for param, arg in zip(params, args):
            name = param.split()[-1]
            if m := re.fullmatch(r"([ba])p(\d+)", name):
                tree = row.before if m[1] == "b" else row.after
                assert arg is env[tree.leaves[int(m[2])]], name
            elif name in ("x", "dy", "y"):
                assert arg is env[row.row_inputs[0 if name in ("x", "dy") else 1]], name
            elif name == "o":
                assert arg.shape == run.shape and arg.dtype == run.out
            elif name in ("rows", "cols"):
                assert int(arg) == (run.cols if name == "cols" else int(np.prod(run.shape)) // run.cols)
            else:
                assert int(arg) == extents[name], name
