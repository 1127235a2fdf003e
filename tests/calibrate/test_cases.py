"""A model's own products and convolutions as benchmark cases (`parc.calibrate.cases`)."""

from __future__ import annotations

import onnx
import pytest

import parc.calibrate.graphs as graphs
from parc.calibrate.cases import measurable_cases, model_cases, rank_cases
from parc.calibrate.catalogue import PRODUCTS, SPLIT
from parc.calibrate.fit import fit
from parc.calibrate.measure import Solo, measure_rank
from parc.errors import UsageError
from tests.calibrate.samples import conv_model
from tests.helpers import tiny_training_step


def test_a_models_own_convolutions_calibrate_the_classes_it_has(tmp_path):
    model, _ = tiny_training_step("unet-tiny", tmp_path)
    path = tmp_path / "step.onnx"
    onnx.save(model, path)
    cases = model_cases([path])
    convs = {cls: items for cls, items in cases.items() if cls not in PRODUCTS}
    nodes = sum(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node)
    # every convolution of the step is a case of its class: forward, input and weight gradients
    assert set(convs) == {"Conv", "ConvTranspose", "ConvWeightGrad"}
    assert sum(count for cases in convs.values() for *_, count in cases) == nodes
    # two ranks splitting the batch: a forward convolution's rows, a weight gradient's contracted batch
    halves = rank_cases(convs, 2)
    (x, w, _, _), (hx, hw, _, _) = convs["ConvWeightGrad"][0], halves["ConvWeightGrad"][0]
    assert (hx[1], hw[1], hx[0], hw[0]) == (x[1] // 2, w[1] // 2, x[0], w[0])
    assert halves["Conv"][0][0][0] == convs["Conv"][0][0][0] // 2
    rows = measure_rank(Solo(), 1, budget=0.002, cases=convs)
    assert all("count" in r for r in rows["conv"])  # the built-in cases of these classes are not run
    assert sum(r["count"] for r in rows["conv"]) == nodes and all(r["flops_per_s"] > 0 for r in rows["conv"])


def test_a_models_own_products_calibrate_their_classes_split_where_the_batch_is(tmp_path):
    model, _ = tiny_training_step("gpt-tiny", tmp_path)
    path = tmp_path / "step.onnx"
    onnx.save(model, path)
    cases = model_cases([path])
    products = {cls: items for cls, items in cases.items() if cls in PRODUCTS}
    assert set(products) == {"MatMul", "BatchMatMul", "Gemm"}
    nodes = sum(n.op_type in ("MatMul", "Gemm") for n in model.graph.node)
    assert sum(count for items in products.values() for *_, count in items) == nodes
    tokens = {d for v in model.graph.input if v.name == "input_ids" for d in
              [v.type.tensor_type.shape.dim[0].dim_value * v.type.tensor_type.shape.dim[1].dim_value]}
    halves = rank_cases(products, 2)
    for cls, items in products.items():
        for (x, w, attrs, count), (hx, hw, hattrs, hcount) in zip(items, halves[cls]):
            assert (hattrs, hcount) == (attrs, count)
            whole, half = graphs.case(cls, x, w, attrs)[1], graphs.case(cls, hx, hw, hattrs)[1]
            if SPLIT in attrs:  # a batch split halves the work
                assert half * 2 == whole, (cls, x, w, attrs)
            else:
                assert (hx, hw) == (x, w)
    # a weight's gradient (Gemm, transA: [tokens, h]^T [tokens, o]) splits its contracted tokens
    grads = [(x, w, a) for x, w, a, _ in products["Gemm"] if a.get("transA") and x[0] in tokens]
    assert grads and all(a[SPLIT] == [[0], [0]] for *_, a in grads)
    # attention's products split the batch of both operands
    assert all(a[SPLIT] == [[0], [0]] for x, w, a, _ in products["BatchMatMul"])
    rows = measure_rank(Solo(), 1, budget=0.002, cases=products)
    own = [r for r in rows["matmul"] if "count" in r]
    assert rows["matmul"] == own  # the built-in products of these classes are not run
    assert sum(r["count"] for r in own) == nodes and all(r["flops_per_s"] > 0 for r in own)
    f = fit(rows, 1)
    assert set(f["op_efficiency"]) >= {"Gemm", "BatchMatMul"}


def test_a_models_symbolic_batch_is_bound_by_dim(tmp_path):
    path = conv_model(tmp_path / "conv.onnx")
    assert model_cases([path], {"N": 6}) == {"Conv": [((6, 3, 8, 8), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}, 1)]}
    with pytest.raises(UsageError, match="--model: .*--dim"):
        model_cases([path])
    with pytest.raises(UsageError, match="--dim M: no --model file"):
        model_cases([path], {"N": 6, "M": 2})


def test_a_grouped_weight_gradient_splits_its_batch_in_every_group():
    # a grouped weight gradient: input [C, g x N, H, W], gradient [M, N, H, W], g = 2, N = 4
    convs = {"ConvWeightGrad": [((8, 8, 5, 5), (16, 4, 5, 5), {"group": 2}, 1)],
             "ConvTranspose": [((4, 16, 6, 6), (16, 8, 3, 3), {}, 2)]}
    halves = rank_cases(convs, 2)
    assert halves["ConvWeightGrad"] == [((8, 4, 5, 5), (16, 2, 5, 5), {"group": 2}, 1)]
    assert halves["ConvTranspose"] == [((2, 16, 6, 6), (16, 8, 3, 3), {}, 2)]
    whole, half = (graphs.case("ConvWeightGrad", x, w, a)[1] for x, w, a, _ in
                   (convs["ConvWeightGrad"][0], halves["ConvWeightGrad"][0]))
    assert half * 2 == whole


def test_only_the_shapes_holding_most_of_a_class_are_measured():
    # one shape holds 96% of the class's FLOPs: the other is not measured
    big, small = ((16, 64, 32, 32), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}), ((16, 8, 8, 8), (8, 8, 3, 3), {})
    kept, said = measurable_cases({"Conv": [(*big, 1), (*small, 3)]}, [1, 2])
    assert kept == {"Conv": [(*big, 1)]} and "the 1 largest measured" in said
    with pytest.raises(UsageError, match="--model: cannot measure"):  # a kernel larger than its input
        measurable_cases({"Conv": [((2, 3, 4, 4), (4, 3, 9, 9), {}, 1)]}, [1])
