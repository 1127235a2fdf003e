"""A plan's ranks as threads of one process: the same `Rank` programs, with collectives over
shared memory instead of MPI. For tests and debugging on one host (no mpiexec, no process
start-up); `parc run` and `parc verify` use MPI.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from parc.exec.comm import CommTimeout
from parc.sharding.layout import reduce_parts


class _World:
    def __init__(self, size: int, timeout: float) -> None:
        self.size = size
        self.timeout = timeout
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list = [None] * size
        self.subs: dict = {}
        self.links: dict[tuple[int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    def link(self, src: int, dst: int) -> queue.Queue:
        with self.lock:
            return self.links.setdefault((src, dst), queue.Queue())

    def sub(self, key, size: int) -> _World:
        with self.lock:
            if key not in self.subs:
                self.subs[key] = _World(size, self.timeout)
            return self.subs[key]


class ThreadComm:
    """MpiComm's interface among threads (see parc/exec/comm.py). Pipeline transfers go as
    NcclComm's do: one FIFO link per direction between two ranks, matched by order, not tag."""

    device_buffers = False

    def __init__(self, world: _World, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.size = world.size

    def _wait(self, what: str) -> None:
        try:
            self.world.barrier.wait()
        except threading.BrokenBarrierError:
            raise CommTimeout(f"rank {self.rank}: {what} did not complete within {self.world.timeout:g} s") from None

    def _exchange(self, x, what: str) -> list:
        self.world.slots[self.rank] = x
        self._wait(what)
        parts = list(self.world.slots)
        self._wait(what)
        return parts

    def for_axis(self, mesh_shape: tuple[int, ...], axis: int) -> ThreadComm:
        coords = list(np.unravel_index(self.rank, mesh_shape))
        me = coords[axis]
        coords[axis] = 0
        color = int(np.ravel_multi_index(coords, mesh_shape))
        return ThreadComm(self.world.sub((tuple(mesh_shape), axis, color), mesh_shape[axis]), int(me))

    def for_ranks(self, ranks: tuple[int, ...]) -> ThreadComm:
        return ThreadComm(self.world.sub(("ranks", tuple(ranks)), len(ranks)), list(ranks).index(self.rank))

    def all_reduce(self, x: np.ndarray, op: str = "sum") -> np.ndarray:
        return reduce_parts(self._exchange(np.asarray(x), "all_reduce"), op)

    def all_gather(self, x: np.ndarray, dim: int = 0) -> np.ndarray:
        return np.concatenate(self._exchange(np.asarray(x), "all_gather"), axis=dim)

    def reduce_scatter(self, x: np.ndarray, dim: int = 0, op: str = "sum") -> np.ndarray:
        full = reduce_parts(self._exchange(np.asarray(x), "reduce_scatter"), op)
        return np.split(full, self.size, axis=dim)[self.rank].copy()

    def all_to_all(self, x: np.ndarray, split_dim: int, concat_dim: int) -> np.ndarray:
        parts = self._exchange(np.asarray(x), "all_to_all")
        return np.concatenate([np.split(p, self.size, axis=split_dim)[self.rank] for p in parts], axis=concat_dim)

    def exchange(self, pieces: list[np.ndarray], sizes: list[int]) -> list[np.ndarray]:
        parts = self._exchange([np.array(p, copy=True) for p in pieces], "all_to_all of pieces")
        return [parts[p][self.rank] for p in range(self.size)]

    def gather_parts(self, x: np.ndarray) -> list[np.ndarray]:
        return self._exchange(np.asarray(x), "gather_parts")

    def open_links(self, pairs) -> None:
        for src, dst in pairs:
            self.world.link(src, dst)

    def isend(self, x: np.ndarray, peer: int, tag: int = 0):
        self.world.link(self.rank, peer).put(np.array(x, copy=True))
        return None

    def wait_sends(self, pending: list) -> None:
        """Nothing to wait for: a link holds what was sent until it is received."""

    def recv(self, shape: tuple[int, ...], dtype, peer: int, tag: int = 0) -> np.ndarray:
        try:
            x = self.world.link(peer, self.rank).get(timeout=self.world.timeout)
        except queue.Empty:
            raise CommTimeout(f"rank {self.rank}: recv from rank {peer} did not complete within "
                              f"{self.world.timeout:g} s") from None
        if x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
            raise CommTimeout(f"rank {self.rank}: recv from rank {peer} expected {tuple(shape)} {np.dtype(dtype)}, "
                              f"got {x.shape} {x.dtype} (the two sides' transfer orders differ)")
        return x

    def barrier(self) -> None:
        self._wait("barrier")

    def abort(self, code: int = 1) -> None:
        self.world.barrier.abort()


def run_threads(plan_dir: str | Path, batches: Sequence[dict], engine: str = "ort",
                timeout: float = 60.0) -> tuple[list[dict], list[dict]]:
    """Run every rank of the plan as a thread for len(batches) steps: (the outputs per step,
    each from the lowest rank that has it (a pipeline's loss is on its last stage), each rank's
    final resident state)."""
    from parc.exec.runner import Rank
    from parc.plandir.taskgraph import TASKGRAPH_FILE, load_taskgraph

    ranks = load_taskgraph(Path(plan_dir) / TASKGRAPH_FILE).ranks
    world = _World(ranks, timeout)
    outputs: list[list[dict]] = [[] for _ in range(ranks)]
    states: list[dict] = [{} for _ in range(ranks)]
    errors: list[BaseException] = []

    def body(r: int) -> None:
        comm = ThreadComm(world, r)
        try:
            runner = Rank(plan_dir, r, comm, engine, threads=1)
            for batch in batches:
                outputs[r].append(runner.step(batch))
            states[r] = dict(runner.state)
        except BaseException as e:  # reported to the caller; the others stop at the barrier
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, CommTimeout)), errors[0])
        raise first
    merged = [{k: v for r in reversed(range(ranks)) for k, v in outputs[r][step].items()}
              for step in range(len(batches))]
    return merged, states
