"""Which engine a rank runs, on what device, and how it uses its host.

`pick_engine` turns `--engine` into an engine and a device (CuPy on a GPU only where one is
usable: `gpu_problem` says why not); `plan_engine` keeps a plan that computes in a type
onnxruntime's CPU provider lacks (bf16) off onnxruntime. `rank_threads` shares a host's CPUs out
among its ranks; `keep_freed_memory` has a rank's allocator keep what it frees. `parc profile`
measures with the same choices, so its figures are what a rank would see.
"""

from __future__ import annotations

import os
from typing import Any

from parc.errors import UsageError, first_line
from parc.plandir.plan import Plan

ENGINES = ("auto", "ort", "cupy", "numpy")

MIN_CUPY = 13  # the oldest CuPy major version parc runs on (pyproject's cuda12/cuda13 extras)
MIN_CUDA = 12000  # the oldest CUDA runtime (cudaRuntimeGetVersion: 1000 * major + 10 * minor)


def gpu_problem(cupy_module: Any = None) -> str | None:
    """Why parc cannot run CuPy on a GPU here, or None when it can: CuPy missing or too old, no
    driver or device, a CUDA runtime too old. `cupy_module` stands in for CuPy in tests."""
    cupy = cupy_module
    if cupy is None:
        try:
            import cupy
        except ImportError:
            return "CuPy is not installed (pip install 'parc[cuda13]' or 'parc[cuda12]')"
        except Exception as e:  # a broken install: CUDA libraries missing
            return f"CuPy does not load ({first_line(e, typed=True)})"
    try:
        major = int(str(cupy.__version__).split(".")[0])
    except ValueError:
        major = MIN_CUPY
    if major < MIN_CUPY:
        return f"CuPy {cupy.__version__} is older than parc supports (>= {MIN_CUPY})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        version = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:  # no driver, or the driver is older than the runtime
        return f"CUDA reports no usable GPU ({first_line(e, typed=True)})"
    if count == 0:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else "")
    if version < MIN_CUDA:
        return (f"CUDA runtime {version // 1000}.{version % 1000 // 10} is older than parc supports "
                f"(>= {MIN_CUDA // 1000}.{MIN_CUDA % 1000 // 10})")
    return None


def gpu_available() -> bool:
    """A CUDA GPU that CuPy can use."""
    return gpu_problem() is None


def pick_engine(engine: str) -> tuple[str, str]:
    """(engine, device): `ort` runs onnxruntime on the CPU (onnxruntime-gpu's CUDA EP is not
    wired up yet); `cupy` runs parc's kernels on a GPU, and is refused without one (one line
    saying why); `numpy` runs the same kernels on the CPU; `auto` is cupy on a GPU, else ort."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    if engine == "ort":
        return "ort", "cpu"
    if engine == "numpy":
        return "cupy", "cpu"
    if engine == "cupy":
        problem = gpu_problem()
        if problem is not None:
            raise UsageError(f"--engine cupy: {problem}; --engine numpy runs parc's kernels on the CPU")
        return "cupy", "gpu"
    return ("cupy", "gpu") if gpu_available() else ("ort", "cpu")


ORT_CPU_LACKS = ("bfloat16",)  # element types onnxruntime's CPU provider has no MatMul, Add, ... for


def ort_cpu_lacks(plan: Plan) -> list[str]:
    """The element types of a plan's tensors that onnxruntime's CPU provider cannot compute with."""
    return sorted({t.dtype for t in plan.tensors.values()} & set(ORT_CPU_LACKS))


def plan_engine(engine: str, plan: Plan) -> str:
    """The --engine a plan runs with. A plan holding values onnxruntime's CPU provider cannot
    compute with (a bf16 step: `parc grad --precision bf16`) takes the array engine under `auto`
    (cupy on a GPU, numpy on the CPU) and is refused under `ort`, one line."""
    held = ort_cpu_lacks(plan)
    if not held:
        return engine
    if engine == "ort":
        raise UsageError(f"--engine ort: onnxruntime's CPU provider has no {held[0]} kernels and this plan "
                         f"computes in {held[0]}; --engine numpy runs it on the CPU, --engine cupy on a GPU")
    if engine == "auto":
        return "cupy" if gpu_available() else "numpy"
    return engine


def rank_threads(ranks: int) -> int:
    """Threads each of `ranks` ranks on this host gives its engine: the host's CPUs shared out."""
    return max(1, (os.cpu_count() or 1) // ranks)


def keep_freed_memory() -> bool:
    """Have the C allocator keep the memory a rank frees for its next allocations (glibc: no
    mmap, no trimming), so a step's arrays reuse pages the last step faulted in. By default glibc
    serves a large block with mmap (from 128 KiB, the threshold rising with the blocks freed up
    to 32 MiB) and trims the heap's top, so a step's collectives and modules can fault their
    outputs' pages in again every step. A step's allocations repeat, so the heap stops growing
    after the first. False where the C library is not glibc (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))

