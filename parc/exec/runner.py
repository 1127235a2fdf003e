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

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from parc.errors import ParcError, PlanFormatError, UsageError, first_line
from parc.exec.engines.gpu import device_out_of_memory
from parc.exec.trace import FOLD
from parc.plandir import TASKGRAPH_FILE, load_program, rank_dir
from parc.plandir.taskgraph import MB_END, MB_FIRST, MB_START, WHOLE, last_of_micro, last_uses, load_taskgraph
from parc.sharding.layout import exchange, positions, reduce_parts, shard_index
from parc.sharding.reshard import Collective
from parc.sharding.simulator import run_step
from parc.sharding.spec import ShardSpec, Split

ENGINES = ("auto", "ort", "cupy", "numpy")


class RunError(ParcError):
    """A plan failed while running (names the rank and task)."""


def ort_session(model: str | bytes | onnx.ModelProto, threads: int | None):
    """An onnxruntime CPU session as the executor runs a module (`parc profile` measures with the
    same; `parc verify`'s reference too): `threads` intra-op threads (None: onnxruntime's
    default), no inter-op parallelism. `model`: a path, the bytes or the proto.

    onnxruntime's CPU ScatterND with a reduction adds duplicate indices from several threads
    without atomics (onnxruntime issues #18048, #23396; gpt-tiny's embedding gradient came out
    wrong by 4e-3 on 2 threads with 1.32), so the session runs a model holding one with each such
    node as the ScatterElements it equals (`scatter_as_elements`: that kernel is exact on any
    thread count), or, where a node indexes more than one dim, on one intra-op thread."""
    import onnxruntime as ort

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load_model_from_string(model) \
        if isinstance(model, bytes) else onnx.load(model, load_external_data=False)
    opts = ort.SessionOptions()
    if racy_scatter(proto.graph):
        proto = scatter_as_elements(proto)
        model = proto.SerializeToString()
        if racy_scatter(proto.graph):
            threads = 1
    if threads is not None:
        opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    data = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    return ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])


def _reducing_scatter(node: onnx.NodeProto) -> bool:
    return node.op_type == "ScatterND" and node.domain in ("", "ai.onnx") and \
        next((a.s for a in node.attribute if a.name == "reduction"), b"none") != b"none"


def racy_scatter(graph: onnx.GraphProto) -> bool:
    """Whether a graph (or a subgraph of it) holds a ScatterND with a reduction: onnxruntime's CPU
    kernel races on duplicate indices when it runs on more than one thread (`ort_session`)."""
    for node in graph.node:
        if _reducing_scatter(node):
            return True
        for a in node.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            if any(racy_scatter(g) for g in subs):
                return True
    return False


