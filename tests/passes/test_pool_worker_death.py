"""A worker process killed mid-job (the system's out-of-memory killer) ends the run with one
line naming the job, not an internal error."""

from __future__ import annotations

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
