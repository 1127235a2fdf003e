"""`node_pieces`: the short contiguous pieces a node walks, which a CPU engine pays for one by one
(`DeviceSpec.piece_cost`) on top of the roofline."""

import numpy as np
import pytest
from onnx import helper

from parc.ir.dtypes import DType
from parc.ir.graph import Node, Value
from parc.ops import node_pieces

F32 = DType.from_numpy(np.float32)


def _v(name: str, shape) -> Value:
    return Value(name, F32, shape)


def _node(op: str, inputs: list, out, **attrs) -> Node:
    return Node(op, [_v(f"x{i}", s) for i, s in enumerate(inputs)], [_v("y", out)],
                {k: helper.make_attribute(k, v) for k, v in attrs.items()})


def test_a_transposes_runs_are_the_trailing_dims_it_keeps():
    # attention's heads moved ahead of the tokens, runs of 8 float32 (32 B: a whole piece each)
    assert node_pieces(_node("Transpose", [(8, 16, 4, 8)], (8, 4, 16, 8), perm=[0, 2, 1, 3])) == 4096 / 8
    # runs of 64 float32 (256 B) count a quarter each: a long run streams
    assert node_pieces(_node("Transpose", [(8, 16, 4, 64)], (8, 4, 16, 64), perm=[0, 2, 1, 3])) == 512 * 0.25
    # two kept dims make one run of 4 x 8
    assert node_pieces(_node("Transpose", [(8, 16, 4, 8)], (16, 8, 4, 8), perm=[1, 0, 2, 3])) == 4096 / 32 * 0.5
    # the last axis moves: the input's rows are the pieces (no perm: the dims reversed)
    assert node_pieces(_node("Transpose", [(8, 4, 16, 8)], (8, 4, 8, 16), perm=[0, 1, 3, 2])) == 4096 / 8
    assert node_pieces(_node("Transpose", [(64, 16)], (16, 64))) == 64
    # nothing moves: one piece, not priced
    assert node_pieces(_node("Transpose", [(8, 16)], (8, 16), perm=[0, 1])) == 0


def test_a_row_op_walks_its_rows():
    assert node_pieces(_node("Softmax", [(8, 4, 16, 16)], (8, 4, 16, 16), axis=-1)) == 512
    assert node_pieces(_node("LayerNormalization", [(128, 32)], (128, 32))) == 128 * 0.5
    # a layer normalisation over the last two axes: rows of 16 x 16
    assert node_pieces(_node("LayerNormalization", [(8, 4, 16, 16)], (8, 4, 16, 16), axis=2)) == 32 * 64 / 1024
    # a softmax (opset 13 on) along one axis that is not the last: rows of 16 along it
    assert node_pieces(_node("Softmax", [(8, 4, 16, 16)], (8, 4, 16, 16), axis=2)) == 512
    # a segmentation loss over NCHW scores: a row of 10 classes at each pixel
    assert node_pieces(_node("SoftmaxCrossEntropyLoss", [(16, 10, 32, 32), (16, 32, 32)], ())) == 16 * 32 * 32


def test_a_broadcast_walks_its_spans():
    # a row's statistic taken from it: 128 spans of 32 (128 B: half a piece each)
    assert node_pieces(_node("Sub", [(8, 16, 32), (8, 16, 1)], (8, 16, 32))) == 128 * 0.5
    # softmax's gradient: spans of 16
    assert node_pieces(_node("Mul", [(8, 4, 16, 16), (8, 4, 16, 1)], (8, 4, 16, 16))) == 512
    # a bias: spans of its 96
    assert node_pieces(_node("Add", [(128, 96), (96,)], (128, 96))) == pytest.approx(128 * 64 / 384)
    # a factor shared by the heads: spans of 16, the innermost run over which every input is whole
    # (a Where's pieces are its condition's runs instead: `test_a_wheres_pieces_are_...`)
    assert node_pieces(_node("Mul", [(8, 1, 16), (8, 4, 16)], (8, 4, 16))) == 32
    # no broadcast, or a scalar's: one span, not priced
    assert node_pieces(_node("Add", [(128, 96), (128, 96)], (128, 96))) == 0
    assert node_pieces(_node("Mul", [(8, 16, 128), ()], (8, 16, 128))) == 0
    assert node_pieces(_node("Pow", [(8, 16, 128), (1,)], (8, 16, 128))) == 0


def test_unknown_shapes_and_other_ops_have_none():
    assert node_pieces(_node("Transpose", [None], None, perm=[1, 0])) == 0
    assert node_pieces(_node("Sub", [(8, 16, 32), (8, 16, 1)], None)) == 0
    assert node_pieces(_node("Softmax", [("B", 16)], ("B", 16))) == 0
    assert node_pieces(_node("MatMul", [(8, 16), (16, 4)], (8, 4))) == 0
    assert node_pieces(_node("Relu", [(8, 16)], (8, 16))) == 0


def test_a_transpose_of_size_one_dims_moves_nothing():
    assert node_pieces(_node("Transpose", [(8, 1, 16)], (1, 8, 16), perm=[1, 0, 2])) == 0
    assert node_pieces(_node("Transpose", [(1, 8, 16)], (8, 16, 1), perm=[1, 2, 0])) == 0
    # the size-1 dim between them does not hide that the last axis moves
    assert node_pieces(_node("Transpose", [(8, 1, 16)], (16, 1, 8), perm=[2, 1, 0])) == 8


