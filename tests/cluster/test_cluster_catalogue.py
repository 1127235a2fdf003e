"""The device and link catalogues: datasheet figures, units, lookup, and the descriptors' rules."""

from __future__ import annotations

import dataclasses

import pytest

from parc.cluster import DEVICES, LINKS, DeviceSpec, LinkSpec, lookup_device, lookup_link
from parc.cluster.devices import GB, TFLOPS, GiB
from parc.errors import UsageError
from parc.ir.dtypes import BFLOAT16, DOUBLE, FLOAT, FLOAT16, INT64

EXPECTED_DEVICES = {
    # name: (memory GiB, memory GB/s, fp32 TFLOP/s, fp16 TFLOP/s, default link)
    "p100-16g": (16, 732, 10.6, 21.2, "nvlink1"),
    "v100-16g": (16, 900, 15.7, 125, "nvlink2"),
    "v100-32g": (32, 900, 15.7, 125, "nvlink2"),
    "t4-16g": (16, 320, 8.1, 65, "pcie3"),
    "a10-24g": (24, 600, 31.2, 125, "pcie4"),
    "a100-40g": (40, 1555, 19.5, 312, "nvlink3"),
    "a100-80g": (80, 2039, 19.5, 312, "nvlink3"),
    "h100-80g": (80, 3350, 67, 989.5, "nvlink4"),
    "h200-141g": (141, 4800, 67, 989.5, "nvlink4"),
    "cpu": (64, 100, 1.0, 1.0, "shm"),
}


def test_catalogue_holds_exactly_the_documented_devices():
    assert sorted(DEVICES) == sorted(EXPECTED_DEVICES)


@pytest.mark.parametrize("name", sorted(EXPECTED_DEVICES))
def test_catalogue_figures(name):
    memory_gib, bandwidth_gbs, fp32, fp16, link = EXPECTED_DEVICES[name]
    spec = DEVICES[name]
    assert spec.memory_bytes == memory_gib * 2**30  # capacities are GiB
    assert spec.memory_bandwidth == pytest.approx(bandwidth_gbs * 1e9)  # rates are decimal
    assert spec.peak("float32") == pytest.approx(fp32 * 1e12)
    assert spec.peak("float16") == pytest.approx(fp16 * 1e12)
    assert spec.default_link == link and link in LINKS
    assert spec.compute_efficiency == spec.memory_efficiency == 1.0
    assert 0 < spec.launch_floor <= 1e-5


def test_a100_80g_has_80_gib():
    assert DEVICES["a100-80g"].memory_bytes == 80 * GiB == 85_899_345_920


def test_tensor_core_peaks_are_dense():
    # Datasheets print sparse figures for Ampere/Hopper; the catalogue keeps half of them.
    assert DEVICES["a100-80g"].peak("tf32") == 156 * TFLOPS
    assert DEVICES["a100-80g"].peak("bfloat16") == 312 * TFLOPS
    assert DEVICES["a100-80g"].peak("int8") == 624 * TFLOPS
    assert DEVICES["h100-80g"].peak("tf32") == 494.5 * TFLOPS
    assert DEVICES["h100-80g"].peak("float8") == 1979 * TFLOPS
    assert DEVICES["a10-24g"].peak("tf32") == 62.5 * TFLOPS
    assert DEVICES["t4-16g"].peak("int8") == 130 * TFLOPS


def test_missing_dtypes_fall_back_to_float32():
    v100 = DEVICES["v100-32g"]
    assert v100.peak("bfloat16") == v100.peak("float32")  # Volta has no bf16 units
    assert v100.peak("tf32") == v100.peak("float32")
    assert v100.peak(INT64) == v100.peak("float32")


def test_dtype_objects_and_short_names():
    a100 = DEVICES["a100-80g"]
    assert a100.peak(FLOAT) == a100.peak("float32") == a100.peak("fp32") == 19.5 * TFLOPS
    assert a100.peak(FLOAT16) == a100.peak("fp16") == a100.peak("half") == 312 * TFLOPS
    assert a100.peak(BFLOAT16) == a100.peak("bf16") == 312 * TFLOPS
    assert a100.peak(DOUBLE) == a100.peak("fp64") == 19.5 * TFLOPS


@pytest.mark.parametrize("alias, name", [
    ("A100-80G", "a100-80g"), ("a100-80gb", "a100-80g"), ("A100_80GB", "a100-80g"), ("t4", "t4-16g"),
    ("T4-16G", "t4-16g"), ("a10", "a10-24g"), ("p100", "p100-16g"), ("h100", "h100-80g"),
    ("h200", "h200-141g"), ("V100M32", "v100-32g"), (" cpu ", "cpu"),
])
def test_lookup_aliases(alias, name):
    assert lookup_device(alias, "--devices") is DEVICES[name]


