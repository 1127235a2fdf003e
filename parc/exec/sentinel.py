"""The sentinel: failure attribution under the user's own `mpiexec` or `srun`.

Without `parc run`'s launcher above the ranks nobody watches them from outside, and MPICH's
hydra kills every rank with SIGKILL the moment one dies, so no rank can say anything. The lowest
rank of each host therefore starts this small process in a session of its own (hydra's cleanup
does not reach it, and hydra forwards its stderr and waits for it), handing it a listening
socket that every rank of the host connects to (`RankState`). It runs a `FirstExit` over those
connections: when a rank's connection closes without the rank having said it ended cleanly, and
the rank did not report an error itself, the sentinel prints the line `parc run`'s launcher
would print, and exits. It exits silently when every rank of its host has ended cleanly.

    python -m parc.exec.sentinel FD JOBDIR RANKS SIZE    (RANKS: this host's ranks, 0,1,2)

Ranks on other hosts are not visible to it: with ranks on several hosts it names the first of
its own host's ranks to end, and says a rank elsewhere may have ended before.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from parc.exec.watch import FirstExit, how, read_state, where

START_S = 120.0  # a sentinel whose ranks never all connect gives up after this long without any


def main(argv: list[str]) -> int:
    fd, jobdir, ranks, size = int(argv[0]), argv[1], [int(r) for r in argv[2].split(",")], int(argv[3])
    listener = socket.socket(fileno=fd)
    path = Path(listener.getsockname())
    try:
        return _watch(FirstExit(jobdir, ranks, listener=listener), jobdir, ranks, size)
    finally:
        path.unlink(missing_ok=True)


def _watch(watch: FirstExit, jobdir: str, ranks: list[int], size: int) -> int:
    start = time.monotonic()
    while watch.first is None:
        time.sleep(0.02)
        if not watch.alive() and watch.first is None:
            return 0  # the watcher failed: nothing to say, and hydra must not wait on this process
        if watch.clean >= set(ranks):
            return 0  # every rank of this host ended cleanly
        if watch.linked_ever and not watch.open_links and watch.first is None:
            time.sleep(0.5)  # the watcher may still be reading the last close
            if watch.first is None and not watch.open_links:
                return 0
        if not watch.linked_ever and time.monotonic() - start > START_S:
            return 0
    watch.stop()  # joins the watcher: the first rank's wait status is read
    rank, pid, status = watch.first
    state = read_state(jobdir, rank)
    if state and state.get("error_at") and state["error_at"] <= watch.when:
        return 0  # it said what went wrong itself
    others = [read_state(jobdir, r) for r in range(size) if r != rank]  # other hosts' too, when shared
    if any(s and s.get("error_at") and s["error_at"] <= watch.when for s in others):
        return 0  # another rank of this host reported an error first: its line explains the end
    host = f" on {state['host']}" if state and state.get("host") else ""
    tail = ("the other ranks were stopped because of it" if len(ranks) == size else
            f"it was the first of this host's ranks ({', '.join(map(str, ranks))}) to end; a rank on another "
            "host may have ended before it")
    sys.stderr.write(f"parc: error: rank {rank} (pid {pid}{host}) {how(status)} {where(state)}; {tail}\n")
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
