"""NCCL communicators over device buffers (CuPy), the GPU side of `parc/exec/comm.py`.

`NcclComm(mpi)` makes one NCCL communicator over the ranks of an MpiComm: rank 0 of the group
draws the NCCL unique id and broadcasts it over MPI (Rhino 6.3's distributed initialization);
`for_axis` does the same per mesh axis, once, and caches it. Operations take and return CuPy
arrays on the current device and run on the communicator's own CUDA stream; each waits for its
stream with a deadline (an event polled until `timeout`), and a peer that never joins aborts the
NCCL communicator and raises CommTimeout, as MpiComm does. Pipeline transfers go over NCCL too,
device to device, each direction between two ranks on its own link (`open_links`). The interface
is MpiComm's, so the executor does not care which one it holds (`device_buffers` says whether it
takes device arrays).
"""

from __future__ import annotations

import time

import numpy as np

from parc.errors import ParcError
from parc.exec.comm import DEFAULT_TIMEOUT, CommTimeout, beat_every

_TYPES = {"float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64", "float16": "NCCL_FLOAT16",
          "int32": "NCCL_INT32", "int64": "NCCL_INT64", "uint8": "NCCL_UINT8", "int8": "NCCL_INT8",
          "bool": "NCCL_UINT8", "bfloat16": "NCCL_BFLOAT16"}
NCCL_BFLOAT16 = 9  # ncclBfloat16 (NCCL >= 2.10), for a CuPy whose wrapper does not name it
_OPS = {"sum": "NCCL_SUM", "max": "NCCL_MAX", "min": "NCCL_MIN"}
_LINK_TAG = 32000  # the MPI tag of a link's NCCL id (MPI carries no pipeline transfer on a GPU run)


class NcclComm:
    """One NCCL communicator over the ranks of `mpi` (see the module docstring)."""

    device_buffers = True

    def __init__(self, mpi, timeout: float = DEFAULT_TIMEOUT) -> None:
        import cupy
        from cupy.cuda import nccl

        self.cp, self.nccl, self.mpi, self.timeout = cupy, nccl, mpi, timeout
        uid = nccl.get_unique_id() if mpi.rank == 0 else None
        uid = mpi.comm.bcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(mpi.size, uid, mpi.rank)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._axes: dict = {}
        self._links: dict[tuple[int, int], tuple] = {}  # (sender, receiver) -> (communicator, stream)

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

    # -- pipeline transfers ---------------------------------------------------------------------
    # Each direction between two ranks has its own two-rank NCCL communicator and CUDA stream (a
    # link): a send waiting for its receiver never holds up a receive from the same peer, which
    # 1F1B needs (stage s sends microbatch k+1's activation before it receives k's gradient;
    # stage s+1 sends that gradient before it receives the activation). NCCL matches sends with
    # receives by position, not tag; the task graph's loader refuses orders in which the two
    # sides of a link disagree (`parc.plandir.taskgraph`).
    def open_links(self, pairs) -> None:
        """Make the links of `pairs` ((sender, receiver) ranks, this rank one of the two). Every
        rank makes its links in one global order (sorted), so the first link not yet made has
        both its ranks at it, and making them cannot deadlock."""
        for src, dst in sorted(set(pairs)):
            if (src, dst) in self._links:
                continue
            if self.rank == src:
                uid = self.nccl.get_unique_id()
                self.mpi.comm.send(uid, dest=dst, tag=_LINK_TAG)
            else:
                uid = self.mpi.comm.recv(source=src, tag=_LINK_TAG)
            link = self.nccl.NcclCommunicator(2, uid, 0 if self.rank == src else 1)
            self._links[src, dst] = (link, self.cp.cuda.Stream(non_blocking=True))

    def _link(self, src: int, dst: int):
        if (src, dst) not in self._links:
            raise ParcError(f"rank {self.rank}: no NCCL link from rank {src} to rank {dst} (open_links makes them)")
        return self._links[src, dst]

    def isend(self, x, peer: int, tag: int = 0):
        """Start sending x (a device array) to `peer`; `wait_sends` completes it (x is kept
        until then). `tag` is for MpiComm's interface: NCCL matches by order."""
        link, stream = self._link(self.rank, peer)
        x = self._ready(x, stream)
        link.send(x.data.ptr, x.size, self._type(x), 1, stream.ptr)
        return (stream.record(), x, peer, link)

    def wait_sends(self, pending: list) -> None:
        for event, _x, peer, link in pending:
            self._until(event, link, f"send to rank {peer}")

    def recv(self, shape, dtype, peer: int, tag: int = 0):
        """A device array of `shape` from `peer`'s next send to this rank."""
        link, stream = self._link(peer, self.rank)
        out = self.cp.empty(tuple(shape), dtype=dtype)
        link.recv(out.data.ptr, out.size, self._type(out), 0, stream.ptr)
        self._until(stream.record(), link, f"recv from rank {peer}")
        return out

    # -- plumbing -------------------------------------------------------------------------------
    def _type(self, x) -> int:
        name = _TYPES.get(np.dtype(x.dtype).name)
        if name is None:
            raise ParcError(f"NCCL: no data type for {x.dtype}")
        return getattr(self.nccl, name, NCCL_BFLOAT16 if name == "NCCL_BFLOAT16" else None)

    def _op(self, op: str) -> int:
        if op not in _OPS:
            raise ParcError(f"reduction {op!r}: expected one of {', '.join(_OPS)}")
        return getattr(self.nccl, _OPS[op])

    def _wait(self, what: str) -> None:
        """The stream's work so far, done within the deadline (else abort and CommTimeout)."""
        self._until(self.stream.record(), self.comm, what)

    def _until(self, event, comm, what: str) -> None:
        """Poll `event` until done; past the deadline, abort `comm` and raise CommTimeout."""
        deadline = time.monotonic() + self.timeout
        beat = 0.0
        while not event.done:
            now = time.monotonic()
            beat = beat_every(beat, now)
            if now > deadline:
                comm.abort()
                raise CommTimeout(f"rank {self.rank}: NCCL {what} did not complete within {self.timeout:g} s "
                                  f"(a peer may have died)")
            time.sleep(1e-5)

    def _ready(self, x, stream=None):
        """x, contiguous, with the compute stream's writes to it visible to `stream` (the
        communicator's own by default)."""
        x = self.cp.ascontiguousarray(x) if x.ndim else self.cp.asarray(x).copy()
        (stream or self.stream).wait_event(self.cp.cuda.get_current_stream().record())
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

    def exchange(self, pieces: list, sizes: list[int]) -> list:
        """Send the 1-D `pieces[q]` to rank q; per rank p, the `sizes[p]` elements p sent here."""
        send = [self._ready(p) for p in pieces]
        out = [self.cp.empty(int(n), dtype=pieces[0].dtype) for n in sizes]
        dtype = self._type(pieces[0])
        self.nccl.groupStart()
        for q in range(self.size):
            if send[q].size:
                self.comm.send(send[q].data.ptr, send[q].size, dtype, q, self.stream.ptr)
            if sizes[q]:
                self.comm.recv(out[q].data.ptr, int(sizes[q]), dtype, q, self.stream.ptr)
        self.nccl.groupEnd()
        self._wait(f"all_to_all of pieces of {sum(int(p.size) for p in send)} elements")
        return out

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
            for link, _stream in self._links.values():
                link.abort()
            self.comm.abort()
        finally:
            self.mpi.abort(code)
