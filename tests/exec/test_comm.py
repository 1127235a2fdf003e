"""MpiComm on CPU ranks under mpiexec (the mpich wheel's): collectives against NumPy, mesh-axis
sub-communicators, both ways of waiting (`MpiComm.spin`), and a timeout when a peer never joins."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import MPIEXEC, needs_mpiexec

SCRIPT = Path(__file__).with_name("mpi_check.py")
pytestmark = needs_mpiexec


def test_collectives_on_four_ranks():
    res = subprocess.run([MPIEXEC, "-n", "4", sys.executable, str(SCRIPT), "collectives"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(re.findall(r"rank \d: ok", res.stdout)) == [f"rank {r}: ok" for r in range(4)]  # lines may interleave


def test_a_waiting_rank_naps_on_its_doorbell_and_leaves_the_cores_to_the_others():
    """Ranks sharing cores (`MpiComm.bells`): a rank waiting 0.4 s on a recv from a rank that
    computes uses under half the CPU it used napping 50 us between polls, yet gets its message;
    then a collective the computing ranks join late."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # a core each, as the runner's
    res = subprocess.run([MPIEXEC, "-n", "4", sys.executable, str(SCRIPT), "bells"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(re.findall(r"rank \d: ok", res.stdout)) == [f"rank {r}: ok" for r in range(4)]


@pytest.mark.parametrize("how", ["spin", "nap"])
def test_a_peer_that_never_joins_times_out_instead_of_hanging(how):
    """Whether a waiting rank polls without a break (ranks with a core each) or naps between
    polls (ranks sharing cores), the deadline holds."""
    t = time.monotonic()
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(SCRIPT), "timeout", how],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "rank 0: all_reduce(sum) of (4, 6) did not complete within 2 s" in res.stdout
    assert time.monotonic() - t < 30
