"""The alpha-beta and roofline formulas against hand computations."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parc.cluster import (
    COLLECTIVES,
    DEVICES,
    LINKS,
    DeviceSpec,
    LinkSpec,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    axis_collective_time,
    collective_time,
    compute_time,
    enumerate_meshes,
    node_floor,
    parse_devices,
    reduce_scatter_time,
    send_recv_time,
)
from parc.ir.dtypes import BFLOAT16, FLOAT, FLOAT16

LINK = LinkSpec("test", 1e9, 1e-5)  # 1 GB/s, 10 us
B = 8e6  # 8 MB


@pytest.mark.parametrize("kind, n, expected", [
    # all-reduce: 2(n-1) steps, 2(n-1)/n B: 6 * 10us + 1.5 * 8 MB / 1 GB/s
    ("all_reduce", 4, 6e-5 + 0.012),
    ("all_reduce", 2, 2e-5 + 0.008),
    ("all_reduce", 8, 14e-5 + 0.014),
    # all-gather and reduce-scatter: n-1 steps, (n-1)/n B
    ("all_gather", 4, 3e-5 + 0.006),
    ("reduce_scatter", 4, 3e-5 + 0.006),
    ("all_gather", 8, 7e-5 + 0.007),
    # all-to-all: n-1 steps, (n-1)/n^2 B per device
    ("all_to_all", 4, 3e-5 + 0.0015),
    ("all_to_all", 2, 1e-5 + 0.002),
    # send/recv: one message of B
    ("send_recv", 2, 1e-5 + 0.008),
])
def test_collectives_by_hand(kind, n, expected):
    assert collective_time(kind, LINK, n, B) == pytest.approx(expected, rel=1e-12)
    assert COLLECTIVES[kind](LINK, n, B) == pytest.approx(expected, rel=1e-12)


def test_per_kind_functions_are_the_table():
    assert COLLECTIVES == {"all_reduce": all_reduce_time, "all_gather": all_gather_time,
                           "reduce_scatter": reduce_scatter_time, "all_to_all": all_to_all_time,
                           "send_recv": send_recv_time}


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_one_device_costs_nothing(kind):
    assert collective_time(kind, LINK, 1, B) == 0.0


def test_send_recv_ignores_n_and_zero_bytes_cost_latency():
    assert send_recv_time(LINK, 1, 0) == send_recv_time(LINK, 16, 0) == 1e-5
    assert all_reduce_time(LINK, 4, 0) == pytest.approx(6e-5)


@pytest.mark.parametrize("kind", list(COLLECTIVES))
def test_a_call_cost_is_paid_once_per_collective_whatever_the_group(kind):
    busy = replace(LINK, call=3e-4)  # ranks outnumbering cores: every call waits for its members
    for n in (2, 4, 8):
        assert collective_time(kind, busy, n, B) == pytest.approx(collective_time(kind, LINK, n, B) + 3e-4, rel=1e-12)
    if kind != "send_recv":
        assert collective_time(kind, busy, 1, B) == 0.0
    with pytest.raises(ValueError, match="call must be >= 0"):
        LinkSpec("bad", 1e9, 1e-5, call=-1.0)
    assert LinkSpec.from_json(busy.to_json()) == busy and "call" not in LINK.to_json()


def test_collective_time_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collective_time("broadcast", LINK, 4, B)
    with pytest.raises(ValueError, match="n >= 1"):
        collective_time("all_reduce", LINK, 0, B)
    with pytest.raises(ValueError, match="nbytes >= 0"):
        collective_time("all_reduce", LINK, 2, -1)


@given(st.integers(2, 64), st.floats(0, 1e10))
def test_reduce_scatter_plus_all_gather_is_all_reduce(n, nbytes):
    split = reduce_scatter_time(LINK, n, nbytes) + all_gather_time(LINK, n, nbytes)
    assert split == pytest.approx(all_reduce_time(LINK, n, nbytes), rel=1e-9)


def test_axis_collective_time_uses_the_axis_link():
    mesh = enumerate_meshes(parse_devices("2x8xv100-32g"))[1]  # 2x8 [net-100g/8, nvlink2]
    gradient = 4 * 350e6  # 350M float32 parameters
    # across nodes: 2 steps x 14 us + 1 x 1.4 GB / (12.5 GB/s / 8)
    assert axis_collective_time(mesh, 0, "all_reduce", gradient) == pytest.approx(2 * 14e-6 + 1.4e9 / 1.5625e9)
    # inside a node: 14 steps x 3.4 us + 14/8 x 1.4 GB / 150 GB/s
    assert axis_collective_time(mesh, 1, "all_reduce", gradient) == pytest.approx(
        14 * 3.4e-6 + 1.75 * 1.4e9 / 150e9)
    assert axis_collective_time(mesh, 1, "send_recv", 1e6) == pytest.approx(3.4e-6 + 1e6 / 150e9)
    assert LINKS["nvlink2"] == mesh.links[1]


def test_compute_bound_and_memory_bound():
    v100 = DEVICES["v100-32g"]
    # 15.7 TFLOP at 15.7 TFLOP/s float32: 1 s, plus the 5 us floor
    assert compute_time(15.7e12, 0, v100, "float32") == pytest.approx(1 + 5e-6)
    assert compute_time(15.7e12, 0, v100, FLOAT) == pytest.approx(1 + 5e-6)
    # the same FLOPs in float16 on tensor cores: 15.7 / 125 s
    assert compute_time(15.7e12, 0, v100, FLOAT16) == pytest.approx(15.7 / 125 + 5e-6)
    # bf16 has no V100 units: the float32 rate
    assert compute_time(15.7e12, 0, v100, BFLOAT16) == pytest.approx(1 + 5e-6)
    # an element-wise op: 1 GFLOP but 9 GB of traffic at 900 GB/s -> memory-bound, 10 ms
    assert compute_time(1e9, 9e9, v100, "float32") == pytest.approx(0.01 + 5e-6)
    # nothing to do still costs the launch floor
    assert compute_time(0, 0, v100) == 5e-6
    # a module's nodes in a row on a GPU: kernels queue behind the host's launches, so a node
    # costs the longer of the two (a kernel shorter than its launch costs the launch)
    assert v100.gpu and compute_time(15.7e12, 0, v100, queued=True) == pytest.approx(1)
    assert compute_time(0, 9e5, v100, queued=True) == 5e-6
    # a layer norm streaming at a tenth of the bandwidth (a calibrated class)
    slow = replace(v100, memory_op_efficiency={"LayerNormalization": 0.1})
    assert compute_time(0, 9e9, slow, "float32", "LayerNormalization") == pytest.approx(0.1 + 5e-6)
    assert compute_time(0, 9e9, slow, "float32", "Mul") == pytest.approx(0.01 + 5e-6)
    # a CPU runs each kernel in the calling thread: the floor adds even in a row
    cpu = DEVICES["cpu"]
    assert not cpu.gpu and compute_time(1e12, 0, cpu, queued=True) == pytest.approx(1 + 2e-6)


def test_efficiencies_scale_their_own_term():
    a100 = dataclasses.replace(DEVICES["a100-80g"], compute_efficiency=0.5, memory_efficiency=0.8,
                               launch_floor=0.0)
    assert compute_time(312e12, 0, a100, "bf16") == pytest.approx(2.0)
    assert compute_time(0, 2039e9, a100, "bf16") == pytest.approx(1.25)
    assert compute_time(312e12, 2039e9, a100, "bf16") == pytest.approx(2.0)  # max, not sum
    cpu = DEVICES["cpu"]
    assert compute_time(1e12, 0, cpu, "float32") == pytest.approx(1 + 2e-6)


def test_compute_time_rejects_negative_work():
    with pytest.raises(ValueError, match="flops >= 0"):
        compute_time(-1, 0, DEVICES["cpu"])


def test_a_nodes_floor_and_pieces_add_to_its_roofline():
    cpu = replace(DEVICES["cpu"], launch_floor=1e-6, node_floor=2e-6, op_floor={"Transpose": 5e-6, "Where": 0.0},
                  node_piece=1e-8, op_piece={"Softmax": 3e-8})
    # an elementwise node: the roofline, its pieces at the default cost, the launch and class floors
    assert compute_time(0, 1e11, cpu, "float32", "Sub", pieces=100) == pytest.approx(1.0 + 1e-6 + 1e-6 + 2e-6)
    # a class with its own floor and piece cost (0 counts: not the default)
    assert compute_time(0, 1e11, cpu, "float32", "Transpose") == pytest.approx(1.0 + 1e-6 + 5e-6)
    assert compute_time(0, 1e11, cpu, "float32", "Where") == pytest.approx(1.0 + 1e-6)
    assert compute_time(0, 0.0, cpu, "float32", "Softmax", pieces=1000) == pytest.approx(3e-5 + 1e-6)
    # pieces add to the roofline (a walk of short pieces is not overlapped with the streaming)
    assert compute_time(1e12, 0, cpu, "float32", "Softmax", pieces=1000) == pytest.approx(1.0 + 3e-5 + 1e-6 + 2e-6)
    # a node without work (a Reshape) pays the launch floor only
    assert compute_time(0, 0, cpu, "float32", "Reshape") == pytest.approx(1e-6)
    assert node_floor(0, 0, cpu, "Reshape") == pytest.approx(1e-6)
    assert node_floor(1, 0, cpu, "Transpose") == pytest.approx(6e-6)
    # the catalogue's devices have neither
    v100 = DEVICES["v100-32g"]
    assert v100.class_floor("Transpose") == 0.0 and v100.piece_cost("Softmax") == 0.0
    assert compute_time(0, 9e5, v100, pieces=1e6) == compute_time(0, 9e5, v100)
    with pytest.raises(ValueError, match="op_piece of Softmax must be >= 0"):
        replace(cpu, op_piece={"Softmax": -1.0})
    with pytest.raises(ValueError, match="node floor must be >= 0"):
        replace(cpu, node_floor=-1e-6)
    assert DeviceSpec.from_json(cpu.to_json()) == cpu
