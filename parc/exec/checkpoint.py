"""Checkpoints of a running plan: per-rank shards, a manifest, resume, reshard on load, export.

A checkpoint directory holds ``checkpoint.json`` and one folder of shards, ``step_<N>.<run>/``, with
``rank_<r>.npz`` (that rank's shards of every parameter and optimizer state tensor). The manifest
says the format, step, the plan's mesh, each tensor's global shape, dtype and layout, the source
model, and the sha256 of every shard file; a directory whose files do not match is refused.

A save never touches the checkpoint it replaces: every rank writes its shard into a new folder
(a temporary file, flushed to disk, then renamed), and when all have, rank 0 writes the new
manifest the same way. Renaming the manifest is the commit: a job that dies at any point of a
save leaves the previous complete checkpoint or the new complete one, never a mix. The old folder
is removed after the commit.

`load_checkpoint` continues a run exactly when the plan is the same; when it is not (another
rank count, other layouts), each rank rebuilds its own shards from the saved ones (reshard on
load). `export_checkpoint` writes the source model with the trained values as one ONNX file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np

from parc.errors import UsageError
from parc.plandir import Program, load_plan, load_program
from parc.plandir.manifest import sha256_file
from parc.sharding.layout import assemble, devices, shard_index
from parc.sharding.spec import ShardSpec, ShardSpecError

FORMAT = "parc.checkpoint/2"
FORMATS = ("parc.checkpoint/1", FORMAT)  # /1 kept its shards beside the manifest
MANIFEST = "checkpoint.json"


def _device_spec(program: Program, spec: str) -> ShardSpec:
    s = ShardSpec.parse(spec)
    return ShardSpec(tuple(s)[1:]) if program.micro_batches > 1 else s


def _device_mesh(program: Program) -> tuple[int, ...]:
    return program.mesh[1:] if program.micro_batches > 1 else program.mesh


def save_checkpoint(directory: str | Path, runner, step: int, run: str = "") -> None:
    """Every rank writes its shards into a new folder; rank 0 then commits the manifest
    (collective call). `run` names this run (every rank passes the same): the folder is never
    one a checkpoint of an earlier run uses, whatever any rank reads of the directory. Each file
    operation is announced to `runner.on_task` as a task (`checkpoint_write`,
    `checkpoint_rename`, `checkpoint_commit`), so a rank's state says it was saving, and the
    fault-injection switch can strike there."""
    from parc.exec.runner import to_host

    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    r = runner.rank
    folder = f"step_{step:08d}" + (f".{run}" if run else "")  # `run`: the same on every rank, new each run
    (root / folder).mkdir(exist_ok=True)
    name = f"{folder}/rank_{r}.npz"
    _write_then_rename(runner, root / name, name, "checkpoint_rename",
                       lambda f: np.savez(f, **{k: to_host(v) for k, v in runner.state.items()}))
    runner.comm.barrier()
    if r == 0:
        program = runner.program
        plan = load_plan(runner.dir)
        tensors: dict[str, dict] = {}
        for prog in _stage_programs(runner):
            for x in prog.residents:
                if x["kind"] != "state" or x["name"] in tensors:
                    continue  # a tied weight held by two stages: the first stage's copy
                tensors[x["name"]] = {"shape": x["shape"], "dtype": x["dtype"],
                                      "spec": str(_device_spec(prog, x["spec"])),
                                      **({"ranks": list(prog.stage_ranks), "mesh": list(_device_mesh(prog))}
                                         if prog.stage_ranks is not None else {})}
        ranks = runner.graph.ranks
        _fsync_dir(root / folder)
        doc = {"format": FORMAT, "step": step, "ranks": ranks, "mesh": list(_device_mesh(program)),
               "model": {"path": plan.model.path, "sha256": plan.model.sha256} if plan.model else None,
               "tensors": tensors,
               "files": {f"{folder}/rank_{q}.npz": sha256_file(root / folder / f"rank_{q}.npz")
                         for q in range(ranks)}}
        _write_then_rename(runner, root / MANIFEST, MANIFEST, "checkpoint_commit",
                           lambda f: f.write((json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()))
        _fsync_dir(root)
        _remove_leftovers(root, keep=folder)
    runner.comm.barrier()


def _write_then_rename(runner, target: Path, label: str, rename_kind: str, write) -> None:
    """`write(file)` into a temporary file beside `target`, flushed to disk, then renamed over
    it; each step announced as a task (`checkpoint_write`, then `rename_kind`)."""
    tmp = target.parent / f".{target.name}.{os.getpid()}"
    _announce(runner, "checkpoint_write", label)
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    _announce(runner, rename_kind, label)
    os.replace(tmp, target)
    _announce(runner, None)


def _announce(runner, kind: str | None, file: str = "") -> None:
    if runner.on_task is not None:
        runner.on_task(None if kind is None else {"kind": kind, "id": file})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# what a save leaves besides the committed folder: other folders, /1 shards, temporary files
_LEFTOVER = re.compile(r"step_\d{8}(\.[0-9a-f]+)?|rank_\d+\.npz|\.rank_\d+\.(npz\.)?\d+(\.npz)?|\."
                       + re.escape(MANIFEST) + r"\.\d+")


def _remove_leftovers(root: Path, keep: str) -> None:
    """Shard folders other than `keep`, /1 shards and temporary files of interrupted saves."""
    with contextlib.suppress(OSError):  # best effort: the checkpoint is committed already
        for p in root.iterdir():
            if p.name == keep or not _LEFTOVER.fullmatch(p.name):
                continue
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        for p in (root / keep).glob(".rank_*"):
            p.unlink(missing_ok=True)


def _shard_file(root: Path, doc: dict, rank: int) -> Path:
    """Where a checkpoint keeps rank `rank`'s shards."""
    name = f"rank_{rank}.npz"
    return root / next((k for k in doc["files"] if Path(k).name == name), name)


