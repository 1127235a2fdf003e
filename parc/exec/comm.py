"""Communicators: the collectives a plan's task graph names, over MPI (host buffers).

One interface for every backend (NCCL on GPUs comes with the executor): `all_reduce`,
`all_gather` and `reduce_scatter` along a tensor dim, `all_to_all` (split one dim, concatenate
another), `broadcast`, `send`/`recv`, each with a deadline. `MpiComm.for_ranks(ranks)` gives the
communicator of a collective's group as the task graph lists it (a mesh axis's ranks in
coordinate order), `for_axis(mesh_shape, axis)` that of one mesh axis (the ranks that differ only
in that axis's coordinate, row-major as `parc.cluster.Mesh`); both are created once and cached
(Rhino 6.3).

Every operation is non-blocking underneath and polled until done or until `timeout` seconds
pass; then it raises CommTimeout naming the operation, so a rank that died cannot hang the
others (the executor then aborts the job).
"""

from __future__ import annotations

import os
import select
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from parc.errors import ParcError

DEFAULT_TIMEOUT = 30.0
_OPS = ("sum", "max", "min")
NAP_S = 5e-5  # a waiting rank's first nap between polls where ranks share cores
BELL_NAP_S = 2e-3  # its longest, on its doorbell (`Bells`)
JOINED, POSTED, RECEIVED = range(3)  # what a ring says: a collective joined, a send posted, a recv done


class CommTimeout(ParcError):
    """A collective or point-to-point operation did not complete in time."""


# Called about every HEARTBEAT_S while a rank waits on its peers (`parc run` sets it to the rank
# state's `beat`): a rank that waits shows it is alive; one stopped or stuck elsewhere does not.
heartbeat = None
HEARTBEAT_S = 0.25


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity where the system says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def beat_every(last: float, now: float) -> float:
    """Call the heartbeat when HEARTBEAT_S has passed since `last`; the new `last`."""
    if heartbeat is not None and now - last >= HEARTBEAT_S:
        heartbeat()
        return now
    return last


class Bells:
    """A doorbell per rank among the ranks of one host that share its cores: a named pipe that
    the rank naps on (`sleep`) while it waits, and that the host's other ranks ring (`ring`) when
    they send to it or join a collective with it. So a waiting rank sleeps long without missing
    its message by long, and leaves its core to the ranks computing (`MpiComm._wait`). The pipes'
    names are gone once every rank has opened them; the open descriptors close with the process.
    A ring is a byte written without blocking (a full pipe has been rung already); a lost ring
    costs a nap (BELL_NAP_S at most), never a message."""

    def __init__(self, comm, fd: int, doors: dict[int, int]) -> None:
        self.comm = comm  # the communicator whose ranks `doors` is keyed by
        self.fd = fd
        self.doors = doors  # rank -> the write end of its pipe (this host's other ranks)
        self.me = comm.Get_rank()

    @classmethod
    def make(cls, comm) -> Bells | None:
        """Every rank of `comm` calls it; None on every rank where a host's ranks cannot make
        or open the pipes (a temporary directory they do not share, say)."""
        import tempfile

        from mpi4py import MPI

        host = comm.Split_type(MPI.COMM_TYPE_SHARED)
        me = comm.Get_rank()
        mates = host.allgather(me)
        fd, doors = -1, {}
        try:
            made = tempfile.mkdtemp(prefix="parc-bells-") if host.Get_rank() == 0 else None
        except OSError:
            made = None
        where = host.bcast(made, root=0)
        ok = where is not None
        try:
            if ok:
                os.mkfifo(os.path.join(where, str(me)))
                fd = os.open(os.path.join(where, str(me)), os.O_RDWR | os.O_NONBLOCK)
        except OSError:
            ok = False
        ok = host.allreduce(ok, op=MPI.LAND)
        try:
            if ok:
                doors = {r: os.open(os.path.join(where, str(r)), os.O_WRONLY | os.O_NONBLOCK)
                         for r in mates if r != me}
        except OSError:
            ok = False
        ok = host.allreduce(ok, op=MPI.LAND)  # every pipe is open (or none is used)
        if where is not None:
            try:
                os.unlink(os.path.join(where, str(me)))
            except OSError:
                pass
        host.Barrier()
        if made is not None:
            try:
                os.rmdir(made)
            except OSError:
                pass
        host.Free()
        everywhere = comm.allreduce(ok, op=MPI.LAND)
        if not everywhere:
            for f in [fd, *doors.values()]:
                if f >= 0:
                    os.close(f)
            return None
        return cls(comm, fd, doors)

    def covers(self, ranks) -> bool:
        """Whether every one of `ranks` is on this host (and so rings here)."""
        return all(r in self.doors for r in ranks)

    def code(self, rank: int, kind: int) -> int:
        """The byte rank `rank` rings with for `kind` (JOINED, POSTED, RECEIVED)."""
        return (rank % 85) * 3 + kind

    def ring(self, ranks, kind: int) -> None:
        me = bytes([self.code(self.me, kind)])
        for r in ranks:
            door = self.doors.get(r)
            if door is not None:
                try:
                    os.write(door, me)
                except (BlockingIOError, BrokenPipeError):
                    pass

    def done(self, ranks, received: bool) -> None:
        """After a wait: a recv (`received`) rings its sender, who may wait for it to complete
        its send (a send or a collective rings nothing here); the rings this rank got meanwhile
        are taken, so that they do not stand for a later wait's."""
        if received:
            self.ring(ranks, RECEIVED)
        self.sleep(0.0)

    def sleep(self, seconds: float) -> set[int]:
        """Nap until rung or `seconds` pass; the rings that came (they are taken)."""
        if seconds and not select.select([self.fd], [], [], seconds)[0]:
            return set()
        rings: set[int] = set()
        try:
            while True:
                got = os.read(self.fd, 4096)
                if not got:
                    break
                rings.update(got)
        except BlockingIOError:
            pass
        return rings