@pytest.mark.parametrize("seed", range(30))
def test_a_size_one_dim_does_not_change_the_pieces(seed):
    """The same data with a size-1 dim inserted anywhere (and the perm moving it anywhere) walks
    the same pieces; a broadcast of a tensor by itself walks one span."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(d) for d in rng.integers(2, 9, size=rng.integers(1, 5)))
    perm = [int(p) for p in rng.permutation(len(shape))]
    base = node_pieces(_node("Transpose", [shape], tuple(shape[p] for p in perm), perm=perm))
    at, to = int(rng.integers(0, len(shape) + 1)), int(rng.integers(0, len(shape) + 1))
    wider = shape[:at] + (1,) + shape[at:]
    moved = [p + (p >= at) for p in perm]
    moved.insert(to, at)
    assert node_pieces(_node("Transpose", [wider], tuple(wider[p] for p in moved), perm=moved)) == base
    assert node_pieces(_node("Add", [shape, shape], shape)) == 0


def test_a_convolutions_pieces_are_the_elements_of_its_lowering():
    # a 3x3 Conv, 8 -> 16 channels on 16 images of 32 x 32: im2col is 8*9 rows by 1024 positions per
    # image, each row copied as 32 runs of 32 (the output's last dim), a run costing at least a
    # cache line's worth of elements (16 float32)
    conv = _node("Conv", [(16, 8, 32, 32), (16, 8, 3, 3)], (16, 16, 32, 32), pads=[1, 1, 1, 1])
    assert node_pieces(conv) == 16 * 72 * 1024 + 16 * 72 * 32 * 16
    # grouped: each group expands its own C/g channels, all C of them in all
    grouped = _node("Conv", [(2, 8, 8, 8), (8, 2, 3, 3)], (2, 8, 8, 8), pads=[1, 1, 1, 1], group=4)
    assert node_pieces(grouped) == 2 * 8 * 9 * 64 + 2 * 8 * 9 * 8 * 16
    # a pointwise Conv is multiplied as it is; one with a stride or padding is expanded
    assert node_pieces(_node("Conv", [(16, 8, 32, 32), (4, 8, 1, 1)], (16, 4, 32, 32))) == 0
    strided = _node("Conv", [(16, 8, 32, 32), (4, 8, 1, 1)], (16, 4, 16, 16), strides=[2, 2])
    assert node_pieces(strided) == 16 * 8 * 256 + 16 * 8 * 16 * 16
    # float16 fits 32 elements in a line
    f16 = DType.from_numpy(np.float16)
    half = Node("Conv", [Value("x", f16, (16, 8, 32, 32)), Value("w", f16, (16, 8, 3, 3))],
                [Value("y", f16, (16, 16, 32, 32))], {"pads": helper.make_attribute("pads", [1, 1, 1, 1])})
    assert node_pieces(half) == 16 * 72 * 1024 + 16 * 72 * 32 * 32
    # a ConvTranspose writes Cout x kernel rows by the input's positions, then folds them (col2im)
    up = _node("ConvTranspose", [(16, 16, 16, 16), (16, 8, 2, 2)], (16, 8, 32, 32), strides=[2, 2])
    assert node_pieces(up) == 16 * 8 * 4 * 256
    grad = _node("ConvTranspose", [(4, 8, 8, 8), (8, 4, 3, 3)], (4, 8, 8, 8), pads=[1, 1, 1, 1], group=2)
    assert node_pieces(grad) == 4 * 8 * 9 * 64
    # a weight's gradient is a Conv too: its batch is the forward's input channels
    # (kernels of 32 x 32 over outputs of 3 x 3: 3 runs of 3 per row, whatever the output channels)
    wgrad = _node("Conv", [(8, 16, 32, 32), (4, 16, 32, 32)], (8, 4, 3, 3), pads=[1, 1, 1, 1])
    assert node_pieces(wgrad) == 8 * 16 * 1024 * 9 + 8 * 16 * 1024 * 3 * 16
    assert node_pieces(_node("Conv", [(8, 16, 32, 32), (2, 16, 32, 32)], (8, 2, 3, 3), pads=[1, 1, 1, 1])) \
        == node_pieces(wgrad)
    # an unknown shape: none
    assert node_pieces(_node("Conv", [(16, 8, 32, 32), (16, 8, 3, 3)], None)) == 0


def _where(cond: Value, out_shape) -> Node:
    return Node("Where", [cond, _v("a", out_shape), _v("b", ())], [_v("y", out_shape)])


def test_a_wheres_pieces_are_the_runs_of_its_condition():
    from parc.ir.tensor import TensorData

    def const(name, a):
        return Value(name, const=TensorData.from_array(a))

    causal = np.tri(8, 8, dtype=bool)  # row i: i + 1 True then False; runs change at each row's end
    runs = 1 + int(np.count_nonzero(causal.ravel()[1:] != causal.ravel()[:-1]))
    assert runs == 15
    # broadcast over the batch and heads: its runs once per copy
    assert node_pieces(_where(const("m", causal), (2, 4, 8, 8))) == runs * 8
    # the whole output: its runs exactly
    full = np.random.default_rng(0).random((4, 64)) > 0.5
    assert node_pieces(_where(const("m", full), (4, 64))) == 1 + np.count_nonzero(full.ravel()[1:] != full.ravel()[:-1])
    # broadcast inside (a column mask over rows): counted on the broadcast output
    column = np.array([[True], [False]])
    assert node_pieces(_where(const("m", column), (2, 16))) == 2
    # a condition from data (a ReLU's gradient): as a random one, half the elements
    relu = Value("pos", F32, (4, 64))
    Node("Greater", [_v("x", (4, 64)), _v("zero", ())], [relu])
    assert node_pieces(_where(relu, (4, 64))) == 128
    # a mask cast from a constant buffer: a causal triangle's two runs a row
    cast = Value("cast", F32, (8, 8))
    Node("Cast", [const("buf", causal.astype(np.uint8))], [cast])
    assert node_pieces(_where(cast, (2, 4, 8, 8))) == 2 * 2 * 4 * 8
    assert node_pieces(_where(relu, None)) == 0
