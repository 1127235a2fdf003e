"""`parc profile`: the fit of its measurements, the calibration file it writes (which `parc plan
--calibration` reads back), and a short real run over 1 and 2 ranks."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from parc.cluster import load_constants, parse_devices
from parc.exec import profile as prof
from tests.helpers import assert_one_line_error, needs_mpiexec, parc


def _rows(alpha: float, beta: float, handoff: float, k: int, call: float = 0.0) -> dict:
    """Rows a machine with these figures would measure (the ring formula exactly)."""
    reduces = []
    for n in sorted({k, 2}):
        for b in prof.ALL_REDUCE_BYTES:
            t = call + 2 * (n - 1) * alpha + 2 * (n - 1) / n * b / beta
            reduces.append({"n": n, "bytes": b, "s": t, "first_s": t + handoff})
    return {"launch_floor_s": 1e-6, "task_overhead_s": 4e-6,
            "memory": [{"op": "Add", "bytes": 1 << 20, "s": 1e-4, "bytes_per_s": 10e9},
                       {"op": "Softmax", "bytes": 1 << 20, "s": 1e-4, "bytes_per_s": 40e9}],
            "matmul": [{"shape": [8, 8, 8], "s": 1e-3, "flops_per_s": 1e11}],
            "all_reduce": reduces}


def test_fit_recovers_the_figures_of_the_formula():
    f = prof.fit(_rows(20e-6, 3e9, 5e-4, 4), 4)
    assert f["latency"] == pytest.approx(20e-6, rel=1e-6) and f["bandwidth"] == pytest.approx(3e9, rel=1e-6)
    assert f["handoff"] == pytest.approx(5e-4)
    # Softmax streams fastest (40 GB/s): the bandwidth; elementwise ops (Add) a quarter of it
    assert f["memory_bandwidth"] == pytest.approx(40e9) and f["memory_efficiency"] == pytest.approx(0.25)
    assert f["memory_op_efficiency"] == pytest.approx({"Softmax": 1.0})
    assert (f["peak_float32"], f["launch_floor"], f["task_overhead"]) == pytest.approx((1e11, 1e-6, 4e-6))
    assert f["compute_efficiency"] == 1.0 and f["op_efficiency"] == {}


def test_a_call_cost_is_told_from_alpha_by_two_group_sizes():
    # 4 ranks on 2 cores: every collective waits about as long for its members to run, whatever
    # their number; alpha alone would price the pairs' collectives at a third of that
    f = prof.fit(_rows(5e-6, 1e9, 8e-4, 4, call=3e-4), 4)
    assert (f["call"], f["latency"], f["bandwidth"]) == pytest.approx((3e-4, 5e-6, 1e9), rel=1e-6)
    # no call cost in the rows: none fitted (the test above asserts alpha and beta exact)
    assert prof.fit(_rows(20e-6, 3e9, 5e-4, 4), 4)["call"] == pytest.approx(0.0, abs=1e-12)
    # one group size cannot tell a call from alpha: the ring formula alone, as before
    two = prof.fit(_rows(5e-6, 1e9, 0.0, 2, call=3e-4), 2)
    assert two["call"] == 0.0 and two["latency"] == pytest.approx(5e-6 + 3e-4 / 2, rel=1e-3)
    # a call cost that would need a negative alpha is not taken
    rows = _rows(5e-6, 1e9, 0.0, 4)
    for r in rows["all_reduce"]:
        r["s"] += 4e-4 if r["n"] == 4 else 0.0
    assert prof.fit(rows, 4)["call"] == 0.0


def test_reduce_scatters_all_gathers_and_all_to_alls_get_figures_of_their_own(tmp_path):
    """Bursts of reduce-scatters at 25 us + (n-1)/n B at 1.5 GB/s, all-gathers at 10 us +
    2 GB/s and all-to-alls at 20 us + (n-1)/n^2 B at 1 GB/s, beside all-reduces at 5 us a step
    and 4 GB/s: each kind's alpha and beta come back, the link's call cost taken off first;
    written under the link and read back onto it."""
    rows = _rows(5e-6, 4e9, 0.0, 2)
    rows["collectives"] = [{"kind": kind, "n": 2, "bytes": b, "s": alpha + b * share / beta}
                           for kind, alpha, beta, share in (("reduce_scatter", 25e-6, 1.5e9, 1 / 2),
                                                            ("all_gather", 10e-6, 2e9, 1 / 2),
                                                            ("all_to_all", 20e-6, 1e9, 1 / 4))
                           for b in prof.ALL_REDUCE_BYTES]
    f = prof.fit(rows, 2)
    assert f["kinds"]["reduce_scatter"] == pytest.approx((25e-6, 1.5e9), rel=1e-6)
    assert f["kinds"]["all_gather"] == pytest.approx((10e-6, 2e9), rel=1e-6)
    assert f["kinds"]["all_to_all"] == pytest.approx((20e-6, 1e9), rel=1e-6)
    assert prof.fit_kind(rows["collectives"][:4], "reduce_scatter", 5e-6) == pytest.approx((20e-6, 1.5e9), rel=1e-6)
    # no latency at all: the bandwidth alone, alpha 0
    flat = [{"kind": "all_gather", "n": 2, "bytes": b, "s": b / 2 / 2e9} for b in prof.ALL_REDUCE_BYTES]
    assert prof.fit_kind(flat, "all_gather", 0.0) == pytest.approx((0.0, 2e9), abs=1e-12, rel=1e-6)
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: prof.fit(_rows(5e-6, 4e9, 0.0, 2), 1), 2: f}, {2: rows}, "cpu", "shm")
    assert "in a burst reduce_scatter 2 ranks 64 B" in out.read_text()
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.figures("reduce_scatter") == pytest.approx((25e-6, 1.5e9), rel=1e-6)
    assert link.figures("all_to_all") == pytest.approx((20e-6, 1e9), rel=1e-6)
    assert link.figures("all_reduce") == pytest.approx((5e-6, 4e9), rel=1e-6)


def test_the_handoff_is_the_first_ones_excess_where_it_moves_no_bytes():
    # a first all-reduce after compute that also pays 1 ns a byte more than the burst (caches the
    # compute evicted): the handoff is the 64 B rows' excess, not an average over the sizes
    rows = _rows(20e-6, 3e9, 5e-4, 4)
    for r in rows["all_reduce"]:
        r["first_s"] += r["bytes"] * 1e-9
    assert prof.fit(rows, 4)["handoff"] == pytest.approx(5e-4 + 64e-9)
    for r in rows["all_reduce"]:  # a first faster than the burst: no handoff
        r["first_s"] = r["s"] / 2
    assert prof.fit(rows, 4)["handoff"] == 0.0


def test_the_file_written_is_the_calibration_plan_reads(tmp_path):
    measured = {1: _rows(0, 1, 0, 1), 2: _rows(20e-6, 3e9, 5e-4, 2), 4: _rows(40e-6, 1e9, 1e-3, 4, call=2e-4)}
    del measured[1]["all_reduce"]
    fitted = {k: prof.fit(rows, k) for k, rows in measured.items()}
    out = tmp_path / "calib.yaml"
    prof.write_calibration(out, fitted, measured, "cpu", "shm")
    assert out.read_text().startswith("# parc profile: ")
    calibration = load_constants(out)
    one = calibration.apply(parse_devices("1xcpu")).devices[0]
    assert one.peak("float32") == pytest.approx(1e11) and one.task_overhead == pytest.approx(4e-6)
    four = calibration.apply(parse_devices("4xcpu"))
    link = four.nodes[0].intra_link
    assert (link.latency, link.bandwidth, link.handoff, link.call) == pytest.approx((40e-6, 1e9, 1e-3, 2e-4))
    two = calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert (two.handoff, two.call) == pytest.approx((5e-4, 0.0))
    assert calibration.cpus == 0 and not four.nodes[0].sharing  # the host's CPUs not given
    prof.write_calibration(out, fitted, measured, "cpu", "shm", cpus=2)
    four = load_constants(out).apply(parse_devices("4xcpu"))  # 4 ranks on 2 CPUs: 2 computing run faster
    assert [a for a, _ in four.nodes[0].sharing] == [2]
    assert four.nodes[0].sharing[0][1][0] == load_constants(out).apply(parse_devices("2xcpu")).devices[0]


@pytest.mark.parametrize("engine", [("ort", "cpu"), ("cupy", "cpu")], ids=["ort", "numpy"])
def test_a_rank_alone_measures_every_class_of_op(engine):
    rows = prof.measure_rank(prof._Solo(), 1, budget=0.005, engine=engine)
    assert rows["launch_floor_s"] > 0 and rows["task_overhead_s"] >= 0
    assert {r["op"] for r in rows["memory"]} == set(prof.MEMORY_OPS)
    assert len(rows["matmul"]) == len(prof.MATMULS) + len(prof.GEMMS) and all(r["flops_per_s"] > 0 for r in rows["matmul"])
    assert [r["class"] for r in rows["matmul"] if "class" in r] == ["Gemm"] * len(prof.GEMMS)
    assert {r["class"] for r in rows["conv"]} == set(prof.CONVS) and all(r["flops_per_s"] > 0 for r in rows["conv"])
    assert {r["op"] for r in rows["sweep"]} == {"Add"} and len(rows["sweep"]) == len(prof.SWEEP_ROWS)
    assert "all_reduce" not in rows
    # the Gemm class is fitted as its own (a weight's gradient), a fraction of the fastest rate
    f = prof.fit(rows, 1)
    assert 0 < f["op_efficiency"]["Gemm"] <= 1 and 0 < f["memory_op_efficiency"]["ScatterND"] <= 1


@needs_mpiexec
def test_profile_over_two_ranks_writes_a_calibration_plan_accepts(tmp_path):
    out = tmp_path / "calib.yaml"
    model = _conv_model(tmp_path / "conv.onnx")
    res = parc("profile", "-o", str(out), "--ranks", "2", "--seconds", "0.01", "--model", str(model), "--dim", "N=4",
               "--no-reference", timeout=300)
    assert res.returncode == 0, res.stderr
    calibration = load_constants(out)
    assert [n for n, _ in calibration.sharing] == [2]
    assert calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link.name == "shm"
    # the host's speed probed before each rank count and at the end, the first = 1
    line = next(x for x in out.read_text().splitlines() if x.startswith("# the host's speed"))
    speeds = [float(v) for v in line.split(": ")[1].split(", ")]
    assert len(speeds) == 3 and speeds[0] == 1.0 and all(v > 0 for v in speeds)
    # the model's convolution, measured at the whole batch alone and at half of it on each of two ranks
    rows = {piece.split(": ")[0].strip("# ") for line in out.read_text().splitlines() for piece in line.split(", ")}
    assert {"Conv 4x3x8x8 * 4x3x3x3", "Conv 2x3x8x8 * 4x3x3x3"} <= rows
    # the file names the model its figures were measured on (`parc plan` warns on another)
    from parc.plandir.manifest import sha256_file

    assert calibration.fitted_on == (("conv.onnx", sha256_file(model)),)


def test_bad_profile_flags_are_one_line_errors(tmp_path):
    assert_one_line_error(parc("profile"), "-o FILE")
    assert_one_line_error(parc("profile", "-o", str(tmp_path)), "is a directory")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--seconds", "0"), "--seconds")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--ranks", "0"), "--ranks")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "none.onnx")),
                          "--model", "no such file")
    (tmp_path / "bad.onnx").write_text("not a model")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "bad.onnx")),
                          "--model", "bad.onnx")
    assert not (tmp_path / "c.yaml").exists()
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--dim", "N=4"), "--dim", "--model")


def test_batched_products_and_memory_classes_are_fractions_of_the_fastest_rate(tmp_path):
    rows = _rows(20e-6, 3e9, 0.0, 1)
    rows["matmul"] = [{"shape": [64, 64, 64], "flops_per_s": 4e11}, {"shape": [8, 4, 64, 64, 64], "flops_per_s": 1e11},
                      {"shape": [16, 128, 64, 256], "flops_per_s": 4e11}]
    rows["memory"] = [{"op": "Add", "bytes_per_s": 2e12}, {"op": "MulBroadcast", "bytes_per_s": 2e12},
                      {"op": "LayerNorm", "bytes_per_s": 2e11}, {"op": "ReduceSumFirst", "bytes_per_s": 1e12}]
    f = prof.fit(rows, 1)
    assert f["peak_float32"] == pytest.approx(4e11) and f["compute_efficiency"] == 1.0
    assert f["op_efficiency"] == pytest.approx({"BatchMatMul": 0.5})  # geometric mean of 1e11 and 4e11
    assert f["memory_bandwidth"] == pytest.approx(2e12) and f["memory_efficiency"] == 1.0
    assert f["memory_op_efficiency"] == pytest.approx({"LayerNormalization": 0.1, "ReduceSum": 0.5})
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: f}, {1: {**rows, "matmul": [], "memory": []}}, "h100-80g", "nvlink4")
    spec = load_constants(out).apply(parse_devices("1xh100-80g")).devices[0]
    assert spec.memory_fraction("LayerNormalization") == pytest.approx(0.1) and spec.memory_fraction("Mul") == 1.0
    assert spec.efficiency("BatchMatMul") == pytest.approx(0.5) and spec.gpu


def test_convolution_classes_are_fractions_of_the_fastest_rate():
    rows = _rows(20e-6, 3e9, 0.0, 2)
    rows["conv"] = [{"class": "Conv", "flops_per_s": 5e10}, {"class": "ConvWeightGrad", "flops_per_s": 1e10},
                    {"class": "Conv", "flops_per_s": 2e11}]
    f = prof.fit(rows, 2)
    assert f["peak_float32"] == pytest.approx(1e11)  # MatMul 1e11; Conv's geometric mean is 1e11 too
    assert f["op_efficiency"] == pytest.approx({"Conv": 1.0, "ConvWeightGrad": 0.1})
    assert f["compute_efficiency"] == pytest.approx(1.0)


def test_a_models_own_convolutions_calibrate_the_classes_it_has(tmp_path):
    import onnx

    from tests.helpers import tiny_training_step

    model, _ = tiny_training_step("unet-tiny", tmp_path)
    path = tmp_path / "step.onnx"
    onnx.save(model, path)
    cases = prof.model_cases([path])
    convs = {cls: items for cls, items in cases.items() if cls not in prof.PRODUCTS}
    nodes = sum(n.op_type in ("Conv", "ConvTranspose") for n in model.graph.node)
    # every convolution of the step is a case of its class: forward, input and weight gradients
    assert set(convs) == {"Conv", "ConvTranspose", "ConvWeightGrad"}
    assert sum(count for cases in convs.values() for *_, count in cases) == nodes
    # two ranks splitting the batch: a forward convolution's rows, a weight gradient's contracted batch
    halves = prof.rank_cases(convs, 2)
    (x, w, _, _), (hx, hw, _, _) = convs["ConvWeightGrad"][0], halves["ConvWeightGrad"][0]
    assert (hx[1], hw[1], hx[0], hw[0]) == (x[1] // 2, w[1] // 2, x[0], w[0])
    assert halves["Conv"][0][0][0] == convs["Conv"][0][0][0] // 2
    rows = prof.measure_rank(prof._Solo(), 1, budget=0.002, cases=convs)
    assert all("count" in r for r in rows["conv"])  # the built-in cases of these classes are not run
    assert sum(r["count"] for r in rows["conv"]) == nodes and all(r["flops_per_s"] > 0 for r in rows["conv"])


def test_a_models_own_products_calibrate_their_classes_split_where_the_batch_is(tmp_path):
    import onnx

    from tests.helpers import tiny_training_step

    model, _ = tiny_training_step("gpt-tiny", tmp_path)
    path = tmp_path / "step.onnx"
    onnx.save(model, path)
    cases = prof.model_cases([path])
    products = {cls: items for cls, items in cases.items() if cls in prof.PRODUCTS}
    assert set(products) == {"MatMul", "BatchMatMul", "Gemm"}
    nodes = sum(n.op_type in ("MatMul", "Gemm") for n in model.graph.node)
    assert sum(count for items in products.values() for *_, count in items) == nodes
    tokens = {d for v in model.graph.input if v.name == "input_ids" for d in
              [v.type.tensor_type.shape.dim[0].dim_value * v.type.tensor_type.shape.dim[1].dim_value]}
    halves = prof.rank_cases(products, 2)
    for cls, items in products.items():
        for (x, w, attrs, count), (hx, hw, hattrs, hcount) in zip(items, halves[cls]):
            assert (hattrs, hcount) == (attrs, count)
            whole, half = prof._case(cls, x, w, attrs)[1], prof._case(cls, hx, hw, hattrs)[1]
            if prof.SPLIT in attrs:  # a batch split halves the work
                assert half * 2 == whole, (cls, x, w, attrs)
            else:
                assert (hx, hw) == (x, w)
    # a weight's gradient (Gemm, transA: [tokens, h]^T [tokens, o]) splits its contracted tokens
    grads = [(x, w, a) for x, w, a, _ in products["Gemm"] if a.get("transA") and x[0] in tokens]
    assert grads and all(a[prof.SPLIT] == [[0], [0]] for *_, a in grads)
    # attention's products split the batch of both operands
    assert all(a[prof.SPLIT] == [[0], [0]] for x, w, a, _ in products["BatchMatMul"])
    rows = prof.measure_rank(prof._Solo(), 1, budget=0.002, cases=products)
    own = [r for r in rows["matmul"] if "count" in r]
    assert rows["matmul"] == own  # the built-in products of these classes are not run
    assert sum(r["count"] for r in own) == nodes and all(r["flops_per_s"] > 0 for r in own)
    f = prof.fit(rows, 1)
    assert set(f["op_efficiency"]) >= {"Gemm", "BatchMatMul"}


def _conv_model(path):
    """A one-Conv model whose batch is symbolic (N): input [N, 3, 8, 8], weight [4, 3, 3, 3]."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([conv], "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_a_models_symbolic_batch_is_bound_by_dim(tmp_path):
    path = _conv_model(tmp_path / "conv.onnx")
    assert prof.model_cases([path], {"N": 6}) == {"Conv": [((6, 3, 8, 8), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}, 1)]}
    with pytest.raises(prof.UsageError, match="--model: .*--dim"):
        prof.model_cases([path])
    with pytest.raises(prof.UsageError, match="--dim M: no --model file"):
        prof.model_cases([path], {"N": 6, "M": 2})


