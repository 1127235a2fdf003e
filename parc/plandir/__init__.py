"""The plan directory: its layout, and the formats of plan.json, program.json and manifest.json
(`parc.plandir.manifest`; taskgraph.json's format is `parc.plandir.taskgraph`'s).

    PLAN_DIR/
      plan.json              the plan (docs/plan.md; `parc.plandir.plan`: one format, stages)
      taskgraph.json         tasks, edges, each rank's order (format owned by parc.plandir.taskgraph)
      model.sharded.onnx     the source annotated with ONNX's multi-device fields
      rank_<r>/program.json  what rank r's executor holds (`Program`, format parc.program/1)
      rank_<r>/*.onnx, weights.bin   its modules, and init.onnx with its shards
      manifest.json          the sha256 of every file (parc.plandir.manifest)

The planner stamps the versions defined here and every reader accepts exactly these, so the two
cannot disagree. Readers check what they rely on and raise a one-line PlanFormatError naming the
file and the first key that is missing or of the wrong type. Neither the planner nor the executor
is imported here (DESIGN guideline 8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from parc.errors import PlanFormatError
from parc.ir.dtypes import onnx_nbytes
from parc.plandir.manifest import MANIFEST, check_manifest, sha256_file, write_manifest
from parc.plandir.plan import PLAN_FORMAT, Plan, check_plan, check_type, is_int
from parc.plandir.taskgraph import TASKGRAPH_FILE

__all__ = ["MANIFEST", "PLAN_FILE", "PLAN_FORMAT", "PROGRAM_FILE", "PROGRAM_FORMAT", "Plan", "Program",
           "TASKGRAPH_FILE", "check_manifest", "check_plan", "load_plan", "load_program", "plan_path",
           "program_path", "rank_dir", "sha256_file", "write_manifest", "write_plan", "write_program"]

PLAN_FILE = "plan.json"
PROGRAM_FILE = "program.json"
PROGRAM_FORMAT = "parc.program/1"


def rank_dir(plan_dir: str | Path, rank: int) -> Path:
    """The directory of one rank's files."""
    return Path(plan_dir) / f"rank_{rank}"


def program_path(plan_dir: str | Path, rank: int) -> Path:
    return rank_dir(plan_dir, rank) / PROGRAM_FILE


# -- plan.json ------------------------------------------------------------------------------------

def plan_path(plan_dir: str | Path) -> Path:
    """The plan.json of a plan directory, or PlanFormatError saying what is missing."""
    d = Path(plan_dir)
    if not d.exists():
        raise PlanFormatError(f"{d}: no such plan directory")
    if not d.is_dir():
        raise PlanFormatError(f"{d}: not a plan directory (expected a directory holding {PLAN_FILE})")
    path = d / PLAN_FILE
    if not path.is_file():
        raise PlanFormatError(f"{d}: no {PLAN_FILE} in the plan directory (was it written by `parc plan`?)")
    return path


def write_plan(plan_dir: str | Path, plan: Plan) -> None:
    """Write a plan's plan.json. What is written reads back as the same Plan (checked on every
    write: a field that does not survive JSON is a bug here, not a reader's problem)."""
    text = json.dumps(plan.to_json(), indent=1, sort_keys=True) + "\n"
    assert Plan.from_json(json.loads(text)) == plan, "plan.json does not read back as the plan written"
    (Path(plan_dir) / PLAN_FILE).write_text(text)


def load_plan(plan_dir: str | Path) -> Plan:
    """The checked plan.json of a plan directory, as a Plan."""
    path = plan_path(plan_dir)
    return Plan.from_json(_read_json(path), str(path))


# -- rank_<r>/program.json ------------------------------------------------------------------------

