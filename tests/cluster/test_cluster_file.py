"""Cluster files and calibration: the YAML format, and errors that name the file, line and key."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from parc.cluster import (
    DEVICES,
    LINKS,
    Calibration,
    Cluster,
    LinkSpec,
    enumerate_meshes,
    load_cluster,
    load_constants,
    override_fields,
    parse_devices,
)
from parc.cluster.devices import DeviceSpec
from parc.errors import UsageError

EXAMPLE = """\
devices:
  mygpu: {fp32_tflops: 20, fp16_tflops: 80, memory_gib: 24, bandwidth_gbs: 900}
  v100-30g: {base: v100-32g, memory_gib: 30}
nodes:
  - gpus: 8xv100-32g
    intra_link: nvlink2
    count: 2
  - gpus: [mygpu, 2xv100-30g]
    intra_link: {bandwidth_gbps: 256, latency_us: 5}
    nics: 2
inter_link: 100gbe
calibration:
  devices:
    v100-32g: {launch_floor_us: 8, compute_efficiency: 0.6}
  links:
    nvlink2: {bandwidth_gbs: 130}
  constants:
    memory: {activation_factor: 1.2}
"""


def write(tmp_path, text: str, name: str = "cluster.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_example_file(tmp_path):
    cluster = load_cluster(write(tmp_path, EXAMPLE))
    assert cluster.node_sizes == (8, 8, 3)
    v100 = cluster.devices[0]
    assert v100 == dataclasses.replace(DEVICES["v100-32g"], launch_floor=8e-6, compute_efficiency=0.6)
    mygpu, v100_30 = cluster.nodes[2].devices[:2]
    assert mygpu.name == "mygpu" and mygpu.peak_flops == (("float32", 20e12), ("float16", 80e12))
    assert mygpu.memory_bytes == 24 * 2**30 and mygpu.memory_bandwidth == 900e9
    assert mygpu.launch_floor == 5e-6 and mygpu.default_link == "pcie4"  # DeviceSpec defaults
    assert v100_30 == dataclasses.replace(DEVICES["v100-32g"], name="v100-30g", memory_bytes=30 * 2**30)
    assert cluster.nodes[0].intra_link == LinkSpec("nvlink2", 130e9, 3.4e-6)  # calibrated
    assert cluster.nodes[2].intra_link == LinkSpec("custom-intra", 32e9, 5e-6)
    assert [n.nics for n in cluster.nodes] == [1, 1, 2]
    assert cluster.inter_link == LINKS["net-100g"]
    assert cluster.min_memory == 24 * 2**30


def test_minimal_file_matches_the_spec(tmp_path):
    path = write(tmp_path, "nodes:\n  - gpus: 8xa100-80g\n    count: 2\n")
    assert load_cluster(path) == parse_devices("2x8xa100-80g")
    path = write(tmp_path, "nodes: [{gpus: 4xv100-32g+4xp100-16g}]\n")
    assert load_cluster(path) == parse_devices("(4xv100-32g+4xp100-16g)")


def test_links_by_mapping_and_base(tmp_path):
    path = write(tmp_path, """\
        nodes:
          - gpus: [t4, t4]
            intra_link: {base: pcie4, latency_us: 2, name: my-pcie}
        inter_link: {bandwidth: 5.0e9, latency: 2.0e-5}
        """)
    cluster = load_cluster(path)
    assert cluster.nodes[0].intra_link == LinkSpec("my-pcie", 32e9, 2e-6)
    assert cluster.inter_link == LinkSpec("custom-inter", 5e9, 2e-5)


def test_si_field_names_and_peak_table(tmp_path):
    path = write(tmp_path, """\
        devices:
          g: {peak_flops: {float32: 1.0e13, bf16: 4.0e13}, memory_bytes: 1073741824, memory_bandwidth: 5.0e11,
              launch_floor: 0, default_link: 25gbe}
        nodes: [{gpus: 2xg}]
        """)
    cluster = load_cluster(path)
    g = cluster.devices[0]
    assert g.peak_flops == (("float32", 1e13), ("bfloat16", 4e13)) and g.launch_floor == 0.0
    assert cluster.nodes[0].intra_link == LINKS["net-25g"]


def test_load_constants_and_apply(tmp_path):
    path = write(tmp_path, """\
        devices:
          a100: {compute_efficiency: 0.5}
        """)
    with pytest.raises(UsageError, match="ambiguous"):
        load_constants(path)
    path = write(tmp_path, """\
        devices:
          A100-80GB: {compute_efficiency: 0.5, memory_efficiency: 0.8, bf16_tflops: 250}
        links:
          hdr: {latency_us: 20}
        constants:
          memory: {activation_factor: 1.5, reserved_gib: 1}
        """, "calib.yaml")
    calibration = load_constants(path)
    assert calibration.section("memory") == {"activation_factor": 1.5, "reserved_gib": 1.0}
    assert calibration.section("solver") == {}
    cluster = calibration.apply(parse_devices("2x8xa100-80g"))
    a100 = cluster.devices[0]
    assert (a100.compute_efficiency, a100.memory_efficiency) == (0.5, 0.8)
    assert a100.peak("bfloat16") == 250e12 and a100.peak("float16") == 312e12  # peaks merge
    assert cluster.inter_link == LinkSpec("net-200g", 25e9, 20e-6)  # an A100 node's HDR ports
    assert cluster.nodes[0].intra_link == LINKS["nvlink3"]
    assert hash(calibration) == hash(load_constants(path))
    untouched = parse_devices("8xv100-32g", inter_link=LINKS["net-400g"])
    assert calibration.apply(untouched) == untouched


def test_override_fields():
    @dataclasses.dataclass(frozen=True)
    class Constants:
        name: str = "memory"
        activation_factor: float = 1.0

    assert override_fields(Constants(), {"activation_factor": 2.0}, "f.yaml: memory").activation_factor == 2.0
    assert override_fields(Constants(), {}, "f.yaml: memory") == Constants()
    with pytest.raises(UsageError, match=r"^f\.yaml: memory: no constant named 'activation' \(known: activation_factor\)$"):
        override_fields(Constants(), {"activation": 2.0}, "f.yaml: memory")
    with pytest.raises(UsageError, match="^f.yaml: device cpu: launch floor must be >= 0, got -1.0$"):
        override_fields(DEVICES["cpu"], {"launch_floor": -1.0}, "f.yaml")


def test_calibrated_cluster_changes_mesh_links(tmp_path):
    path = write(tmp_path, """\
        nodes: [{gpus: 8xa100-80g, count: 2, nics: 8}]
        inter_link: ndr
        calibration: {links: {ndr: {bandwidth_gbs: 40}}}
        """)
    meshes = {str(m): m for m in enumerate_meshes(load_cluster(path))}
    assert meshes["2x8"].links[0] == LinkSpec("net-400g", 40e9, 14e-6)  # 8 NICs: no sharing


ERRORS = [
    # (file text, expected message after the path)
    ("nodes: [{gpus: 8xfoo}]\n", ":1: nodes[0].gpus: unknown device type 'foo' (known: a10-24g, "),
    ("nodes:\n  - gpus: 8xv100\n", ":2: nodes[0].gpus: device type 'v100' is ambiguous: say which of "
                                   "v100-16g, v100-32g"),
    ("nodes: []\n", ":1: nodes: expected at least one node"),
    ("nodes: {gpus: 8xv100-32g}\n", ":1: nodes: expected a list, found a mapping"),
    ("nodes:\n  - gpu: 8xv100-32g\n", ":2: nodes[0].gpu: unknown key (expected one of gpus, intra_link, nics, count)"),
    ("nodes:\n  - {}\n", ":2: nodes[0]: missing key 'gpus'"),
    ("nodes:\n  - gpus: 0xv100-32g\n", ":2: nodes[0].gpus: counts must be between 1 and 65536, got 0"),
    ("nodes:\n  - gpus: 8x\n", ":2: nodes[0].gpus: expected a device type after '8x'"),
    ("nodes: [{gpus: 2x8xv100-32g}]\n", ":1: nodes[0].gpus: '2x8xv100-32g' gives a node count inside a node"),
    ("nodes: [{gpus: 8}]\n", ":1: nodes[0].gpus: expected COUNTxTYPE (e.g. 8xv100-32g) or a list of device types"),
    ("nodes: [{gpus: []}]\n", ":1: nodes[0].gpus: expected COUNTxTYPE"),
    ("nodes: [{gpus: [t4, 3]}]\n", ":1: nodes[0].gpus[1]: expected a non-empty string, found 3"),
    ("nodes: [{gpus: t4, count: 0}]\n", ":1: nodes[0].count: expected an integer from 1 to 65536, found 0"),
    ("nodes:\n  - {gpus: 8xt4, count: 65536}\n", ":2: nodes[0]: 524288 devices; parc plans for at most 65536"),
    ("nodes: [{gpus: t4, nics: 1.5}]\n", ":1: nodes[0].nics: expected an integer from 1 to 65536, found 1.5"),
    ("nodes: [{gpus: t4, count: 1000000000000}]\n", ":1: nodes[0].count: expected an integer from 1 to 65536, "
                                                     "found 1000000000000"),
    ("nodes:\n  - gpus: t4\n    intra_link: nvlink\n", ":3: nodes[0].intra_link: unknown link 'nvlink' (known: "),
    ("nodes:\n  - gpus: t4\n    intra_link: {bandwidth_gbs: 5}\n",
     ":3: nodes[0].intra_link: missing key 'latency_us' (or give base: a catalogue link)"),
    ("nodes:\n  - gpus: t4\n    intra_link: {latency_us: 5}\n", ":3: nodes[0].intra_link: missing key 'bandwidth_gbs'"),
    ("nodes:\n  - gpus: t4\n    intra_link: {bandwidth_gbs: 5, bandwidth_gbps: 40, latency_us: 1}\n",
     ":3: nodes[0].intra_link.bandwidth_gbps: bandwidth given twice"),
    ("nodes: [{gpus: t4}]\ninter_link: {bandwidth_gbps: 100, latency_us: -1}\n",
     ":2: inter_link.latency_us: expected a number >= 0, found -1"),
    ("nodes: [{gpus: t4}]\ninter_link: {bandwidth_gbps: fast, latency_us: 1}\n",
     ":2: inter_link.bandwidth_gbps: expected a number, found 'fast'"),
    ("inter_link: 100gbe\n", ":1: document: missing key 'nodes'"),
    ("- nodes\n", ":1: document: expected a mapping with keys devices, nodes, inter_link, calibration, found a list"),
    ("nodes: [{gpus: t4}]\nnode: []\n", ":2: node: unknown key (expected one of devices, nodes, inter_link, calibration)"),
    ("nodes: [{gpus: t4}]\nnodes: [{gpus: t4}]\n", ":2: nodes: key given twice"),
    ("{nodes: [\n", ":2: not valid YAML: expected the node content, but found '<stream end>'"),
    ("nodes:\n  - gpus: t4\n   bad: indent\n", ":3: not valid YAML: "),
    ("nodes: !!python/object:os.system {}\n", ":1: nodes: unsupported YAML tag 'tag:yaml.org,2002:python/object:os.system'"),
    ("nodes: !!python/name:os.system\n", ":1: not valid YAML: could not determine a constructor"),
    ("", ": the file is empty"),
    ("devices:\n  v100-32g: {fp32_tflops: 1}\nnodes: [{gpus: t4}]\n",
     ":2: devices.v100-32g: 'v100-32g' is a catalogue device: pick a new name (with base: v100-32g)"),
    ("devices:\n  g: {fp32_tflops: 1, memory_gib: 2}\nnodes: [{gpus: 8xg}]\n",
     ":2: devices.g: missing key 'bandwidth_gbs' (or give base: a catalogue device)"),
    ("devices:\n  g: {fp32_tflops: 1, memory_gib: 2, bandwidth_gbs: 3, speed: 4}\nnodes: [{gpus: g}]\n",
     ":2: devices.g.speed: unknown key (expected one of fp64_tflops, "),
    ("devices:\n  g:\n    fp32_tflops: 0\n    memory_gib: 2\n    bandwidth_gbs: 3\nnodes: [{gpus: g}]\n",
     ":3: devices.g.fp32_tflops: expected a number > 0, found 0"),
    ("devices:\n  g: {base: v100, memory_gib: 2}\nnodes: [{gpus: g}]\n", ":2: devices.g.base: device type 'v100' is ambiguous"),
    ("devices:\n  8xg: {base: t4}\nnodes: [{gpus: t4}]\n", ":2: devices.8xg: '8xg' cannot name a device"),
    ("devices:\n  g: {base: t4, compute_efficiency: 3}\nnodes: [{gpus: t4}]\n",
     ":2: devices.g: device g: compute_efficiency must be in (0, 1], got 3.0"),
    ("devices:\n  g: {base: t4, fp32_tflops: 1, peak_flops: {fp32: 2}}\nnodes: [{gpus: t4}]\n",
     ":2: devices.g.peak_flops.fp32: float32 given twice"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  devices:\n    v100: {launch_floor_us: 1}\n",
     ":4: calibration.devices.v100: device type 'v100' is ambiguous"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  devices:\n    t4: {launch_floor: 1, launch_floor_us: 3}\n",
     ":4: calibration.devices.t4.launch_floor_us: launch_floor given twice"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  devices:\n    t4: {base: a10}\n",
     ":4: calibration.devices.t4.base: unknown key"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  devices:\n    t4: {memory_efficiency: 1.2}\n",
     ":4: calibration.devices.t4: device t4-16g: memory_efficiency must be in (0, 1], got 1.2"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  links:\n    nvlink9: {latency_us: 2}\n",
     ":4: calibration.links.nvlink9: unknown link 'nvlink9'"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  links:\n    pcie3: {bandwidth_gbs: 0}\n",
     ":4: calibration.links.pcie3.bandwidth_gbs: expected a number > 0, found 0"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  devices:\n    t4: {launch_floor_us: 1}\n    T4-16G: {launch_floor_us: 2}\n",
     ":5: calibration.devices.T4-16G: device t4-16g is calibrated twice"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  links:\n    100gbe: {latency_us: 1}\n    net-100g: {latency_us: 2}\n",
     ":5: calibration.links.net-100g: link net-100g is calibrated twice"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  link: {}\n",
     ":3: calibration.link: unknown key (expected one of devices, links, constants, sharing, cpus, fitted_on)"),
    ("nodes: [{gpus: t4}]\ncalibration:\n  constants:\n    memory: {factor: big}\n",
     ":4: calibration.constants.memory.factor: expected a number, found 'big'"),
]


@pytest.mark.parametrize("text, message", ERRORS, ids=[str(i) for i in range(len(ERRORS))])
def test_cluster_file_errors(tmp_path, text, message):
    path = write(tmp_path, text, "bad.yaml")
    with pytest.raises(UsageError) as info:
        load_cluster(path)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(path + message), line


def test_unreadable_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(UsageError, match=r"nope\.yaml: cannot read the file \(No such file or directory\)$"):
        load_cluster(missing)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(UsageError, match="bin.yaml: cannot read the file"):
        load_cluster(str(tmp_path / "bin.yaml"))


def test_recursive_anchor_is_refused(tmp_path):
    path = write(tmp_path, "nodes: &a [*a]\n")
    with pytest.raises(UsageError, match="nested too deeply|not valid YAML"):
        load_cluster(path)


def test_calibration_is_a_frozen_value():
    calibration = Calibration(devices=(("t4-16g", (("launch_floor", 1e-6),)),), source="c.yaml")
    cluster = calibration.apply(parse_devices("2xt4"))
    assert all(d.launch_floor == 1e-6 for d in cluster.devices)
    with pytest.raises(dataclasses.FrozenInstanceError):
        calibration.source = "x"  # type: ignore[misc]


SHARED = """\
devices:
  cpu: {fp32_tflops: 0.2, bandwidth_gbs: 30, task_overhead_us: 5}
