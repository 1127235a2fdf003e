"""Jobs over one graph in forked worker processes (Rhino 3: each mesh is searched in a process).

The workers are forked, so they inherit the graph from a module variable instead of receiving
a pickled copy. Jobs and results travel pickled with every Graph, Node and Value replaced by its
position in the graph, so a CostModel built in a worker comes back bound to the parent's own
graph (and goes out again to another worker for a follow-up solve). An exception comes back by
value (its class, args and attributes: not every exception pickles through its `__init__`) and
is raised as the serial loop would: the first failing job, in job order. With one process, or
where fork is unavailable, the jobs run in-process, in order.
"""

from __future__ import annotations

import gc
import io
import math
import multiprocessing
import pickle
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, TypeVar

from parc.errors import WorkerDiedError
from parc.ir.graph import Graph, Node, Value

T = TypeVar("T")
J = TypeVar("J")

# (fn, graph) while a pool runs: what its forked workers inherit. Set only by run_jobs.
_SHARED: tuple[Callable, Graph] | None = None


def can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class SharedMinimum:
    """The least value offered so far, in this process and in the workers it forks afterwards
    (a search's cheapest plan: a mesh whose lower bound is above it cannot win)."""

    def __init__(self) -> None:
        self._shared = multiprocessing.get_context("fork").Value("d", math.inf) if can_fork() else None
        self._local = math.inf

    @property
    def value(self) -> float:
        return self._shared.value if self._shared is not None else self._local

    def offer(self, x: float) -> None:
        if self._shared is None:
            self._local = min(self._local, x)
            return
        with self._shared.get_lock():
            if x < self._shared.value:
                self._shared.value = x


def run_jobs(fn: Callable[[Graph, J], T], graph: Graph, jobs: Sequence[J], processes: int,
             then: Callable[[J, T], Sequence[J]] | None = None,
             spare: Callable[[], J | None] | None = None) -> list[T]:
    """fn(graph, job) for every job, in up to `processes` forked processes; the results in job
    order. `then(job, result)`, called in this process as each result arrives, returns follow-up
    jobs (numbered after those so far). `fn` must not change the graph.

    `spare()` is asked for a job whenever a worker would otherwise wait with nothing queued: a
    job that may turn out to be needed (None: none). Its result goes to `then` like any other,
    but it is not one of the results: it becomes one only when `then` returns that same job
    object as a follow-up, which then waits for it instead of running it again (a follow-up
    whose spare run has already finished is not run again either: `then` has its result). Spare
    jobs still running when every needed job is done are stopped. With one process no worker is
    ever idle: `spare` is never asked, and the needed jobs run as they would with several."""
    queue = list(jobs)
    if processes <= 1 or not can_fork():
        out: list[T] = []
        while len(out) < len(queue):
            out.append(fn(graph, queue[len(out)]))
            if then is not None:
                queue.extend(then(queue[len(out) - 1], out[-1]))
        return out
    global _SHARED
    if _SHARED is not None:
        raise RuntimeError("run_jobs: a pool is already running in this process")
    _SHARED = (fn, graph)
    # Garbage left in this process (say an onnxruntime session in a reference cycle) must not be
    # collected in a forked worker: its destructor would wait on locks of threads that were not
    # forked (seen: a worker hung in ORT's pthread_cond_destroy). Collect it here, and freeze what
    # is left so that the workers' collections never visit what they inherited.
    gc.collect()
    gc.freeze()
    try:
        pool = ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"),
                                   initializer=_die_with_parent)
        try:
            results, stray = _collect(pool, graph, queue, then, spare, processes)
            if stray:  # spare jobs nobody needed, still running
                _stop(pool)
            return results
        except BaseException:
            _stop(pool)
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        gc.unfreeze()
        _SHARED = None