def test_a_grouped_weight_gradient_splits_its_batch_in_every_group():
    # a grouped weight gradient: input [C, g x N, H, W], gradient [M, N, H, W], g = 2, N = 4
    convs = {"ConvWeightGrad": [((8, 8, 5, 5), (16, 4, 5, 5), {"group": 2}, 1)],
             "ConvTranspose": [((4, 16, 6, 6), (16, 8, 3, 3), {}, 2)]}
    halves = prof.rank_cases(convs, 2)
    assert halves["ConvWeightGrad"] == [((8, 4, 5, 5), (16, 2, 5, 5), {"group": 2}, 1)]
    assert halves["ConvTranspose"] == [((2, 16, 6, 6), (16, 8, 3, 3), {}, 2)]
    whole, half = (prof._case("ConvWeightGrad", x, w, a)[1] for x, w, a, _ in
                   (convs["ConvWeightGrad"][0], halves["ConvWeightGrad"][0]))
    assert half * 2 == whole


def test_only_the_shapes_holding_most_of_a_class_are_measured():
    # one shape holds 96% of the class's FLOPs: the other is not measured
    big, small = ((16, 64, 32, 32), (64, 64, 3, 3), {"pads": [1, 1, 1, 1]}), ((16, 8, 8, 8), (8, 8, 3, 3), {})
    kept, said = prof.measurable_cases({"Conv": [(*big, 1), (*small, 3)]}, [1, 2])
    assert kept == {"Conv": [(*big, 1)]} and "the 1 largest measured" in said
    with pytest.raises(prof.UsageError, match="--model: cannot measure"):  # a kernel larger than its input
        prof.measurable_cases({"Conv": [((2, 3, 4, 4), (4, 3, 9, 9), {}, 1)]}, [1])


