"""`comm.Bells` on real named pipes, in one process: a ring reaches the rank rung and says who
rang and why; a nap without a ring times out empty; after a wait the rings are taken, and a
recv's end rings its sender."""

from __future__ import annotations

import os
import time

from parc.exec.comm import JOINED, POSTED, RECEIVED, Bells


class _Comm:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank


def _bells(tmp_path, n: int) -> list[Bells]:
    for r in range(n):
        os.mkfifo(tmp_path / str(r))
    fds = [os.open(tmp_path / str(r), os.O_RDWR | os.O_NONBLOCK) for r in range(n)]
    return [Bells(_Comm(r), fds[r], {q: os.open(tmp_path / str(q), os.O_WRONLY | os.O_NONBLOCK)
                                    for q in range(n) if q != r}) for r in range(n)]


def test_a_ring_says_who_rang_and_why_and_a_nap_without_one_times_out(tmp_path):
    a, b, c = _bells(tmp_path, 3)
    t = time.monotonic()
    assert c.sleep(0.02) == set()  # nobody rang: the whole nap
    assert time.monotonic() - t >= 0.015
    a.ring([2], JOINED)
    b.ring([2], POSTED)
    b.ring([2], POSTED)  # rung twice: one ring
    assert c.sleep(5.0) == {c.code(0, JOINED), c.code(1, POSTED)}
    assert c.sleep(0.0) == set()  # taken
    assert len({c.code(r, k) for r in range(85) for k in (JOINED, POSTED, RECEIVED)}) == 255
    assert a.covers([1, 2]) and not a.covers([1, 3])


def test_after_a_wait_the_rings_are_taken_and_a_recv_rings_its_sender(tmp_path):
    a, b = _bells(tmp_path, 2)
    a.ring([1], JOINED)  # a ring meant for a wait that ended without napping
    b.done([0], received=True)
    assert b.sleep(0.0) == set()
    assert a.sleep(1.0) == {a.code(1, RECEIVED)}
    b.done([0], received=False)  # a send's or a collective's end rings nothing
    assert a.sleep(0.0) == set()
