"""What each rank is doing, and which rank failed first: failure attribution for `parc run`.

Each rank keeps a small state file in its job's directory (`parc run`'s temporary one,
`PARC_RANK_PIDS`, or one the ranks agree on under the user's own launcher): its pid, host, step
and the task it is in (kind, id, microbatch, stage, peers), rewritten in place (a memory-mapped
page) when a task starts and, while the rank waits on its peers, about every `comm.HEARTBEAT_S`,
so a rank that is killed leaves behind what it was doing and one that stops shows no more life.

Each rank also holds a connection to a `FirstExit` (the launcher's, or a per-host sentinel's),
which the kernel closes the moment the rank's process ends: the watcher knows which rank ended
first even when the process manager then kills the others. A rank whose collective or transfer
times out, or that its launcher stops with SIGTERM, reads the others' state files to name those
that show no life.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import select
import socket
import threading
import time
from pathlib import Path

PAGE = 1024  # bytes of a state file


def state_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.state"


class RankState:
    """This rank's state file, rewritten in place (one mmap'd page), and its connection to the
    watcher's socket at `link`, if any. The runner calls `set` for every task, so each task's
    JSON is made once and kept (tasks are the runner's own dicts)."""

    def __init__(self, directory: str | Path, rank: int, link: str | Path | None = None) -> None:
        self.path = state_path(directory, rank)
        with open(self.path, "wb") as f:
            f.write(b" " * PAGE)
        self._fd = os.open(self.path, os.O_RDWR)
        self._map = mmap.mmap(self._fd, PAGE)
        self._head = json.dumps({"rank": rank, "pid": os.getpid(), "host": socket.gethostname()},
                                separators=(",", ":")).encode()[:-1]
        self._link = _connect(link, rank) if link else None  # closed by the kernel when this process ends
        self._encoded: dict[int, tuple[dict, bytes]] = {}  # id(task) -> (task, its JSON)
        self.step: int | None = None
        self.task: dict | None = None
        self._error_at = b""
        self.set(None)

    def set(self, task: dict | None, step: int | None = None) -> None:
        """Record the task being run (None between tasks) and, when given, the step."""
        if step is not None:
            self.step = step
        self.task = task
        self.since = time.time()
        self._write(self.since)

    def reported(self, line: str = "") -> None:
        """Record that this rank is about to print its error `line` and end the job: the line
        in `rank_<r>.error` (the process manager may kill the job before it forwards what the
        rank printed; the launcher then prints it from there), then `error_at` in the state, so
        the launcher leaves the explaining to that line."""
        if line:
            with contextlib.suppress(OSError):  # the directory may be gone: the line still goes to stderr
                tmp = self.path.with_suffix(".error.tmp")
                tmp.write_text(line)
                os.replace(tmp, self.path.with_suffix(".error"))
        self._error_at = b',"error_at":%.6f' % time.time()
        self._write(time.time())

    def stopped(self) -> None:
        """Record that the launcher stopped this rank (SIGTERM): it did not end first."""
        self._error_at += b',"stopped_at":%.6f' % time.time()
        self._write(time.time())

    def beat(self) -> None:
        """Show that this rank is alive (it waits on its peers): called while it waits."""
        self._write(time.time())

    def _task_json(self) -> bytes:
        task = self.task
        if task is None:
            return b"null"
        kept = self._encoded.get(id(task))
        if kept is None or kept[0] is not task:
            record = dict(task)
            if "group" in record:  # as text, so that a group of thousands of ranks fits the page
                record["group"] = _ranks(list(record["group"]))[:200]
            if len(self._encoded) > 100_000:
                self._encoded.clear()
            kept = self._encoded[id(task)] = (task, json.dumps(record, separators=(",", ":")).encode())
        return kept[1]

    def _write(self, beat: float) -> None:
        step = b"null" if self.step is None else b"%d" % self.step
        data = b'%s%s,"step":%s,"since":%.6f,"beat":%.6f,"task":%s}' % (self._head, self._error_at, step,
                                                                         self.since, beat, self._task_json())
        if len(data) >= PAGE:  # a task too long to describe: its kind and id
            short = json.dumps({k: self.task[k] for k in ("kind", "id") if k in self.task}).encode()  # type: ignore[index]
            data = b'%s%s,"step":%s,"since":%.6f,"beat":%.6f,"task":%s}' % (self._head, self._error_at, step,
                                                                             self.since, beat, short)
        self._map[:] = data + b" " * (PAGE - len(data))

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
        if self._link is not None:
            self._link.close()

    def ended(self) -> None:
        """Tell the watcher this rank ends cleanly (its connection's close is not a failure)."""
        if self._link is not None:
            with contextlib.suppress(OSError):
                self._link.sendall(b"end\n")

    def remove(self) -> None:
        """Close and delete the state file (a rank that ended cleanly)."""
        self.close()
        self.path.unlink(missing_ok=True)
        self.path.with_suffix(".error").unlink(missing_ok=True)


EXITS = "exits.sock"  # the launcher's socket in the job directory: each rank holds a connection


def _connect(path: str | Path, rank: int) -> socket.socket | None:
    """A connection to a `FirstExit` (the launcher's, or the sentinel's under the user's own
    launcher), which sees it close the moment this process ends (the kernel closes a dying
    process's files before anything else can react to its death); None without one."""
    path = Path(path)
    if not path.exists():
        return None
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        link.connect(str(path))
        link.sendall(b"%d %d\n" % (rank, os.getpid()))
    except OSError:
        link.close()
        return None
    return link


def read_error(directory: str | Path, rank: int) -> str | None:
    """The error line rank `rank` reported (`RankState.reported`), or None."""
    try:
        return state_path(directory, rank).with_suffix(".error").read_text()
    except OSError:
        return None


def read_state(directory: str | Path, rank: int) -> dict | None:
    try:
        text = state_path(directory, rank).read_text().strip()
        return json.loads(text) if text else None
    except (OSError, ValueError):
        return None


def describe_task(task: dict | None) -> str:
    """'the all_reduce of (2, 16, 64) with ranks 0-3' or 'compute of module stage0.onnx'."""
    if not task:
        return "between tasks"
    kind = task.get("kind")
    if kind == "collective":
        text = f"{task.get('op', 'collective')} of {task.get('shape')} with ranks {_ranks(task.get('group', []))}"
    elif kind in ("send", "recv"):
        text = f"{kind} of {task.get('tensor') or 'a value'} {'to' if kind == 'send' else 'from'} rank {task.get('peer')}"
    elif kind in CHECKPOINT_TASKS:
        text = f"{CHECKPOINT_TASKS[kind]} {task.get('id', '')}"
    else:
        text = f"{kind} {task.get('id', '')}".strip()
    if task.get("micro_batch") is not None:
        text += f", microbatch {task['micro_batch']}"
    if task.get("stage") is not None:
        text += f", stage {task['stage']}" + (f" ({PASSES[task['pass']]})" if task.get("pass") in PASSES else "")
    return text


PASSES = {"F": "forward", "B": "backward", "A": "after the microbatches"}


CHECKPOINT_TASKS = {"checkpoint_write": "the checkpoint's write of",
                    "checkpoint_rename": "the checkpoint's rename of",
                    "checkpoint_commit": "the checkpoint's commit (rename) of"}


def _ranks(group: list[int] | str) -> str:
    if isinstance(group, str):  # as a state file keeps it
        return group
    group = sorted(group)
    if group and group == list(range(group[0], group[-1] + 1)) and len(group) > 2:
        return f"{group[0]}-{group[-1]}"
    return ", ".join(map(str, group))


def where(state: dict | None) -> str:
    """'at step 37 in the all_reduce of ...' for a state record."""
    if not state:
        return "before its first step"
    step = state.get("step")
    at = f"at step {step + 1}" if step is not None else "before its first step"
    return f"{at}, in {describe_task(state.get('task'))}" if state.get("task") else f"{at}, between tasks"


STALE_S = 1.0  # a rank whose state has not moved for this long while others wait is not responding


def _quiet_for(now: float, s: dict) -> float:
    """Seconds since a rank's state last moved."""
    return now - max(s.get("beat") or 0, s.get("since") or 0)


def _unresponsive(states: dict[int, dict], now: float) -> list[str]:
    """The ranks among `states` that are gone (their process, when on this host) or show no life
    for STALE_S: 'rank 1 (pid 4711 on node3, gone; at step 3, in ..., no sign of life for 2.0 s)'."""
    host, out = socket.gethostname(), []
    for r, s in sorted(states.items()):
        gone = s.get("host") == host and s.get("pid") is not None and not _alive(int(s["pid"]))
        if gone or _quiet_for(now, s) > STALE_S:
            out.append(f"rank {r} (pid {s.get('pid')} on {s.get('host')}{', gone' if gone else ''}; {where(s)}, "
                       f"no sign of life for {_quiet_for(now, s):.1f} s)")
    return out


def _states(directory: str | Path, ranks: int, me: int) -> dict[int, dict]:
    return {r: s for r in range(ranks) if r != me and (s := read_state(directory, r))}


def absent_text(directory: str | Path, me: int, task: dict | None, ranks: int) -> str:
    """For a collective or transfer of `task` that timed out on rank `me`: which ranks are not
    responding (gone, stopped or hung), else where the members that are not in the task are,
    from the ranks' state files ('' when nothing can be said)."""
    now = time.time()
    silent = _unresponsive(_states(directory, ranks, me), now)
    if silent:
        return "; not responding: " + "; ".join(silent)
    if not task or task.get("kind") not in ("collective", "send", "recv"):
        return ""
    if task["kind"] == "collective":
        missing = absent_members(directory, list(task.get("group", [])), task["id"], me)
        if not missing:
            return ""
        return "; never reached it: " + "; ".join(
            f"rank {r} ({where(s)}{_for(now, s)})" for r, s in missing)
    peer = task.get("peer")
    s = read_state(directory, peer)
    return f"; rank {peer} is {where(s)}{_for(now, s)}"


def stopped_text(directory: str | Path, me: int, ranks: int) -> str:
    """For a rank the launcher stops (SIGTERM) because another failed: the rank that reported an
    error first, else the ranks gone or not responding, from the state files this rank can see.
    Ranks the launcher stopped too (`stopped_at`) are not counted."""
    states = _states(directory, ranks, me)
    said = sorted((s["error_at"], r) for r, s in states.items() if "error_at" in s)
    if said:
        return f"; because rank {said[0][1]} failed first ({where(states[said[0][1]])}; see its line)"
    silent = _unresponsive({r: s for r, s in states.items() if "stopped_at" not in s}, time.time())
    if silent:
        return "; not responding: " + "; ".join(silent)
    return (f"; no rank's state seen from here shows why (on {len(states) + 1} of {ranks} ranks; "
            "set PARC_STATE_DIR to a directory every node sees to see all)")


def _for(now: float, s: dict | None) -> str:
    return f", for {now - s['since']:.1f} s" if s and s.get("since") else ""


def absent_members(directory: str | Path, group: list[int], task_id: str, me: int) -> list[tuple[int, dict | None]]:
    """The members of a collective (or the peer of a transfer) whose state shows they are not in
    task `task_id`: (rank, their state)."""
    out = []
    for r in group:
        if r == me:
            continue
        s = read_state(directory, r)
        if not s or not s.get("task") or s["task"].get("id") != task_id:
            out.append((r, s))
    return out


class FirstExit:
    """Watches the ranks' connections to the socket `listener` (by default bound at
    DIRECTORY/EXITS) and keeps the first rank to end without saying it ended cleanly: (rank, pid,
    wait status or None) in `first`, `when` it was seen.

    The process manager kills the other ranks within milliseconds of the first death, so the
    order cannot come from when this process gets to look, nor from when each process ends:
    MPICH's hydra sees the first rank's pipes close and kills the others while that rank is still
    being torn down, and a smaller process may finish dying first. A rank's connection closes at
    the same point as its pipes, and the connections sit in one selector (epoll on Linux), whose
    ready list keeps events in the order they fired. A rank that ends before it connects is not
    seen (the launcher then reads the process manager's banner). Watching ends when the first is
    found, when every rank has ended cleanly, or as `give_up_s` says."""

    def __init__(self, directory: str | Path, ranks: int | list[int], listener: socket.socket | None = None,
                 give_up_s: float | None = None) -> None:
        self.watched = set(range(ranks) if isinstance(ranks, int) else ranks)
        # with give_up_s: stop watching when no rank connects in that time, or when every
        # connection has closed cleanly (the ranks that never connected are not waited for)
        self.give_up_s = give_up_s
        self.first: tuple[int, int, int | None] | None = None
        self.when = float("inf")  # time.time() when the first rank's end was seen (the ranks' clock)
        self.clean: set[int] = set()  # ranks that said they ended cleanly (`RankState.ended`)
        if listener is None:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(Path(directory) / EXITS))
            listener.listen(max(len(self.watched), 8))
        self._listener = listener
        self._listener.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
        self._listener.close()

    def done(self) -> bool:
        """Whether the watching is over: the first found, every rank ended cleanly, or the
        watcher failed."""
        return not self._thread.is_alive()

    def _run(self) -> None:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        start, accepted, quiet_since = time.monotonic(), 0, None
        try:
            while not self._stop.is_set() and not self.watched <= self.clean:
                for key, _ in sel.select(0.1 if self.give_up_s else 0.5):  # in firing order
                    if key.fileobj is self._listener:
                        accepted += self._accept(sel)
                        continue
                    conn, seen = key.fileobj, key.data  # seen: [rank or None, bytes, pid, clean]
                    if not self._read(conn, seen):
                        continue
                    sel.unregister(conn)
                    conn.close()
                    if seen[3]:
                        self.clean.add(seen[0])
                    elif seen[0] is not None:
                        return self._found(seen[0], seen[2])
                if self.give_up_s:
                    now = time.monotonic()
                    if not accepted and now - start > self.give_up_s:
                        return
                    open_links = len(sel.get_map()) - 1
                    quiet_since = None if open_links or not accepted else quiet_since or now
                    if quiet_since is not None and now - quiet_since > 0.5:
                        return
        finally:
            for key in list(sel.get_map().values()):
                if key.fileobj is not self._listener:
                    key.fileobj.close()
            sel.close()

    def _accept(self, sel) -> int:
        """Accept the waiting connections; how many."""
        import selectors

        count = 0
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return count
            conn.setblocking(False)
            sel.register(conn, selectors.EVENT_READ, [None, b"", -1, False])
            count += 1

    @staticmethod
    def _read(conn: socket.socket, seen: list) -> bool:
        """Read what a rank sent (its number and pid, then `end` at a clean end); True when its
        connection has closed."""
        while True:
            try:
                data = conn.recv(64)
            except BlockingIOError:
                return False
            except OSError:
                return True
            if not data:
                return True
            seen[1] += data
            lines = seen[1].split(b"\n")
            if seen[0] is None and len(lines) > 1:
                try:
                    seen[0], seen[2] = map(int, lines[0].split())
                except ValueError:  # not a rank's greeting: ignore the connection
                    return True
            seen[3] = b"end" in lines[1:]

    def _found(self, rank: int, pid: int) -> None:
        self.when = time.time()
        self.first = (rank, pid, None)  # its wait status follows, once it is a zombie
        status = None
        if hasattr(os, "pidfd_open") and pid > 0:  # its files are closed; wait for it to be a zombie
            try:
                fd = os.pidfd_open(pid)
                select.select([fd], [], [], 0.5)
                os.close(fd)
            except OSError:
                pass
            status = _zombie_status(pid)
        self.first = (rank, pid, status)