def test_a_host_that_moves_while_profiling_is_warned_about(tmp_path, monkeypatch):
    probes = iter([1.0, 1.3])  # the product took 30% longer at the end
    monkeypatch.setattr(prof, "host_probe", lambda *a, **k: next(probes))
    said = []
    prof.profile(tmp_path / "c.yaml", 1, budget=0.002, echo=said.append, reference=False)
    assert any(line.startswith("warning: this host's speed moved by 30%") for line in said)
    assert "(a fixed product, the first = 1): 1.00, 0.77" in (tmp_path / "c.yaml").read_text()


def test_a_models_convolutions_weigh_as_often_as_it_has_them():
    # the class's rate is the model's FLOPs over its time: 3 x 1 GFLOP at 1 GFLOP/s and 1 x 1 GFLOP
    # at 4 GFLOP/s take 3.25 s for 4 GFLOP (the built-in cases' geometric mean would say 2 GFLOP/s)
    rows = _rows(20e-6, 3e9, 0.0, 1)
    rows["matmul"] = [{"shape": [64, 64, 64], "flops_per_s": 8e9}]
    rows["conv"] = [{"class": "ConvWeightGrad", "flops": 1e9, "flops_per_s": 1e9, "count": 3},
                    {"class": "ConvWeightGrad", "flops": 1e9, "flops_per_s": 4e9, "count": 1},
                    {"class": "Conv", "flops": 1e9, "flops_per_s": 2e9}, {"class": "Conv", "flops": 1e9, "flops_per_s": 8e9}]
    f = prof.fit(rows, 1)
    assert f["op_efficiency"] == pytest.approx({"ConvWeightGrad": 4 / 3.25 / 8, "Conv": 0.5})


def test_where_is_measured_as_its_own_class():
    rows = prof.measure_rank(prof._Solo(), 1, budget=0.002)
    where = [r for r in rows["memory"] if r["op"] in ("Where", "WhereMasked")]
    assert len(where) == 2 * len(prof.MEMORY_ROWS) and prof.fit(rows, 1)["memory_op_efficiency"]["Where"] > 0
    # an optimizer's computed division and square root, and a transpose that moves the last axis
    own = prof.fit(rows, 1)["memory_op_efficiency"]
    assert all(0 < own[cls] <= 1 for cls in ("Div", "Sqrt", "TransposeLastAxis"))
    # attention's softmax after a causal mask's fill: onnxruntime's slow path where exp underflows
    assert own["SoftmaxMasked"] < own["Softmax"] / 3
    # and after a padding mask's fill: slower than a Softmax, faster than the causal fill
    assert own["SoftmaxMasked"] < own["SoftmaxPadded"] < own["Softmax"]


