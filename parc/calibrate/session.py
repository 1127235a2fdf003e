"""One benchmark: a model in a session of the engine `parc run` would use, its inputs, and the
mean time of a run."""

from __future__ import annotations

import statistics
import time

import numpy as np

from parc.calibrate.catalogue import BUDGET, MASKED, PADDED, POOL_BYTES
from parc.exec.data import padding
from parc.exec.engines.array import ArrayEngine
from parc.exec.runner import ort_session


class OrtBench:
    """One benchmark model in an onnxruntime session."""

    def __init__(self, model, threads: int) -> None:
        self.session = ort_session(model, threads)
        self.shapes = {i.name: tuple(i.shape) for i in self.session.get_inputs()}

    def place(self, array: np.ndarray):
        return array

    def run(self, feeds: dict) -> None:
        self.session.run(None, feeds)


class ArrayBench:
    """One benchmark model in parc's array engine (numpy on the CPU or CuPy on a GPU), timed to
    the end of its kernels (the GPU is synchronised after each run). Outputs are made contiguous:
    a Transpose is a view in the engine, and its copy is paid by whichever kernel reads it."""

    def __init__(self, model, device: str, fuse: bool | None = None) -> None:
        self.engine = ArrayEngine(model, device=device, fuse=fuse)
        self.shapes = {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in model.graph.input}
        self.sync = self.engine.xp.cuda.get_current_stream().synchronize if device == "gpu" else (lambda: None)

    def place(self, array: np.ndarray):
        return self.engine.xp.asarray(array)

    def run(self, feeds: dict) -> None:
        for value in self.engine.run(feeds).values():
            self.engine.xp.ascontiguousarray(value)
        self.sync()


def open_session(model, threads: int, engine: tuple[str, str] = ("ort", "cpu"),
                 fuse: bool | None = None) -> OrtBench | ArrayBench:
    """A benchmark of `model` on `engine` (`runner.pick_engine`'s (kind, device))."""
    kind, device = engine
    return OrtBench(model, threads) if kind == "ort" else ArrayBench(model, device, fuse)


def mean_seconds(session, feeds: list[dict], budget: float = BUDGET, least: int = 5) -> float:
    """Mean seconds of one run over about `budget` seconds, the feeds taken in turn (so that
    inputs come from memory, not from a cache warmed by the run before). The mean, not the
    median: ranks sharing cores are descheduled for whole time slices, and a short run either
    escapes that or takes all of it; the mean charges each run its share, as a step sees it."""
    session.run(feeds[0])
    times: list[float] = []
    spent = 0.0
    while len(times) < least or spent < budget:
        f = feeds[len(times) % len(feeds)]
        t0 = time.perf_counter()
        session.run(f)
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
        if len(times) >= 2000:
            break
    return statistics.fmean(times)


def make_feeds(session, pool_bytes: int = POOL_BYTES) -> list[dict]:
    """Sets of random inputs for `session`'s model, as many as fit `pool_bytes` (at least one, at
    most 64), placed on its device; an input named `MASKED` or `PADDED` holds attention's scores
    after a causal or a padding mask's fill."""
    rng = np.random.default_rng(0)
    one = sum(int(np.prod(s)) * 4 for s in session.shapes.values())
    count = max(1, min(64, pool_bytes // max(one, 1)))

    def values(name: str, shape: tuple) -> np.ndarray:
        x = rng.standard_normal(shape, dtype=np.float32)
        if name == MASKED:  # above the diagonal of its last two dims: a causal mask's fill
            x[..., ~np.tri(shape[-2], shape[-1], dtype=bool)] = -1e9
        if name == PADDED:  # the keys a sequence's padding hides, for every query of it
            x[~padding(rng, (*shape[:-2], shape[-1])).astype(bool)[..., None, :].repeat(shape[-2], -2)] = -1e9
        return x

    return [{n: session.place(values(n, s)) for n, s in session.shapes.items()} for _ in range(count)]
