"""The benchmarks each rank of a profiling job runs, all ranks at once: the launch floor and a
run's overhead, memory-bound ops, products and convolutions, reads after other traffic, and
collectives between the ranks (`measure_rank`); `worker` is one rank of such a job."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

import parc.calibrate.graphs as graphs
from parc.calibrate.cases import rank_cases, read_cases
from parc.calibrate.catalogue import (
    ALL_REDUCE_BYTES,
    ARRIVAL_STEP,
    ARRIVALS,
    BUDGET,
    BURST,
    CHAIN,
    COLD_REPEATS,
    COLD_ROWS,
    COLD_TOUCH,
    COPIES,
    MEMORY_OPS,
    PIECE_OPS,
    PIECE_ROWS,
    PRODUCTS,
    matmul_class,
    sizes_for,
)
from parc.calibrate.session import make_feeds, mean_seconds, open_session
from parc.exec.comm import MpiComm
from parc.exec.engine_choice import keep_freed_memory, pick_engine, rank_threads


def measure_rank(comm, threads: int, budget: float = BUDGET, engine: tuple[str, str] = ("ort", "cpu"),
                 cases: Mapping[str, list[tuple]] | None = None) -> dict:
    """This rank's figures (every rank of the job runs it at the same time), each benchmark run
    for about `budget` seconds on `engine` (`runner.pick_engine`'s (kind, device)). `cases`: a
    model's products and convolutions (`model_cases`), measured at this job's share of their batch
    instead of the built-in cases of the classes they have."""
    barrier = comm.barrier if comm.size > 1 else (lambda: None)
    sizes = sizes_for(engine)

    def timed(model, fuse: bool | None = None) -> float:
        s = open_session(model, threads, engine, fuse)
        feeds = make_feeds(s, sizes.pool_bytes)
        barrier()  # every rank measures at once
        t = mean_seconds(s, feeds, budget)
        del s, feeds  # a GPU's memory back to the pool before the next benchmark
        return t

    # the chain unfused: the floor is what each node's kernel costs (fusion is the engine's gain)
    one, many = timed(graphs.chain(1), fuse=False), timed(graphs.chain(CHAIN), fuse=False)
    floor = max((many - one) / (CHAIN - 1), 1e-9)
    overhead = max(one - floor, 0.0)

    def stream(op: str, r: int) -> dict:
        model, nbytes = graphs.memory_op(op, r)
        t = timed(model) - overhead
        return {"op": op, "bytes": nbytes, "s": t, "bytes_per_s": nbytes / max(t - floor, 1e-9), "pieces": graphs.pieces(model)}

    rows = {"launch_floor_s": floor, "task_overhead_s": overhead, "matmul": [],
            "memory": [stream(op, r) for op in MEMORY_OPS for r in sizes.memory_rows],
            "sweep": [stream("Add", r) for r in sizes.sweep_rows]}
    rows["pieces"] = []
    for op in PIECE_OPS if sizes.piece_cols else ():
        model, nbytes = graphs.memory_op(op, PIECE_ROWS, sizes.piece_cols)
        rows["pieces"].append({"op": op, "bytes": nbytes, "pieces": graphs.pieces(model), "s": timed(model) - overhead})
    # a small case runs COPIES times in one session, so that the run's overhead (as long as the
    # node itself) is a sixteenth of the figure's error, not all of it
    rows["small"] = []
    for op in MEMORY_OPS if sizes.small else ():
        model, nbytes = graphs.memory_op(op, *sizes.small)
        rows["small"].append({"op": op, "bytes": nbytes, "pieces": graphs.pieces(model),
                              "s": (timed(graphs.copies(model, COPIES)) - overhead) / COPIES})
    for batch, m, k, n in sizes.small_matmuls:
        flops = 2 * int(np.prod(batch, dtype=np.int64)) * m * k * n
        rows["small"].append({"shape": [*batch, m, k, n], "flops": flops,
                              "s": (timed(graphs.copies(graphs.matmul(batch, m, k, n), COPIES)) - overhead) / COPIES})
    own = rank_cases(cases or {}, comm.size)
    for batch, m, k, n in sizes.matmuls:
        if matmul_class([*batch, m, k, n]) in own:
            continue
        t = timed(graphs.matmul(batch, m, k, n)) - overhead
        flops = 2 * int(np.prod(batch, dtype=np.int64)) * m * k * n
        rows["matmul"].append({"shape": [*batch, m, k, n], "s": t, "flops_per_s": flops / max(t - floor, 1e-9)})
    rows["conv"] = []
    runs = [(cls, x, w, attrs, None) for cls, items in (*sizes.convs.items(), ("Gemm", sizes.gemms))
            if cls not in own for x, w, attrs in items]
    runs += [(cls, x, w, attrs, count) for cls, items in own.items() for x, w, attrs, count in items]
    for cls, x, w, attrs, count in runs:
        model, flops = graphs.case(cls, x, w, attrs)
        t = timed(model) - overhead
        row = {"class": cls, "input": list(x), "weight": list(w), "s": t, "flops": flops,
               "flops_per_s": flops / max(t - floor, 1e-9)}
        if count is not None:  # a model's own: its nodes of this shape
            row["count"] = count
        elif sizes.conv_pieces and cls not in PRODUCTS:
            row["pieces"] = graphs.pieces(model)
        rows["matmul" if cls in PRODUCTS else "conv"].append(row)
    if engine[1] == "cpu":
        rows["cold"] = _cold_reads(threads, engine, barrier)
    if comm.size > 1:
        rows["all_reduce"] = _all_reduces(comm, threads, engine)
        rows["collectives"] = _other_collectives(comm)
    return rows


def _other_collectives(comm) -> list[dict]:
    """Seconds of a reduce-scatter, an all-gather and an all-to-all over the whole job, of tensors
    of ALL_REDUCE_BYTES (the reduce-scatter's input, the all-gather's output, the all-to-all's
    whole tensor: each rank holds its share), in bursts as the all-reduces' (the mean over the
    calls after each burst's first), through the calls the executor makes (`parc.exec.comm`: its
    copies included; an all-to-all split along one dim and concatenated along another, as a
    resharding S(i) -> S(j) runs it). Every rank gets the rows."""
    k = comm.size
    rows = []
    for kind in ("reduce_scatter", "all_gather", "all_to_all"):
        for nbytes in ALL_REDUCE_BYTES:
            x = np.ones(max(nbytes // 4 // k, 1) * k, np.float32)
            piece = x[: x.size // k]
            mine = np.ones((k, max(nbytes // 4 // k // k, 1)), np.float32)  # this rank's share, k pieces
            times = []
            for _ in range(ARRIVALS // 3):
                comm.barrier()
                for i in range(BURST):
                    t0 = time.perf_counter()
                    if kind == "reduce_scatter":
                        comm.reduce_scatter(x, 0)
                    elif kind == "all_gather":
                        comm.all_gather(piece, 0)
                    else:
                        comm.all_to_all(mine, split_dim=0, concat_dim=1)
                    if i:
                        times.append(time.perf_counter() - t0)
            whole = mine.nbytes * k if kind == "all_to_all" else x.nbytes
            rows.append({"kind": kind, "n": k, "bytes": whole, "s": statistics.fmean(times)})
    return comm.comm.bcast(rows, root=k - 1)


def _cold_reads(threads: int, engine: tuple[str, str], barrier: Callable[[], None]) -> list[dict]:
    """An Add's seconds right after this rank wrote each of COLD_TOUCH bytes elsewhere (every
    rank at once): from 0 (its inputs as the run before left them) to more than the host's
    caches keep for it. The median of COLD_REPEATS, each after its own writing."""
    model, nbytes = graphs.memory_op("Add", COLD_ROWS)
    session = open_session(model, threads, engine)
    feed = make_feeds(session)[0]
    other = np.zeros(max(COLD_TOUCH) // 4, np.float32)
    out = []
    for touch in COLD_TOUCH:
        part = other[:touch // 4]
        barrier()
        times = []
        for _ in range(COLD_REPEATS):
            session.run(feed)
            part += 1.0  # reads and writes `touch` bytes
            t0 = time.perf_counter()
            session.run(feed)
            times.append(time.perf_counter() - t0)
        out.append({"touched": touch, "bytes": nbytes, "s": statistics.median(times)})
    return out


def _all_reduces(comm, threads: int, engine: tuple[str, str] = ("ort", "cpu")) -> list[dict]:
    """Seconds of all-reduces as the last member to arrive sees them: the first after compute
    (an onnxruntime matmul, the members arriving 1 ms apart, as in a step), then a burst of them
    back to back (as a step's gradients are); over the whole job, and over pairs of ranks while
    the other pairs compute. On a host whose ranks outnumber its cores these are mostly waits for
    a core (the first: the link's handoff). Every rank gets the rows (from the last rank)."""
    busy = open_session(graphs.matmul((), 128, 128, 128), threads, engine)
    feed = make_feeds(busy)[0]

    def compute(seconds: float) -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            busy.run(feed)

    r, k = comm.rank, comm.size
    pair = comm.for_ranks((r - r % 2, r - r % 2 + 1)) if k > 2 and k % 2 == 0 else None  # odd k: no pairs
    rows = []
    # the whole job (everyone communicates), then pairs while the other ranks compute (a
    # pipeline stage's collectives run while the other stages work)
    for group, turns in ((comm, 1), (pair, 2)) if pair is not None else ((comm, 1),):
        for nbytes in ALL_REDUCE_BYTES:
            x = np.ones(nbytes // 4, np.float32)
            first, burst = [], []
            for _ in range(ARRIVALS):
                for turn in range(turns):  # pairs take turns: half of them communicate, half compute
                    comm.barrier()
                    if turns > 1 and (r // 2) % 2 != turn:
                        compute(ARRIVAL_STEP * (BURST + 2))
                        continue
                    compute(ARRIVAL_STEP * (group.rank + 1))
                    for i in range(BURST):
                        t0 = time.perf_counter()
                        group.all_reduce(x)
                        (burst if i else first).append(time.perf_counter() - t0)
            rows.append({"n": group.size, "bytes": nbytes, "first_s": statistics.fmean(first),
                         "s": statistics.fmean(burst)})
    return comm.comm.bcast(rows, root=k - 1)


def worker(out: str, budget: float, engine: str = "ort", cases: str | None = None) -> None:
    """One rank of a profiling job (run under mpiexec by `profile`): rank 0 writes the rows.
    `cases`: the file of a model's products and convolutions the parent wrote (`write_cases`)."""
    keep_freed_memory()  # as `parc run` runs a rank
    comm = MpiComm(timeout=600.0)
    rows = measure_rank(comm, rank_threads(comm.size), budget, pick_engine(engine), read_cases(cases))
    if comm.rank == 0:
        Path(out).write_text(json.dumps(rows))


class Solo:
    """The communicator of a one-rank measurement (nothing to wait for)."""

    size, rank = 1, 0

    def barrier(self) -> None:
        pass