def test_a_padded_benchmark_input_hides_each_sequences_padding_from_every_query():
    from parc.exec.data import PADDED

    class Session:
        shapes = {prof.PADDED: (64, 16, 16)}

        @staticmethod
        def place(x):
            return x

    x = prof._feeds(Session(), pool_bytes=1)[0][prof.PADDED]
    hidden = x <= -1e9
    assert (hidden == hidden[:, :1, :]).all()  # the same keys for every query of a sequence
    kept = (~hidden[:, 0, :]).sum(-1)
    assert kept.min() >= 16 - 16 // PADDED and kept.max() == 16 and (kept < 16).any()
    assert all(((~hidden[i, 0, :k]).all() and hidden[i, 0, k:].all()) for i, k in enumerate(kept))  # at the end


def test_a_masked_benchmark_input_holds_a_causal_fill_above_its_diagonal():
    class Session:
        shapes = {prof.MASKED: (2, 4, 4), "x": (2, 4, 4)}

        @staticmethod
        def place(x):
            return x

    feeds = prof._feeds(Session(), pool_bytes=1)[0]
    upper = ~np.tri(4, 4, dtype=bool)
    assert (feeds[prof.MASKED][:, upper] == -1e9).all() and (feeds[prof.MASKED][:, ~upper] > -1e3).all()
    assert (feeds["x"] > -1e3).all()


def test_the_array_engine_pays_for_a_transpose_it_returns_as_a_view():
    rows = prof.measure_rank(prof._Solo(), 1, budget=0.005, engine=("cupy", "cpu"))
    add = min(r["bytes_per_s"] for r in rows["memory"] if r["op"] == "Add")
    assert all(r["bytes_per_s"] < 20 * add for r in rows["memory"] if r["op"] == "Transpose")


class _FakeCupy:
    """The part of CuPy `gpu_device_type` reads, reporting one card."""

    def __init__(self, name, gib: float) -> None:
        props = {"name": name.encode(), "totalGlobalMem": int(gib * (1 << 30))}
        runtime = type("runtime", (), {"getDeviceProperties": staticmethod(lambda i: props)})
        device = type("Device", (), {"id": 0})
        self.cuda = type("cuda", (), {"runtime": runtime, "Device": device})


@pytest.mark.parametrize(("name", "gib", "want"), [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100-80g"), ("NVIDIA H200", 139.8, "h200-141g"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40g"), ("NVIDIA A100 80GB PCIe", 79.2, "a100-80g"),
    ("Tesla V100-SXM2-32GB", 31.7, "v100-32g"), ("Tesla V100-PCIE-16GB", 15.8, "v100-16g"),
    ("Tesla T4", 14.7, "t4-16g")])
def test_a_gpu_is_named_by_the_catalogue(name, gib, want):
    assert prof.gpu_device_type(_FakeCupy(name, gib)) == want


def test_a_gpu_outside_the_catalogue_asks_for_its_type():
    with pytest.raises(prof.UsageError, match="GeForce RTX 4090.*--device"):
        prof.gpu_device_type(_FakeCupy("NVIDIA GeForce RTX 4090", 23.6))


def test_profile_engine_flags_are_one_line_errors(tmp_path):
    out = str(tmp_path / "c.yaml")
    assert_one_line_error(parc("profile", "-o", out, "--engine", "tpu"), "--engine tpu")
    assert_one_line_error(parc("profile", "-o", out, "--device", "x9000"), "--device")
    if not _gpu():
        assert_one_line_error(parc("profile", "-o", out, "--engine", "cupy"), "--engine cupy")


def _gpu() -> bool:
    from parc.exec.runner import gpu_available

    return gpu_available()


def test_piece_costs_and_floors_are_fitted_with_their_classes_rates(tmp_path):
    """Rows of a machine where a Transpose streams at 20 GB/s and pays 15 ns a short run, an
    elementwise op 40 GB/s and 8 ns a broadcast span, and small nodes a floor beyond both."""
    launch, rate, cost, add_rate, span = 1e-6, 20e9, 15e-9, 40e9, 8e-9
    rows = _rows(20e-6, 3e9, 0.0, 1)
    rows["launch_floor_s"] = launch
    rows["memory"] = [{"op": "Transpose", "bytes": b, "pieces": b / 1024, "s": launch + b / rate + b / 1024 * cost}
                      for b in (1 << 20, 4 << 20, 16 << 20)]
    rows["memory"] += [{"op": "Add", "bytes": b, "s": launch + b / add_rate} for b in (3 << 20, 12 << 20)]
    for r in rows["memory"]:
        r["bytes_per_s"] = r["bytes"] / (r["s"] - launch)
    rows["pieces"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 32768.0,
                       "s": launch + (1 << 20) / rate + 32768 * cost},
                      {"op": "SubRows", "bytes": 1 << 20, "pieces": 2048.0,
                       "s": launch + (1 << 20) / add_rate + 2048 * span}]
    rows["small"] = [{"op": "Transpose", "bytes": 131072, "pieces": 64.0,
                      "s": launch + 131072 / rate + 64 * cost + 3e-6},
                     {"op": "Add", "bytes": 196608, "pieces": 0.0, "s": launch + 196608 / add_rate + 0.5e-6},
                     {"shape": [128, 64, 64], "flops": 2 * 128 * 64 * 64, "s": launch + 2 * 128 * 64 * 64 / 1e11 + 4e-6}]
    f = prof.fit(rows, 1)
    assert f["memory_bandwidth"] == pytest.approx(add_rate)
    assert f["memory_op_efficiency"]["Transpose"] * f["memory_bandwidth"] == pytest.approx(rate)
    assert f["op_piece"] == pytest.approx({"Transpose": cost}) and f["node_piece"] == pytest.approx(span)
    assert f["op_floor"] == pytest.approx({"Transpose": 3e-6, "MatMul": 4e-6, "Gemm": 4e-6})  # a Gemm: MatMul's
    assert f["node_floor"] == pytest.approx(0.5e-6)
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: f}, {1: rows}, "cpu", "shm")
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert (cpu.piece_cost("Transpose"), cpu.piece_cost("Sub"), cpu.class_floor("Gemm"), cpu.class_floor("Mul")) == \
        pytest.approx((cost, span, 4e-6, 0.5e-6))
    # a piece case a negative cost would fit (pieces that run faster than the stream): a cost of 0,
    # the class keeps its measured rate
    rows["pieces"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 32768.0, "s": launch + (1 << 20) / rate / 4}]
    f = prof.fit(rows, 1)
    assert f["op_piece"] == {"Transpose": 0.0} and f["memory_op_efficiency"]["Transpose"] > 0


def test_a_small_case_is_measured_as_copies_of_its_node():
    model, _ = prof._memory_op("Softmax", 64)
    copies = prof._copies(model, 4)
    assert [n.op_type for n in copies.graph.node] == ["Softmax"] * 4 and len(copies.graph.output) == 4
    assert len({n.output[0] for n in copies.graph.node}) == 4 and len(model.graph.node) == 1
    assert prof._pieces(model) == 64 / 16  # 64 rows of 1 KiB: a sixteenth of a piece each
    rows = prof.measure_rank(prof._Solo(), 1, budget=0.002)
    assert {r["op"] for r in rows["pieces"]} == set(prof.PIECE_OPS)
    assert len(rows["small"]) == len(prof.MEMORY_OPS) + len(prof.SMALL_MATMULS)
    assert all(r["pieces"] > 0 for r in rows["pieces"])


