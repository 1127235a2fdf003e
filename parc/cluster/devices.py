"""Devices: what one rank can compute and hold, and the built-in catalogue of common GPUs.

Units: memory capacities are binary (GiB = 2**30 bytes; a "16 GB" HBM2 or GDDR6 part holds
16 GiB, which is also what nvidia-smi reports in MiB); rates are decimal (GB/s = 1e9 bytes/s,
TFLOP/s = 1e12 FLOP/s), as on the datasheets.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from parc.errors import UsageError

GiB = 2**30
GB = 1e9
TFLOPS = 1e12

# The element types a device may list a peak for, in canonical order. Tensor-core dtypes (tf32,
# float16, bfloat16, int8, float8) give the dense matrix-multiply peak, the rate a large GEMM can
# reach; float32/float64 give the peak of the plain (or FP64 tensor-core) units.
PEAK_DTYPES = ("float64", "float32", "tf32", "float16", "bfloat16", "float8", "int8")

_DTYPE_ALIASES = {
    "double": "float64", "fp64": "float64", "f64": "float64",
    "float": "float32", "fp32": "float32", "f32": "float32", "single": "float32",
    "half": "float16", "fp16": "float16", "f16": "float16",
    "bf16": "bfloat16",
    "fp8": "float8", "float8e4m3fn": "float8", "float8e4m3fnuz": "float8", "float8e5m2": "float8",
    "float8e5m2fnuz": "float8",
}


def dtype_key(dtype: object) -> str:
    """The PEAK_DTYPES key for a DType, an ONNX dtype name or a common short name ('fp16')."""
    name = str(getattr(dtype, "name", dtype)).strip().lower()
    return _DTYPE_ALIASES.get(name, name)


# an op class (`parc.ops.op_class`) -> the class a device without its figures prices it as
CLASS_FALLBACK = {"SoftmaxMasked": "Softmax", "SoftmaxPadded": "Softmax"}
# classes whose pieces (`parc.ops.node_pieces`) count something other than short runs of memory
# (a convolution's lowering's elements, a Where's runs of its condition): a device without their
# own piece cost charges them none (not `node_piece`, a run's cost)
OWN_PIECES = frozenset({"Conv", "ConvWeightGrad", "ConvTranspose", "Where"})


@dataclass(frozen=True)
class DeviceSpec:
    """One device type: peak FLOP/s per dtype, memory, memory bandwidth, and cost constants.

    `peak_flops` may be given as a mapping; it is stored as (dtype, FLOP/s) pairs in
    PEAK_DTYPES order, so equal specs are equal and hashable.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]  # dense peak FLOP/s (OP/s for int8) per dtype
    memory_bytes: int  # device memory capacity, bytes
    memory_bandwidth: float  # device memory bandwidth, bytes/s
    launch_floor: float = 5e-6  # seconds every kernel costs however small (launch + tail)
    compute_efficiency: float = 1.0  # fraction of peak FLOP/s an op reaches (calibrate)
    memory_efficiency: float = 1.0  # fraction of peak memory bandwidth an op reaches (calibrate)
    default_link: str = "pcie4"  # the catalogue link joining devices of this type in one node
    task_overhead: float = 0.0  # seconds the executor spends per task beyond its kernels (calibrate)
    # per op class (`parc.ops.op_class`), the fraction of peak FLOP/s it reaches instead of
    # compute_efficiency (calibrate: convolutions run well below a matmul's rate on CPUs)
    op_efficiency: tuple[tuple[str, float], ...] = ()
    # per op class, the fraction of memory_bandwidth it reaches instead of memory_efficiency
    # (calibrate: a layer norm or a reduction streams slower than an elementwise op)
    memory_op_efficiency: tuple[tuple[str, float], ...] = ()
    # seconds a node costs beyond its launch floor and its roofline where its tensors are small
    # (calibrate: onnxruntime hands a 64 KiB Transpose to its thread pool and waits for it; the
    # roofline's rates are a large op's): `node_floor` for every class without its own in
    # `op_floor`. Only a node with work pays it (a Reshape moves nothing)
    node_floor: float = 0.0
    op_floor: tuple[tuple[str, float], ...] = ()
    # seconds per short piece a node walks (`parc.ops.node_pieces`: a Transpose's runs, a
    # Softmax's rows, a broadcast's spans), on top of its roofline (calibrate): `node_piece` for
    # every class without its own in `op_piece`
    node_piece: float = 0.0
    op_piece: tuple[tuple[str, float], ...] = ()
    # the bytes/s at which a node reads a value last touched more than `cache_share` bytes of
    # traffic before (a module's inputs, a forward activation its gradient reads back), where
    # memory_bandwidth's rates are those of data the caches still hold (calibrate: an Add streams
    # far slower after the rank has touched much other memory: docs/simulate.md); 0: every read
    # at memory_bandwidth's rates (`timing.module_seconds`)
    cold_bandwidth: float = 0.0
    cache_share: float = 0.0  # bytes of traffic a value stays in this rank's share of the caches
    # what a node takes in a real training step over what the rest of the model prices it at
    # (calibrate: `parc profile` runs reference steps with `parc run` and compares them with their
    # simulation, `fit_step_ratio`: the benchmarks, each run warm and alone, price a step short;
    # docs/simulate.md); every node's time is multiplied by it
    step_ratio: float = 1.0
    # `parc run` runs it with parc's array engine on a GPU: trees of elementwise nodes are fused
    # into one kernel (`parc.exec.engines.fusion`: a tree moves only its leaves and its root), and
    # kernels queue behind the host's launches (a node costs its launch or its kernel, the longer)
    gpu: bool = False

    def __post_init__(self) -> None:
        name = str(self.name).strip().lower()
        if not name:
            raise ValueError("a device needs a name")
        pairs = self.peak_flops.items() if isinstance(self.peak_flops, Mapping) else self.peak_flops
        peaks: dict[str, float] = {}
        for dtype, value in pairs:
            key = dtype_key(dtype)
            if key not in PEAK_DTYPES:
                raise ValueError(f"device {name}: unknown dtype {dtype!r} (known: {', '.join(PEAK_DTYPES)})")
            if key in peaks:
                raise ValueError(f"device {name}: dtype {key} given twice")
            peaks[key] = _positive(f"device {name}: peak {key}", value)
        if "float32" not in peaks:
            raise ValueError(f"device {name}: needs a float32 peak (other dtypes fall back to it)")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "peak_flops", tuple((k, peaks[k]) for k in PEAK_DTYPES if k in peaks))
        object.__setattr__(self, "memory_bytes", int(_positive(f"device {name}: memory", self.memory_bytes)))
        object.__setattr__(self, "memory_bandwidth", _positive(f"device {name}: memory bandwidth",
                                                               self.memory_bandwidth))
        object.__setattr__(self, "launch_floor", _non_negative(f"device {name}: launch floor", self.launch_floor))
        object.__setattr__(self, "task_overhead", _non_negative(f"device {name}: task overhead", self.task_overhead))
        object.__setattr__(self, "node_floor", _non_negative(f"device {name}: node floor", self.node_floor))
        object.__setattr__(self, "node_piece", _non_negative(f"device {name}: node piece", self.node_piece))
        object.__setattr__(self, "cold_bandwidth", _non_negative(f"device {name}: cold bandwidth", self.cold_bandwidth))
        object.__setattr__(self, "cache_share", _non_negative(f"device {name}: cache share", self.cache_share))
        object.__setattr__(self, "step_ratio", _positive(f"device {name}: step ratio", self.step_ratio))
        for table in ("op_floor", "op_piece"):
            pairs = getattr(self, table)
            object.__setattr__(self, table, tuple(sorted(
                (str(op), _non_negative(f"device {name}: {table} of {op}", value))
                for op, value in (pairs.items() if isinstance(pairs, Mapping) else pairs))))
        for field in ("compute_efficiency", "memory_efficiency"):
            value = _positive(f"device {name}: {field}", getattr(self, field))
            if value > 1.0:
                raise ValueError(f"device {name}: {field} must be in (0, 1], got {value}")
            object.__setattr__(self, field, value)
        object.__setattr__(self, "default_link", str(self.default_link).strip().lower())
        for table in ("op_efficiency", "memory_op_efficiency"):
            pairs = getattr(self, table)
            ops = {}
            for op, value in (pairs.items() if isinstance(pairs, Mapping) else pairs):
                value = _positive(f"device {name}: {table} of {op}", value)
                if value > 1.0:
                    raise ValueError(f"device {name}: {table} of {op} must be in (0, 1], got {value}")
                ops[str(op)] = value
            object.__setattr__(self, table, tuple(sorted(ops.items())))

    @functools.cached_property
    def _tables(self) -> dict[str, dict[str, float]]:
        return {t: dict(getattr(self, t)) for t in ("op_efficiency", "memory_op_efficiency", "op_floor", "op_piece")}

    def _per_class(self, table: str, default: float, op_class: str) -> float:
        """`table`'s value for `op_class` (or for the class it falls back to, `CLASS_FALLBACK`),
        or `default` where it has none."""
        if not op_class:
            return default
        values = self._tables[table]
        return values.get(op_class, values.get(CLASS_FALLBACK.get(op_class, ""), default))

    def efficiency(self, op_class: str = "") -> float:
        """The fraction of peak FLOP/s an op of `op_class` reaches (compute_efficiency unless
        the class has its own)."""
        return self._per_class("op_efficiency", self.compute_efficiency, op_class)

    def memory_fraction(self, op_class: str = "") -> float:
        """The fraction of memory_bandwidth an op of `op_class` streams at (memory_efficiency
        unless the class has its own)."""
        return self._per_class("memory_op_efficiency", self.memory_efficiency, op_class)

    def class_floor(self, op_class: str = "") -> float:
        """Seconds a node of `op_class` with work costs beyond its launch floor and its roofline
        (`node_floor` unless the class has its own `op_floor`)."""
        return self._per_class("op_floor", self.node_floor, op_class)

    def piece_cost(self, op_class: str = "") -> float:
        """Seconds per short piece (`parc.ops.node_pieces`) a node of `op_class` walks
        (`node_piece` unless the class has its own `op_piece`; 0 for a class of `OWN_PIECES`)."""
        return self._per_class("op_piece", 0.0 if op_class in OWN_PIECES else self.node_piece, op_class)

    def cold_cost(self) -> float:
        """Seconds per byte a read of a value the caches no longer hold costs beyond the rate of
        the elementwise stream (memory_bandwidth x memory_efficiency); 0 uncalibrated."""
        if not self.cold_bandwidth:
            return 0.0
        return max(0.0, 1.0 / self.cold_bandwidth - 1.0 / (self.memory_bandwidth * self.memory_efficiency))

    def peak(self, dtype: object) -> float:
        """Peak FLOP/s for `dtype`; types the device has no fast path for run at its float32 rate."""
        table = dict(self.peak_flops)
        return table.get(dtype_key(dtype), table["float32"])

    def to_json(self) -> dict:
        return {"name": self.name, "peak_flops": dict(self.peak_flops), "memory_bytes": self.memory_bytes,
                "memory_bandwidth": self.memory_bandwidth, "launch_floor": self.launch_floor,
                "compute_efficiency": self.compute_efficiency, "memory_efficiency": self.memory_efficiency,
                "default_link": self.default_link, "task_overhead": self.task_overhead,
                **({"op_efficiency": dict(self.op_efficiency)} if self.op_efficiency else {}),
                **({"memory_op_efficiency": dict(self.memory_op_efficiency)} if self.memory_op_efficiency else {}),
                **({"node_floor": self.node_floor} if self.node_floor else {}),
                **({"op_floor": dict(self.op_floor)} if self.op_floor else {}),
                **({"node_piece": self.node_piece} if self.node_piece else {}),
                **({"op_piece": dict(self.op_piece)} if self.op_piece else {}),
                **({"cold_bandwidth": self.cold_bandwidth, "cache_share": self.cache_share}
                   if self.cold_bandwidth else {}),
                **({"step_ratio": self.step_ratio} if self.step_ratio != 1.0 else {}),
                **({"gpu": True} if self.gpu else {})}

    @staticmethod
    def from_json(data: Mapping) -> DeviceSpec:
        return DeviceSpec(**data)

    def __str__(self) -> str:
        return self.name


