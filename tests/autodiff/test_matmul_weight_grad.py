"""A weight applied over batch dims (x [B, S, K] @ W [K, N], every linear layer of a
transformer) gets its gradient as one 2-D product over the flattened rows (a Gemm with transA),
not a batched product and a sum over the batch: the batched form was the GPU step's largest
remaining cost (issue 14). The values are checked against float64 finite differences here and
in test_grad_rules.test_matmul's drawn shapes."""

from __future__ import annotations

import numpy as np

from parc.autodiff import differentiate
from parc.ir import from_model
from tests.autodiff.fd import P, check_op, op_loss_model


def test_weight_gradient_is_one_2d_product():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 4, 5)), rng.standard_normal((5, 6))
    check_op("MatMul", [P(x), P(w)])  # float64 finite differences
    model, names, _ = op_loss_model("MatMul", [P(x), P(w)], {}, 1, 18, np.random.default_rng(0))
    graph = from_model(model)
    grads = differentiate(graph, graph.outputs[0], [graph.constants[n] for n in names])
    producer = {o.name: n for n in graph.nodes for o in n.outputs}
    node, seen = producer[grads[names[1]].name], []
    while node.op_type == "Reshape":  # the weight's gradient, through its reshape
        seen.append(node.op_type)
        node = producer[node.inputs[0].name]
    assert node.op_type == "Gemm" and node.attr("transA", 0) == 1, (node.op_type, seen)