def test_a_k_rank_section_keeps_its_own_zero_floors_and_piece_costs(tmp_path):
    """Sharing sections are laid over one rank's figures: a k-rank fit of 0 (a floor, or a piece
    cost whose fit failed) is written, not left for one rank's figure to fill."""
    one = {**prof.fit(_rows(0, 1, 0, 1), 1), "node_floor": 2e-6, "node_piece": 1e-8,
           "op_floor": {"Transpose": 3e-6}, "op_piece": {"Transpose": 1e-8}}
    two = {**prof.fit(_rows(20e-6, 3e9, 5e-4, 2), 2), "node_floor": 0.0, "node_piece": 0.0,
           "op_floor": {"Transpose": 0.0}, "op_piece": {"Transpose": 0.0}}
    rows = {1: _rows(0, 1, 0, 1), 2: _rows(20e-6, 3e9, 5e-4, 2)}
    del rows[1]["all_reduce"]
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: one, 2: two}, rows, "cpu", "shm")
    calibration = load_constants(out)
    alone = calibration.apply(parse_devices("1xcpu")).devices[0]
    shared = calibration.apply(parse_devices("2xcpu")).devices[0]
    assert (alone.node_floor, alone.piece_cost("Transpose"), alone.class_floor("Transpose")) == \
        pytest.approx((2e-6, 1e-8, 3e-6))
    assert (shared.node_floor, shared.node_piece, shared.piece_cost("Transpose"), shared.class_floor("Transpose")) == \
        (0.0, 0.0, 0.0, 0.0)
    # a piece fit that fails is a cost of 0 in the fit's output, not a missing class
    rows = _rows(0, 1, 0, 1)
    rows["memory"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 1024.0, "s": 1e-4, "bytes_per_s": 1e10}]
    rows["pieces"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 32768.0, "s": 2e-5}]
    assert prof.fit(rows, 1)["op_piece"] == {"Transpose": 0.0}


def _stream_rows(cache: int, fast: float, slow: float, sweep: bool = True, k: int = 1) -> dict:
    """Rows of a host whose Adds stream at `fast` bytes/s up to `cache` bytes and `slow` beyond,
    and whose Transposes stream at half those rates."""
    rows = _rows(20e-6, 3e9, 0.0, k)
    launch = rows["launch_floor_s"]

    def row(op, b, half=1.0):
        rate = (fast if b <= cache else slow) * half
        return {"op": op, "bytes": b, "s": launch + b / rate, "bytes_per_s": rate}

    rows["memory"] = [row("Add", b) for b in (3 << 20, 12 << 20, 48 << 20)]
    rows["memory"] += [row("Transpose", b, 0.5) for b in (2 << 20, 8 << 20, 32 << 20)]
    rows["sweep"] = [row("Add", b) for b in (3 << 18, 3 << 19, 6 << 20, 24 << 20)] if sweep else []
    return rows


def test_the_caches_reach_and_speedup_are_fitted_from_the_adds(tmp_path):
    """Adds at 150 GB/s up to 3 MiB and 50 GB/s beyond: the caches reach 3 MiB at 3x, and the
    rates written are memory's (a Transpose's 2 MiB row, at 75 GB/s, gives 25 GB/s as its others):
    a step's tensors stream at memory's rate whatever their size."""
    rows = _stream_rows(3 << 20, 150e9, 50e9)
    f = prof.fit(rows, 1)
    assert (f["cache_bytes"], f["cache_speedup"]) == pytest.approx((3 << 20, 3.0))
    assert f["memory_bandwidth"] * f["memory_efficiency"] == pytest.approx(50e9)
    assert f["memory_op_efficiency"]["Transpose"] * f["memory_bandwidth"] == pytest.approx(25e9)
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: f}, {1: rows}, "cpu", "shm")
    text = out.read_text()
    assert "sweep Add 0.75 MiB" in text and "from the caches up to 3 MiB, 3.00x" in text
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert cpu.memory_bandwidth * cpu.memory_efficiency == pytest.approx(50e9)
    # the knee where it is: 6 MiB still fast -> 6 MiB
    assert prof.fit(_stream_rows(6 << 20, 150e9, 50e9), 1)["cache_bytes"] == 6 << 20
    # no faster small Adds, or no sweep measured (a GPU): every row as it was measured
    for rows in (_stream_rows(3 << 20, 60e9, 50e9), _stream_rows(3 << 20, 150e9, 50e9, sweep=False)):
        f = prof.fit(rows, 1)
        assert (f["cache_bytes"], f["cache_speedup"]) == (0.0, 1.0)
    f = prof.fit(_stream_rows(3 << 20, 150e9, 50e9, sweep=False), 1)
    assert f["memory_bandwidth"] * f["memory_efficiency"] == pytest.approx((150e9 * 50e9 * 50e9) ** (1 / 3))


def test_pieces_and_floors_measured_within_the_caches_are_fitted_at_the_caches_rate():
    """A Transpose's piece case and small rows run from the caches (3x memory's rate there): its
    piece cost and floor come out as the machine's, its rate as memory's."""
    launch, rate, cost, speedup = 1e-6, 20e9, 15e-9, 3.0
    rows = _stream_rows(3 << 20, 150e9, 50e9)

    def t(b, pieces=0.0, extra=0.0):
        return launch + b / (rate * (speedup if b <= 3 << 20 else 1.0)) + pieces * cost + extra

    rows["memory"] = [r for r in rows["memory"] if r["op"] == "Add"]
    rows["memory"] += [{"op": "Transpose", "bytes": b, "pieces": b / 1024, "s": t(b, b / 1024)}
                       for b in (2 << 20, 8 << 20, 32 << 20)]
    for r in rows["memory"]:
        r["bytes_per_s"] = r["bytes"] / (r["s"] - launch)
    rows["pieces"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 32768.0, "s": t(1 << 20, 32768)}]
    rows["small"] = [{"op": "Transpose", "bytes": 131072, "pieces": 64.0, "s": t(131072, 64, 3e-6)}]
    f = prof.fit(rows, 1)
    assert f["memory_op_efficiency"]["Transpose"] * f["memory_bandwidth"] == pytest.approx(rate)
    assert f["op_piece"]["Transpose"] == pytest.approx(cost) and f["op_floor"]["Transpose"] == pytest.approx(3e-6)


def test_a_convolution_class_rate_and_piece_cost_are_fitted_together(tmp_path):
    """Rows of a machine whose 2-D products run 100 GFLOP/s, where a Conv runs 80 GFLOP/s plus 0.12 ns
    an element of its lowering and a ConvTranspose 40 GFLOP/s plus 0.3 ns: both recovered, and the
    calibration prices a node with both."""
    launch = 1e-6
    rows = _rows(0, 1, 0, 1)
    rows["launch_floor_s"] = launch
    truth = {"Conv": (80e9, 0.12e-9), "ConvTranspose": (40e9, 0.3e-9)}
    cases = {"Conv": [(75e6, 2.4e6), (75e6, 1.2e6), (19e6, 1.2e6), (17e6, 0.16e6)],
             "ConvTranspose": [(19e6, 1.2e6), (19e6, 0.3e6), (38e6, 1.2e6)]}
    rows["conv"] = [{"class": cls, "flops": f, "pieces": p, "s": launch + f / truth[cls][0] + p * truth[cls][1],
                     "input": [1], "weight": [1]} for cls, items in cases.items() for f, p in items]
    for r in rows["conv"]:
        r["flops_per_s"] = r["flops"] / (r["s"] - launch)
    f = prof.fit(rows, 1)
    peak = f["peak_float32"]
    for cls, (rate, cost) in truth.items():
        assert f["op_efficiency"][cls] * peak == pytest.approx(rate, rel=1e-6)
        assert f["op_piece"][cls] == pytest.approx(cost, rel=1e-6)
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: f}, {1: rows}, "cpu", "shm")
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert cpu.piece_cost("ConvTranspose") == pytest.approx(0.3e-9)
    # a rate above the 2-D product's is held at it, and the cost carries the rest
    fast = {**rows, "conv": [{**r, "s": launch + r["flops"] / 1e15 + r["pieces"] * 1e-9}
                             for r in rows["conv"] if r["class"] == "Conv"]}
    for r in fast["conv"]:
        r["flops_per_s"] = r["flops"] / (r["s"] - launch)
    g = prof.fit(fast, 1)
    assert g["op_efficiency"]["Conv"] * g["peak_float32"] == pytest.approx(g["peak_float32"] * g["compute_efficiency"])
    assert g["op_piece"]["Conv"] > 0
    # a model's own shapes (rows with a count): their rate as measured, no piece cost
    own = {**rows, "conv": [{**r, "count": 2} for r in rows["conv"]]}
    h = prof.fit(own, 1)
    assert h["op_piece"]["Conv"] == 0.0 and h["op_piece"]["ConvTranspose"] == 0.0


