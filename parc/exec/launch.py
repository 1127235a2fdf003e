"""Starting a plan's ranks, and the training loop each rank runs.

`parc run` started by a person (no MPI environment) checks the plan directory, then starts the
plan's ranks itself through `mpiexec` (the mpich wheel's next to this Python, else one on PATH),
each running `parc run` again. Under `mpiexec` or `srun` a process reads its rank from the
environment (`rank_from_env`) and runs `train`. On a cluster, start the ranks yourself:

    mpiexec -hosts node1,node2 -n 16 parc run plan/       # MPICH / hydra
    srun -N 2 --ntasks-per-node 8 parc run plan/          # Slurm (PMI)

A rank that fails prints one line naming itself and aborts the job (MPI_Abort), so no rank is
left waiting; collectives also time out (`--timeout`) when a peer dies without a word. Who failed
first is known from the ranks' state files and connections (`parc.exec.watch`): `launch`
watches them under `parc run`, a sentinel per host (`parc.exec.sentinel`) under the user's own
launcher.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from parc.errors import ParcError, UsageError, first_line
from parc.exec.data import NpzData, step_inputs, synthetic

CHILD = "PARC_RANK_CHILD"  # set by the launcher: this process is one rank
PIDS = "PARC_RANK_PIDS"  # set by the launcher: where each rank records its pid
ABORT_GRACE_S = 0.2  # between a rank's error line and its MPI_Abort
STATE_DIR = "PARC_STATE_DIR"  # under the user's own launcher: where the ranks' state directories go


def rank_from_env() -> tuple[int, int] | None:
    """(rank, size) when started by mpiexec (MPICH, Open MPI) or srun, else None."""
    for r, s in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                 ("PMIX_RANK", "PMIX_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ and s in os.environ and (r != "SLURM_PROCID" or "SLURM_STEP_ID" in os.environ):
            return int(os.environ[r]), int(os.environ[s])
    return None


def find_mpiexec() -> str:
    found = (shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
             or shutil.which("mpirun"))
    if found is None:
        raise UsageError("no mpiexec found: install the mpich wheel (pip install mpich) or put an MPI's "
                         "mpiexec on PATH")
    return found


def launch(ranks: int, argv: list[str], timeout: float | None = None) -> int:
    """Run `parc ARGV` as `ranks` MPI ranks; the job's exit code.

    The ranks' stdout passes through. Their stderr passes through too, less the process
    manager's own lines (hydra's banner, MPICH's `Abort(...)` echo) and all but the first
    timeout report. Each rank keeps a state file in a temporary job directory
    (`parc.exec.watch`); the launcher watches the ranks' processes, so when the job fails it
    names the rank that ended first, how and in which task, whatever the process manager then
    did to the others."""
    import tempfile
    import threading

    from parc.exec.watch import FirstExit

    with tempfile.TemporaryDirectory(prefix="parc-run-") as job:
        env = dict(os.environ, **{CHILD: "1", PIDS: job})
        cmd = [find_mpiexec(), "-n", str(ranks), sys.executable, "-m", "parc.cli.main", *argv]
        watch = FirstExit(job, ranks)  # its socket exists before any rank looks for it
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                bufsize=1)
        banner: list[tuple[int, int | None]] = []  # hydra's (pid, exit code): not always the first to die
        said: list[str] = []  # the ranks' error lines forwarded
        errors = threading.Thread(target=_forward_errors, args=(proc.stderr, said), daemon=True)
        errors.start()
        deadline = time.monotonic() + timeout if timeout else None
        assert proc.stdout is not None
        bar = _Bar() if sys.stdout.isatty() else None
        for line in proc.stdout:
            if bar is not None:
                bar.update(line)
            m = re.search(r"PID (\d+) RUNNING AT", line)
            if m:
                banner.append((int(m.group(1)), None))
            m = re.search(r"EXIT CODE: (\d+)", line)
            if m and banner and banner[-1][1] is None:
                banner[-1] = (banner[-1][0], int(m.group(1)))
            if not _mpiexec_banner(line):
                if bar is not None:
                    bar.print(line.rstrip("\n"))
                else:
                    sys.stdout.write(line)
                    sys.stdout.flush()
            if deadline and time.monotonic() > deadline:
                proc.kill()
                print(f"parc: error: the ranks did not finish within {timeout:g} s; stopped", file=sys.stderr)
                return 1
        rc = proc.wait()
        errors.join(timeout=5)
        watch.stop()
        if bar is not None:
            bar.close()
        if rc:
            _explain_end(job, ranks, watch, banner, said)
        return rc


def _explain_end(job: str, ranks: int, watch, banner: list[tuple[int, int | None]], said: list[str]) -> None:
    """After a failed job: the line naming the rank that ended first (unless a rank's own error
    line explains the end), the earliest rank's error line if the process manager did not pass
    it on, or hydra's banner when no rank was seen to end."""
    from parc.exec.watch import blame, read_error, read_state

    states = {r: read_state(job, r) for r in range(ranks)}
    if watch.first is not None:
        rank, pid, status = watch.first
        if status is None:  # reaped before the watcher read it: hydra's banner, when it names this pid
            code = next((c for p, c in banner if p == pid and c is not None), None)
            status = None if code is None else code if code in (6, 9, 11, 15) else code << 8
        line = blame(states, (rank, pid, status), watch.when, "the other ranks were stopped because of it")
        if line:
            print(line, file=sys.stderr)
    elif banner:  # no rank was seen to end (one that died before it connected)
        pid, code = banner[0]
        print(f"parc: error: a rank (pid {pid}) died (exit code {code}); the other ranks were stopped", file=sys.stderr)
    if not said:  # the process manager ended the job before it passed the ranks' lines on
        reported = sorted((s["error_at"], r) for r, s in states.items() if s and "error_at" in s)
        if reported and (line := read_error(job, reported[0][1])):
            print(line, file=sys.stderr)


