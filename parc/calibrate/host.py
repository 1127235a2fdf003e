"""What this host is and how fast it runs now: the probe of its speed, the catalogue's name of its
GPU, and the engine that measured it."""

from __future__ import annotations

import numpy as np

from parc.calibrate.catalogue import PROBE, sizes_for
from parc.calibrate.graphs import matmul
from parc.calibrate.session import make_feeds, mean_seconds, open_session
from parc.cluster.devices import DEVICES
from parc.errors import UsageError
from parc.exec.engines import gpu


def host_probe(threads: int, engine: tuple[str, str] = ("ort", "cpu"), budget: float = 0.3) -> float:
    """Seconds of one fixed product (`PROBE`) on `engine`, the mean over about `budget` seconds:
    how fast this host runs now. `parc profile` probes before each rank count and at the end
    (a shared host's speed moves over the minutes a profile takes, and a calibration measured in
    a slow spell predicts every step slow); `benchmarks/predict.py` probes before each run."""
    s = open_session(matmul(*PROBE), threads, engine)
    return mean_seconds(s, make_feeds(s, sizes_for(engine).pool_bytes), budget)


def gpu_device_type(cupy=None) -> str:
    """The catalogue's name for the GPU this process sees (its family in the name CUDA reports,
    the member whose memory is nearest the card's), e.g. 'NVIDIA H100 80GB HBM3' -> h100-80g."""
    name, memory = gpu_card(cupy)
    words = name.lower().replace("-", " ").split()
    family = [spec for spec in DEVICES.values() if spec.name.split("-")[0] in words]
    if not family:
        raise UsageError(f"the GPU '{name}' is not in parc's device catalogue: name its type with --device "
                         f"(known: {', '.join(DEVICES)}, or one a cluster file defines)")
    return min(family, key=lambda spec: abs(spec.memory_bytes - memory)).name


def gpu_card(cupy=None) -> tuple[str, int]:
    """The name CUDA reports for the current GPU and its memory in bytes."""
    if cupy is None:
        import cupy
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return (name.decode() if isinstance(name, bytes) else str(name)), int(props["totalGlobalMem"])


def engine_text(kind: tuple[str, str]) -> str:
    """What measured, for the file's first line: the engine, its library and (a GPU) the card."""
    if kind[0] == "ort":
        import onnxruntime

        return f"onnxruntime {onnxruntime.__version__}"
    if kind[1] == "cpu":
        return f"parc's array engine on numpy {np.__version__}"
    import cupy

    name, _ = gpu_card(cupy)
    runtime, driver = cupy.cuda.runtime.runtimeGetVersion(), cupy.cuda.runtime.driverGetVersion()
    return (f"parc's array engine on CuPy {cupy.__version__}, {name}, CUDA runtime {runtime // 1000}."
            f"{runtime % 1000 // 10}, driver API {driver // 1000}.{driver % 1000 // 10}, float32 matmuls "
            f"{'in TF32 (CUPY_TF32=1)' if gpu.tf32_requested() else 'in full fp32'}")
