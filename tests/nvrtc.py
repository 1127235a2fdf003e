"""Compile CUDA C with NVRTC on a machine without a GPU: the test suite's check that every kernel
parc writes (the row kernels, the casts, the column sums, the flat kernels fusion generates)
compiles, so that a kernel's syntax or type error is found here rather than on a lent GPU.

NVRTC (`nvidia-cuda-nvrtc`, a dev dependency) compiles to a cubin for one architecture without a
device: front end and ptxas both run. It is called through ctypes, as CuPy calls it, with the
options CuPy passes for the same source (`--std=c++14`, `--fmad=false`, `-default-device`)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path

ARCH = "sm_90"  # H100/H200, the GPUs parc's kernels are measured on


class CompileError(Exception):
    """NVRTC refused a source: its log."""


@functools.cache
def library() -> ctypes.CDLL:
    """libnvrtc from the `nvidia-cuda-nvrtc` wheel (CUDA 13's layout, then 12's)."""
    spec = importlib.util.find_spec("nvidia")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for root in roots:
        for path in sorted(root.glob("cu*/lib/libnvrtc.so*")) + sorted(root.glob("cuda_nvrtc/lib/libnvrtc.so*")):
            if "builtins" not in path.name:
                return ctypes.CDLL(str(path))
    raise FileNotFoundError("libnvrtc not found: pip install nvidia-cuda-nvrtc (the dev extra has it)")


def _check(lib: ctypes.CDLL, status: int, what: str) -> None:
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise CompileError(f"{what}: {lib.nvrtcGetErrorString(status).decode()}")


def compile_cuda(source: str, options: Sequence[str] = (), name_expressions: Sequence[str] = ()) -> bytes:
    """The cubin NVRTC makes of `source` for ARCH; CompileError with NVRTC's log if it refuses.
    `name_expressions` are template instantiations to make (as CuPy's RawModule asks for them)."""
    lib = library()
    prog = ctypes.c_void_p()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"parc.cu", 0, None, None), "create")
    try:
        for name in name_expressions:
            _check(lib, lib.nvrtcAddNameExpression(prog, name.encode()), f"name expression {name}")
        opts = [f"--gpu-architecture={ARCH}", "-default-device", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if status != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetProgramLog(prog, log)
            raise CompileError(log.value.decode(errors="replace"))
        for name in name_expressions:
            lowered = ctypes.c_char_p()
            _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)), f"lowered {name}")
        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