def _forward_errors(stream, said: list[str]) -> None:
    """The ranks' stderr to ours, less the process manager's noise and repeated timeouts; the
    ranks' error lines go into `said` too."""
    timeouts = 0
    for line in stream:
        text = line.strip()
        if not text or text.startswith(("Abort(", "[proxy:", "[mpiexec@")) or _mpiexec_banner(line):
            continue
        if text.startswith("parc: rank "):
            said.append(text)
            if "did not complete within" in text:
                timeouts += 1
                if timeouts > 1:  # the first says who never came; the others wait on the same ones
                    continue
        sys.stderr.write(line)
        sys.stderr.flush()


class _Bar:
    """A progress bar under the ranks' step lines, on a terminal."""

    def __init__(self) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                                 TimeElapsedColumn(), transient=True)
        self.task = self.progress.add_task("", total=None)
        self.progress.start()

    def update(self, line: str) -> None:
        m = re.match(r"step +(\d+)/(\d+) +loss (\S+)", line)
        if m:
            self.progress.update(self.task, completed=int(m.group(1)), total=int(m.group(2)),
                                 description=f"loss {m.group(3)}")

    def print(self, text: str) -> None:
        self.progress.console.print(text, highlight=False, markup=False)

    def close(self) -> None:
        self.progress.stop()


def _mpiexec_banner(line: str) -> bool:
    text = line.strip()
    return text.startswith("=") or text.startswith(("YOUR APPLICATION TERMINATED", "This typically refers",
                                                    "Please see the FAQ page"))