def _stage_programs(runner) -> list[Program]:
    """The program of each pipeline stage's first rank (a plan of one mesh: this rank's)."""
    if runner.program.stage_ranks is None:
        return [runner.program]
    return [load_program(runner.dir, s["ranks"][0]) for s in runner.graph.stages]


def _holders(doc: dict, t: dict) -> tuple[list[int], tuple[int, ...]]:
    """The ranks holding a tensor's shards, and their device mesh."""
    return list(t.get("ranks", range(doc["ranks"]))), tuple(t.get("mesh", doc["mesh"]))


def check_writable(directory: str | Path) -> None:
    """A checkpoint may go to a new or empty directory, or replace a checkpoint; parc refuses
    to write among other files."""
    root = Path(directory)
    if root.exists() and not root.is_dir():
        raise UsageError(f"--checkpoint {root}: exists and is not a directory")
    existing = next(p for p in (root, *root.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise UsageError(f"--checkpoint {root}: {existing} is not a directory (parc writes the checkpoint there)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--checkpoint {root}: {'not writable' if existing == root else f'{existing} is not writable'}"
                         " (parc writes the checkpoint there)")
    if root.is_dir() and not (root / MANIFEST).is_file() and \
            any(not _LEFTOVER.fullmatch(p.name) for p in root.iterdir()):  # an interrupted first save is fine
        raise UsageError(f"--checkpoint {root}: holds files and no {MANIFEST}; refusing to write a "
                         f"checkpoint among them")


def check_checkpoint(directory: str | Path, hashes: bool = True) -> dict:
    """The checkpoint's manifest, or UsageError naming what is missing or changed (the shards'
    sha256 too, unless `hashes` is False)."""
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file():
        raise UsageError(f"--checkpoint {root}: no {MANIFEST} (no checkpoint was written there)")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"--checkpoint {root}: {MANIFEST} is not valid JSON ({e.msg})") from None
    if not isinstance(doc, dict) or doc.get("format") not in FORMATS:
        raise UsageError(f"--checkpoint {root}: unknown format {doc.get('format') if isinstance(doc, dict) else doc!r} "
                         f"(this parc reads {' and '.join(map(repr, FORMATS))})")
    for name in doc["files"]:
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise UsageError(f"--checkpoint {root}: {MANIFEST} names a file outside the directory ({name})")
        if not (root / name).is_file():
            raise UsageError(f"--checkpoint {root}: {name} is missing")
    if hashes:
        _check_hashes(root, doc, range(doc["ranks"]))
    return doc


def _check_hashes(root: Path, doc: dict, ranks) -> None:
    """The shard files of `ranks` against their sha256 in the manifest."""
    for q in ranks:
        f = _shard_file(root, doc, q)
        if sha256_file(f) != doc["files"][str(f.relative_to(root))]:
            raise UsageError(f"--checkpoint {root}: {f.relative_to(root)} does not match its sha256 in {MANIFEST}")


def check_resumable(directory: str | Path, plan_dir: str | Path, hashes: bool = True) -> dict:
    """The checkpoint's manifest when the plan in `plan_dir` can resume from it (every state
    tensor the plan holds is there, with its global shape and dtype; layouts may differ: they
    are resharded), else UsageError naming the first that is not. `hashes=False` leaves the
    shards' sha256 to `load_checkpoint` (each rank of a user's launcher checks this)."""
    from parc.plandir.taskgraph import load_taskgraph

    root = Path(directory)
    doc = check_checkpoint(root, hashes)
    graph = load_taskgraph(Path(plan_dir) / "taskgraph.json")
    trained: set[str] = set()
    for r in sorted({s["ranks"][0] for s in graph.stages} or {0}):
        for x in load_program(plan_dir, r).residents:
            if x["kind"] != "state":
                continue
            trained.add(x["name"])
            t = doc["tensors"].get(x["name"])
            if t is None:
                raise UsageError(f"--checkpoint {root}: has no tensor '{x['name']}', which the plan in {plan_dir} "
                                 "trains (a checkpoint of another model?)")
            if list(t["shape"]) != list(x["shape"]) or t["dtype"] != x["dtype"]:
                raise UsageError(f"--checkpoint {root}: '{x['name']}' is {t['dtype']} {list(t['shape'])} there, "
                                 f"{x['dtype']} {list(x['shape'])} in the plan in {plan_dir} (another model size?)")
    extra = sorted(set(doc["tensors"]) - trained)
    if extra:
        raise UsageError(f"--checkpoint {root}: holds {len(extra)} tensor(s) the plan in {plan_dir} does not train "
                         f"('{extra[0]}'{', ...' if len(extra) > 1 else ''}; a checkpoint of another model or optimizer?)")
    return doc


def full_tensors(directory: str | Path, doc: dict, names=None, strict: bool = True) -> dict[str, np.ndarray | None]:
    """Whole tensors assembled from a checkpoint's shards. Replicas that differ between ranks
    raise ShardSpecError, or with `strict=False` give None (`parc verify` reports a mismatch)."""
    root = Path(directory)
    files = [np.load(_shard_file(root, doc, q)) for q in range(doc["ranks"])]
    out: dict[str, np.ndarray | None] = {}
    for name, t in doc["tensors"].items():
        if names is not None and name not in names:
            continue
        ranks, mesh = _holders(doc, t)
        shards = {c: files[ranks[i]][name] for i, c in enumerate(devices(mesh))}
        try:
            out[name] = assemble(shards, ShardSpec.parse(t["spec"]), mesh)
        except ShardSpecError:
            if strict:
                raise
            out[name] = None
    return out


def load_checkpoint(directory: str | Path, runner) -> int:
    """Replace the runner's state by the checkpoint's; the step to continue from."""
    root = Path(directory)
    doc = check_checkpoint(root, hashes=False)  # each rank hashes only the shards it reads, below
    program = runner.program
    mine = {x["name"]: x for x in program.residents if x["kind"] == "state"}
    missing = sorted(set(mine) - set(doc["tensors"]))
    if missing:
        raise UsageError(f"--checkpoint {root}: no tensor '{missing[0]}' (a checkpoint of another model?)")
    mesh = _device_mesh(program)
    holders = (list(program.stage_ranks if program.stage_ranks is not None else range(runner.graph.ranks)), mesh)
    same = (doc["ranks"] == runner.graph.ranks and
            all(doc["tensors"][n]["spec"] == str(_device_spec(program, x["spec"])) and
                _holders(doc, doc["tensors"][n]) == holders for n, x in mine.items()))
    _check_hashes(root, doc, [runner.rank] if same else range(doc["ranks"]))
    if same:
        with np.load(_shard_file(root, doc, runner.rank)) as f:
            state = {n: f[n] for n in mine}
    else:  # reshard on load: this rank's shard of each whole tensor
        whole = full_tensors(root, doc, set(mine))
        coords = program.coords[1 if program.micro_batches > 1 else 0:]
        state = {}
        for n, x in mine.items():
            spec = _device_spec(program, x["spec"])
            a = whole[n]
            state[n] = np.asarray(a[np.ix_(*shard_index(a.shape, spec, mesh, coords))] if a.ndim else a, order="C")
    for n, a in state.items():
        if tuple(a.shape) != tuple(runner.state[n].shape):
            raise UsageError(f"--checkpoint {root}: '{n}' has shape {a.shape} here, the plan expects "
                             f"{runner.state[n].shape}")
        runner.state[n] = runner.xp.asarray(a.astype(runner.state[n].dtype, copy=False))
    return int(doc["step"])


def export_checkpoint(directory: str | Path, output: str | Path) -> Path:
    """The source model with the checkpoint's values as its initializers, as one ONNX file."""
    import onnx
    from onnx import numpy_helper

    from parc.ir.exporter import check_output_file

    root, out = Path(directory), Path(output)
    doc = check_checkpoint(root)
    src = Path((doc.get("model") or {}).get("path", ""))
    if not src.is_file():
        raise UsageError(f"{root}: the source model {src} is gone; export writes its trained values into it")
    if out.resolve() == src.resolve():
        raise UsageError(f"-o {out}: refusing to overwrite the source model")
    check_output_file(out)
    model = onnx.load(str(src))
    whole = full_tensors(root, doc)
    for i, t in enumerate(model.graph.initializer):
        if t.name in whole:
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(whole[t.name], t.name))
    big = sum(a.nbytes for a in whole.values()) > 1 << 30
    tmp = out.parent / f".{out.name}.tmp"
    onnx.save(model, str(tmp), save_as_external_data=big, location=out.name + ".data" if big else None)
    os.replace(tmp, out)
    return out