def _positive(what: str, value: object) -> float:
    number = _number(what, value)
    if not number > 0:
        raise ValueError(f"{what} must be > 0, got {value}")
    return number


def _non_negative(what: str, value: object) -> float:
    number = _number(what, value)
    if not number >= 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return number


def _number(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)


def _gpu(*args, **kwargs) -> DeviceSpec:
    """A GPU of the catalogue (`DeviceSpec.gpu`)."""
    return DeviceSpec(*args, gpu=True, **kwargs)


def _tf(**peaks: float) -> dict[str, float]:
    return {dtype: value * TFLOPS for dtype, value in peaks.items()}


# Datasheet figures, dense (the "with sparsity" numbers halved). "SXM" parts are the NVLink
# versions. Sources:
#   P100: NVIDIA Tesla P100 datasheet (2016), "NVLink" (SXM2) column.
#   V100: NVIDIA V100 Tensor Core GPU datasheet (2020), "V100 SXM2" column.
#   T4:   NVIDIA T4 Tensor Core GPU datasheet (2019). FP64 is not listed: Turing runs FP64 at 1/32
#         of FP32 (Turing architecture whitepaper).
#   A10:  NVIDIA A10 Tensor Core GPU datasheet (2021). FP64 is not listed: GA102 runs FP64 at
#         1/64 of FP32 (Ampere GA102 whitepaper).
#   A100: NVIDIA A100 Tensor Core GPU datasheet (2021), "A100 40GB SXM" / "A100 80GB SXM"
#         columns; float64 is the FP64 Tensor Core peak.
#   H100: NVIDIA H100 Tensor Core GPU datasheet (2023), "H100 SXM" column; float64 is FP64 Tensor.
#   H200: NVIDIA H200 Tensor Core GPU datasheet (2024), "H200 SXM" column; float64 is FP64 Tensor.
#         "141 GB" is taken as 141 GiB (nvidia-smi reports 143,771 MiB = 140.4 GiB).
#   cpu:  not a product: a modest host, about 16 AVX2 cores at 2 GHz (16 x 2 x 16 FLOP/cycle x
#         2e9 = 1.0 TFLOP/s float32) with 4-6 DDR4 channels (~100 GB/s) and 64 GiB. Used for CPU
#         ranks in tests and `parc run` on one machine.
_CATALOGUE = (
    _gpu("p100-16g", _tf(float64=5.3, float32=10.6, float16=21.2),
               16 * GiB, 732 * GB, default_link="nvlink1"),
    _gpu("v100-16g", _tf(float64=7.8, float32=15.7, float16=125),
               16 * GiB, 900 * GB, default_link="nvlink2"),
    _gpu("v100-32g", _tf(float64=7.8, float32=15.7, float16=125),
               32 * GiB, 900 * GB, default_link="nvlink2"),
    _gpu("t4-16g", _tf(float64=8.1 / 32, float32=8.1, float16=65, int8=130),
               16 * GiB, 320 * GB, default_link="pcie3"),
    _gpu("a10-24g", _tf(float64=31.2 / 64, float32=31.2, tf32=62.5, float16=125, bfloat16=125, int8=250),
               24 * GiB, 600 * GB, default_link="pcie4"),
    _gpu("a100-40g", _tf(float64=19.5, float32=19.5, tf32=156, float16=312, bfloat16=312, int8=624),
               40 * GiB, 1555 * GB, default_link="nvlink3"),
    _gpu("a100-80g", _tf(float64=19.5, float32=19.5, tf32=156, float16=312, bfloat16=312, int8=624),
               80 * GiB, 2039 * GB, default_link="nvlink3"),
    _gpu("h100-80g", _tf(float64=67, float32=67, tf32=494.5, float16=989.5, bfloat16=989.5,
                               float8=1979, int8=1979),
               80 * GiB, 3350 * GB, default_link="nvlink4"),
    _gpu("h200-141g", _tf(float64=67, float32=67, tf32=494.5, float16=989.5, bfloat16=989.5,
                                float8=1979, int8=1979),
               141 * GiB, 4800 * GB, default_link="nvlink4"),
    DeviceSpec("cpu", _tf(float64=0.5, float32=1.0), 64 * GiB, 100 * GB, launch_floor=2e-6,
               default_link="shm"),
)

