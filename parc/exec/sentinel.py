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

from parc.exec.watch import FirstExit, blame, read_state

START_S = 120.0  # a sentinel none of whose ranks connects gives up after this long


def main(argv: list[str]) -> int:
    fd, jobdir, ranks, size = int(argv[0]), argv[1], [int(r) for r in argv[2].split(",")], int(argv[3])
    listener = socket.socket(fileno=fd)
    path = Path(listener.getsockname())
    try:
        watch = FirstExit(jobdir, ranks, listener=listener, give_up_s=START_S)
        while not watch.done():
            time.sleep(0.02)
        watch.stop()
        if watch.first is None:
            return 0  # every rank of this host ended cleanly (or none came)
        states = {r: read_state(jobdir, r) for r in range(size)}  # other hosts' too, when the directory is shared
        tail = ("the other ranks were stopped because of it" if len(ranks) == size else
                f"it was the first of this host's ranks ({', '.join(map(str, ranks))}) to end; a rank on another "
                "host may have ended before it")
        line = blame(states, watch.first, watch.when, tail)
        if line:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        return 0
    finally:
        path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