links:
  shm: {latency_us: 10, bandwidth_gbs: 2}
sharing:
  "2":
    devices:
      cpu: {fp32_tflops: 0.1, bandwidth_gbs: 20}
    links:
      shm: {latency_us: 20, handoff_us: 300}
  "4":
    links:
      shm: {latency_us: 5, call_us: 290}
    devices:
      cpu: {fp32_tflops: 0.05, bandwidth_gbs: 10}
"""


def test_sharing_applies_the_figures_of_the_nearest_count_of_devices_per_node(tmp_path):
    calibration = load_constants(write(tmp_path, SHARED, "calib.yaml"))
    alone = calibration.apply(parse_devices("1xcpu")).devices[0]
    assert (alone.peak("float32"), alone.memory_bandwidth, alone.task_overhead) == (0.2e12, 30e9, 5e-6)
    two = calibration.apply(parse_devices("2xcpu"))
    assert two.devices[0].peak("float32") == 0.1e12 and two.devices[0].task_overhead == 5e-6  # over the base
    assert two.nodes[0].intra_link == LinkSpec("shm", 2e9, 20e-6, 300e-6)
    four = calibration.apply(parse_devices("4xcpu"))
    assert four.devices[0].memory_bandwidth == 10e9 and four.nodes[0].intra_link == LinkSpec("shm", 2e9, 5e-6, 0.0, 290e-6)
    assert calibration.apply(parse_devices("3xcpu")).devices[0].peak("float32") == 0.05e12  # 3: nearest is 4 (tie)
    assert calibration.apply(parse_devices("16xcpu")).devices[0].peak("float32") == 0.05e12
    mixed = calibration.apply(parse_devices("2x2xcpu"))  # each node of 2
    assert {d.peak("float32") for d in mixed.devices} == {0.1e12}


def test_a_host_whose_ranks_outnumber_its_cpus_keeps_the_figures_of_fewer_ranks_computing(tmp_path):
    calibration = load_constants(write(tmp_path, "cpus: 2\n" + SHARED, "calib.yaml"))
    four = calibration.apply(parse_devices("4xcpu"))  # 4 ranks of 1 thread on 2 CPUs
    assert [(a, [d.peak("float32") for d in devices]) for a, devices in four.nodes[0].sharing] == [(2, [0.1e12] * 4)]
    assert four.shared_devices(3) == ((2, four.nodes[0].sharing[0][1][3]),)
    assert four.devices[0].peak("float32") == 0.05e12  # all 4 at once: the 4 ranks' figures
    assert Cluster.from_json(json.loads(json.dumps(four.to_json()))) == four  # plan.json keeps the sharing
    assert calibration.apply(parse_devices("3xcpu")).nodes[0].sharing[0][0] == 2
    for fits in ("1xcpu", "2xcpu", "2x2xcpu"):  # the ranks' threads fit the CPUs
        assert all(not node.sharing for node in calibration.apply(parse_devices(fits)).nodes)
    assert not load_constants(write(tmp_path, SHARED, "c.yaml")).apply(parse_devices("4xcpu")).nodes[0].sharing
    many = load_constants(write(tmp_path, "cpus: 16\n" + SHARED, "c16.yaml"))
    assert not many.apply(parse_devices("4xcpu")).nodes[0].sharing  # 4 ranks of 4 threads fit 16 CPUs


@pytest.mark.parametrize(("text", "message"), [
    ("cpus: 0\n", "cpus: expected an integer from 1"),
    ("cpus: two\n", "cpus: expected an integer from 1"),
    ('sharing:\n  "1": {devices: {cpu: {fp32_tflops: 1}}}\n', "an int >= 2"),
    ('sharing:\n  two: {devices: {cpu: {fp32_tflops: 1}}}\n', "an int >= 2"),
    ('sharing:\n  "2": {constants: {x: {y: 1}}}\n', "unknown key"),
    ('links:\n  shm: {handoff_us: -1}\n', "handoff"),
    ('links:\n  shm: {call_us: -1}\n', "call"),
    ('links:\n  shm: {reduce_scatter: {latency_us: 5}}\n', "needs a latency .* and a bandwidth"),
    ('links:\n  shm: {all_gather: {latency_us: 5, bandwidth_gbs: 0}}\n', "bandwidth"),
    ('links:\n  shm: {all_gather: {latency_us: 5, bandwidth_gbs: 1, steps: 2}}\n', "unknown key"),
    ('devices:\n  cpu: {task_overhead_us: -1}\n', "task_overhead"),
])
def test_sharing_errors_name_the_key(tmp_path, text, message):
    path = write(tmp_path, text, "calib.yaml")
    with pytest.raises(UsageError, match=message) as e:
        load_constants(path)
    assert "calib.yaml" in str(e.value)


def test_op_efficiency_prices_a_class_of_op_apart(tmp_path):
    from parc.cluster.cost import compute_time

    path = write(tmp_path, "devices:\n  cpu: {fp32_tflops: 1, op_efficiency: {Conv: 0.5}}\n", "calib.yaml")
    cpu = load_constants(path).apply(parse_devices("1xcpu")).devices[0]
    assert cpu.efficiency("Conv") == 0.5 and cpu.efficiency("MatMul") == cpu.compute_efficiency == 1.0
    floor = cpu.launch_floor
    assert compute_time(1e12, 0, cpu, "float32", "Conv") - floor == pytest.approx(2.0)
    assert compute_time(1e12, 0, cpu, "float32", "MatMul") - floor == pytest.approx(1.0)
    with pytest.raises(UsageError, match="op_efficiency"):
        load_constants(write(tmp_path, "devices:\n  cpu: {op_efficiency: {Conv: 2}}\n", "bad.yaml"))


def test_floors_and_piece_costs_are_read_by_class(tmp_path):
    from parc.cluster.cost import compute_time

    text = ("devices:\n  cpu: {launch_floor_us: 1, node_floor_us: 2, op_floor_us: {Transpose: 5, Where: 0},\n"
            "        node_piece_ns: 10, op_piece_ns: {Softmax: 30}}\n")
    cpu = load_constants(write(tmp_path, text, "calib.yaml")).apply(parse_devices("1xcpu")).devices[0]
    assert (cpu.node_floor, cpu.class_floor("Transpose"), cpu.class_floor("Where"), cpu.class_floor("Mul")) == \
        pytest.approx((2e-6, 5e-6, 0.0, 2e-6))
    assert (cpu.piece_cost("Softmax"), cpu.piece_cost("Sub")) == pytest.approx((3e-8, 1e-8))
    assert compute_time(0, 0, cpu, "float32", "Softmax", pieces=1000) == pytest.approx(1e-6 + 3e-5)
    # a later file's table merges into the earlier one's (as op_efficiency does)
    more = write(tmp_path, "devices:\n  cpu: {op_floor_us: {Softmax: 7}}\n", "more.yaml")
    base = parse_devices("1xcpu")
    calibrated = dataclasses.replace(base, nodes=(dataclasses.replace(base.nodes[0], devices=(cpu,)),))
    merged = load_constants(more).apply(calibrated).devices[0]
    assert (merged.class_floor("Softmax"), merged.class_floor("Transpose")) == pytest.approx((7e-6, 5e-6))


def test_a_step_ratio_multiplies_every_nodes_time(tmp_path):
    from parc.cluster.cost import compute_time

    plain = parse_devices("1xcpu").devices[0]
    cpu = load_constants(write(tmp_path, "devices:\n  cpu: {step_ratio: 1.25}\n", "calib.yaml")).apply(
        parse_devices("1xcpu")).devices[0]
    assert cpu.step_ratio == 1.25 and plain.step_ratio == 1.0
    for flops, nbytes in ((1e9, 0), (0, 1e9), (0, 0)):  # compute-bound, memory-bound, the floor alone
        assert compute_time(flops, nbytes, cpu) == pytest.approx(1.25 * compute_time(flops, nbytes, plain))
    assert compute_time(1e9, 0, dataclasses.replace(cpu, gpu=True), queued=True) == pytest.approx(
        1.25 * compute_time(1e9, 0, dataclasses.replace(plain, gpu=True), queued=True))
    assert DeviceSpec.from_json(cpu.to_json()) == cpu


def test_a_links_step_ratio_multiplies_every_collectives_time_but_not_its_handoff(tmp_path):
    from parc.cluster.cost import collective_time, ring_time
    from parc.cluster.mesh import shared_link

    text = ("links:\n  shm:\n    latency_us: 5\n    bandwidth_gbs: 4\n    handoff_us: 300\n    step_ratio: 2.5\n"
            "    reduce_scatter: {latency_us: 20, bandwidth_gbs: 1.5}\n")
    link = load_constants(write(tmp_path, text, "calib.yaml")).apply(parse_devices("2xcpu")).nodes[0].intra_link
    plain = dataclasses.replace(link, step_ratio=1.0)
    assert link.step_ratio == 2.5 and link.handoff == pytest.approx(3e-4)
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
        assert collective_time(kind, link, 2, 1e6) == pytest.approx(2.5 * collective_time(kind, plain, 2, 1e6))
    # fitted on collectives: a pipeline's message keeps its figures
    assert collective_time("send_recv", link, 2, 1e6) == pytest.approx(collective_time("send_recv", plain, 2, 1e6))
    assert ring_time("all_reduce", link, 2, 1e6, latency_share=0.5) == pytest.approx(
        2.5 * ring_time("all_reduce", plain, 2, 1e6, latency_share=0.5))
    assert LinkSpec.from_json(link.to_json()) == link and "step_ratio" not in plain.to_json()
    assert shared_link(link, 2, 1).step_ratio == 2.5
    with pytest.raises(UsageError, match="step_ratio") as e:
        load_constants(write(tmp_path, "links:\n  shm: {step_ratio: 0}\n", "bad.yaml"))
    assert "bad.yaml" in str(e.value) and "\n" not in str(e.value)


def test_a_calibration_names_the_models_it_was_measured_on(tmp_path):
    text = "fitted_on:\n  - {file: a.onnx, sha256: ab12}\ndevices:\n  cpu: {fp32_tflops: 0.2}\n"
    assert load_constants(write(tmp_path, text, "calib.yaml")).fitted_on == (("a.onnx", "ab12"),)
    assert load_constants(write(tmp_path, "devices:\n  cpu: {fp32_tflops: 0.2}\n", "c.yaml")).fitted_on == ()


@pytest.mark.parametrize("text, key", [
    ("fitted_on:\n  - {file: a.onnx}\n", "sha256"),
    ("fitted_on: a.onnx\n", "fitted_on"),
    ("devices:\n  cpu: {step_ratio: 0}\n", "step_ratio"),
    ("devices:\n  cpu: {op_floor_us: {Transpose: -1}}\n", "Transpose"),
    ("devices:\n  cpu: {op_piece_ns: {Softmax: -2}}\n", "Softmax"),
    ("devices:\n  cpu: {node_piece_ns: -1}\n", "node_piece_ns"),
    ("devices:\n  cpu: {node_floor_us: x}\n", "node_floor_us"),
])
def test_a_negative_floor_or_piece_cost_is_refused_naming_its_key(tmp_path, text, key):
    with pytest.raises(UsageError, match=key) as e:
        load_constants(write(tmp_path, text, "calib.yaml"))
    assert "calib.yaml" in str(e.value) and "\n" not in str(e.value)


def test_a_link_gives_collective_kinds_figures_of_their_own(tmp_path):
    """A calibration's reduce-scatter and all-gather figures price those kinds (ring steps and
    volume as ever, at their own alpha and beta); every other kind keeps the link's; a link
    shared by streams keeps them, its bandwidths divided."""
    from parc.cluster.cost import ring_time
    from parc.cluster.mesh import shared_link

    text = ("links:\n  shm:\n    latency_us: 5\n    bandwidth_gbs: 4\n"
            "    reduce_scatter: {latency_us: 20, bandwidth_gbs: 1.5}\n    all_gather: {latency_us: 10, bandwidth_gbs: 2}\n")
    link = load_constants(write(tmp_path, text, "calib.yaml")).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.figures("reduce_scatter") == (20e-6, 1.5e9) and link.figures("all_gather") == (10e-6, 2e9)
    assert link.figures("all_reduce") == link.figures("all_to_all") == (5e-6, 4e9)
    assert ring_time("reduce_scatter", link, 2, 1e6) == pytest.approx(20e-6 + 1e6 / 1.5e9)
    assert ring_time("all_reduce", link, 2, 1e6) == pytest.approx(2 * 5e-6 + 1e6 / 4e9)
    assert LinkSpec.from_json(link.to_json()) == link
    assert shared_link(link, 2, 1).figures("all_gather") == (10e-6, 1e9)


def test_a_file_without_a_network_gets_the_shipped_ports(tmp_path):
    """Nodes of A100s in a file that names no inter_link get the DGX A100's 8 x 200 Gb/s; a file
    that names its inter_link describes its own network: one port a node unless it says nics."""
    from parc.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{gpus: 8xa100-80g, count: 2}]\n")
    shipped = load_cluster(path)
    assert [n.nics for n in shipped.nodes] == [8, 8] and shipped.inter_link == LINKS["net-200g"]
    path.write_text("nodes: [{gpus: 8xa100-80g, count: 2}]\ninter_link: 100gbe\n")
    own = load_cluster(path)
    assert [n.nics for n in own.nodes] == [1, 1] and own.inter_link == LINKS["net-100g"]
