"""`parc profile`'s fit of its measurements (`parc.calibrate.fit`), on rows a machine with known
figures would measure, and the calibration file's figures read back onto devices and links."""

from __future__ import annotations

import dataclasses

import pytest

import parc.calibrate.graphs as graphs
from parc.calibrate.catalogue import ALL_REDUCE_BYTES, RUN_OPS
from parc.calibrate.file import write_calibration
from parc.calibrate.fit import fit, fit_cold, fit_kind
from parc.cluster import load_constants, parse_devices
from parc.cluster.devices import OWN_PIECES
from tests.calibrate.samples import machine_rows


def test_fit_recovers_the_figures_of_the_formula():
    f = fit(machine_rows(20e-6, 3e9, 5e-4, 4), 4)
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
    f = fit(machine_rows(5e-6, 1e9, 8e-4, 4, call=3e-4), 4)
    assert (f["call"], f["latency"], f["bandwidth"]) == pytest.approx((3e-4, 5e-6, 1e9), rel=1e-6)
    # no call cost in the rows: none fitted (the test above asserts alpha and beta exact)
    assert fit(machine_rows(20e-6, 3e9, 5e-4, 4), 4)["call"] == pytest.approx(0.0, abs=1e-12)
    # one group size cannot tell a call from alpha: the ring formula alone, as before
    two = fit(machine_rows(5e-6, 1e9, 0.0, 2, call=3e-4), 2)
    assert two["call"] == 0.0 and two["latency"] == pytest.approx(5e-6 + 3e-4 / 2, rel=1e-3)
    # a call cost that would need a negative alpha is not taken
    rows = machine_rows(5e-6, 1e9, 0.0, 4)
    for r in rows["all_reduce"]:
        r["s"] += 4e-4 if r["n"] == 4 else 0.0
    assert fit(rows, 4)["call"] == 0.0


def test_reduce_scatters_all_gathers_and_all_to_alls_get_figures_of_their_own(tmp_path):
    """Bursts of reduce-scatters at 25 us + (n-1)/n B at 1.5 GB/s, all-gathers at 10 us +
    2 GB/s and all-to-alls at 20 us + (n-1)/n^2 B at 1 GB/s, beside all-reduces at 5 us a step
    and 4 GB/s: each kind's alpha and beta come back, the link's call cost taken off first;
    written under the link and read back onto it."""
    rows = machine_rows(5e-6, 4e9, 0.0, 2)
    rows["collectives"] = [{"kind": kind, "n": 2, "bytes": b, "s": alpha + b * share / beta}
                           for kind, alpha, beta, share in (("reduce_scatter", 25e-6, 1.5e9, 1 / 2),
                                                            ("all_gather", 10e-6, 2e9, 1 / 2),
                                                            ("all_to_all", 20e-6, 1e9, 1 / 4))
                           for b in ALL_REDUCE_BYTES]
    f = fit(rows, 2)
    assert f["kinds"]["reduce_scatter"] == pytest.approx((25e-6, 1.5e9), rel=1e-6)
    assert f["kinds"]["all_gather"] == pytest.approx((10e-6, 2e9), rel=1e-6)
    assert f["kinds"]["all_to_all"] == pytest.approx((20e-6, 1e9), rel=1e-6)
    assert fit_kind(rows["collectives"][:4], "reduce_scatter", 5e-6) == pytest.approx((20e-6, 1.5e9), rel=1e-6)
    # no latency at all: the bandwidth alone, alpha 0
    flat = [{"kind": "all_gather", "n": 2, "bytes": b, "s": b / 2 / 2e9} for b in ALL_REDUCE_BYTES]
    assert fit_kind(flat, "all_gather", 0.0) == pytest.approx((0.0, 2e9), abs=1e-12, rel=1e-6)
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: fit(machine_rows(5e-6, 4e9, 0.0, 2), 1), 2: f}, {2: rows}, "cpu", "shm")
    assert "in a burst reduce_scatter 2 ranks 64 B" in out.read_text()
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.figures("reduce_scatter") == pytest.approx((25e-6, 1.5e9), rel=1e-6)
    assert link.figures("all_to_all") == pytest.approx((20e-6, 1e9), rel=1e-6)
    assert link.figures("all_reduce") == pytest.approx((5e-6, 4e9), rel=1e-6)