def test_a_device_without_a_convolutions_piece_cost_charges_its_pieces_nothing():
    from parc.cluster.devices import OWN_PIECES

    cpu = dataclasses.replace(parse_devices("1xcpu").devices[0], node_piece=1e-8)  # a run's cost
    assert cpu.piece_cost("Transpose") == 1e-8
    assert all(cpu.piece_cost(cls) == 0.0 for cls in OWN_PIECES)
    assert dataclasses.replace(cpu, op_piece={"Conv": 2e-10}).piece_cost("Conv") == 2e-10


def test_a_wheres_rate_and_cost_a_run_are_fitted_from_its_two_masks():
    """A Where streams at 20 GB/s and pays 7 ns where its condition changes: the random mask's rows
    and the causal triangle's differ in runs per byte, which tells the two apart."""
    launch, rate, run = 1e-6, 20e9, 7e-9
    rows = _rows(0, 1, 0, 1)
    rows["launch_floor_s"] = launch
    rows["memory"] = []
    for op in prof.RUN_OPS:
        for r in (1024, 4096):
            model, nbytes = prof._memory_op(op, r)
            pieces = prof._pieces(model)
            rows["memory"].append({"op": op, "bytes": nbytes, "pieces": pieces, "s": launch + nbytes / rate + pieces * run})
    rows["memory"] += [{"op": "Add", "bytes": b, "s": launch + b / 40e9} for b in (3 << 20, 12 << 20)]
    for r in rows["memory"]:
        r["bytes_per_s"] = r["bytes"] / (r["s"] - launch)
    rows["pieces"] = [{"op": "SubRows", "bytes": 1 << 20, "pieces": 2048.0, "s": launch + (1 << 20) / 40e9 + 2048 * 8e-9}]
    f = prof.fit(rows, 1)
    assert f["memory_op_efficiency"]["Where"] * f["memory_bandwidth"] == pytest.approx(rate, rel=1e-6)
    assert f["op_piece"]["Where"] == pytest.approx(run, rel=1e-6)
    random, masked = (r["pieces"] / r["bytes"] for r in rows["memory"][::2][:2])
    assert random > 30 * masked  # a random mask changes at every other element


def _cold_rows(rates: dict[int, float]) -> list[dict]:
    nbytes = 12 << 20
    return [{"touched": mib << 20, "bytes": nbytes, "s": nbytes / rate} for mib, rate in rates.items()]


def test_reads_after_a_ranks_traffic_give_the_cold_rate_and_the_caches_share(tmp_path):
    """An Add at 24 GB/s after nothing and after 32 MiB written, 16 GB/s after 128 MiB, 9 GB/s
    after 512 MiB: the cold rate is 9 GB/s; the rate falls to their geometric mean (14.7 GB/s)
    between 128 and 512 MiB written (log-interpolated: 128 * 4^(1.3/7)), and each written byte
    is read and written: the share is twice that in traffic. Written to the calibration, read back
    onto the device."""
    rows = _cold_rows({0: 24e9, 32: 24e9, 128: 16e9, 512: 9e9})
    cold, share = prof.fit_cold(rows)
    mid = (24e9 * 9e9) ** 0.5
    written = 128 * 4 ** ((16e9 - mid) / (16e9 - 9e9)) * 2**20
    assert cold == pytest.approx(9e9) and share == pytest.approx(2 * written)
    stream = _stream_rows(3 << 20, 150e9, 24e9)
    stream["cold"] = rows
    f = prof.fit(stream, 1)
    assert (f["cold_bandwidth"], f["cache_share"]) == pytest.approx((cold, share))
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, {1: f}, {1: stream}, "cpu", "shm")
    assert "cold Add after writing 0 MiB" in out.read_text()
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert (cpu.cold_bandwidth, cpu.cache_share) == pytest.approx((cold, share))
    assert cpu.cold_cost() == pytest.approx(1 / 9e9 - 1 / 24e9)
    # no fall (the caches hold it all, or none of it): nothing to price
    assert prof.fit_cold(_cold_rows({0: 24e9, 32: 23e9, 128: 22e9, 512: 21e9})) == (0.0, 0.0)
    # a fall already by the first writing: the share is that much traffic
    assert prof.fit_cold(_cold_rows({0: 24e9, 32: 9e9, 128: 9e9, 512: 9e9})) == pytest.approx((9e9, 2 * (32 << 20)))


def test_the_cold_benchmark_runs_on_this_machine():
    """`_cold_reads` on one thread: a row per amount written, each a positive time."""
    rows = prof._cold_reads(1, ("ort", "cpu"), lambda: None)
    assert [r["touched"] for r in rows] == list(prof.COLD_TOUCH)
    assert all(r["s"] > 0 and r["bytes"] == 12 << 20 for r in rows)


def test_the_step_ratio_is_what_makes_each_reference_step_take_its_measured_time(tmp_path):
    """A step simulated at 10 ms (8 ms of it compute) and measured at 12 ms needs its compute x
    1.25; one simulated at 20 ms (all compute) and measured at 20 ms, x 1: the ratio is their
    geometric mean. Written for each rank count, read back onto the device of that count."""
    rows = [{"model": "a", "simulated_s": 0.010, "compute_s": 0.008, "measured_s": 0.012},
            {"model": "b", "simulated_s": 0.020, "compute_s": 0.020, "measured_s": 0.020}]
    assert prof.fit_step_ratio(rows[:1]) == pytest.approx(1.25)
    assert prof.fit_step_ratio(rows) == pytest.approx(1.25 ** 0.5)
    # a reference far off is held within the range, and no reference at all leaves 1
    assert prof.fit_step_ratio([{**rows[0], "measured_s": 1.0}]) == prof.STEP_RATIO_RANGE[1]
    assert prof.fit_step_ratio([]) == 1.0
    # run when the host had 80% of the speed the figures saw: 15 ms then is 12 ms at their speed
    assert prof.fit_step_ratio([{**rows[0], "measured_s": 0.015, "host_speed": 0.8}]) == pytest.approx(1.25)
    rows[1]["host_speed"] = 1.0
    fitted = {k: {**prof.fit(_rows(20e-6, 3e9, 0.0, k), k), "step_ratio": r} for k, r in ((1, 1.1), (2, 1.3))}
    measured = {1: _rows(20e-6, 3e9, 0.0, 1), 2: {**_rows(20e-6, 3e9, 0.0, 2), "steps": rows}}
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, fitted, measured, "cpu", "shm")
    text = out.read_text()
    assert ("reference steps (simulated / its busiest rank's compute / measured median, the host's speed then "
            "against when these figures were measured): a 0.01 / 0.008 / 0.012, b 0.02 / 0.02 / 0.02 at 1.00") in text
    calibration = load_constants(out)
    assert calibration.apply(parse_devices("1xcpu")).devices[0].step_ratio == pytest.approx(1.1)
    assert calibration.apply(parse_devices("2xcpu")).devices[0].step_ratio == pytest.approx(1.3)


