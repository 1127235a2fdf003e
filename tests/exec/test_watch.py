"""Rank state files and the launcher's first-exit watch (parc/exec/watch.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from parc.exec.watch import EXITS, FirstExit, RankState, absent_text, how, read_state, stopped_text, where

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


def _first_of(watch: FirstExit, procs) -> None:
    """Wait for every process, then (up to 5 s) for the watcher's verdict."""
    for p in procs:
        p.wait()
    deadline = time.monotonic() + 5
    while watch.first is None and time.monotonic() < deadline:
        time.sleep(0.01)


def _assert_done_with_nothing(watch: FirstExit) -> None:
    """The watching ends (within 5 s) without a first failure."""
    deadline = time.monotonic() + 5
    while not watch.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.done() and watch.first is None


def _ranks_connected(tmp_path, sizes: dict[int, int], then: str = "time.sleep(60)") -> list[subprocess.Popen]:
    """One process per rank holding a RankState connected to tmp_path's watcher socket, each
    with `sizes[r]` bytes of written pages (a slow teardown), once they are all ready."""
    code = ("import sys, time; from parc.exec.watch import RankState; "
            f"s = RankState({str(tmp_path)!r}, int(sys.argv[1]), link={str(tmp_path / EXITS)!r}); "
            f"big = b'x' * int(sys.argv[2]); print('ready', flush=True); {then}")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(n)], stdout=subprocess.PIPE)
             for r, n in sizes.items()]
    for p in procs:
        assert p.stdout.readline() == b"ready\n"
    return procs


def test_first_exit_sees_the_first_rank_close_before_it_is_reaped(tmp_path):
    """MPICH's hydra sees a rank's pipes close and kills the others while that rank is still
    being torn down, so a smaller process may finish dying first. Each rank's connection to the
    watcher closes when its pipes do: the order of those closes names the first (process ends,
    the order parc used before, failed 1 run in 3 here)."""
    watch = FirstExit(tmp_path, 3)
    procs = _ranks_connected(tmp_path, {0: 0, 1: 0, 2: 1 << 30})  # rank 2 takes longest to die
    try:
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


def test_a_clean_end_is_not_a_failure(tmp_path):
    """A rank that says it ends cleanly (`ended`) and exits is not the first failure; when every
    rank has, the watching is over with nothing found."""
    watch = FirstExit(tmp_path, 2)
    procs = _ranks_connected(tmp_path, {0: 0, 1: 0}, then="s.ended() if sys.argv[1] == '0' else time.sleep(60)")
    try:
        procs[0].wait()
        time.sleep(0.2)
        procs[1].kill()
        _first_of(watch, procs)
        assert watch.first is not None and watch.first[0] == 1
    finally:
        watch.stop()
        for p in procs:
            p.kill()
    (tmp_path / EXITS).unlink()
    watch = FirstExit(tmp_path, 2)
    procs = _ranks_connected(tmp_path, {0: 0, 1: 0}, then="s.ended()")
    _first_of(watch, procs)
    _assert_done_with_nothing(watch)
    watch.stop()


def test_a_sentinel_watcher_gives_up(tmp_path):
    """With give_up_s (the sentinel's): no rank ever connects, or every connection closed cleanly
    and no other rank came: the watching ends, so hydra never waits on the sentinel."""
    watch = FirstExit(tmp_path, 4, give_up_s=0.3)
    _assert_done_with_nothing(watch)
    watch.stop()
    (tmp_path / EXITS).unlink()
    watch = FirstExit(tmp_path, 4, give_up_s=60)  # ranks 2 and 3 never connect
    procs = _ranks_connected(tmp_path, {0: 0, 1: 0}, then="s.ended()")
    _first_of(watch, procs)
    _assert_done_with_nothing(watch)
    watch.stop()


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
    assert stopped_text(tmp_path, 0, 3).startswith(f"; not responding: rank 2 (pid {gone.pid} on ")
    assert ", gone; at step 4, in all_reduce of [2, 16] with ranks 0-3" in stopped_text(tmp_path, 0, 3)
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
    assert text.startswith(f"; not responding: rank 1 (pid {gone[0].pid} on ") and "rank 2" not in text, text