def test_the_handoff_is_the_first_ones_excess_where_it_moves_no_bytes():
    # a first all-reduce after compute that also pays 1 ns a byte more than the burst (caches the
    # compute evicted): the handoff is the 64 B rows' excess, not an average over the sizes
    rows = machine_rows(20e-6, 3e9, 5e-4, 4)
    for r in rows["all_reduce"]:
        r["first_s"] += r["bytes"] * 1e-9
    assert fit(rows, 4)["handoff"] == pytest.approx(5e-4 + 64e-9)
    for r in rows["all_reduce"]:  # a first faster than the burst: no handoff
        r["first_s"] = r["s"] / 2
    assert fit(rows, 4)["handoff"] == 0.0


def test_batched_products_and_memory_classes_are_fractions_of_the_fastest_rate(tmp_path):
    rows = machine_rows(20e-6, 3e9, 0.0, 1)
    rows["matmul"] = [{"shape": [64, 64, 64], "flops_per_s": 4e11}, {"shape": [8, 4, 64, 64, 64], "flops_per_s": 1e11},
                      {"shape": [16, 128, 64, 256], "flops_per_s": 4e11}]
    rows["memory"] = [{"op": "Add", "bytes_per_s": 2e12}, {"op": "MulBroadcast", "bytes_per_s": 2e12},
                      {"op": "LayerNorm", "bytes_per_s": 2e11}, {"op": "ReduceSumFirst", "bytes_per_s": 1e12}]
    f = fit(rows, 1)
    assert f["peak_float32"] == pytest.approx(4e11) and f["compute_efficiency"] == 1.0
    assert f["op_efficiency"] == pytest.approx({"BatchMatMul": 0.5})  # geometric mean of 1e11 and 4e11
    assert f["memory_bandwidth"] == pytest.approx(2e12) and f["memory_efficiency"] == 1.0
    assert f["memory_op_efficiency"] == pytest.approx({"LayerNormalization": 0.1, "ReduceSum": 0.5})
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: f}, {1: {**rows, "matmul": [], "memory": []}}, "h100-80g", "nvlink4")
    spec = load_constants(out).apply(parse_devices("1xh100-80g")).devices[0]
    assert spec.memory_fraction("LayerNormalization") == pytest.approx(0.1) and spec.memory_fraction("Mul") == 1.0
    assert spec.efficiency("BatchMatMul") == pytest.approx(0.5) and spec.gpu


def test_convolution_classes_are_fractions_of_the_fastest_rate():
    rows = machine_rows(20e-6, 3e9, 0.0, 2)
    rows["conv"] = [{"class": "Conv", "flops_per_s": 5e10}, {"class": "ConvWeightGrad", "flops_per_s": 1e10},
                    {"class": "Conv", "flops_per_s": 2e11}]
    f = fit(rows, 2)
    assert f["peak_float32"] == pytest.approx(1e11)  # MatMul 1e11; Conv's geometric mean is 1e11 too
    assert f["op_efficiency"] == pytest.approx({"Conv": 1.0, "ConvWeightGrad": 0.1})
    assert f["compute_efficiency"] == pytest.approx(1.0)


def test_a_models_convolutions_weigh_as_often_as_it_has_them():
    # the class's rate is the model's FLOPs over its time: 3 x 1 GFLOP at 1 GFLOP/s and 1 x 1 GFLOP
    # at 4 GFLOP/s take 3.25 s for 4 GFLOP (the built-in cases' geometric mean would say 2 GFLOP/s)
    rows = machine_rows(20e-6, 3e9, 0.0, 1)
    rows["matmul"] = [{"shape": [64, 64, 64], "flops_per_s": 8e9}]
    rows["conv"] = [{"class": "ConvWeightGrad", "flops": 1e9, "flops_per_s": 1e9, "count": 3},
                    {"class": "ConvWeightGrad", "flops": 1e9, "flops_per_s": 4e9, "count": 1},
                    {"class": "Conv", "flops": 1e9, "flops_per_s": 2e9}, {"class": "Conv", "flops": 1e9, "flops_per_s": 8e9}]
    f = fit(rows, 1)
    assert f["op_efficiency"] == pytest.approx({"ConvWeightGrad": 4 / 3.25 / 8, "Conv": 0.5})