def test_the_links_ratio_and_handoff_are_fitted_on_each_traced_collective(tmp_path):
    """Traced collectives that took 1.8x their figures plus 60 us times the share of the handoff
    they were charged (1 after compute, 0 after another collective, 0.5 on a half-crowded host):
    both come back, from two runs; with noise, they still add up to the runs' total. Written
    under the link with the bursts' handoff kept in the header, and read back onto a mesh of
    that rank count."""
    figures = [10e-6, 40e-6, 200e-6, 1e-3, 15e-6, 80e-6]
    shares = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    points = [(f, 1.8 * f + 60e-6 * sh, sh) for f, sh in zip(figures, shares)]
    rows = [{"model": "a", "collectives": 6, "figures_s": sum(figures), "handoff_s": 0.0, "measured_s": 0.0,
             "points": points} for _ in range(2)]
    assert prof.fit_link_ratio(rows) == (pytest.approx(1.8), pytest.approx(60e-6))
    # a run on a slow spell of the host (every collective 3x) does not move the median of three
    slow_run = {**rows[0], "points": [(f, 3 * t, sh) for f, t, sh in points]}
    assert prof.fit_link_ratio([rows[0], slow_run, rows[1]]) == (pytest.approx(1.8), pytest.approx(60e-6))
    # each model's collectives are matched to their own runs' and fitted together
    other = [(f, 1.8 * f + 60e-6 * sh, sh) for f, sh in ((30e-6, 1.0), (500e-6, 0.0))]
    both = [*rows, *({**rows[0], "model": "b", "points": other} for _ in range(3))]
    assert prof.fit_link_ratio(both) == (pytest.approx(1.8), pytest.approx(60e-6))
    # faster after compute than after another collective: no handoff, the ratio alone
    quick = [(f, 1.5 * f - 5e-6 * sh, sh) for f, sh in zip(figures, shares)]
    ratio, handoff = prof.fit_link_ratio([{**rows[0], "points": quick}])
    assert handoff == 0.0 and ratio == pytest.approx(sum(t for _, t, _ in quick) / sum(figures))
    # noisy: whatever the split, the two give the runs' total
    rng = np.random.default_rng(0)
    noisy = [(f, t * rng.uniform(0.7, 1.3), sh) for f, t, sh in points]
    ratio, handoff = prof.fit_link_ratio([{**rows[0], "points": noisy}])
    assert ratio * sum(figures) + handoff * sum(shares) == pytest.approx(sum(t for _, t, _ in noisy))
    assert 1.0 < ratio < 3.0 and handoff > 0
    # a ratio beyond the range is held at it, the handoff fitted with it
    slow = [(f, 10 * f + 60e-6 * sh, sh) for f, sh in zip(figures, shares)]
    ratio, handoff = prof.fit_link_ratio([{**rows[0], "points": slow}])
    assert ratio == prof.STEP_RATIO_RANGE[1] and handoff > 60e-6
    fitted = {1: prof.fit(_rows(20e-6, 3e9, 0.0, 1), 1), 2: prof.fit(_rows(20e-6, 3e9, 35e-6, 2), 2)}
    fitted[2].update(link_step_ratio=1.8, link_handoff=60e-6)
    measured = {1: _rows(20e-6, 3e9, 0.0, 1), 2: {**_rows(20e-6, 3e9, 35e-6, 2), "split": rows}}
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, fitted, measured, "cpu", "shm")
    assert "the link's step_ratio x1.8 and handoff 60 us (the bursts' first all-reduce: 35 us)" in out.read_text()
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert (link.step_ratio, link.handoff) == (pytest.approx(1.8), pytest.approx(60e-6))


def test_the_links_step_ratio_is_what_makes_the_traced_collectives_take_their_time(tmp_path):
    """Collectives whose traced times make the fit x2.25 with no handoff (none was charged):
    written on the link of that rank count, read back onto a mesh of it; a count without a ratio
    of its own keeps 1. No collective with a figure: ratio 1, the bursts' handoff kept."""
    points = [(0.001, 0.00225, 0.0), (0.002, 0.0045, 0.0)]
    rows = [{"model": "a", "collectives": 2, "figures_s": 0.003, "handoff_s": 0.0, "measured_s": 0.00675,
             "points": points}]
    assert prof.fit_link_ratio(rows) == (pytest.approx(2.25), 0.0)
    assert prof.fit_link_ratio([]) == (1.0, None)
    assert prof.fit_link_ratio([{**rows[0], "points": [(0.0, 0.001, 1.0)]}]) == (1.0, None)
    fitted = {1: prof.fit(_rows(20e-6, 3e9, 0.0, 1), 1), 2: {**prof.fit(_rows(20e-6, 3e9, 0.0, 2), 2),
                                                           "link_step_ratio": 2.25}}
    measured = {1: _rows(20e-6, 3e9, 0.0, 1), 2: {**_rows(20e-6, 3e9, 0.0, 2), "split": rows}}
    out = tmp_path / "c.yaml"
    prof.write_calibration(out, fitted, measured, "cpu", "shm")
    assert "a 2 collectives 0.00675 / 0 / 0.003" in out.read_text()
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.step_ratio == pytest.approx(2.25)
    # a count of ranks without a ratio of its own (4 sharing 2 cores) keeps 1, not 2's
    fitted[4] = prof.fit(_rows(20e-6, 3e9, 0.0, 4), 4)
    measured[4] = _rows(20e-6, 3e9, 0.0, 4)
    prof.write_calibration(out, fitted, measured, "cpu", "shm")
    calibration = load_constants(out)
    assert calibration.apply(parse_devices("4xcpu")).nodes[0].intra_link.step_ratio == 1.0
    assert calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link.step_ratio == pytest.approx(2.25)


@needs_mpiexec
def test_profile_ends_with_reference_steps_that_set_the_step_ratio(tmp_path, monkeypatch):
    """`parc profile` on two ranks with a small reference: each count's reference step is planned
    with the figures just written, run with `parc run` and simulated; the ratio of each count is
    `fit_step_ratio` of those rows, and the file holds it and the rows."""
    monkeypatch.setattr(prof, "REFERENCE_STEPS", (("t5-tiny", ("batch=4",)),))
    monkeypatch.setattr(prof, "REFERENCE_RUNS", 8)
    out = tmp_path / "c.yaml"
    said: list[str] = []
    measured = prof.profile(out, 2, budget=0.002, echo=said.append)
    cores = (os.cpu_count() or 1) >= 2  # two ranks with a core each: the split reference is traced
    assert [line for line in said if line.startswith("running")] == [
        *(["running the reference step t5-tiny, every parameter split, on 2 ranks ..."] if cores else []),
        "running the reference step t5-tiny on 1 rank ...", "running the reference step t5-tiny on 2 ranks ..."]
    calibration = load_constants(out)
    # each kind the executor runs, measured in bursts through its calls, at every size
    assert sorted((r["kind"], r["bytes"]) for r in measured[2]["collectives"]) == sorted(
        (kind, b) for kind in ("reduce_scatter", "all_gather", "all_to_all") for b in prof.ALL_REDUCE_BYTES)
    for k in (1, 2):
        (row,) = measured[k]["steps"]
        assert row["model"] == "t5-tiny" and 0 < row["compute_s"] <= row["simulated_s"] and row["measured_s"] > 0
        device = calibration.apply(parse_devices(f"{k}xcpu")).devices[0]
        assert device.step_ratio == pytest.approx(prof.fit_step_ratio([row]))
    link = calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link
    if not cores:
        assert "split" not in measured[2] and link.step_ratio == 1.0
        return
    split = measured[2]["split"]
    assert len(split) == prof.SPLIT_TRACES
    assert all(r["collectives"] > 0 and r["figures_s"] > 0 and r["measured_s"] > 0 for r in split)
    ratio, handoff = prof.fit_link_ratio(split)
    assert all(len(r["points"]) == r["collectives"] for r in split)
    assert link.step_ratio == pytest.approx(ratio) and link.handoff == pytest.approx(handoff)