def blame(states: dict[int, dict | None], first: tuple[int, int, int | None], when: float, tail: str) -> str | None:
    """The line naming the rank that ended first (`FirstExit.first`), how and where, from the
    ranks' `states`; None when a rank reported its error (`error_at`) before that end: its own
    line explains the job's end (a killed rank says nothing)."""
    if any(s and s.get("error_at", float("inf")) <= when for s in states.values()):
        return None
    rank, pid, status = first
    state = states.get(rank)
    host = f" on {state['host']}" if state and state.get("host") else ""
    return f"parc: error: rank {rank} (pid {pid}{host}) {how(status)} {where(state)}; {tail}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _zombie_status(pid) is None


def _zombie_status(pid: int) -> int | None:
    """The wait status of a process that has ended but is not yet reaped (Linux's
    /proc/PID/stat field 52), else None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return int(fields[49])


def how(status: int | None) -> str:
    """'killed by signal 9 (SIGKILL)', 'exit code 3' or 'ended' from a wait status."""
    if status is None:
        return ("ended without a word (a signal, most likely: a rank that raises says so first; its exit "
                "status was reaped before parc could read it)")
    import signal

    if status & 0x7F:
        sig = status & 0x7F
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return f"was killed by signal {sig} ({name})"
    return f"exited with code {status >> 8}"


FAULT_ENV = "PARC_FAULT"
FAULT_ACTIONS = ("die", "hang", "raise")
FAULT_KINDS = ("any", "compute", "collective", "send", "recv", "checkpoint_write", "checkpoint_rename",
               "checkpoint_commit")


class InjectedFault(RuntimeError):
    """The error a `PARC_FAULT=...:raise` rank raises."""


def parse_fault(spec: str) -> tuple[int, int, str, str]:
    """`RANK:STEP:ACTION[:KIND]` -> (rank, step, action, kind): the fault-injection switch of the
    failure tests (never set it otherwise). At step STEP (1-based), rank RANK dies (SIGKILL to
    itself), hangs (stops, as SIGSTOP would) or raises, at its first task of KIND (default any;
    the checkpoint kinds strike in a save at the end of step STEP: a shard's write or rename, or
    rank 0's commit of the manifest)."""
    from parc.errors import UsageError

    parts = spec.split(":")
    try:
        rank, step = int(parts[0]), int(parts[1])
        action, kind = parts[2], parts[3] if len(parts) > 3 else "any"
    except (IndexError, ValueError):
        raise UsageError(f"{FAULT_ENV}={spec}: expected RANK:STEP:ACTION[:KIND]") from None
    if action not in FAULT_ACTIONS or kind not in FAULT_KINDS or len(parts) > 4 or step < 1:
        raise UsageError(f"{FAULT_ENV}={spec}: ACTION is one of {', '.join(FAULT_ACTIONS)}, KIND one of "
                         f"{', '.join(FAULT_KINDS)}, STEP >= 1")
    return rank, step, action, kind


def with_fault(on_task, rank: int, state_step, spec: str | None):
    """`on_task` (may be None) wrapped so that the fault `spec` names strikes this rank."""
    if not spec:
        return on_task
    target, step, action, kind = parse_fault(spec)
    if target != rank:
        return on_task

    def hook(task: dict | None) -> None:
        if on_task is not None:
            on_task(task)
        if task is None or state_step() != step - 1 or (kind != "any" and task.get("kind") != kind):
            return
        if action == "die":
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "hang":
            import signal

            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise InjectedFault(f"injected fault ({FAULT_ENV}={spec}) in {describe_task(task)}")
    return hook