def test_piece_costs_and_floors_are_fitted_with_their_classes_rates(tmp_path):
    """Rows of a machine where a Transpose streams at 20 GB/s and pays 15 ns a short run, an
    elementwise op 40 GB/s and 8 ns a broadcast span, and small nodes a floor beyond both."""
    launch, rate, cost, add_rate, span = 1e-6, 20e9, 15e-9, 40e9, 8e-9
    rows = machine_rows(20e-6, 3e9, 0.0, 1)
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
    f = fit(rows, 1)
    assert f["memory_bandwidth"] == pytest.approx(add_rate)
    assert f["memory_op_efficiency"]["Transpose"] * f["memory_bandwidth"] == pytest.approx(rate)
    assert f["op_piece"] == pytest.approx({"Transpose": cost}) and f["node_piece"] == pytest.approx(span)
    assert f["op_floor"] == pytest.approx({"Transpose": 3e-6, "MatMul": 4e-6, "Gemm": 4e-6})  # a Gemm: MatMul's
    assert f["node_floor"] == pytest.approx(0.5e-6)
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: f}, {1: rows}, "cpu", "shm")
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert (cpu.piece_cost("Transpose"), cpu.piece_cost("Sub"), cpu.class_floor("Gemm"), cpu.class_floor("Mul")) == \
        pytest.approx((cost, span, 4e-6, 0.5e-6))
    # a piece case a negative cost would fit (pieces that run faster than the stream): a cost of 0,
    # the class keeps its measured rate
    rows["pieces"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 32768.0, "s": launch + (1 << 20) / rate / 4}]
    f = fit(rows, 1)
    assert f["op_piece"] == {"Transpose": 0.0} and f["memory_op_efficiency"]["Transpose"] > 0


def _stream_rows(cache: int, fast: float, slow: float, sweep: bool = True, k: int = 1) -> dict:
    """Rows of a host whose Adds stream at `fast` bytes/s up to `cache` bytes and `slow` beyond,
    and whose Transposes stream at half those rates."""
    rows = machine_rows(20e-6, 3e9, 0.0, k)
    launch = rows["launch_floor_s"]

    def row(op, b, half=1.0):
        rate = (fast if b <= cache else slow) * half
        return {"op": op, "bytes": b, "s": launch + b / rate, "bytes_per_s": rate}

    rows["memory"] = [row("Add", b) for b in (3 << 20, 12 << 20, 48 << 20)]
    rows["memory"] += [row("Transpose", b, 0.5) for b in (2 << 20, 8 << 20, 32 << 20)]
    rows["sweep"] = [row("Add", b) for b in (3 << 18, 3 << 19, 6 << 20, 24 << 20)] if sweep else []
    return rows


def _cold_rows(rates: dict[int, float]) -> list[dict]:
    nbytes = 12 << 20
    return [{"touched": mib << 20, "bytes": nbytes, "s": nbytes / rate} for mib, rate in rates.items()]


