"""Rank state files and the launcher's first-exit watch (parc/exec/watch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from parc.exec.watch import FirstExit, RankState, absent_text, how, read_state, stopped_text, where

ALLREDUCE = {"kind": "collective", "id": "c0.a0.g3", "op": "all_reduce", "shape": [2, 16], "group": [0, 1, 2, 3]}


def test_state_is_rewritten_in_place(tmp_path):
    state = RankState(tmp_path, 2)
    assert read_state(tmp_path, 2)["task"] is None
    state.set(ALLREDUCE, step=6)
    first = read_state(tmp_path, 2)
    assert first["rank"] == 2 and first["pid"] == os.getpid() and first["step"] == 6
    assert first["task"] == {**ALLREDUCE, "group": "0-3"}  # groups as text: thousands of ranks fit the page
    time.sleep(0.01)
    state.beat()
    again = read_state(tmp_path, 2)
    assert again["since"] == first["since"] and again["beat"] > first["beat"]
    assert len((tmp_path / "rank_2.state").read_bytes()) == 1024
    assert where(again) == "at step 7, in all_reduce of [2, 16] with ranks 0-3"
    state.set({"kind": "recv", "id": "r1.recv.x", "peer": 0, "micro_batch": 1, "tensor": "x"})
    assert where(read_state(tmp_path, 2)) == "at step 7, in recv of x from rank 0, microbatch 1"
    assert "error_at" not in read_state(tmp_path, 2)
    state.reported()  # about to print its error: the launcher leaves the explaining to it
    assert read_state(tmp_path, 2)["error_at"] >= again["beat"]
    state.set({**ALLREDUCE, "group": list(range(0, 8192, 2))})  # 4,096 ranks, not a range
    assert where(read_state(tmp_path, 2)).startswith("at step 7, in all_reduce of [2, 16] with ranks 0, 2, 4,")
    state.close()


def _write(tmp_path, rank: int, task, since: float, beat: float, pid: int | None = None) -> None:
    record = {"rank": rank, "pid": pid or os.getpid(), "host": "h", "step": 3, "task": task, "since": since,
              "beat": beat}
    (tmp_path / f"rank_{rank}.state").write_text(json.dumps(record))


def test_the_rank_that_shows_no_life_is_named(tmp_path):
    now = time.time()
    for r in (0, 2, 3):  # waiting in the collective, beating
        _write(tmp_path, r, ALLREDUCE, now - 10, now - 0.1)
    _write(tmp_path, 1, {"kind": "compute", "id": "r1.m004"}, now - 10, now - 10)  # stopped in its compute
    text = absent_text(tmp_path, 0, ALLREDUCE, 4)
    assert text.startswith("; not responding: rank 1 (pid ") and "at step 4, in compute r1.m004" in text
    assert "rank 2" not in text and "rank 3" not in text


def test_every_rank_alive_names_those_elsewhere(tmp_path):
    now = time.time()
    _write(tmp_path, 0, ALLREDUCE, now - 5, now)
    _write(tmp_path, 1, {**ALLREDUCE, "id": "c0.a0.g4"}, now - 5, now)  # a different collective: a mismatch
    text = absent_text(tmp_path, 0, ALLREDUCE, 2)
    assert text.startswith("; never reached it: rank 1 (at step 4, in all_reduce") and "c0" not in text


def test_how_a_process_ended():
    assert how(9) == "was killed by signal 9 (SIGKILL)"
    assert how(3 << 8) == "exited with code 3"
    assert how(None).startswith("ended without a word")


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds (Linux)")
def _first_of(watch: FirstExit, procs) -> None:
    """Wait for every process, then (up to 5 s) for the watcher's verdict."""
    for p in procs:
        p.wait()
    deadline = time.monotonic() + 5
    while watch.first is None and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds (Linux)")