@dataclass
class MpiComm:
    """A communicator over mpi4py (`comm`: an MPI.Comm, COMM_WORLD by default)."""

    comm: object = None
    timeout: float = DEFAULT_TIMEOUT
    # poll without giving the core up: where this host's ranks have a core each, counting the
    # CPUs they may run on together (None: find out, one collective over the communicator; its
    # sub-communicators inherit the answer)
    spin: bool | None = None
    # the host's doorbells where its ranks share cores (`Bells`): True makes them (one collective
    # over the communicator), None goes without; sub-communicators get their parent's
    bells: Bells | bool | None = True
    _axes: dict = field(default_factory=dict, repr=False)
    device_buffers = False  # takes host (NumPy) arrays

    def __post_init__(self) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        if self.comm is None:
            self.comm = MPI.COMM_WORLD
        if self.spin is None:
            host = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            self.spin = host.Get_size() <= len(set().union(*host.allgather(usable_cpus())))
            host.Free()
        if self.bells is True:
            self.bells = None if self.spin else Bells.make(self.comm)
        elif self.bells is False:
            self.bells = None
        self._world: list[int] = []  # each member's rank in the bells' communicator
        self._members: tuple[int, ...] = ()  # the others', which a collective waits on
        if self.bells is not None:
            self._world = [int(w) for w in MPI.Group.Translate_ranks(
                self.comm.Get_group(), list(range(self.size)), self.bells.comm.Get_group())]
            self._members = tuple(w for i, w in enumerate(self._world) if i != self.rank)

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    def for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> MpiComm:
        """The communicator of mesh axis `axis` that holds this rank (cached)."""
        key = (tuple(mesh_shape), axis)
        if key not in self._axes:
            if int(np.prod(mesh_shape)) != self.size:
                raise ParcError(f"mesh {tuple(mesh_shape)} has {int(np.prod(mesh_shape))} ranks, "
                                f"the communicator {self.size}")
            coords = list(np.unravel_index(self.rank, mesh_shape))
            key_coord = coords[axis]
            coords[axis] = 0
            color = int(np.ravel_multi_index(coords, mesh_shape))
            self._axes[key] = MpiComm(self.comm.Split(color, key_coord), self.timeout, self.spin, self.bells)
        return self._axes[key]

    def for_ranks(self, ranks: tuple[int, ...]) -> MpiComm:
        """The communicator of `ranks` (this rank among them), in that order (cached): what the
        executor uses for a collective's group (a mesh axis's ranks in coordinate order). Only the
        members take part in making it (MPI_Comm_create_group), so the groups of one pipeline
        stage need nothing from the other stages."""
        key = ("ranks", tuple(ranks))
        if key not in self._axes:
            group = self.comm.Get_group().Incl(list(ranks))
            self._axes[key] = MpiComm(self.comm.Create_group(group), self.timeout, self.spin, self.bells)
            group.Free()
        return self._axes[key]

    # -- collectives -------------------------------------------------------------------------

    def _wait(self, request, what: str, peer: int | None = None, receiving: bool = False) -> None:
        """Poll until done, until the deadline. Where this host's ranks have a core each
        (`spin`), every poll follows the last: MPI moves a large message only while its ranks
        poll, so naps between polls there slow a late member's large all-reduce (benchmarks/LOG.md,
        2026-11-28, fifth session). Where ranks share cores, yielding the CPU between the first
        polls (a collective among ranks that share cores completes in microseconds), then
        sleeping between polls: 50 us where a counterpart (`peer`, whose message this rank is
        `receiving` or who receives its send; else every other member) is on another host; else
        on this host's doorbell (`Bells`), from 50 us up to BELL_NAP_S, twice as long each time
        nothing it waits for rang, and 50 us once every counterpart has rung (joined the
        collective, posted the send, completed the recv of this rank's send). A rank
        that naps 50 us while the host's other ranks compute takes their cores from them: their
        products run far slower beside ranks waiting so than beside ranks on their doorbells
        (docs/run.md; benchmarks/LOG.md, 2026-11-29, eleventh session)."""
        bells = self.bells
        others = self._counterparts(peer) if bells is not None else ()
        quiet = bells is not None and bells.covers(others)
        if quiet and peer is None:
            bells.ring(others, JOINED)
        if request.Test():
            if quiet:
                bells.done(others, receiving)
            return
        # the rings this wait waits for: every other member's joining, or `peer`'s post
        kind = JOINED if peer is None else POSTED if receiving else RECEIVED  # a send waits for its recv
        awaited = {bells.code(w, kind) for w in others} if quiet else set()
        deadline = time.monotonic() + self.timeout
        polls, beat, nap, heard = 0, 0.0, NAP_S, set()
        while not request.Test():
            polls += 1
            if polls < 200 or self.spin and polls % 1000:
                if not self.spin:
                    os.sched_yield()
                continue
            now = time.monotonic()
            beat = beat_every(beat, now)
            if now > deadline:
                raise CommTimeout(f"rank {self.rank}: {what} did not complete within {self.timeout:g} s "
                                  f"(a peer may have died)")
            if self.spin:
                continue
            if not quiet:
                time.sleep(NAP_S)
                continue
            rung = awaited & bells.sleep(NAP_S if heard else nap)
            if rung:
                heard |= rung
                polls, nap = 0, NAP_S  # a counterpart is there: poll closely again
            elif not heard:
                nap = min(2 * nap, BELL_NAP_S)
        if quiet:
            bells.done(others, receiving)

    def _counterparts(self, peer: int | None) -> tuple[int, ...]:
        """The world ranks this rank waits on: `peer`'s, else every other member's."""
        return self._members if peer is None else (self._world[peer],)

    def _op(self, op: str):
        if op not in _OPS:
            raise ParcError(f"reduction {op!r}: expected one of {', '.join(_OPS)}")
        return {"sum": self._mpi.SUM, "max": self._mpi.MAX, "min": self._mpi.MIN}[op]

    def all_reduce(self, x: np.ndarray, op: str = "sum") -> np.ndarray:
        if _bf16(x):  # MPI has no bfloat16: reduced in float32, rounded once
            return self.all_reduce(x.astype(np.float32), op).astype(x.dtype)
        x = np.asarray(x, order="C")
        out = np.empty_like(x)
        self._wait(self.comm.Iallreduce(x, out, op=self._op(op)), f"all_reduce({op}) of {x.shape}")
        return out

    def all_gather(self, x: np.ndarray, dim: int = 0) -> np.ndarray:
        """Every rank's x concatenated along `dim` in rank order (equal shapes)."""
        if _bf16(x):
            return self.all_gather(_bits(x), dim).view(x.dtype)
        x = np.asarray(x, order="C")
        out = np.empty((self.size, *x.shape), dtype=x.dtype)
        self._wait(self.comm.Iallgather(x, out), f"all_gather of {x.shape}")
        return np.concatenate(list(out), axis=dim)

    def reduce_scatter(self, x: np.ndarray, dim: int = 0, op: str = "sum") -> np.ndarray:
        """The `op` reduction of every rank's x, split along `dim`: this rank's piece."""
        if x.shape[dim] % self.size:
            raise ParcError(f"reduce_scatter: dim {dim} of {x.shape} does not split {self.size} ways")
        if _bf16(x):
            return self.reduce_scatter(x.astype(np.float32), dim, op).astype(x.dtype)
        send = np.asarray(np.stack(np.split(x, self.size, axis=dim)), order="C")
        out = np.empty(send.shape[1:], dtype=x.dtype)
        self._wait(self.comm.Ireduce_scatter_block(send, out, op=self._op(op)), f"reduce_scatter of {x.shape}")
        return out

    def all_to_all(self, x: np.ndarray, split_dim: int, concat_dim: int) -> np.ndarray:
        """Split x along `split_dim` into one piece per rank, send piece r to rank r, and
        concatenate what arrives along `concat_dim` in rank order."""
        if x.shape[split_dim] % self.size:
            raise ParcError(f"all_to_all: dim {split_dim} of {x.shape} does not split {self.size} ways")
        if _bf16(x):
            return self.all_to_all(_bits(x), split_dim, concat_dim).view(x.dtype)
        send = np.asarray(np.stack(np.split(x, self.size, axis=split_dim)), order="C")
        out = np.empty_like(send)
        self._wait(self.comm.Ialltoall(send, out), f"all_to_all of {x.shape}")
        return np.concatenate(list(out), axis=concat_dim)

    def exchange(self, pieces: list[np.ndarray], sizes: list[int]) -> list[np.ndarray]:
        """Send the 1-D `pieces[q]` to rank q; per rank p, the 1-D piece of `sizes[p]` elements p
        sent here (an all_to_all of pieces of any sizes: `parc.sharding.layout.exchange`)."""
        dtype = pieces[0].dtype
        if _bf16(pieces[0]):
            return [p.view(dtype) for p in self.exchange([_bits(p) for p in pieces], sizes)]
        counts = [int(p.size) for p in pieces]
        send = np.concatenate(pieces)
        recv = np.empty(int(sum(sizes)), dtype=dtype)
        self._wait(self.comm.Ialltoallv([send, (counts, _displs(counts))], [recv, (list(sizes), _displs(sizes))]),
                   f"all_to_all of pieces of {sum(counts)} elements")
        return np.split(recv, np.cumsum(sizes)[:-1])

    def gather_parts(self, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's x, in rank order; shapes may differ in any dim (uneven or strided
        layouts, which the generic resharding step then rearranges)."""
        if _bf16(x):
            return [p.view(x.dtype) for p in self.gather_parts(_bits(x))]
        x = np.asarray(x, order="C")
        shapes = np.empty((self.size, max(x.ndim, 1)), dtype=np.int64)
        mine = np.array(x.shape if x.ndim else (1,), dtype=np.int64)
        self._wait(self.comm.Iallgather(mine, shapes), f"all_gather of shapes {x.shape}")
        shapes = [tuple(int(d) for d in s) if x.ndim else () for s in shapes]
        counts = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        flat = np.empty(sum(counts), dtype=x.dtype)
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        mpi_type = self._mpi._typedict[x.dtype.char]
        self._wait(self.comm.Iallgatherv(x.reshape(-1), [flat, counts, displs, mpi_type]),
                   f"all_gather of pieces {x.shape}")
        return [flat[d:d + c].reshape(s) for d, c, s in zip(displs, counts, shapes)]

    def broadcast(self, x: np.ndarray, root: int = 0) -> np.ndarray:
        if _bf16(x):
            return self.broadcast(_bits(x), root).view(x.dtype)
        x = np.array(x, copy=True, order="C")
        self._wait(self.comm.Ibcast(x, root=root), f"broadcast from rank {root}")
        return x

    def send(self, x: np.ndarray, peer: int, tag: int = 0) -> None:
        self.wait_sends([self.isend(x, peer, tag)])

    def open_links(self, pairs) -> None:
        """Nothing to make: MPI matches a transfer by its peer and tag (NcclComm makes one
        communicator per direction here)."""

    def isend(self, x: np.ndarray, peer: int, tag: int = 0):
        """Start sending x to `peer`; `wait_sends` completes it (the buffer is kept until then)."""
        buf = _bits(np.ascontiguousarray(x))
        request = self.comm.Isend(buf, dest=peer, tag=tag)
        if self.bells is not None:
            self.bells.ring(self._counterparts(peer), POSTED)  # a receiver may be napping on it
        return (request, buf, peer)

    def wait_sends(self, pending: list) -> None:
        for request, _buf, peer in pending:
            self._wait(request, f"send to rank {peer}", peer)

    def recv(self, shape: tuple[int, ...], dtype, peer: int, tag: int = 0) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        self._wait(self.comm.Irecv(_bits(out), source=peer, tag=tag), f"recv from rank {peer}", peer, receiving=True)
        return out

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "barrier")

    def abort(self, code: int = 1) -> None:
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_size() == 1:  # nobody to take down; MPI_Abort would print its own line
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        self.comm.Abort(code)


def _bf16(x) -> bool:
    return getattr(x, "dtype", None) is not None and x.dtype.name == "bfloat16"


def _displs(counts) -> list[int]:
    return [0, *np.cumsum(counts)[:-1].tolist()]


def _bits(x: np.ndarray) -> np.ndarray:
    """A bfloat16 array's bits as uint16 (MPI has no bfloat16 type; moving bits is exact), else x."""
    return x.view(np.uint16) if _bf16(x) else x
