"""A worker process killed mid-job (the system's out-of-memory killer) ends the run with one
line naming the job, not an internal error."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import pytest

from parc.errors import WorkerDiedError
from parc.ir.graph import Graph
from parc.passes.spmd.pool import can_fork, run_jobs


@dataclass(frozen=True)
class _Job:
    n: int

    @property
    def label(self) -> str:
        return f"job {self.n}"


def _die_on_two(graph: Graph, job: _Job) -> int:
    if job.n == 2:
        os._exit(9)  # as a SIGKILL leaves it: no exception, no result
    return job.n


@pytest.mark.skipif(not can_fork(), reason="workers are forked")
def test_a_killed_worker_is_named():
    with pytest.raises(WorkerDiedError, match=r"process died .*out of memory.* while running [^;]*job 2.*--jobs 1"):
        run_jobs(_die_on_two, Graph(), [_Job(1), _Job(2), _Job(3)], 2)



class _Finalized:
    """Records, when finalized, which process ran its finalizer."""

    log = ""

    def __del__(self) -> None:
        with open(_Finalized.log, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect_and_double(graph: Graph, job: int) -> int:
    gc.collect()  # a worker's collection must not finalize what it inherited
    return job * 2


@pytest.mark.skipif(not can_fork(), reason="workers are forked")
def test_workers_never_collect_inherited_garbage(tmp_path):
    """Garbage left by earlier work is collected before the fork, never in a worker: an
    onnxruntime session in a reference cycle hung a forked worker that collected it (its
    destructor waits on threads that a fork does not copy)."""
    _Finalized.log = str(tmp_path / "finalized")
    gc.disable()  # keep the cycles as garbage until the pool forks
    try:
        for _ in range(4):
            holder = {"object": _Finalized()}
            holder["self"] = holder  # type: ignore[assignment]
        del holder
        assert run_jobs(_collect_and_double, Graph(), list(range(6)), 2) == [0, 2, 4, 6, 8, 10]
    finally:
        gc.enable()
    gc.collect()
    pids = (tmp_path / "finalized").read_text().split()
    assert pids == [str(os.getpid())] * 4
