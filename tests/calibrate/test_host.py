"""What the host is (`parc.calibrate.host`): its GPU named by the catalogue."""

from __future__ import annotations

import pytest

from parc.calibrate.host import gpu_device_type
from parc.errors import UsageError


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
    assert gpu_device_type(_FakeCupy(name, gib)) == want


def test_a_gpu_outside_the_catalogue_asks_for_its_type():
    with pytest.raises(UsageError, match="GeForce RTX 4090.*--device"):
        gpu_device_type(_FakeCupy("NVIDIA GeForce RTX 4090", 23.6))