def _collect(pool: ProcessPoolExecutor, graph: Graph, queue: list, then: Callable | None,
             spare: Callable | None, processes: int) -> tuple[list, bool]:
    """Results in job order (the needed jobs), and whether spare jobs are still running; on a
    failure of a needed job, once every earlier needed job is in, raise the first."""
    objects = _graph_objects(graph)
    index: dict[Future, int] = {}
    jobs: list[Any] = []
    results: list[Any] = []
    errors: dict[int, _Raised] = {}
    needed: list[bool] = []
    by_id: dict[int, int] = {}  # id(spare job) -> its number (the job is kept in `jobs`: ids stay unique)

    def submit(more: Sequence, is_needed: bool = True) -> None:
        for job in more:
            k = by_id.get(id(job)) if is_needed else None
            if k is not None:  # a spare job now needed: wait for it, or keep the result it gave
                needed[k] = True
                continue
            index[pool.submit(_work, _dumps(job, objects))] = len(jobs)
            if not is_needed:
                by_id[id(job)] = len(jobs)
            jobs.append(job)
            results.append(None)
            needed.append(is_needed)

    def running() -> set[Future]:
        return {f for f in index if not f.done()}

    def waiting_on(pending: set[Future]) -> bool:
        return any(needed[index[f]] for f in pending)

    submit(queue)
    pending = set(index)
    while waiting_on(pending):
        while spare is not None and not errors and len(running()) < processes:
            job = spare()
            if job is None:
                break
            n = len(index)
            submit([job], is_needed=False)
            pending |= {g for g, j in index.items() if j >= n}
        finished, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in sorted(finished, key=index.__getitem__):
            if f.cancelled():
                continue
            k = index[f]
            try:
                out = f.result()
            except BrokenProcessPool as e:  # which worker died is not known: name the jobs in flight
                wait(pending)
                lost = sorted(index[g] for g in (*finished, *pending) if not g.cancelled() and g.exception() is not None)
                names = ", ".join(getattr(jobs[j], "label", None) or f"job {j}" for j in lost[:3])
                raise WorkerDiedError(
                    f"a planner process died (killed by the system, most likely out of memory: this machine has "
                    f"{_memory_gib():.0f} GiB) while running {names}; fewer processes (--jobs 1) or meshes "
                    f"(--mesh-dims 1) need less") from e
            if isinstance(out, _Raised):
                if needed[k]:
                    errors[k] = out
                else:  # a spare job's failure: run again if it turns out to be needed
                    by_id.pop(id(jobs[k]))
                continue
            results[k] = _loads(out, objects)
            more = then(jobs[k], results[k]) if then is not None else ()
            if more and not errors:
                n = len(index)
                submit(more)
                pending |= {g for g, j in index.items() if j >= n}
        if errors:
            first = min(errors)
            for f in pending:
                if index[f] > first:
                    f.cancel()
            if all(f.done() for f in pending if index[f] < first and needed[index[f]]):
                raise errors[first].exception()
    return [r for r, n in zip(results, needed) if n], bool(running())