def test_first_exit_is_the_first_to_end_even_when_the_rest_follow_at_once(tmp_path):
    """The watcher may wake after all four have ended: the order comes from epoll's ready list."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(4)]
    try:
        for r, p in enumerate(procs):
            _write(tmp_path, r, None, time.time(), time.time(), pid=p.pid)
        watch = FirstExit(tmp_path, 4)
        time.sleep(0.3)
        procs[2].kill()
        procs[2].wait()  # ended (a process manager reacts to that: it reaps the process first)
        for victim in (0, 3, 1):  # then kills the rest at once, before the watcher may have looked
            procs[victim].kill()
        _first_of(watch, procs)
        watch.stop()
        assert watch.first is not None and watch.first[:2] == (2, procs[2].pid)
    finally:
        for p in procs:
            p.kill()


def test_first_exit_sees_the_first_rank_close_before_it_is_reaped(tmp_path):
    """MPICH's hydra sees a rank's pipes close and kills the others while that rank is still
    being torn down, so a smaller process may finish dying first. Each rank's connection to the
    watcher closes when its pipes do: the order of those closes names the first."""
    watch = FirstExit(tmp_path, 3)
    code = ("import sys, time; from parc.exec.watch import RankState; "
            f"s = RankState({str(tmp_path)!r}, int(sys.argv[1])); "
            "big = b'x' * int(sys.argv[2]); "  # pages written: a slow teardown
            "print('ready', flush=True); time.sleep(60)")
    sizes = {0: 0, 1: 0, 2: 1 << 30}  # rank 2 takes longest to die
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(sizes[r])], stdout=subprocess.PIPE)
             for r in range(3)]
    try:
        for p in procs:
            assert p.stdout.readline() == b"ready\n"
        procs[2].kill()
        assert procs[2].stdout.read() == b""  # its pipe closed: now kill the rest, as hydra does
        for victim in (0, 1):
            procs[victim].kill()
        _first_of(watch, procs)
        assert watch.first is not None and watch.first[:2] == (2, procs[2].pid)
    finally:
        watch.stop()
        for p in procs:
            p.kill()


def test_a_stopped_rank_says_because_of_which(tmp_path):
    """What a rank that its launcher stops with SIGTERM says, from the state files it can see."""
    now = time.time()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for r in range(3):
        _write(tmp_path, r, ALLREDUCE, now, now)
    _write(tmp_path, 2, ALLREDUCE, now - 5, now - 5, pid=gone.pid)  # its process is gone
    record = json.loads((tmp_path / "rank_2.state").read_text())
    (tmp_path / "rank_2.state").write_text(json.dumps({**record, "host": __import__("socket").gethostname()}))
    assert stopped_text(tmp_path, 0, 3).startswith(f"; because rank 2 (pid {gone.pid} on ")
    assert "had ended, at step 4, in all_reduce of [2, 16] with ranks 0-3" in stopped_text(tmp_path, 0, 3)
    _write(tmp_path, 1, ALLREDUCE, now, now)
    state = json.loads((tmp_path / "rank_1.state").read_text())
    (tmp_path / "rank_1.state").write_text(json.dumps({**state, "error_at": now}))  # rank 1 said what failed
    assert stopped_text(tmp_path, 0, 3).startswith("; because rank 1 failed first (at step 4")
    for r in range(3):
        _write(tmp_path, r, ALLREDUCE, now, time.time())
    assert "no rank's state seen from here shows why" in stopped_text(tmp_path, 0, 3)


def test_a_pipeline_task_names_its_stage():
    from parc.exec.watch import describe_task

    task = {"kind": "send", "id": "r0.send.x.to2.mb1", "peer": 2, "tensor": "x", "micro_batch": 1, "stage": 0,
            "pass": "B"}
    assert describe_task(task) == "send of x to rank 2, microbatch 1, stage 0 (backward)"


def test_ranks_the_launcher_stopped_are_not_blamed(tmp_path):
    """srun sends SIGTERM to every rank at once: a rank whose handler runs late sees the others
    gone, but they marked themselves stopped, so only the one that ended first is named."""
    import socket

    now = time.time()
    gone = [subprocess.Popen([sys.executable, "-c", "pass"]) for _ in range(2)]
    for p in gone:
        p.wait()
    for r, p in zip((1, 2), gone):
        _write(tmp_path, r, ALLREDUCE, now - 5, now - 5, pid=p.pid)
        record = json.loads((tmp_path / f"rank_{r}.state").read_text())
        (tmp_path / f"rank_{r}.state").write_text(json.dumps({**record, "host": socket.gethostname()}))
    record = json.loads((tmp_path / "rank_2.state").read_text())
    (tmp_path / "rank_2.state").write_text(json.dumps({**record, "stopped_at": now}))  # stopped, not first
    text = stopped_text(tmp_path, 0, 3)
    assert text.startswith(f"; because rank 1 (pid {gone[0].pid} on ") and "rank 2" not in text, text
