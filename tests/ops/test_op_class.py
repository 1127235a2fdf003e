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