def test_the_caches_reach_and_speedup_are_fitted_from_the_adds(tmp_path):
    """Adds at 150 GB/s up to 3 MiB and 50 GB/s beyond: the caches reach 3 MiB at 3x, and the
    rates written are memory's (a Transpose's 2 MiB row, at 75 GB/s, gives 25 GB/s as its others):
    a step's tensors stream at memory's rate whatever their size."""
    rows = _stream_rows(3 << 20, 150e9, 50e9)
    f = fit(rows, 1)
    assert (f["cache_bytes"], f["cache_speedup"]) == pytest.approx((3 << 20, 3.0))
    assert f["memory_bandwidth"] * f["memory_efficiency"] == pytest.approx(50e9)
    assert f["memory_op_efficiency"]["Transpose"] * f["memory_bandwidth"] == pytest.approx(25e9)
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: f}, {1: rows}, "cpu", "shm")
    text = out.read_text()
    assert "sweep Add 0.75 MiB" in text and "from the caches up to 3 MiB, 3.00x" in text
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert cpu.memory_bandwidth * cpu.memory_efficiency == pytest.approx(50e9)
    # the knee where it is: 6 MiB still fast -> 6 MiB
    assert fit(_stream_rows(6 << 20, 150e9, 50e9), 1)["cache_bytes"] == 6 << 20
    # no faster small Adds, or no sweep measured (a GPU): every row as it was measured
    for rows in (_stream_rows(3 << 20, 60e9, 50e9), _stream_rows(3 << 20, 150e9, 50e9, sweep=False)):
        f = fit(rows, 1)
        assert (f["cache_bytes"], f["cache_speedup"]) == (0.0, 1.0)
    f = fit(_stream_rows(3 << 20, 150e9, 50e9, sweep=False), 1)
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
    f = fit(rows, 1)
    assert f["memory_op_efficiency"]["Transpose"] * f["memory_bandwidth"] == pytest.approx(rate)
    assert f["op_piece"]["Transpose"] == pytest.approx(cost) and f["op_floor"]["Transpose"] == pytest.approx(3e-6)


def test_a_convolution_class_rate_and_piece_cost_are_fitted_together(tmp_path):
    """Rows of a machine whose 2-D products run 100 GFLOP/s, where a Conv runs 80 GFLOP/s plus 0.12 ns
    an element of its lowering and a ConvTranspose 40 GFLOP/s plus 0.3 ns: both recovered, and the
    calibration prices a node with both."""
    launch = 1e-6
    rows = machine_rows(0, 1, 0, 1)
    rows["launch_floor_s"] = launch
    truth = {"Conv": (80e9, 0.12e-9), "ConvTranspose": (40e9, 0.3e-9)}
    cases = {"Conv": [(75e6, 2.4e6), (75e6, 1.2e6), (19e6, 1.2e6), (17e6, 0.16e6)],
             "ConvTranspose": [(19e6, 1.2e6), (19e6, 0.3e6), (38e6, 1.2e6)]}
    rows["conv"] = [{"class": cls, "flops": f, "pieces": p, "s": launch + f / truth[cls][0] + p * truth[cls][1],
                     "input": [1], "weight": [1]} for cls, items in cases.items() for f, p in items]
    for r in rows["conv"]:
        r["flops_per_s"] = r["flops"] / (r["s"] - launch)
    f = fit(rows, 1)
    peak = f["peak_float32"]
    for cls, (rate, cost) in truth.items():
        assert f["op_efficiency"][cls] * peak == pytest.approx(rate, rel=1e-6)
        assert f["op_piece"][cls] == pytest.approx(cost, rel=1e-6)
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: f}, {1: rows}, "cpu", "shm")
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert cpu.piece_cost("ConvTranspose") == pytest.approx(0.3e-9)
    # a rate above the 2-D product's is held at it, and the cost carries the rest
    fast = {**rows, "conv": [{**r, "s": launch + r["flops"] / 1e15 + r["pieces"] * 1e-9}
                             for r in rows["conv"] if r["class"] == "Conv"]}
    for r in fast["conv"]:
        r["flops_per_s"] = r["flops"] / (r["s"] - launch)
    g = fit(fast, 1)
    assert g["op_efficiency"]["Conv"] * g["peak_float32"] == pytest.approx(g["peak_float32"] * g["compute_efficiency"])
    assert g["op_piece"]["Conv"] > 0
    # a model's own shapes (rows with a count): their rate as measured, no piece cost
    own = {**rows, "conv": [{**r, "count": 2} for r in rows["conv"]]}
    h = fit(own, 1)
    assert h["op_piece"]["Conv"] == 0.0 and h["op_piece"]["ConvTranspose"] == 0.0