def test_a_reference_step_that_fails_leaves_the_benchmarks_calibration_with_a_warning(tmp_path, monkeypatch):
    from parc.exec.runner import RunError

    def broken(*argv):
        raise RunError("parc profile's reference step `parc plan x.onnx ...` failed: no")

    monkeypatch.setattr(prof, "_parc", broken)
    out, said = tmp_path / "c.yaml", []
    prof.profile(out, 1, budget=0.002, echo=said.append)
    assert any(line.startswith("warning: parc profile's reference step `parc plan") and "without step_ratio" in line
               for line in said)
    assert "step_ratio" not in out.read_text()
    assert load_constants(out).apply(parse_devices("1xcpu")).devices[0].step_ratio == 1.0


@needs_mpiexec
def test_reference_steps_that_fail_after_the_split_one_leave_the_bursts_handoff(tmp_path, monkeypatch):
    """The traced split reference fits the link's ratio and handoff; where the reference steps
    after it fail, the calibration is written without ratios and with the bursts' handoff."""
    from parc.exec.runner import RunError

    points = [(f, 1.8 * f + 60e-6 * sh, sh) for f, sh in ((10e-6, 1.0), (40e-6, 0.0), (200e-6, 1.0))]
    monkeypatch.setattr(prof, "reference_models", lambda *a, **k: ([], [("a", tmp_path / "a.onnx")]))
    monkeypatch.setattr(prof, "link_ratios", lambda *a, **k: {2: [{"model": "a", "collectives": 3, "figures_s": 0.0,
                                                                 "handoff_s": 0.0, "measured_s": 0.0,
                                                                 "points": points}]})

    def broken(*a, **k):
        raise RunError("parc profile's reference step `parc run ref0.1 ...` failed: no")

    monkeypatch.setattr(prof, "reference_steps", broken)
    out, said = tmp_path / "c.yaml", []
    measured = prof.profile(out, 2, budget=0.002, echo=said.append)
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.step_ratio == 1.0 and link.handoff == pytest.approx(prof.fit(measured[2], 2)["handoff"])
    assert "fitted on them" not in out.read_text()


@needs_mpiexec
def test_a_split_reference_that_fails_leaves_the_links_figures_and_the_node_ratios(tmp_path, monkeypatch):
    """A model the split hints cannot plan (a user's `--model`, say) costs the links their
    ratio, with a warning, and nothing else: the reference steps still set the node ratios."""
    from parc.exec.runner import RunError

    def fake(*argv):
        argv = [str(a) for a in argv]
        if argv[0] == "plan" and "--hints" in argv:
            raise RunError("parc profile's reference step `parc plan x.onnx ...` failed: ineligible")
        if argv[0] == "run":
            return "\n".join('{"step_time_s": 0.012}' for _ in range(prof.REFERENCE_RUNS))
        return ""

    monkeypatch.setattr(prof, "_parc", fake)
    monkeypatch.setattr(prof, "host_probe", lambda *a, **k: 0.01)  # a host as fast throughout
    monkeypatch.setattr(prof.os, "cpu_count", lambda: 2)  # two ranks with a core each
    import parc.plandir

    monkeypatch.setattr(parc.plandir, "load_plan",
                        lambda d: {"simulation": {"step_time_s": 0.010, "ranks": [{"compute_s": 0.008}]}})
    out, said = tmp_path / "c.yaml", []
    prof.profile(out, 2, budget=0.002, echo=said.append)
    assert any(line.startswith("warning: parc profile's reference step") and "links are written without" in line
               for line in said)
    calibration = load_constants(out)
    assert calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link.step_ratio == 1.0
    assert calibration.apply(parse_devices("2xcpu")).devices[0].step_ratio == pytest.approx(1.25)


def test_the_links_are_fitted_over_every_reference_that_runs_split(tmp_path, monkeypatch):
    """Each reference step is planned split and traced on each count of ranks with a core each;
    one the split hints cannot plan is left out with a warning, the others' collectives kept."""
    from parc.exec.runner import RunError

    planned = []

    def fake(*argv):
        argv = [str(a) for a in argv]
        planned.append(argv[1])
        if argv[1].endswith("a.onnx"):
            raise RunError("parc profile's reference step `parc plan a.onnx ...` failed: ineligible")
        return ""

    monkeypatch.setattr(prof, "_parc", fake)
    monkeypatch.setattr(prof, "_traced_collectives", lambda plan, name, engine, stem: [{"model": name, "at": plan.name}])
    refs = ([], [(n, tmp_path / f"{n}.onnx") for n in ("a", "b", "c")])
    said: list[str] = []
    rows = prof.link_ratios(tmp_path / "c.yaml", [1, 2, 4], 2, "cpu", "ort", tmp_path, said.append, refs)
    assert planned == [str(tmp_path / f"{n}.onnx") for n in ("a", "b", "c")]  # on 2 ranks only: 4 share 2 cores
    assert rows == {2: [{"model": "b", "at": "split.2.1"}, {"model": "c", "at": "split.2.2"}]}
    assert said[-1] == ("warning: parc profile's reference step `parc plan a.onnx ...` failed: ineligible; "
                        "the links are fitted without a")
    # none can run split: the first failure is raised (the caller writes the links' figures)
    with pytest.raises(RunError, match="a.onnx"):
        prof.link_ratios(tmp_path / "c.yaml", [2], 2, "cpu", "ort", tmp_path, said.append, ([], refs[1][:1]))


def test_the_models_given_are_the_reference_steps(tmp_path, monkeypatch):
    """With `--model` files the references are those models (their dims bound as given), not the
    zoo's: a calibration from a model's own shapes is meant for that model."""
    calls = []

    def fake(*argv):
        calls.append([str(a) for a in argv])
        if argv[0] == "run":
            return "\n".join('{"step_time_s": 0.012}' for _ in range(prof.REFERENCE_RUNS))
        return ""

    monkeypatch.setattr(prof, "_parc", fake)
    import parc.plandir

    # the plan's own replay (plan.json's `simulation`, what `parc simulate` gives)
    monkeypatch.setattr(parc.plandir, "load_plan",
                        lambda d: {"simulation": {"step_time_s": 0.010, "ranks": [{"compute_s": 0.008}]}})
    rows = prof.reference_steps(tmp_path / "c.yaml", [1, 2], "cpu", "ort", tmp_path, lambda s: None,
                                models=[tmp_path / "mine.train.onnx"], dims={"N": 4})
    assert not any(c[0] == "models" for c in calls)
    plans = [c for c in calls if c[0] == "plan"]
    assert [c[1] for c in plans] == [str(tmp_path / "mine.train.onnx")] * 2
    assert all(c[c.index("--dim") + 1] == "N=4" for c in plans) and [c[c.index("--devices") + 1] for c in plans] == \
        ["1xcpu", "2xcpu"]
    assert rows[2] == [{"model": "mine.train.onnx", "simulated_s": 0.010, "compute_s": 0.008, "measured_s": 0.012}]
    assert prof.fit_step_ratio(rows[2]) == pytest.approx(1.25)
    # with the probes of each count's figures, each run is probed before it: its host_speed
    probed = iter([0.5, 0.4])  # the host's probe before each run: slower, then as before
    monkeypatch.setattr(prof, "host_probe", lambda *a, **k: next(probed))
    timed = prof.reference_steps(tmp_path / "c.yaml", [1, 2], "cpu", "ort", tmp_path, lambda s: None,
                                 models=[tmp_path / "mine.train.onnx"], probes={1: 0.4, 2: 0.4})
    assert [r["host_speed"] for k in (1, 2) for r in timed[k]] == [pytest.approx(0.8), pytest.approx(1.0)]
    assert prof.fit_step_ratio(timed[1]) == pytest.approx(1 + (0.012 * 0.8 - 0.010) / 0.008)
