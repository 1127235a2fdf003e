"""`op_class`: the class a calibration prices a node's FLOPs by."""

import numpy as np

from parc.ir.graph import Node, Value
from parc.ops import op_class


def _conv(x, w, y) -> Node:
    return Node("Conv", [Value("x", shape=x), Value("w", shape=w)], [Value("y", shape=y)])


def test_a_weight_gradient_convolution_is_its_own_class():
    assert op_class(_conv((16, 8, 32, 32), (8, 8, 3, 3), (16, 8, 32, 32))) == "Conv"
    assert op_class(_conv((8, 16, 32, 32), (8, 16, 32, 32), (8, 8, 3, 3))) == "ConvWeightGrad"
    assert op_class(_conv((8, 16, 32, 32), (8, 16, 32, 32), None)) == "Conv"  # unknown shape: the op
    assert op_class(Node("MatMul", [Value("a"), Value("b")], [Value("c")])) == "MatMul"


def _transpose(shape, perm) -> Node:
    from onnx import helper

    attrs = {"perm": helper.make_attribute("perm", perm)} if perm is not None else {}
    return Node("Transpose", [Value("x", shape=shape)], [Value("y")], attrs)


def test_a_transpose_that_moves_the_last_axis_is_its_own_class():
    assert op_class(_transpose((2, 3, 4, 5), [0, 2, 1, 3])) == "Transpose"  # whole rows move
    assert op_class(_transpose((2, 3, 4, 5), [0, 1, 3, 2])) == "TransposeLastAxis"
    assert op_class(_transpose((4, 5), None)) == "TransposeLastAxis"  # no perm: reversed
    assert op_class(_transpose((5,), None)) == "Transpose"
    assert op_class(_transpose(None, [1, 0])) == "Transpose"  # unknown rank: the op


def _const(name, array) -> Value:
    from parc.ir.tensor import TensorData

    return Value(name, const=TensorData.from_array(np.asarray(array)))


def _softmax_of(op: str, *inputs: Value) -> Node:
    scores = Value("s", shape=(2, 4, 8, 8))
    Node(op, list(inputs), [scores])
    return Node("Softmax", [scores], [Value("y")])


def test_a_softmax_of_scores_a_mask_filled_is_its_own_class():
    x, causal = Value("x", shape=(2, 4, 8, 8)), np.tri(8, 8, dtype=bool)
    fill = _const("f", np.float32(-1e9))
    assert op_class(_softmax_of("Where", _const("m", causal), x, fill)) == "SoftmaxMasked"  # parc's models
    additive = np.where(causal, 0.0, np.finfo(np.float32).min).astype(np.float32)
    assert op_class(_softmax_of("Add", x, _const("m", additive))) == "SoftmaxMasked"  # a GPT-2 export's, folded
    # a Llama export's: the causal triangle And-ed with the padding mask, then a Where's fill
    pad = Value("pad", shape=(2, 1, 1, 8))
    both = Value("both", shape=(2, 1, 8, 8))
    Node("And", [_const("tri", causal[None, None]), pad], [both])
    bias = Value("bias", shape=(2, 1, 8, 8))
    Node("Where", [both, _const("zero", np.float32(0)), fill], [bias])
    assert op_class(_softmax_of("Add", x, bias)) == "SoftmaxMasked"
    # not masked: a padding mask alone (what it hides depends on the data), a bias of small
    # values, a mask that hides nothing, a Softmax of a graph input
    Node("And", [_const("all", np.ones((1, 1, 8, 1), bool)), pad], [both2 := Value("both2", shape=(2, 1, 8, 8))])
    Node("Where", [both2, _const("zero", np.float32(0)), fill], [bias2 := Value("bias2", shape=(2, 1, 8, 8))])
    assert op_class(_softmax_of("Add", x, bias2)) == "Softmax"
    assert op_class(_softmax_of("Add", x, _const("b", np.full((8, 8), -3.0, np.float32)))) == "Softmax"
    assert op_class(_softmax_of("Where", _const("m", np.ones((8, 8), bool)), x, fill)) == "Softmax"
    assert op_class(Node("Softmax", [Value("x", shape=(2, 8))], [Value("y")])) == "Softmax"


def test_a_device_without_the_masked_softmaxs_figures_prices_it_as_a_softmax():
    from parc.cluster.devices import DeviceSpec

    cpu = DeviceSpec("c", {"float32": 1e11}, 1 << 30, 1e10, memory_efficiency=0.9,
                     memory_op_efficiency={"Softmax": 0.5})
    assert cpu.memory_fraction("SoftmaxMasked") == 0.5
    measured = DeviceSpec("c", {"float32": 1e11}, 1 << 30, 1e10, memory_op_efficiency={"Softmax": 0.5, "SoftmaxMasked": 0.1})
    assert measured.memory_fraction("SoftmaxMasked") == 0.1 and measured.memory_fraction("Where") == 1.0


def test_a_softmax_of_scores_a_data_made_mask_filled_is_the_padded_class():
    from parc.ir.dtypes import BOOL, FLOAT, INT64

    x, fill = Value("x", shape=(2, 4, 8, 8)), _const("f", np.float32(-1e9))

    def filled(cond: Value) -> Node:
        bias = Value("bias", shape=(2, 1, 8, 8))
        Node("Where", [cond, _const("zero", np.float32(0)), fill], [bias])
        return _softmax_of("Add", x, bias)

    # a BERT export's: the int64 attention mask looked up in a table of two, cast, expanded
    ids = Value("attention_mask", INT64, (2, 8))
    looked, cast, wide = Value("l", shape=(2, 1, 1, 8)), Value("c", BOOL, (2, 1, 1, 8)), Value("e", BOOL, (2, 1, 8, 8))
    Node("Gather", [_const("table", np.array([0.0, 1.0], np.float32)), ids], [looked])
    Node("Cast", [looked], [cast])
    Node("Expand", [cast, _const("shape", np.array([2, 1, 8, 8]))], [wide])
    assert op_class(filled(wide)) == "SoftmaxPadded"
    # a boolean mask input And-ed with a mask that hides nothing
    pad, both = Value("pad", BOOL, (2, 1, 1, 8)), Value("both", BOOL, (2, 1, 8, 8))
    Node("And", [_const("all", np.ones((1, 1, 8, 1), bool)), pad], [both])
    assert op_class(filled(both)) == "SoftmaxPadded"
    # a constant mask as well: the causal class
    tri = Value("tri", BOOL, (2, 1, 8, 8))
    Node("And", [_const("causal", np.tri(8, 8, dtype=bool)[None, None]), pad], [tri])
    assert op_class(filled(tri)) == "SoftmaxMasked"
    # not from data: a mask of activations, of a parameter, of an input's shape
    act, pos = Value("act", FLOAT, (2, 1, 8, 8)), Value("pos", BOOL, (2, 1, 8, 8))
    Node("Greater", [act, _const("z", np.float32(0))], [pos])
    assert op_class(filled(pos)) == "Softmax"
    flag = Value("flag", BOOL, (2, 1, 8, 8), is_param=True)
    assert op_class(filled(flag)) == "Softmax"
    shape, dims = Value("shape_of", INT64, (2,)), Value("dims", BOOL, (2, 1, 8, 8))
    Node("Shape", [ids], [shape])
    Node("Expand", [_const("t", np.ones((1, 1, 8, 8), bool)), shape], [dims])
    assert op_class(filled(dims)) == "Softmax"