def scatter_as_elements(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose top-level reducing ScatterNDs that index one leading dim (indices
    [..., 1]: an embedding's gradient) are ScatterElements along dim 0 of the flattened tensors:

        data [V, T...] -> [V, prod T]; indices [L..., 1] -> [prod L, 1], expanded to the updates'
        [prod L, prod T]; the result reshaped to data's shape.

    The same sum (the same reduction of the same elements). The expanded indices are int64 at
    the updates' size, twice a float32 update's bytes while the node runs (an embedding gradient
    of 8192 x 1024: 64 MiB), which the predicted peak does not count. Nodes whose index depth
    (`_index_depth`) is not a known 1 are left as they are: their module runs on one thread."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    if any(_reducing_scatter(n) for n in graph.node):
        try:  # the indices' shapes (a module lists only its inputs' and outputs')
            graph = onnx.shape_inference.infer_shapes(out).graph
        except Exception:  # noqa: BLE001 (a model onnx cannot infer: the nodes stay, on one thread)
            pass
    known = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
             for v in (*graph.value_info, *graph.input, *graph.output) if v.type.tensor_type.HasField("shape")}
    known.update({t.name: list(t.dims) for t in graph.initializer})  # constant indices (folded position ids)
    nodes = []
    for k, node in enumerate(out.graph.node):
        if not _reducing_scatter(node) or _index_depth(node, known) != 1:
            nodes.append(node)
            continue
        q = len(known[node.input[1]])
        data, ind, upd = node.input[:3]
        reduction = next(a.s for a in node.attribute if a.name == "reduction").decode()
        t = f"{node.name or 'scatter'}.as_elements{k}"
        nodes += [helper.make_node("Flatten", [data], [f"{t}.data"], axis=1),
                  helper.make_node("Flatten", [upd], [f"{t}.upd"], axis=q - 1),
                  helper.make_node("Flatten", [ind], [f"{t}.idx1"], axis=q - 1),
                  helper.make_node("Shape", [f"{t}.upd"], [f"{t}.shape"]),
                  helper.make_node("Expand", [f"{t}.idx1", f"{t}.shape"], [f"{t}.idx"]),
                  helper.make_node("ScatterElements", [f"{t}.data", f"{t}.idx", f"{t}.upd"], [f"{t}.out"],
                                   axis=0, reduction=reduction),
                  helper.make_node("Shape", [data], [f"{t}.data_shape"]),
                  helper.make_node("Reshape", [f"{t}.out", f"{t}.data_shape"], [node.output[0]], name=node.name)]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _index_depth(node: onnx.NodeProto, known: Mapping[str, list]) -> int | None:
    """The k of a ScatterND's indices [..., k]: their last dim where it is known, else from the
    ranks (updates = indices[:-1] + data[k:], so k = rank(indices) - 1 + rank(data) -
    rank(updates): a microbatch's slice of the indices has unknown dims but a known rank)."""
    data, idx, upd = (known.get(name) for name in node.input[:3])
    if not idx:
        return None
    if idx[-1] is not None:
        return idx[-1]
    return len(idx) - 1 + len(data) - len(upd) if data is not None and upd is not None else None


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


def _test_fault() -> tuple[str, str, float] | None:
    """`PARC_TEST_FAULT=scale:<tensor substring>:<factor>` or `skip:<tensor substring>`: a bug the
    verify tests inject into every collective on matching tensors (never set it otherwise)."""
    spec = os.environ.get("PARC_TEST_FAULT")
    if not spec:
        return None
    kind, _, rest = spec.partition(":")
    if kind == "scale":
        name, _, factor = rest.rpartition(":")
        return ("scale", name, float(factor))
    if kind == "skip":
        return ("skip", rest, 1.0)
    raise ParcError(f"PARC_TEST_FAULT={spec}: expected scale:<tensor>:<factor> or skip:<tensor>")


SEND_COMPLETION = {"kind": "send completion", "id": "the step's sends"}  # the task a step ends with


MIN_CUPY = 13  # the oldest CuPy major version parc runs on (pyproject's cuda12/cuda13 extras)
MIN_CUDA = 12000  # the oldest CUDA runtime (cudaRuntimeGetVersion: 1000 * major + 10 * minor)


def gpu_problem(cupy_module: Any = None) -> str | None:
    """Why parc cannot run CuPy on a GPU here, or None when it can: CuPy missing or too old, no
    driver or device, a CUDA runtime too old. `cupy_module` stands in for CuPy in tests."""
    cupy = cupy_module
    if cupy is None:
        try:
            import cupy
        except ImportError:
            return "CuPy is not installed (pip install 'parc[cuda13]' or 'parc[cuda12]')"
        except Exception as e:  # a broken install: CUDA libraries missing
            return f"CuPy does not load ({first_line(e, typed=True)})"
    try:
        major = int(str(cupy.__version__).split(".")[0])
    except ValueError:
        major = MIN_CUPY
    if major < MIN_CUPY:
        return f"CuPy {cupy.__version__} is older than parc supports (>= {MIN_CUPY})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        version = cupy.cuda.runtime.runtimeGetVersion()
    except Exception as e:  # no driver, or the driver is older than the runtime
        return f"CUDA reports no usable GPU ({first_line(e, typed=True)})"
    if count == 0:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        return "no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else "")
    if version < MIN_CUDA:
        return (f"CUDA runtime {version // 1000}.{version % 1000 // 10} is older than parc supports "
                f"(>= {MIN_CUDA // 1000}.{MIN_CUDA % 1000 // 10})")
    return None


def gpu_available() -> bool:
    """A CUDA GPU that CuPy can use."""
    return gpu_problem() is None


def pick_engine(engine: str) -> tuple[str, str]:
    """(engine, device): `ort` runs onnxruntime on the CPU (onnxruntime-gpu's CUDA EP is not
    wired up yet); `cupy` runs parc's kernels on a GPU, and is refused without one (one line
    saying why); `numpy` runs the same kernels on the CPU; `auto` is cupy on a GPU, else ort."""
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    if engine == "ort":
        return "ort", "cpu"
    if engine == "numpy":
        return "cupy", "cpu"
    if engine == "cupy":
        problem = gpu_problem()
        if problem is not None:
            raise UsageError(f"--engine cupy: {problem}; --engine numpy runs parc's kernels on the CPU")
        return "cupy", "gpu"
    return ("cupy", "gpu") if gpu_available() else ("ort", "cpu")


ORT_CPU_LACKS = ("bfloat16",)  # element types onnxruntime's CPU provider has no MatMul, Add, ... for


def ort_cpu_lacks(plan: dict) -> list[str]:
    """The element types of a plan's tensors that onnxruntime's CPU provider cannot compute with."""
    return sorted({t.get("dtype") for t in plan.get("tensors", {}).values()} & set(ORT_CPU_LACKS))


def plan_engine(engine: str, plan: dict) -> str:
    """The --engine a plan runs with. A plan holding values onnxruntime's CPU provider cannot
    compute with (a bf16 step: `parc grad --precision bf16`) takes the array engine under `auto`
    (cupy on a GPU, numpy on the CPU) and is refused under `ort`, one line."""
    held = ort_cpu_lacks(plan)
    if not held:
        return engine
    if engine == "ort":
        raise UsageError(f"--engine ort: onnxruntime's CPU provider has no {held[0]} kernels and this plan "
                         f"computes in {held[0]}; --engine numpy runs it on the CPU, --engine cupy on a GPU")
    if engine == "auto":
        return "cupy" if gpu_available() else "numpy"
    return engine


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


def keep_freed_memory() -> bool:
    """Have the C allocator keep the memory a rank frees for its next allocations (glibc: no
    mmap, no trimming), so a step's arrays reuse pages the last step faulted in. By default glibc
    serves a large block with mmap (from 128 KiB, the threshold rising with the blocks freed up
    to 32 MiB) and trims the heap's top, so a step's collectives and modules can fault their
    outputs' pages in again every step: a 3.4 MB all-reduce between 2 ranks on 2 cores, into a
    new array each call, took 2.5 ms, and 0.9 ms with the memory kept. A step's allocations
    repeat, so the heap stops growing after the first. False where the C library is not glibc
    (nothing changed)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def rank_threads(ranks: int) -> int:
    """Threads each of `ranks` ranks on this host gives its engine: the host's CPUs shared out."""
    return max(1, (os.cpu_count() or 1) // ranks)


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
        kind, self.device = pick_engine(engine)
        self.xp = np
        self.pool = None
        if self.device == "gpu":
            import cupy

            from parc.exec.engines.gpu import TightPool

            self.xp = cupy
            self.pool = TightPool.install(cupy)
        threads = threads or rank_threads(self.graph.ranks)
        self.engines: dict[str, Any] = {}
        for t in self.order:
            if t["kind"] == "compute" and t["module"] not in self.engines:
                path = self.dir / t["module"]
                self.engines[t["module"]] = _Ort(path, threads) if kind == "ort" else _Array(path, self.device)
        self.residents = {r["name"]: r for r in self.program.residents}
        state = self._load_init()
        if init == "seeded":
            state.update(self._seeded(seed))
        elif init != "source":
            raise ParcError(f"--init {init}: expected source or seeded")
        self.state = {k: self.xp.asarray(v) for k, v in state.items()}
        for t in self.order:  # every communicator before the first step (Rhino 6.3)
            if t["kind"] == "collective" and len(t["group"]) > 1:
                self.comm.for_ranks(tuple(t["group"]))
        self.comm.open_links([(rank, t["peer"]) if t["kind"] == "send" else (t["peer"], rank)
                              for t in self.order if t["kind"] in ("send", "recv")])
        self.timings = {"compute": 0.0, "comm": 0.0}
        self.free_after = last_uses(self.order, self.program)
        self.last_of_mb = last_of_micro(self.order)
        self._shards: dict[tuple, tuple] = {}  # the shard indexes transfers cut (`_shard`)
        self._fault = _test_fault()
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
        shared: dict[str, Any] = dict(self.state)
        envs: dict[int, dict[str, Any]] = {}
        acc = self.program.accumulate
        sums: dict[str, Any] = {}
        folded = 0
        outputs: dict[str, np.ndarray] = {}
        pending: list = []

        latest: dict[str, Any] = {}  # the last microbatch's values, which the apply part may read
        counting = self.count_bytes > 0
        spans = None if self.spans is None else []
        if spans is not None:
            self.span_start, begun = time.time(), time.perf_counter()
        self.count_bytes -= counting

        def lookup(env: dict, name: str, mb: int | None) -> Any:
            if name in env:
                return env[name]
            if name in shared:
                return shared[name]
            if mb is None and name in latest:
                return latest[name]
            return self._per_micro(name, mb)

        def fold(mb: int, env: dict) -> None:
            for name, (src, how, *_dim) in acc.items():
                x = env[src]
                if how == "sum":
                    sums[name] = x.copy() if name not in sums else sums[name] + x
                elif how == "last":
                    sums[name] = x
                else:
                    sums.setdefault(name, []).append(x)

        for pos, t in enumerate(self.order):
            mb = t.get("micro_batch")
            env = shared if mb is None else envs.setdefault(mb, {})
            kind = t["kind"]
            if self.on_task is not None and kind != "sink":  # a sink hands a value back: nothing to wait on
                self.on_task(self.task_info[pos])
            try:
                if kind == "source":
                    env[t["tensor"]] = self.xp.asarray(self.data_piece(t["tensor"], batch, mb))
                elif kind == "compute":
                    t0 = time.perf_counter()
                    feeds = {i: lookup(env, i, mb) for i in t["inputs"]}
                    env.update(self.engines[t["module"]].run(feeds))
                    self.timings["compute"] += time.perf_counter() - t0
                elif kind == "collective":
                    t0 = time.perf_counter()
                    x = lookup(env, t["src"], mb)
                    env[t["dst"]] = self._collective(t, x)
                    if self._fault and self._fault[1] in t["tensor"]:
                        env[t["dst"]] = self._inject(t, x, env[t["dst"]])
                    self.timings["comm"] += time.perf_counter() - t0
                elif kind == "send":
                    t0 = time.perf_counter()
                    x = lookup(env, t["local"], mb)
                    if not self.comm.device_buffers:
                        x = to_host(x)
                    if "slice" in t:  # the receiver's shard of a value this rank holds whole
                        sl = t["slice"]
                        x = x[self._shard(sl["global"], sl["spec"], sl["mesh"], sl["coords"], x)]
                    pending.append(self.comm.isend(x, t["peer"], t["tag"]))
                    self.timings["comm"] += time.perf_counter() - t0
                elif kind == "recv":
                    t0 = time.perf_counter()
                    env[t["local"]] = self._receive(t)
                    self.timings["comm"] += time.perf_counter() - t0
                elif kind == "sink":
                    outputs[t["tensor"]] = lookup(env, t["local"], mb)
                if counting:
                    self.peak_bytes = max(self.peak_bytes, held_bytes(shared, *envs.values(), sums, latest,
                                                                      outputs, [p[1] for p in pending if p]))
                if spans is not None:
                    spans.append((pos, (spans[-1][2] if spans else 0.0), time.perf_counter() - begun))
                for name in self.free_after[pos]:
                    env.pop(name, None)
                if mb is not None and self.last_of_mb.get(mb) == pos:
                    fold(mb, env)
                    if spans is not None:
                        spans.append((pos, spans[-1][2], time.perf_counter() - begun, FOLD))
                    folded += 1
                    latest = envs.pop(mb)
                    if folded == self.micro:
                        for name, (_src, how, *dim) in acc.items():
                            shared[name] = (self.xp.concatenate(sums[name], axis=dim[0]) if how == "concat"
                                            else sums[name])
            except ParcError:
                raise
            except KeyError as e:
                raise PlanFormatError(f"rank {self.rank}, task {t['id']}: value {e} is not available") from None
            except Exception as e:  # onnxruntime and MPI raise their own types
                if device_out_of_memory(e):
                    raise  # the launcher says which step and task, and what to do about it
                first = first_line(e)
                raise RunError(f"rank {self.rank}, task {t['id']}: {first}") from None
        if pending:
            if self.on_task is not None:
                self.on_task(SEND_COMPLETION)
            self.comm.wait_sends(pending)
        if spans is not None:
            if pending:
                spans.append((-1, spans[-1][2] if spans else 0.0, time.perf_counter() - begun))
            self.spans = spans
        if self.on_task is not None:
            self.on_task(None)
        for out, inp in self.program.bindings.items():
            if out in outputs and inp in self.state:
                self.state[inp] = outputs[out]
        return outputs

    def _inject(self, t: dict, before: Any, after: Any) -> Any:
        """PARC_TEST_FAULT (tests of `parc verify`): a collective that scales its result or does
        nothing (a missing 1/n, a missing reduction)."""
        kind, _, factor = self._fault  # type: ignore[misc]
        if kind == "scale":
            return after * after.dtype.type(factor)
        return before if before.shape == after.shape else after

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
        piece and rearranging on the host took 0.95-1.3 ms per call for moe-tiny's [32,16,96]
        query-key-value shards on 2 ranks (traced in its step: 1.2-1.4 ms); this way 0.22-0.25 ms."""
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