@pytest.mark.parametrize("family, members", [("v100", "v100-16g, v100-32g"), ("a100", "a100-40g, a100-80g")])
def test_ambiguous_family_lists_the_choices(family, members):
    with pytest.raises(UsageError, match=f"'{family}' is ambiguous: say which of {members}$"):
        lookup_device(family, "--devices")


def test_unknown_device_lists_every_known_type():
    with pytest.raises(UsageError) as info:
        lookup_device("rtx4090", "--devices '8xrtx4090'")
    message = str(info.value)
    assert message.startswith("--devices '8xrtx4090': unknown device type 'rtx4090' (known: ")
    assert all(name in message for name in DEVICES) and "\n" not in message


def test_device_spec_is_canonical_and_hashable():
    a = DeviceSpec(" MyGPU ", {"fp16": 2e12, "float32": 1e12}, 2**30, 1e11)
    b = DeviceSpec("mygpu", (("float32", 1e12), ("float16", 2e12)), 2**30, 1e11)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a.name == "mygpu"
    assert a.peak_flops == (("float32", 1e12), ("float16", 2e12))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.memory_bytes = 1  # type: ignore[misc]


def test_device_json_round_trip():
    for spec in DEVICES.values():
        assert DeviceSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("kwargs, message", [
    ({"peak_flops": {"float16": 1e12}}, "needs a float32 peak"),
    ({"peak_flops": {"float32": 1e12, "complex": 1.0}}, "unknown dtype"),
    ({"peak_flops": {"float32": 1e12, "fp32": 1.0}}, "given twice"),
    ({"peak_flops": {"float32": -1.0}}, "must be > 0"),
    ({"memory_bytes": 0}, "must be > 0"),
    ({"memory_bandwidth": "fast"}, "must be a number"),
    ({"launch_floor": -1e-6}, "must be >= 0"),
    ({"compute_efficiency": 1.5}, r"must be in \(0, 1\]"),
    ({"name": " "}, "needs a name"),
])
def test_device_spec_rejects(kwargs, message):
    args = {"name": "g", "peak_flops": {"float32": 1e12}, "memory_bytes": GiB, "memory_bandwidth": 1e11}
    with pytest.raises(ValueError, match=message):
        DeviceSpec(**{**args, **kwargs})


EXPECTED_LINKS = {
    # name: (GB/s per direction per device, latency us)
    "nvlink1": (80, 3.4), "nvlink2": (150, 3.4), "nvlink3": (300, 3.4), "nvlink4": (450, 3.4),
    "pcie3": (16, 5.7), "pcie4": (32, 5.7), "pcie5": (64, 5.7),
    "net-25g": (3.125, 14), "net-50g": (6.25, 14), "net-100g": (12.5, 14), "net-200g": (25, 14),
    "net-400g": (50, 14), "shm": (10, 1),
}


def test_link_catalogue():
    assert sorted(LINKS) == sorted(EXPECTED_LINKS)
    for name, (gbs, us) in EXPECTED_LINKS.items():
        assert LINKS[name].bandwidth == pytest.approx(gbs * GB)
        assert LINKS[name].latency == pytest.approx(us * 1e-6)


@pytest.mark.parametrize("alias, name", [
    ("100gbe", "net-100g"), ("100G", "net-100g"), ("roce-200g", "net-200g"), ("ib-hdr", "net-200g"),
    ("NDR", "net-400g"), ("25gbe", "net-25g"), ("loopback", "shm"), ("PCIe4", "pcie4"), ("nvlink3", "nvlink3"),
])
def test_link_aliases(alias, name):
    assert lookup_link(alias, "inter_link") is LINKS[name]


def test_unknown_link_lists_the_catalogue():
    with pytest.raises(UsageError, match=r"^x\.yaml:3: inter_link: unknown link 'nvlink' \(known: net-100g, "):
        lookup_link("nvlink", "x.yaml:3: inter_link")


def test_link_spec_rules():
    assert LinkSpec("A", 1, 0) == LinkSpec("a", 1.0, 0.0)
    assert LINKS["net-100g"].slower_than(LINKS["nvlink2"])
    assert LinkSpec("x", 1e9, 2e-6).slower_than(LinkSpec("y", 1e9, 1e-6))
    for bad in ({"bandwidth": 0.0}, {"latency": -1.0}, {"bandwidth": True}):
        with pytest.raises(ValueError):
            LinkSpec(**{"name": "x", "bandwidth": 1.0, "latency": 0.0, **bad})