def _shared_state_dir(mpi) -> str:
    """Under the user's own mpiexec or srun: the directory of the ranks' state files, named by
    rank 0 and made on every host, under $PARC_STATE_DIR (a directory every node sees makes every
    rank's state visible to every other) or the temporary directory (the ranks of one host)."""
    import tempfile

    name = mpi.comm.bcast(f"parc-run-{os.getpid()}-{time.time_ns()}" if mpi.rank == 0 else None, root=0)
    for base in (os.environ.get(STATE_DIR), tempfile.gettempdir()):
        if base:
            try:
                (Path(base) / name).mkdir(parents=True, exist_ok=True)
                return str(Path(base) / name)
            except OSError:  # PARC_STATE_DIR not writable here: the temporary directory
                continue
    return tempfile.mkdtemp(prefix="parc-run-")


def _start_sentinel(mpi, jobdir: str) -> str:
    """Under the user's own launcher, the lowest rank of each host starts the sentinel
    (`parc.exec.sentinel`), handing it a listening socket; the socket's path, which every rank
    of the host connects to."""
    import hashlib
    import socket
    import tempfile

    from mpi4py import MPI

    local = mpi.comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = local.allgather(mpi.rank)
    key = hashlib.sha256(f"{Path(jobdir).name}.{socket.gethostname()}".encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"parc-{key}.sock"  # short: a socket's path has 107 bytes at most
    if local.Get_rank() == 0:
        try:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                listener.bind(str(path))
                listener.listen(len(ranks) + 8)
                subprocess.Popen([sys.executable, "-m", "parc.exec.sentinel", str(listener.fileno()), jobdir,
                                  ",".join(map(str, ranks)), str(mpi.size)],
                                 pass_fds=(listener.fileno(),), start_new_session=True,  # hydra's cleanup passes it by
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            finally:
                listener.close()
        except OSError:  # no sentinel: the ranks run on, only without it
            path.unlink(missing_ok=True)
    local.Barrier()  # every rank of the host reaches it, sentinel or not
    local.Free()
    return str(path)


def _explain_when_stopped(jobdir: str, rank: int, ranks: int, state) -> None:
    """Under the user's launcher, which stops the other ranks with SIGTERM when one fails
    (Slurm's srun, Open MPI's mpirun; MPICH's hydra uses SIGKILL, which nothing can catch): the
    rank says it was stopped, and because of which rank, from the state files it can see."""
    import signal

    from parc.exec.watch import stopped_text

    def stopped(signum, _frame) -> None:
        state.stopped()  # the others' handlers do not count this rank among those that ended first
        sys.stderr.write(f"parc: rank {rank}: stopped by the launcher ({signal.Signals(signum).name})"
                         f"{stopped_text(jobdir, rank, ranks)}\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)


def _write_trace(path: str, runner, mpi, reporter: int, step: int) -> None:
    """Every rank's tasks of the last step (`runner.spans`) gathered to the reporter, which
    writes them to `path` (`parc.exec.trace`)."""
    from parc.exec import trace
    from parc.exec.stepsim import shared_times

    simulated = shared_times(runner.graph) if runner.graph.hosts else {}  # the simulation's on a shared host
    mine = (runner.span_start, trace.rank_events(runner.rank, runner.stage, runner.order, runner.spans or [],
                                                 runner.graph.folds.get(runner.rank, 0.0), simulated))
    every = mpi.comm.gather(mine, root=reporter) if mpi.size > 1 else [mine]
    if runner.rank == reporter:
        trace.write(path, every, step)


def train(plan_dir: Path, *, steps: int, seed: int, engine: str, data: str | None, as_json: bool,
          timeout: float, dump: str | None = None, checkpoint: str | None = None, resume: bool = False,
          checkpoint_every: int = 0, init: str = "source", tf32: bool = False, trace: str | None = None,
          echo: Callable[[str], None] = print) -> None:
    """One rank's training loop (see the module docstring). Rank 0 reports each step. `trace`: a
    file the reporting rank writes every rank's tasks of the last step to (`parc.exec.trace`)."""
    from parc.exec.comm import MpiComm
    from parc.exec.engine_choice import keep_freed_memory, pick_engine
    from parc.exec.engines.gpu import device_out_of_memory
    from parc.exec.runner import Rank, to_host

    keep_freed_memory()
    comm = mpi = MpiComm(timeout=timeout)
    rank = comm.rank
    gpu = pick_engine(engine)[1] == "gpu"
    if gpu:  # one GPU per rank on each node; NCCL between them
        if tf32:  # CuPy reads it at its first float32 matmul
            os.environ["CUPY_TF32"] = "1"
        import cupy

        from parc.exec.nccl import NcclComm

        local = int(next((os.environ[k] for k in ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
                          if k in os.environ), rank))
        cupy.cuda.Device(local % cupy.cuda.runtime.getDeviceCount()).use()
        comm = NcclComm(comm, timeout=timeout)
    current = -1  # the step being run (the fault switch reads it)
    import secrets

    run_id = mpi.comm.bcast(secrets.token_hex(4) if rank == 0 else None, root=0)  # names this run's checkpoints
    from parc.exec import comm as comm_module
    from parc.exec.watch import EXITS, RankState

    # a state file the other ranks (and parc's own launcher) read: in the launcher's job directory,
    # else (the user's mpiexec or srun) in one the ranks agree on
    jobdir = os.environ.get(PIDS) or _shared_state_dir(mpi)
    user_launcher = not os.environ.get(PIDS) and rank_from_env() is not None
    keep = bool(os.environ.get(PIDS)) or user_launcher  # after a failure: the launcher's, or for a look afterwards
    link = _start_sentinel(mpi, jobdir) if user_launcher else Path(jobdir) / EXITS if os.environ.get(PIDS) else None
    try:
        state = RankState(jobdir, rank, link=link)
    except OSError:  # a state directory this rank cannot write: one of its own (the others cannot see it)
        import tempfile

        jobdir = tempfile.mkdtemp(prefix="parc-run-")
        state = RankState(jobdir, rank, link=link)
    comm_module.heartbeat = state.beat
    if user_launcher:
        _explain_when_stopped(jobdir, rank, mpi.size, state)
    try:
        runner = Rank(plan_dir, rank, comm, engine, init=init, seed=seed)
        runner.on_task = state.set
        if os.environ.get("PARC_FAULT"):  # the failure tests' switch (parc.exec.watch.parse_fault)
            from parc.exec.watch import with_fault

            runner.on_task = with_fault(runner.on_task, rank, lambda: current, os.environ["PARC_FAULT"])
        if comm.size != runner.graph.ranks:
            raise UsageError(f"{plan_dir}: the plan has {runner.graph.ranks} ranks, this job {comm.size}")
        inputs = step_inputs(runner.program)
        reporter = runner.program.reporter or 0  # the rank holding the loss
        if trace:
            runner.spans = []
        source = NpzData(data, inputs) if data else None
        start = 0
        saved = None  # the step of the checkpoint in --checkpoint that holds this state
        if resume:
            from parc.exec.checkpoint import load_checkpoint

            start = saved = load_checkpoint(checkpoint, runner)  # type: ignore[arg-type]
        loss_name = runner.program.loss
        batch_size = inputs[0]["shape"][0] if inputs and inputs[0]["shape"] else 1
        dumped = []
        if start >= steps and rank == reporter:
            echo(f"parc: the checkpoint in {checkpoint} is at step {start}, already at --steps {steps} (the "
                 "total count of steps, not how many more): nothing to run; ask for more steps to go on")
        for step in range(start, steps):
            current = step
            state.set(None, step)
            batch = source.batch(step) if source is not None else synthetic(inputs, seed, step)
            t0 = time.perf_counter()
            outs = runner.step(batch)
            runner.synchronize()  # GPU work is asynchronous: the step ends when the device is done
            dt = time.perf_counter() - t0
            loss = float(to_host(outs[loss_name]).reshape(-1)[0]) if loss_name in outs else None
            last = step == steps - 1  # every rank's peak of tensors held, gathered after the last step
            if last and mpi.size > 1:
                mpi.barrier()  # with the timeout: the gather below has none
            peaks = (mpi.comm.gather(runner.peak_bytes, root=reporter) if mpi.size > 1 else [runner.peak_bytes]
                     ) if last else None
            if last and trace:
                _write_trace(trace, runner, mpi, reporter, step + 1)
            if rank == reporter and dump is None:
                record = {"step": step + 1, "loss": loss, "step_time_s": dt, "samples_per_s": batch_size / dt}
                if last:
                    record["peak_bytes_per_rank"] = peaks
                if gpu:
                    record["device_bytes"] = runner.device_bytes()
                if as_json:
                    echo(json.dumps(record))
                else:
                    shown = f"loss {loss:.6f}  " if loss is not None else ""  # forward-only plans have none
                    echo(f"step {step + 1:>4}/{steps}  {shown}{dt * 1e3:8.2f} ms  {batch_size / dt:9.1f} samples/s")
                    if last:
                        echo("tensors held at peak, per rank: " + ", ".join(f"{b / 2**20:.1f} MiB" for b in peaks))
            if dump is not None:
                dumped.append({k: to_host(v) for k, v in outs.items()
                               if k not in runner.program.bindings})
            if checkpoint and checkpoint_every and (step + 1) % checkpoint_every == 0:
                from parc.exec.checkpoint import save_checkpoint

                save_checkpoint(checkpoint, runner, step + 1, run_id)
                saved = step + 1
        if checkpoint and saved != max(steps, start):
            from parc.exec.checkpoint import save_checkpoint

            save_checkpoint(checkpoint, runner, max(steps, start), run_id)
        first = rank == (runner.program.stage_ranks or (0,))[0]
        if dump is not None and (rank == 0 or (first and dumped and dumped[0])):
            name = "outputs.npz" if rank == 0 else f"outputs.{rank}.npz"  # one per pipeline stage
            np.savez(Path(dump) / name, **{f"{k}@{i}": v for i, d in enumerate(dumped) for k, v in d.items()})
        comm.barrier()
        state.ended()
        if not os.environ.get(PIDS):  # a clean end leaves nothing behind
            state.remove()
            with contextlib.suppress(OSError):
                os.rmdir(jobdir)  # the last rank out on each host
    except ParcError as e:
        from parc.exec.comm import CommTimeout

        try:
            where = ""
            if isinstance(e, CommTimeout):  # who never came, from their state files
                from parc.exec.watch import absent_text

                where = absent_text(jobdir, rank, state.task, mpi.size)
            text = re.sub(r"^rank \d+: ", "", str(e))  # a sub-communicator's own numbering: this rank is `rank`
            _report(state, f"parc: rank {rank}: {text}{where}", jobdir, keep)
        finally:  # whatever happens while reporting, the job ends
            comm.abort(2 if isinstance(e, UsageError) else 1)
    except Exception as e:  # any other failure of one rank ends the job, naming the rank
        line = f"parc: rank {rank}: {first_line(e, typed=True)}"
        if device_out_of_memory(e):
            from parc.exec.watch import where

            line = (f"parc: rank {rank}: out of GPU memory "
                    f"{where({'step': current if current >= 0 else None, 'task': state.task})} "
                    f"({first_line(e)}); the plan needs a device with more memory, more devices or a smaller batch")
        try:
            _report(state, line, jobdir, keep)
        finally:
            comm.abort(1)


def _report(state, line: str, jobdir: str, keep: bool) -> None:
    """A rank's error: into its state (the launcher prints it if the line below is lost), then to
    stderr in one write (ranks' lines never interleave). A state directory of this process's
    own (one rank, no launcher) is removed: nobody reads it."""
    state.reported(line)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)  # hydra forwards the line before the abort tears the job down (3 in 100 were lost)
    if not keep:
        shutil.rmtree(jobdir, ignore_errors=True)
