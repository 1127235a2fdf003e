"""NCCL communicators over device buffers (CuPy), the GPU side of `parc/exec/comm.py`.

`NcclComm(mpi)` makes one NCCL communicator over the ranks of an MpiComm: rank 0 of the group
draws the NCCL unique id and broadcasts it over MPI (Rhino 6.3's distributed initialization);
`for_axis` does the same per mesh axis, once, and caches it. Operations take and return CuPy
arrays on the current device and run on the communicator's own CUDA stream; each waits for its
stream with a deadline (an event polled until `timeout`), and a peer that never joins aborts the
NCCL communicator and raises CommTimeout, as MpiComm does. The interface is MpiComm's, so the
executor does not care which one it holds.
"""

from __future__ import annotations

import time

import numpy as np

from parc.errors import ParcError
from parc.exec.comm import DEFAULT_TIMEOUT, CommTimeout

_TYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
          "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8", "int8": "NCCL_INT8",
          "bool": "NCCL_UINT8"}
_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}


class NcclComm:
    """One NCCL communicator over the ranks of `mpi` (see the module docstring)."""

    def __init__(self, mpi, timeout: float = DEFAULT_TIMEOUT) -> None:
        import cupy
        from cupy.cuda import nccl

        self.cp, self.nccl, self.mpi, self.timeout = cupy, nccl, mpi, timeout
        uid = nccl.get_unique_id() if mpi.rank == 0 else None
        uid = mpi.comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._axes: dict = {}

    @property
    def rank(self) -> int:
        return self.mpi.rank

    @property
    def size(self) -> int:
        return self.mpi.size

    def for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> NcclComm:
        key = (tuple(mesh_shape), axis)
        if key not in self._axes:
            self._axes[key] = NcclComm(self.mpi.for_axis(mesh_shape, axis), self.timeout)
        return self._axes[key]

    def for_ranks(self, ranks: tuple[int, ...]) -> NcclComm:
        key = ("ranks", tuple(ranks))
        if key not in self._axes:
            self._axes[key] = NcclComm(self.mpi.for_ranks(ranks), self.timeout)
        return self._axes[key]

    # Pipeline transfers go over MPI from host buffers (the runner hands host arrays over and
    # uploads what it receives); NCCL's own send/recv would need the peers' calls grouped.
    def isend(self, x, peer: int, tag: int = 0):
        return self.mpi.isend(x, peer, tag)

    def wait_sends(self, pending: list) -> None:
        self.mpi.wait_sends(pending)

    def recv(self, shape, dtype, peer: int, tag: int = 0):
        return self.mpi.recv(shape, dtype, peer, tag)

    # -- plumbing -------------------------------------------------------------------------------
    def _type(self, x) -> int:
        name = _TYPES.get(np.dtype(x.dtype).name)
        if name is None:
            raise ParcError(f"NCCL: no data type for {x.dtype}")
        return getattr(self.nccl, name)

    def _op(self, op: str) -> int:
        if op not in _OPS:
            raise ParcError(f"reduction {op!r}: expected one of {', '.join(_OPS)}")
        return getattr(self.nccl, _OPS[op])

    def _wait(self, what: str) -> None:
        """The stream's work so far, done within the deadline (else abort and CommTimeout)."""
        event = self.stream.record()
        deadline = time.monotonic() + self.timeout
        while not event.done:
            if time.monotonic() > deadline:
                self.comm.abort()
                raise CommTimeout(f"rank {self.rank}: NCCL {what} did not complete within {self.timeout:g} s "
                                  f"(a peer may have died)")
            time.sleep(1e-5)

    def _ready(self, x):
        """x, contiguous, with the compute stream's writes to it visible to the comm stream."""
        x = self.cp.ascontiguousarray(x) if x.ndim else self.cp.asarray(x).copy()
        self.stream.wait_event(self.cp.cuda.get_current_stream().record())
        return x

    # -- collectives ----------------------------------------------------------------------------
    def all_reduce(self, x, op: str = "sum"):
        x = self._ready(x)
        out = self.cp.empty_like(x)
        self.comm.allReduce(x.data.ptr, out.data.ptr, x.size, self._type(x), self._op(op), self.stream.ptr)
        self._wait(f"all_reduce({op}) of {x.shape}")
        return out

    def all_gather(self, x, dim: int = 0):
        x = self._ready(x)
        out = self.cp.empty((self.size, *x.shape), dtype=x.dtype)
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._type(x), self.stream.ptr)
        self._wait(f"all_gather of {x.shape}")
        return self.cp.concatenate(list(out), axis=dim)

    def reduce_scatter(self, x, dim: int = 0, op: str = "sum"):
        if x.shape[dim] % self.size:
            raise ParcError(f"reduce_scatter: dim {dim} of {x.shape} does not split {self.size} ways")
        send = self._ready(self.cp.stack(self.cp.split(x, self.size, axis=dim)))
        out = self.cp.empty(send.shape[1:], dtype=x.dtype)
        self.comm.reduceScatter(send.data.ptr, out.data.ptr, out.size, self._type(x), self._op(op), self.stream.ptr)
        self._wait(f"reduce_scatter of {x.shape}")
        return out

    def all_to_all(self, x, split_dim: int, concat_dim: int):
        if x.shape[split_dim] % self.size:
            raise ParcError(f"all_to_all: dim {split_dim} of {x.shape} does not split {self.size} ways")
        send = self._ready(self.cp.stack(self.cp.split(x, self.size, axis=split_dim)))
        out = self.cp.empty_like(send)
        count, dtype = send[0].size, self._type(x)
        self.nccl.groupStart()
        for q in range(self.size):
            self.comm.send(send[q].data.ptr, count, dtype, q, self.stream.ptr)
            self.comm.recv(out[q].data.ptr, count, dtype, q, self.stream.ptr)
        self.nccl.groupEnd()
        self._wait(f"all_to_all of {x.shape}")
        return self.cp.concatenate(list(out), axis=concat_dim)

    def gather_parts(self, x) -> list:
        """Every rank's x in rank order, any shapes: shapes over MPI, padded data over NCCL."""
        shapes = self.mpi.comm.allgather(tuple(x.shape))
        width = max(int(np.prod(s, dtype=np.int64)) for s in shapes)
        flat = self.cp.zeros(width, dtype=x.dtype)
        flat[:x.size] = self.cp.asarray(x).reshape(-1)
        flat = self._ready(flat)
        out = self.cp.empty((self.size, width), dtype=x.dtype)
        self.comm.allGather(flat.data.ptr, out.data.ptr, width, self._type(x), self.stream.ptr)
        self._wait(f"all_gather of pieces {x.shape}")
        return [out[q, :int(np.prod(s, dtype=np.int64))].reshape(s) for q, s in enumerate(shapes)]

    def broadcast(self, x, root: int = 0):
        x = self._ready(x).copy()
        self.comm.bcast(x.data.ptr, x.size, self._type(x), root, self.stream.ptr)
        self._wait(f"broadcast from rank {root}")
        return x

    def barrier(self) -> None:
        self.mpi.barrier()

    def abort(self, code: int = 1) -> None:
        try:
            self.comm.abort()
        finally:
            self.mpi.abort(code)
