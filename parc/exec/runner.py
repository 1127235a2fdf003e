"""One rank of a plan: load its programs, run the static order, keep state between steps.

`Rank(plan_dir, rank, comm, engine)` loads only `rank_<r>/`: the modules (one engine session
each), the resident shards from `init.onnx`, and `program.json`; then `step(batch)` runs the
rank's order from `taskgraph.json` once:

- source: the rank's piece of a data input (the batch is given whole and sliced by the plan's
  layout; with microbatches, also by the microbatch);
- compute: one module on the engine;
- collective: one resharding step among the task's group, on the mesh-axis communicator
  (created before the first step and cached). Even contiguous layouts use the matching MPI
  collective; an all_to_all between strided or uneven splits, and a reduce_scatter to one, send
  each peer only the positions it keeps (`parc.sharding.layout.exchange`, `positions`); other
  strided and uneven steps gather the pieces and rearrange them as `parc.sharding.simulator`
  defines;
- sink: a graph output, handed back whole.

After the microbatch part of a microbatched plan, the values the apply part reads are
accumulated (summed, concatenated, or taken from the last microbatch). New parameters and
optimizer state replace their inputs (the `parc.state` bindings), in the same layout.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.errors import ParcError, PlanFormatError, first_line
from parc.exec.engine_choice import pick_engine, rank_threads
from parc.exec.engines.gpu import device_out_of_memory
from parc.exec.faults import CollectiveFault
from parc.exec.trace import FOLD
from parc.ir.scatter import racy_scatter, scatter_as_elements
from parc.plandir import TASKGRAPH_FILE, load_program, rank_dir
from parc.plandir.taskgraph import MB_END, MB_FIRST, MB_START, WHOLE, last_of_micro, last_uses, load_taskgraph
from parc.sharding.layout import exchange, positions, reduce_parts, shard_index
from parc.sharding.reshard import Collective
from parc.sharding.simulator import run_step
from parc.sharding.spec import ShardSpec, Split


class RunError(ParcError):
    """A plan failed while running (names the rank and task)."""


def ort_session(model: str | bytes | onnx.ModelProto, threads: int | None):
    """An onnxruntime CPU session as the executor runs a module (`parc profile` measures with the
    same; `parc verify`'s reference too): `threads` intra-op threads (None: onnxruntime's
    default), no inter-op parallelism. `model`: a path, the bytes or the proto.

    onnxruntime's CPU ScatterND with a reduction adds duplicate indices from several threads
    without atomics, so a model holding one runs with each such node as the ScatterElements it
    equals (`parc.ir.scatter.scatter_as_elements`, which `parc plan` also applies to the modules
    it writes, so a plan's modules arrive without any: nothing to do), or, where a node indexes
    more than one dim, on one intra-op thread, where onnxruntime's kernel is exact."""
    import onnxruntime as ort

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load_model_from_string(model) \
        if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
    opts = ort.SessionOptions()
    if racy_scatter(proto.graph):
        proto = model = scatter_as_elements(proto)
        if racy_scatter(proto.graph):
            threads = 1
    if threads is not None:
        opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    data = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


class _Ort:
    name = "ort"

    def __init__(self, path: Path, threads: int) -> None:
        self.session = ort_session(str(path), threads)
        self.outputs = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return dict(zip(self.outputs, self.session.run(self.outputs, dict(feeds))))


class _Array:
    name = "cupy"

    def __init__(self, path: Path, device: str) -> None:
        from parc.exec.engines.array import ArrayEngine

        self.engine = ArrayEngine(onnx.load(str(path)), device=device)

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        return self.engine.run(feeds)  # on the GPU, values stay in device memory


SEND_COMPLETION = {"kind": "send completion", "id": "the step's sends"}  # the task a step ends with


def to_host(x) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array."""
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def held_bytes(*holders) -> int:
    """Bytes of the distinct arrays in `holders` (mappings of name -> array, or lists of arrays;
    a concatenation's parts count each)."""
    seen: dict[int, int] = {}

    def add(x: Any) -> None:
        if isinstance(x, list):
            for y in x:
                add(y)
        elif hasattr(x, "nbytes"):
            seen[id(x)] = int(x.nbytes)

    for h in holders:
        for x in (h.values() if isinstance(h, Mapping) else h):
            add(x)
    return sum(seen.values())


def _runs(at: np.ndarray) -> list[tuple[int, int]]:
    """Sorted positions as [start, stop) runs of consecutive ones."""
    if not len(at):
        return []
    breaks = np.flatnonzero(np.diff(at) != 1) + 1
    return [(int(at[a]), int(at[b - 1]) + 1) for a, b in zip([0, *breaks], [*breaks, len(at)])]


def _along(ndim: int, dim: int, start: int, stop: int) -> tuple:
    return (slice(None),) * dim + (slice(start, stop),) + (slice(None),) * (ndim - dim - 1)


def _cut(x, dim: int, runs: list[tuple[int, int]], xp):
    """The runs of x along dim, joined (contiguous)."""
    if len(runs) == 1:
        return xp.ascontiguousarray(x[_along(x.ndim, dim, *runs[0])])
    if not runs:
        return xp.empty(x.shape[:dim] + (0,) + x.shape[dim + 1:], dtype=x.dtype)
    return xp.concatenate([x[_along(x.ndim, dim, a, b)] for a, b in runs], axis=dim)


def _is_even(ax) -> bool:
    return isinstance(ax, Split) and ax.is_even


@dataclass
class _Step:
    """The values of one step while it runs (`Rank.step`)."""

    batch: Mapping[str, np.ndarray]  # every data input, whole
    shared: dict[str, Any]  # values outside any microbatch: the state, the apply part's
    counting: bool  # whether this step's held bytes are counted (`Rank.peak_bytes`)
    spans: list[tuple] | None  # each task's (position, start, end[, FOLD]) where kept (`Rank.spans`)
    begun: float = 0.0  # the step's start (perf_counter), where spans are kept
    envs: dict[int, dict[str, Any]] = field(default_factory=dict)  # each running microbatch's values
    sums: dict[str, Any] = field(default_factory=dict)  # the accumulations of the microbatches folded
    folded: int = 0  # how many microbatches are folded
    latest: dict[str, Any] = field(default_factory=dict)  # the last microbatch's values (the apply part's)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)  # the graph outputs handed back
    pending: list = field(default_factory=list)  # the sends not yet complete


class Rank:
    """The runtime state of one rank (see the module docstring)."""

    def __init__(self, plan_dir: str | Path, rank: int, comm, engine: str = "auto", threads: int | None = None,
                 init: str = "source", seed: int = 0) -> None:
        self.dir = Path(plan_dir)
        self.rank = rank
        self.comm = comm
        self.graph = load_taskgraph(self.dir / TASKGRAPH_FILE)
        self.program = load_program(self.dir, rank)
        self.model_mesh = self.program.mesh
        self.coords = self.program.coords
        self.micro = self.program.micro_batches
        self.order = [self.graph.tasks[t] for t in self.graph.order[rank]]
        self._open_engines(engine, threads or rank_threads(self.graph.ranks))
        self.residents = {r["name"]: r for r in self.program.residents}
        state = self._load_init()
        if init == "seeded":
            state.update(self._seeded(seed))
        elif init != "source":
            raise ParcError(f"--init {init}: expected source or seeded")
        self.state = {k: self.xp.asarray(v) for k, v in state.items()}
        self._connect()
        self.timings = {"compute": 0.0, "comm": 0.0}
        self.free_after = last_uses(self.order, self.program)
        self.last_of_mb = last_of_micro(self.order)
        self._shards: dict[tuple, tuple] = {}  # the shard indexes transfers cut (`_shard`)
        self._fault = CollectiveFault.from_env()
        self.steps = {t["id"]: Collective.from_json(t["step"]) for t in self.order if t["kind"] == "collective"}
        self._exchanges: dict = {}  # (step, piece shape, rank in group) -> `layout.exchange`, runs, sizes
        self._pieces: dict[tuple[str, int | None], tuple[np.ndarray, ...]] = {}  # data slices, made once
        # called with each task's summary as it starts (None when the step ends): `parc run`
        # records it in the rank's state file (`parc.exec.watch`), for failure messages
        self.on_task: Any = None
        # this rank's pipeline stage (None in a plan of one stage)
        self.stage = next((i for i, st in enumerate(self.graph.stages) if rank in st["ranks"]), None) \
            if len(self.graph.stages) > 1 else None
        where = {"stage": self.stage} if self.stage is not None else {}
        self.task_info = [{**{k: t[k] for k in ("kind", "id", "micro_batch", "op", "shape", "group", "peer", "tensor",
                                                "local", "module", "pass") if t.get(k) is not None}, **where}
                          for t in self.order]
        # (position in the order, start, end) of each task of the last step, seconds from its start,
        # and the step's start on the wall clock, where `parc run --trace` asks for them (None: not kept)
        self.spans: list[tuple] | None = None  # (position, start, end[, FOLD]): `trace.rank_events`
        self.span_start = 0.0
        self.count_bytes = 2  # steps whose held bytes are counted (the first two: a step's peak repeats)
        self.peak_bytes = 0  # the most bytes of tensors this rank held at once in a counted step

    def _open_engines(self, engine: str, threads: int) -> None:
        """The device's array library and one engine session per module this rank runs."""
        kind, self.device = pick_engine(engine)
        self.xp = np
        self.pool = None
        if self.device == "gpu":
            import cupy

            from parc.exec.engines.gpu import TightPool

            self.xp = cupy
            self.pool = TightPool.install(cupy)
        self.engines: dict[str, Any] = {}
        for t in self.order:
            if t["kind"] == "compute" and t["module"] not in self.engines:
                path = self.dir / t["module"]
                self.engines[t["module"]] = _Ort(path, threads) if kind == "ort" else _Array(path, self.device)

    def _connect(self) -> None:
        """Every communicator and link the order uses, made before the first step (Rhino 6.3)."""
        for t in self.order:
            if t["kind"] == "collective" and len(t["group"]) > 1:
                self.comm.for_ranks(tuple(t["group"]))
        self.comm.open_links([(self.rank, t["peer"]) if t["kind"] == "send" else (t["peer"], self.rank)
                              for t in self.order if t["kind"] in ("send", "recv")])

    def _seeded(self, seed: int) -> dict[str, np.ndarray]:
        """This rank's shard of each parameter under the seeded, plan-independent init."""
        from parc.exec.init import seeded_shard

        out = {}
        for r in self.program.residents:
            stats = r.get("init")
            if not stats or not stats["std"]:
                continue
            shape = tuple(r["shape"])
            index = shard_index(shape, ShardSpec.parse(r["spec"]), self.model_mesh, self.coords) if shape else ()
            out[r["name"]] = seeded_shard(seed, r["name"], shape, index, stats["mean"], stats["std"],
                                          helper.tensor_dtype_to_np_dtype(r["dtype"]))
        return out

    def _load_init(self) -> dict[str, np.ndarray]:
        """This rank's initial state from init.onnx, each externally stored tensor read from its
        file straight into its array (through the protobuf it was three copies of gpt-medium's
        4.3 GB of parameters and AdamW state, most of `parc run`'s start-up)."""
        here = rank_dir(self.dir, self.rank)
        model = onnx.load(str(here / "init.onnx"), load_external_data=False)
        out = {}
        for t in model.graph.initializer:
            name = t.name.removesuffix(".init")
            if t.data_location != onnx.TensorProto.EXTERNAL:
                out[name] = numpy_helper.to_array(t).copy()
                continue
            where = {e.key: e.value for e in t.external_data}
            path = here / where.get("location", "")
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
            count, offset = int(np.prod(t.dims, dtype=np.int64)), int(where.get("offset", 0))
            if path.resolve().parent != here.resolve() or not path.is_file():
                raise PlanFormatError(f"{here / 'init.onnx'}: tensor {t.name!r} is stored in "
                                      f"{where.get('location')!r}, which is not a file of {here}")
            if int(where.get("length", count * dtype.itemsize)) != count * dtype.itemsize or \
                    offset + count * dtype.itemsize > path.stat().st_size:
                raise PlanFormatError(f"{here / 'init.onnx'}: tensor {t.name!r} ({count} x {dtype}) does not fit "
                                      f"{path.name} at offset {offset}")
            out[name] = np.fromfile(path, dtype=dtype.newbyteorder("<"), count=count, offset=offset).reshape(
                tuple(t.dims)).astype(dtype, copy=False)
        return out

    def synchronize(self) -> None:
        """Wait for the device to finish the work queued so far (nothing to wait for on a CPU)."""
        if self.device == "gpu":
            self.xp.cuda.get_current_stream().synchronize()

    def device_bytes(self) -> int:
        """The most GPU memory this rank's process has held in CuPy's pool (0 on a CPU): the
        TightPool's high-water mark, or the pool's size (CuPy's own pool keeps what it once
        allocated)."""
        if self.device != "gpu":
            return 0
        if self.pool is not None:
            return max(self.pool.high, int(self.pool.pool.total_bytes()))
        return int(self.xp.get_default_memory_pool().total_bytes())

    # -- one step -----------------------------------------------------------------------------
    def data_piece(self, name: str, batch: Mapping[str, np.ndarray], micro_batch: int | None) -> np.ndarray:
        """This rank's (and microbatch's) piece of a whole data input."""
        full = batch[name]
        if not full.ndim:
            return full
        key = (name, micro_batch)
        if key not in self._pieces:
            r = self.residents[name]
            coords = self.coords if micro_batch is None else (micro_batch,) + self.coords[1:]
            index = shard_index(tuple(r["shape"]), ShardSpec.parse(r["spec"]), self.model_mesh, coords)
            self._pieces[key] = np.ix_(*index)
        return np.asarray(full[self._pieces[key]], order="C")

    def step(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run one step on `batch` (every data input, whole); returns the graph outputs whole
        (new parameters and state in this rank's layout) and updates the resident state.

        Each microbatch has its own values (a pipeline stage runs the forward pass of one
        microbatch before the backward pass of an earlier one); after its last task they are
        folded into the accumulations and dropped. Sends complete by the end of the step."""
        s = _Step(batch, dict(self.state), counting=self.count_bytes > 0,
                  spans=None if self.spans is None else [])
        if s.spans is not None:
            self.span_start, s.begun = time.time(), time.perf_counter()
        self.count_bytes -= s.counting
        for pos, t in enumerate(self.order):
            if self.on_task is not None and t["kind"] != "sink":  # a sink hands a value back: nothing to wait on
                self.on_task(self.task_info[pos])
            try:
                self._run_task(s, pos, t)
            except ParcError:
                raise
            except KeyError as e:
                raise PlanFormatError(f"rank {self.rank}, task {t['id']}: value {e} is not available") from None
            except Exception as e:  # onnxruntime and MPI raise their own types
                if device_out_of_memory(e):
                    raise  # the launcher says which step and task, and what to do about it
                raise RunError(f"rank {self.rank}, task {t['id']}: {first_line(e)}") from None
        self._end_step(s)
        return s.outputs

    def _run_task(self, s: _Step, pos: int, t: dict) -> None:
        """Run the task at `pos` in the order, then count what the rank holds, record its span,
        drop the values no later task reads and, after a microbatch's last task, fold it."""
        mb = t.get("micro_batch")
        env = s.shared if mb is None else s.envs.setdefault(mb, {})
        run = self._BY_KIND.get(t["kind"])
        if run is not None:
            run(self, s, t, env, mb)
        if s.counting:
            self.peak_bytes = max(self.peak_bytes, held_bytes(s.shared, *s.envs.values(), s.sums, s.latest,
                                                              s.outputs, [p[1] for p in s.pending if p]))
        if s.spans is not None:
            s.spans.append((pos, (s.spans[-1][2] if s.spans else 0.0), time.perf_counter() - s.begun))
        for name in self.free_after[pos]:
            env.pop(name, None)
        if mb is not None and self.last_of_mb.get(mb) == pos:
            self._fold(s, env)
            if s.spans is not None:
                s.spans.append((pos, s.spans[-1][2], time.perf_counter() - s.begun, FOLD))
            self._end_micro(s, mb)

    # -- the tasks, by kind: each reads and writes the values of its microbatch (`env`) ---------
    def _source_task(self, s: _Step, t: dict, env: dict, mb: int | None) -> None:
        env[t["tensor"]] = self.xp.asarray(self.data_piece(t["tensor"], s.batch, mb))

    def _compute_task(self, s: _Step, t: dict, env: dict, mb: int | None) -> None:
        t0 = time.perf_counter()
        feeds = {i: self._lookup(s, env, i, mb) for i in t["inputs"]}
        env.update(self.engines[t["module"]].run(feeds))
        self.timings["compute"] += time.perf_counter() - t0

    def _collective_task(self, s: _Step, t: dict, env: dict, mb: int | None) -> None:
        t0 = time.perf_counter()
        x = self._lookup(s, env, t["src"], mb)
        env[t["dst"]] = self._collective(t, x)
        if self._fault is not None and self._fault.strikes(t["tensor"]):
            env[t["dst"]] = self._fault.apply(x, env[t["dst"]])
        self.timings["comm"] += time.perf_counter() - t0

    def _send_task(self, s: _Step, t: dict, env: dict, mb: int | None) -> None:
        t0 = time.perf_counter()
        x = self._lookup(s, env, t["local"], mb)
        if not self.comm.device_buffers:
            x = to_host(x)
        if "slice" in t:  # the receiver's shard of a value this rank holds whole
            sl = t["slice"]
            x = x[self._shard(sl["global"], sl["spec"], sl["mesh"], sl["coords"], x)]
        s.pending.append(self.comm.isend(x, t["peer"], t["tag"]))
        self.timings["comm"] += time.perf_counter() - t0

    def _recv_task(self, s: _Step, t: dict, env: dict, mb: int | None) -> None:
        t0 = time.perf_counter()
        env[t["local"]] = self._receive(t)
        self.timings["comm"] += time.perf_counter() - t0

    def _sink_task(self, s: _Step, t: dict, env: dict, mb: int | None) -> None:
        s.outputs[t["tensor"]] = self._lookup(s, env, t["local"], mb)

    _BY_KIND = {"source": _source_task, "compute": _compute_task, "collective": _collective_task,
                "send": _send_task, "recv": _recv_task, "sink": _sink_task}

    def _lookup(self, s: _Step, env: dict, name: str, mb: int | None) -> Any:
        """A value a task reads: its microbatch's, the step's, the last microbatch's (the apply
        part reads them), or one the executor computes per microbatch."""
        if name in env:
            return env[name]
        if name in s.shared:
            return s.shared[name]
        if mb is None and name in s.latest:
            return s.latest[name]
        return self._per_micro(name, mb)

    def _fold(self, s: _Step, env: dict) -> None:
        """Accumulate a microbatch's values that the apply part reads into the step's sums
        (summed, concatenated, or the last one kept), after its last task."""
        for name, (src, how, *_dim) in self.program.accumulate.items():
            x = env[src]
            if how == "sum":
                s.sums[name] = x.copy() if name not in s.sums else s.sums[name] + x
            elif how == "last":
                s.sums[name] = x
            else:
                s.sums.setdefault(name, []).append(x)

    def _end_micro(self, s: _Step, mb: int) -> None:
        """Drop microbatch `mb`'s values (the apply part may still read them as the latest); after
        the last microbatch, its accumulations become values of the step."""
        s.folded += 1
        s.latest = s.envs.pop(mb)
        if s.folded == self.micro:
            for name, (_src, how, *dim) in self.program.accumulate.items():
                s.shared[name] = (self.xp.concatenate(s.sums[name], axis=dim[0]) if how == "concat"
                                  else s.sums[name])

    def _end_step(self, s: _Step) -> None:
        """Wait for the step's sends, keep its spans, and bind its new state in place of the old."""
        if s.pending:
            if self.on_task is not None:
                self.on_task(SEND_COMPLETION)
            self.comm.wait_sends(s.pending)
        if s.spans is not None:
            if s.pending:
                s.spans.append((-1, s.spans[-1][2] if s.spans else 0.0, time.perf_counter() - s.begun))
            self.spans = s.spans
        if self.on_task is not None:
            self.on_task(None)
        for out, inp in self.program.bindings.items():
            if out in s.outputs and inp in self.state:
                self.state[inp] = s.outputs[out]

    def _receive(self, t: dict) -> Any:
        """A value another stage sends: this rank's shard as it is, or the whole value, of which
        this rank keeps its shard."""
        whole = self.comm.recv(tuple(t["shape"]), helper.tensor_dtype_to_np_dtype(t["dtype"]), t["peer"], t["tag"])
        if t.get("layout", WHOLE) != WHOLE or not t["global"]:
            return self.xp.asarray(whole)
        coords = (0,) + self.coords[1:] if self.micro > 1 else self.coords
        return self.xp.asarray(whole[self._shard(t["global"], t["spec"], self.model_mesh, coords, whole)])

    def _shard(self, shape, spec: str, mesh, coords, like) -> tuple:
        """The index (a fresh contiguous array when applied) of the shard at `coords` of a
        `shape` value laid out `spec` on `mesh` (at microbatch 0: the same for every
        microbatch), its index arrays where `like` is (host or device); made once per transfer."""
        device = not isinstance(like, np.ndarray)
        key = (tuple(shape), spec, tuple(mesh), tuple(coords), device)
        if key not in self._shards:
            index = np.ix_(*shard_index(key[0], ShardSpec.parse(spec), key[2], key[3]))
            if device:
                import cupy

                index = tuple(cupy.asarray(i) for i in index)
            self._shards[key] = index
        return self._shards[key]

    @staticmethod
    def _per_micro(name: str, mb: int | None) -> np.ndarray:
        """The inputs the lowering leaves to the executor per microbatch (see parc.passes.lower)."""
        key, _, arg = name.rpartition(".")
        t = mb or 0
        if key == MB_START:
            return np.array([t * int(arg)], np.int64)
        if key == MB_END:
            return np.array([(t + 1) * int(arg)], np.int64)
        if key == MB_FIRST:
            return np.array(1 if t == 0 else 0, helper.tensor_dtype_to_np_dtype(int(arg)))
        raise KeyError(name)

    def _pieces_to_all(self, comm, step: Collective, x):
        """An all_to_all between strided or uneven splits: each rank sends each peer only the
        positions it needs (`layout.exchange`), cut and placed as runs of slices. Gathering every
        piece and rearranging on the host took several times as long for moe-tiny's
        query-key-value shards (benchmarks/LOG.md, 2026-11-28, ninth session)."""
        key = (step, tuple(x.shape), comm.rank)
        if key not in self._exchanges:
            ex = exchange(step.src, step.dst, step.n, tuple(x.shape), comm.rank)
            self._exchanges[key] = (ex, [_runs(at) for at in ex.send], [_runs(at) for at in ex.recv],
                                    [int(np.prod(s, dtype=np.int64)) for s in ex.parts])
        ex, sends, recvs, sizes = self._exchanges[key]
        xp = self.xp
        pieces = [_cut(x, ex.send_dim, runs, xp).reshape(-1) for runs in sends]
        got = comm.exchange(pieces, sizes)
        out = xp.empty(ex.shape, dtype=x.dtype)
        for runs, shape, part in zip(recvs, ex.parts, got):
            part, at = part.reshape(shape), 0
            for start, stop in runs:
                out[_along(x.ndim, ex.recv_dim, start, stop)] = part[_along(x.ndim, ex.recv_dim, at, at + stop - start)]
                at += stop - start
        return out

    def _scatter_partial(self, comm, step: Collective, x):
        """A reduce_scatter to a strided or uneven split: each rank sends each peer its partial
        values at the positions the peer keeps and combines what arrives, moving a piece per
        peer instead of gathering every rank's whole tensor."""
        key = (step, tuple(x.shape), comm.rank)
        if key not in self._exchanges:
            d = step.dst.dim
            keep = [positions(x.shape[d], step.dst, step.n, q) for q in range(step.n)]
            shape = x.shape[:d] + (len(keep[comm.rank]),) + x.shape[d + 1:]
            self._exchanges[key] = ([_runs(at) for at in keep], [int(np.prod(shape, dtype=np.int64))] * step.n, shape)
        sends, sizes, shape = self._exchanges[key]
        xp, d = self.xp, step.dst.dim
        got = comm.exchange([_cut(x, d, runs, xp).reshape(-1) for runs in sends], sizes)
        return reduce_parts([part.reshape(shape) for part in got], step.src.op, xp)

    def _collective(self, t: dict, x: np.ndarray) -> np.ndarray:
        step = self.steps[t["id"]]
        if len(t["group"]) == 1:
            return self.xp.asarray(run_step(step, [to_host(x)])[0])
        comm = self.comm.for_ranks(tuple(t["group"]))  # a mesh axis's group, in coordinate order
        src, dst = step.src, step.dst
        if step.kind == "all_reduce":
            return comm.all_reduce(x, src.op)
        if step.kind == "all_gather" and _is_even(src):
            return comm.all_gather(x, src.dim)
        if step.kind == "reduce_scatter" and _is_even(dst):
            return comm.reduce_scatter(x, dst.dim, src.op)
        if step.kind == "all_to_all" and _is_even(src) and _is_even(dst):
            return comm.all_to_all(x, split_dim=dst.dim, concat_dim=src.dim)
        if step.kind == "all_to_all" and isinstance(src, Split) and isinstance(dst, Split):
            return self._pieces_to_all(comm, step, x)  # strided or uneven: each peer gets what it needs
        if step.kind == "reduce_scatter" and isinstance(dst, Split):
            return self._scatter_partial(comm, step, x)
        parts = [to_host(p) for p in comm.gather_parts(x)]  # strided or uneven: rearranged on the host
        return self.xp.asarray(run_step(step, parts)[comm.rank])