DEVICES: dict[str, DeviceSpec] = {spec.name: spec for spec in _CATALOGUE}

# Other spellings people use. A bare family name ("v100", "a100") is accepted only when the
# catalogue has one member of that family; otherwise the error lists the members.
DEVICE_ALIASES = {
    "t4": "t4-16g", "a10": "a10-24g", "p100": "p100-16g", "h100": "h100-80g", "h100-sxm": "h100-80g",
    "h200": "h200-141g", "v100m16": "v100-16g", "v100m32": "v100-32g",
}


def normalise_device_name(name: str) -> str:
    """The lookup key of a device name: lower case, '-' for '_', a trailing 'gb' shortened to 'g'."""
    key = name.strip().lower().replace("_", "-")
    return key[:-1] if key.endswith("gb") else key  # "a100-80gb" -> "a100-80g"


def lookup_device(name: str, where: str, extra: Mapping[str, DeviceSpec] | None = None) -> DeviceSpec:
    """The device called `name` (case-insensitive, aliases allowed), from `extra` or the catalogue.

    `where` names the flag or file location for the UsageError raised when nothing matches.
    """
    table = {**DEVICES, **(extra or {})}
    key = normalise_device_name(name)
    key = DEVICE_ALIASES.get(key, key) if key not in table else key
    if key in table:
        return table[key]
    family = sorted(n for n in table if n.split("-")[0] == key)
    if family:
        raise UsageError(f"{where}: device type '{name}' is ambiguous: say which of {', '.join(family)}")
    raise UsageError(f"{where}: unknown device type '{name}' (known: {', '.join(known_devices(extra))})")


def known_devices(extra: Iterable[str] | None = None) -> list[str]:
    """Catalogue names (and `extra` custom names) for error messages, sorted."""
    return sorted({*DEVICES, *(extra or ())})