@dataclass(frozen=True)
class Program:
    """rank_<r>/program.json: what one rank's executor holds, feeds and hands back.

    A resident is a dict: `name`, `kind` (data, state, weight, recv), `spec` (its layout on
    `mesh`), `shape` (global), `local`, `dtype` (ONNX), `high` (integer data: the smallest table
    it indexes, or None) and, for a parameter, `init` (the seeded init's `mean` and `std`). The
    stage fields are set in a pipeline stage's program only, all together."""

    rank: int
    coords: tuple[int, ...]  # the rank's coordinates on `mesh`
    mesh: tuple[int, ...]  # the model's mesh (time axis first when microbatched)
    micro_batches: int
    residents: tuple[dict[str, Any], ...]
    outputs: dict[str, str]  # graph output -> local name
    accumulate: dict[str, list]  # value of the apply part -> [micro value, "sum" | "last" | "concat", dim]
    bindings: dict[str, str]  # step output -> the input it feeds next step
    loss: str | None  # the loss output, if this rank computes it
    stage: int | None = None
    stages: int | None = None  # the pipeline's stage count
    stage_ranks: tuple[int, ...] | None = None  # the global ranks of this stage
    data_inputs: tuple[dict[str, Any], ...] | None = None  # the whole step's data inputs (residents)
    reporter: int | None = None  # the rank that holds the loss

    def __post_init__(self) -> None:
        for key, make in (("coords", tuple), ("mesh", tuple), ("residents", tuple), ("outputs", dict),
                          ("bindings", dict), ("stage_ranks", tuple), ("data_inputs", tuple)):
            if getattr(self, key) is not None:
                object.__setattr__(self, key, make(getattr(self, key)))
        object.__setattr__(self, "accumulate", {k: list(v) for k, v in self.accumulate.items()})
        given = [getattr(self, key) is not None for key, _ in _STAGE_KEYS]
        assert all(given) or not any(given), f"rank {self.rank}: the stage fields come together"

    def to_json(self) -> dict[str, Any]:
        doc = {"format": PROGRAM_FORMAT, "rank": self.rank, "coords": list(self.coords), "mesh": list(self.mesh),
               "micro_batches": self.micro_batches, "residents": [dict(x) for x in self.residents],
               "outputs": dict(self.outputs), "accumulate": {k: list(v) for k, v in self.accumulate.items()},
               "bindings": dict(self.bindings), "loss": self.loss}
        if self.stage is not None:
            doc.update(stage=self.stage, stages=self.stages, stage_ranks=list(self.stage_ranks or ()),
                       data_inputs=[dict(x) for x in self.data_inputs or ()], reporter=self.reporter)
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str = PROGRAM_FILE) -> Program:
        """The Program of `doc`, or PlanFormatError naming the first key missing or of the wrong type."""
        if not isinstance(doc, dict):
            raise PlanFormatError(f"{where}: expected a JSON object, found {type(doc).__name__}")
        if "format" not in doc:
            raise PlanFormatError(f"{where}: missing key 'format'")
        if doc["format"] != PROGRAM_FORMAT:
            raise PlanFormatError(f"{where}: unknown format {doc['format']!r} (this parc reads {PROGRAM_FORMAT!r})")
        _check_keys(doc, _PROGRAM_KEYS, where)
        if any(key in doc for key, _ in _STAGE_KEYS):
            _check_keys(doc, _STAGE_KEYS, where)
        for key in ("coords", "mesh", "stage_ranks"):
            if key in doc:
                _check_ints(doc[key], where, key)
        for key in ("outputs", "bindings"):
            for name, local in doc[key].items():
                check_type(local, str, where, f"{key}.{name}")
        for name, how in doc["accumulate"].items():
            _check_accumulation(how, where, f"accumulate.{name}")
        for key in ("residents", "data_inputs"):
            for i, x in enumerate(doc.get(key, ())):
                _check_resident(x, where, f"{key}[{i}]")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})


# (key, JSON type) of program.json; the stage keys are all present or all absent.
_PROGRAM_KEYS: tuple[tuple[str, Any], ...] = (
    ("rank", int), ("coords", list), ("mesh", list), ("micro_batches", int), ("residents", list),
    ("outputs", dict), ("accumulate", dict), ("bindings", dict), ("loss", (str, type(None))),
)
_STAGE_KEYS: tuple[tuple[str, Any], ...] = (
    ("stage", int), ("stages", int), ("stage_ranks", list), ("data_inputs", list), ("reporter", int),
)
_RESIDENT_KEYS: tuple[tuple[str, Any], ...] = (
    ("name", str), ("kind", str), ("spec", str), ("shape", list), ("local", list), ("dtype", int),
    ("high", (int, type(None))),
)
_ACCUMULATIONS = ("sum", "last", "concat")


def local_bytes(resident: dict[str, Any]) -> int:
    """Bytes of a program resident's local shard (its `local` shape and ONNX `dtype`)."""
    return onnx_nbytes(resident["local"], resident["dtype"])


def write_program(plan_dir: str | Path, program: Program) -> Path:
    """Write rank_<r>/program.json of `program`'s rank; its path."""
    path = program_path(plan_dir, program.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(program.to_json(), indent=1, sort_keys=True) + "\n")
    return path


def load_program(plan_dir: str | Path, rank: int) -> Program:
    """The checked rank_<rank>/program.json of a plan directory."""
    path = program_path(plan_dir, rank)
    if not path.is_file():
        raise PlanFormatError(f"{path}: missing (every rank of a plan has one; planned with --no-programs?)")
    program = Program.from_json(_read_json(path), str(path))
    if program.rank != rank:
        raise PlanFormatError(f"{path}: key 'rank' should be {rank} (the directory's rank), found {program.rank}")
    return program


def _check_resident(x: Any, where: str, key: str) -> None:
    check_type(x, dict, where, key)
    _check_keys(x, _RESIDENT_KEYS, where, f"{key}.")
    _check_ints(x["shape"], where, f"{key}.shape")
    _check_ints(x["local"], where, f"{key}.local")
    if "init" in x:
        check_type(x["init"], dict, where, f"{key}.init")
        _check_keys(x["init"], (("mean", (int, float)), ("std", (int, float))), where, f"{key}.init.")


def _check_accumulation(how: Any, where: str, key: str) -> None:
    """[micro value, "sum" | "last"] or [micro value, "concat", dim]."""
    ok = (isinstance(how, list) and len(how) >= 2 and isinstance(how[0], str) and how[1] in _ACCUMULATIONS
          and (how[1] != "concat" or len(how) == 3 and is_int(how[2])))
    if not ok:
        raise PlanFormatError(f"{where}: key '{key}' should be [value, one of {', '.join(_ACCUMULATIONS)}"
                              f" (concat: and a dim)], found {how!r}")


# -- shared checks --------------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise PlanFormatError(f"{path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def _check_keys(doc: dict, keys: tuple[tuple[str, Any], ...], where: str, prefix: str = "") -> None:
    for key, kind in keys:
        if key not in doc:
            raise PlanFormatError(f"{where}: missing key '{prefix}{key}'")
        check_type(doc[key], kind, where, prefix + key)


def _check_ints(value: list, where: str, key: str) -> None:
    if not all(is_int(n) for n in value):
        raise PlanFormatError(f"{where}: key '{key}' should be a list of integers, found {value!r}")
