"""`op_class`: the class a calibration prices a node's FLOPs by."""

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


def test_a_softmax_of_a_masks_fill_is_its_own_class_and_falls_back_to_softmax():
    from parc.cluster.devices import DeviceSpec

    scores = Value("s", shape=(2, 4, 8, 8))
    Node("Where", [Value("m", shape=(8, 8)), Value("x", shape=(2, 4, 8, 8)), Value("f", shape=())], [scores])
    assert op_class(Node("Softmax", [scores], [Value("y")])) == "SoftmaxMasked"
    assert op_class(Node("Softmax", [Value("x", shape=(2, 8))], [Value("y")])) == "Softmax"  # a graph input
    summed = Value("t", shape=(2, 8))
    Node("Add", [Value("a", shape=(2, 8)), Value("b", shape=(2, 8))], [summed])
    assert op_class(Node("Softmax", [summed], [Value("y")])) == "Softmax"
    cpu = DeviceSpec("c", {"float32": 1e11}, 1 << 30, 1e10, memory_efficiency=0.9,
                     memory_op_efficiency={"Softmax": 0.5})
    assert cpu.memory_fraction("SoftmaxMasked") == 0.5  # as a Softmax where the device has no figure
    measured = DeviceSpec("c", {"float32": 1e11}, 1 << 30, 1e10, memory_op_efficiency={"Softmax": 0.5, "SoftmaxMasked": 0.1})
    assert measured.memory_fraction("SoftmaxMasked") == 0.1 and measured.memory_fraction("Where") == 1.0