def test_a_device_without_a_convolutions_piece_cost_charges_its_pieces_nothing():
    cpu = dataclasses.replace(parse_devices("1xcpu").devices[0], node_piece=1e-8)  # a run's cost
    assert cpu.piece_cost("Transpose") == 1e-8
    assert all(cpu.piece_cost(cls) == 0.0 for cls in OWN_PIECES)
    assert dataclasses.replace(cpu, op_piece={"Conv": 2e-10}).piece_cost("Conv") == 2e-10


def test_a_wheres_rate_and_cost_a_run_are_fitted_from_its_two_masks():
    """A Where streams at 20 GB/s and pays 7 ns where its condition changes: the random mask's rows
    and the causal triangle's differ in runs per byte, which tells the two apart."""
    launch, rate, run = 1e-6, 20e9, 7e-9
    rows = machine_rows(0, 1, 0, 1)
    rows["launch_floor_s"] = launch
    rows["memory"] = []
    for op in RUN_OPS:
        for r in (1024, 4096):
            model, nbytes = graphs.memory_op(op, r)
            pieces = graphs.pieces(model)
            rows["memory"].append({"op": op, "bytes": nbytes, "pieces": pieces, "s": launch + nbytes / rate + pieces * run})
    rows["memory"] += [{"op": "Add", "bytes": b, "s": launch + b / 40e9} for b in (3 << 20, 12 << 20)]
    for r in rows["memory"]:
        r["bytes_per_s"] = r["bytes"] / (r["s"] - launch)
    rows["pieces"] = [{"op": "SubRows", "bytes": 1 << 20, "pieces": 2048.0, "s": launch + (1 << 20) / 40e9 + 2048 * 8e-9}]
    f = fit(rows, 1)
    assert f["memory_op_efficiency"]["Where"] * f["memory_bandwidth"] == pytest.approx(rate, rel=1e-6)
    assert f["op_piece"]["Where"] == pytest.approx(run, rel=1e-6)
    random, masked = (r["pieces"] / r["bytes"] for r in rows["memory"][::2][:2])
    assert random > 30 * masked  # a random mask changes at every other element


def test_reads_after_a_ranks_traffic_give_the_cold_rate_and_the_caches_share(tmp_path):
    """An Add at 24 GB/s after nothing and after 32 MiB written, 16 GB/s after 128 MiB, 9 GB/s
    after 512 MiB: the cold rate is 9 GB/s; the rate falls to their geometric mean (14.7 GB/s)
    between 128 and 512 MiB written (log-interpolated: 128 * 4^(1.3/7)), and each written byte
    is read and written: the share is twice that in traffic. Written to the calibration, read back
    onto the device."""
    rows = _cold_rows({0: 24e9, 32: 24e9, 128: 16e9, 512: 9e9})
    cold, share = fit_cold(rows)
    mid = (24e9 * 9e9) ** 0.5
    written = 128 * 4 ** ((16e9 - mid) / (16e9 - 9e9)) * 2**20
    assert cold == pytest.approx(9e9) and share == pytest.approx(2 * written)
    stream = _stream_rows(3 << 20, 150e9, 24e9)
    stream["cold"] = rows
    f = fit(stream, 1)
    assert (f["cold_bandwidth"], f["cache_share"]) == pytest.approx((cold, share))
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: f}, {1: stream}, "cpu", "shm")
    assert "cold Add after writing 0 MiB" in out.read_text()
    cpu = load_constants(out).apply(parse_devices("1xcpu")).devices[0]
    assert (cpu.cold_bandwidth, cpu.cache_share) == pytest.approx((cold, share))
    assert cpu.cold_cost() == pytest.approx(1 / 9e9 - 1 / 24e9)
    # no fall (the caches hold it all, or none of it): nothing to price
    assert fit_cold(_cold_rows({0: 24e9, 32: 23e9, 128: 22e9, 512: 21e9})) == (0.0, 0.0)
    # a fall already by the first writing: the share is that much traffic
    assert fit_cold(_cold_rows({0: 24e9, 32: 9e9, 128: 9e9, 512: 9e9})) == pytest.approx((9e9, 2 * (32 << 20)))