def _memory_gib() -> float:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def _stop(pool: ProcessPoolExecutor) -> None:
    """Kill the workers still running (later jobs of a failed run). Python 3.14 has
    terminate_workers(); before it, the executor's process table is the only handle."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
        return
    for p in list((getattr(pool, "_processes", None) or {}).values()):
        if p.is_alive():
            p.terminate()


def _die_with_parent() -> None:
    """In a worker: end when the parent dies (killed on a time-out, say) instead of waiting
    forever on the job queue, whose write end every forked worker also holds (Linux only)."""
    import ctypes
    import os
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl
        os._exit(1)


def _work(job: bytes) -> bytes | _Raised:
    """In a worker: run a job on the inherited graph; jobs and results pickled against it."""
    assert _SHARED is not None, "run_jobs: a worker without the shared graph (not forked?)"
    fn, graph = _SHARED
    objects = _graph_objects(graph)
    try:
        return _dumps(fn(graph, _loads(job, objects)), objects)
    except BaseException as e:  # noqa: BLE001 - any failure goes back to be raised in the parent
        return _Raised.of(e)


@dataclass
class _Raised:
    """An exception carried by value: rebuilt without calling its class's __init__."""

    cls: type
    args: tuple
    state: dict
    trace: str

    @staticmethod
    def of(e: BaseException) -> _Raised:
        raised = _Raised(type(e), e.args, dict(getattr(e, "__dict__", {})), traceback.format_exc())
        try:
            pickle.dumps(raised)
        except Exception:  # an unpicklable payload: keep the class and message only
            raised = _Raised(type(e), (str(e),), {}, raised.trace)
            try:
                pickle.dumps(raised)
            except Exception:
                raised = _Raised(RuntimeError, (f"{type(e).__name__}: {e}",), {}, raised.trace)
        return raised

    def exception(self) -> BaseException:
        e = self.cls.__new__(self.cls)
        e.args = self.args
        e.__dict__.update(self.state)
        e.__cause__ = _RemoteTraceback(self.trace)
        return e


class _RemoteTraceback(Exception):
    """The worker's traceback, as the cause of the exception re-raised in the parent."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


# -- results pickled against the graph --------------------------------------------------------

def _graph_objects(graph: Graph) -> list[Any]:
    """The graph, its nodes and every value they touch, in an order fixed by the graph alone
    (the same in the parent and in a forked worker)."""
    out: list[Any] = [graph, *graph.nodes]
    seen: set[int] = set()
    values = [*graph.inputs, *graph.constants.values(), *graph.input_constants, *graph.outputs]
    values += [v for n in graph.nodes for v in (*n.inputs, *n.outputs)]
    for v in values:
        if v is not None and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


class _GraphPickler(pickle.Pickler):
    """Graph objects as their positions. An object whose class sets `pool_blob = True` (a cost
    model: large, built once, sent to several jobs) is pickled on its own, and the bytes it
    arrived in go out again as they are, instead of pickling it anew for every job."""

    def __init__(self, file: io.BytesIO, objects: list[Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.objects = objects
        self.position = {id(o): k for k, o in enumerate(objects)}

    blobbing: int | None = None  # the object this pickler pickles whole

    def reducer_override(self, obj: Any) -> Any:
        if not getattr(type(obj), "pool_blob", False) or id(obj) == self.blobbing:
            return NotImplemented
        blob = obj.__dict__.get("_pool_blob")
        if blob is None:
            buf = io.BytesIO()
            inner = _GraphPickler(buf, self.objects)
            inner.blobbing = id(obj)
            inner.dump(obj)
            blob = buf.getvalue()
            obj.__dict__["_pool_blob"] = blob
        return _from_blob, (blob,)

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, (Graph, Node, Value)):
            k = self.position.get(id(obj))
            if k is None:
                raise pickle.PicklingError(f"{obj!r} is not part of the shared graph")
            return k
        return None


class _GraphUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, objects: list[Any]) -> None:
        super().__init__(file)
        self.objects = objects

    def persistent_load(self, pid: int) -> Any:
        return self.objects[pid]


def _dumps(obj: Any, objects: list[Any]) -> bytes:
    buf = io.BytesIO()
    _GraphPickler(buf, objects).dump(obj)
    return buf.getvalue()


def _loads(data: bytes, objects: list[Any]) -> Any:
    global _LOADING
    outer, _LOADING = _LOADING, objects
    try:
        return _GraphUnpickler(io.BytesIO(data), objects).load()
    finally:
        _LOADING = outer


_LOADING: list[Any] | None = None  # the graph objects of the load in progress (for _from_blob)


def _from_blob(blob: bytes) -> Any:
    """An object pickled on its own (`pool_blob`), remembering its bytes to be sent on as they are."""
    assert _LOADING is not None
    obj = _loads(blob, _LOADING)
    obj.__dict__["_pool_blob"] = blob
    return obj
