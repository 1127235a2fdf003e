"""plan.json as typed objects: the plan the planner decided, in one format (docs/plan.md).

A plan is a list of stages on device groups; a one-mesh (SPMD) plan is one stage. The planner
builds a `Plan`, `write_plan` writes its `to_json`, and every reader (`parc run`, `verify`,
`explain`, `simulate`, checkpoints) gets it back from `load_plan` as objects:
`Plan.from_json(plan.to_json()) == plan`. A plan.json of an older format is refused with one
line saying to plan again.

Search records that only a person reads (the meshes and stage counts tried, each collective's
breakdown, the simulated timeline) stay JSON objects: they are kept and written back as they
are, and their keys are documented in docs/plan.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from parc.cluster import Cluster
from parc.errors import PlanFormatError

PLAN_FORMAT = 3  # one format: stages (one for a one-mesh plan), schedule, step roles
OLDER_FORMATS = (1, 2)  # written by earlier versions of parc (one mesh; a pipeline)

Record = dict[str, Any]  # a JSON object kept as it is (see the module docstring)


def _floats(x: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in x)


@dataclass(frozen=True)
class MeshLayout:
    """The device mesh of the plan (a pipeline's: the stage axis first, then its stages' mesh)."""

    shape: tuple[int, ...]
    links: tuple[Record, ...] = ()  # per axis: the link's name, bandwidth and latency
    spans_nodes: tuple[bool, ...] = ()  # per axis: whether it crosses node boundaries
    devices: tuple[int, ...] | None = None  # a one-mesh plan's devices in mesh order
    pipeline: bool = False  # axis 0 is the pipeline's stages

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        object.__setattr__(self, "links", tuple(dict(x) for x in self.links))
        object.__setattr__(self, "spans_nodes", tuple(bool(x) for x in self.spans_nodes))
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))

    def to_json(self) -> Record:
        doc: Record = {"shape": list(self.shape), "links": [dict(x) for x in self.links],
                       "spans_nodes": list(self.spans_nodes)}
        if self.devices is not None:
            doc["devices"] = list(self.devices)
        if self.pipeline:
            doc["pipeline"] = True
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> MeshLayout:
        return cls(doc["shape"], doc.get("links", ()), doc.get("spans_nodes", ()), doc.get("devices"),
                   bool(doc.get("pipeline", False)))


@dataclass(frozen=True)
class Stage:
    """One stage: its device group, its mesh, the values' layouts there, and the planner's figures
    (seconds; the per-microbatch split is None in a one-mesh plan)."""

    id: int
    devices: tuple[int, ...]
    mesh: tuple[int, ...]
    device_types: tuple[str, ...]
    nodes: int  # forward nodes it computes (a one-mesh plan: every node)
    step_time_s: float
    memory_bytes_per_device: float
    parameters: int  # parameter elements it holds
    specs: dict[str, str] = field(default_factory=dict)  # value -> its layout on this stage's mesh
    forward_s: float | None = None
    backward_s: float | None = None
    per_micro_batch_s: float | None = None
    optimizer_s: float | None = None
    send_s: float | None = None
    solver: Record = field(default_factory=dict)  # status and gap of its SPMD search

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
        object.__setattr__(self, "mesh", tuple(int(n) for n in self.mesh))
        object.__setattr__(self, "device_types", tuple(self.device_types))
        object.__setattr__(self, "specs", dict(self.specs))

    def to_json(self, with_specs: bool = True) -> Record:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc.update(devices=list(self.devices), mesh=list(self.mesh), device_types=list(self.device_types))
        if not with_specs:
            del doc["specs"]
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any], specs: Mapping[str, str] | None = None) -> Stage:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in doc.items() if k in names}
        if "specs" not in kw:
            kw["specs"] = dict(specs or {})
        return cls(**kw)


@dataclass(frozen=True)
class Schedule:
    """The pipeline schedule: its kind, the microbatches per step, and the counts searched."""

    kind: str = "1f1b"
    micro_batches: int = 1
    searched: tuple[Record, ...] = ()

    def to_json(self) -> Record:
        return {"kind": self.kind, "micro_batches": self.micro_batches, "searched": [dict(x) for x in self.searched]}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Schedule:
        return cls(str(doc["kind"]), int(doc["micro_batches"]), tuple(dict(x) for x in doc.get("searched", ())))


@dataclass(frozen=True)
class Tensor:
    """A named value of the planned graph: its whole shape, type, bytes and role."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    role: str = "value"  # see ROLES

    def to_json(self) -> Record:
        return {"shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes, "role": self.role,
                "parameter": self.role == PARAMETER}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Tensor:
        return cls(tuple(int(n) for n in doc["shape"]), str(doc["dtype"]), int(doc["bytes"]),
                   str(doc.get("role", PARAMETER if doc.get("parameter") else VALUE)))


PARAMETER, STATE, GRADIENT, NEW, DATA, VALUE = "parameter", "state", "gradient", "new", "data", "value"
ROLES = (PARAMETER, STATE, GRADIENT, NEW, DATA, VALUE)  # NEW: a parameter's or state's next value


@dataclass(frozen=True)
class ParameterRole:
    """A trained parameter of a training step: its gradient, its next value, and its optimizer
    state (state input -> its next value)."""

    gradient: str | None
    new: str | None
    state: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> Record:
        return {"gradient": self.gradient, "new": self.new, "state": dict(self.state)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ParameterRole:
        return cls(doc.get("gradient"), doc.get("new"), dict(doc.get("state", {})))


@dataclass(frozen=True)
class StepRoles:
    """What a training step's values are (from `parc grad`'s record): the loss, the data inputs,
    each parameter's role, the optimizer and the precision of its products."""

    loss: str | None
    data: tuple[str, ...]
    parameters: dict[str, ParameterRole]
    optimizer: Record | None = None
    precision: Record = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", tuple(self.data))

    def to_json(self) -> Record:
        return {"loss": self.loss, "data": list(self.data), "optimizer": self.optimizer,
                "precision": dict(self.precision),
                "parameters": {k: p.to_json() for k, p in self.parameters.items()}}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StepRoles:
        return cls(doc.get("loss"), tuple(doc.get("data", ())),
                   {k: ParameterRole.from_json(v) for k, v in doc.get("parameters", {}).items()},
                   doc.get("optimizer"), dict(doc.get("precision") or {}))


@dataclass(frozen=True)
class Prediction:
    """The planner's figures for one step (seconds, bytes): predicted, not measured."""

    step_time_s: float
    compute_s: float
    comm_s: float
    memory_bytes_per_device: tuple[float, ...]
    memory_budget_bytes: float
    bubble_s: float = 0.0
    per_device: Record = field(default_factory=dict)  # mixed devices: compute and budgets per device

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_bytes_per_device", _floats(self.memory_bytes_per_device))

    def to_json(self) -> Record:
        return {"step_time_s": self.step_time_s, "compute_s": self.compute_s, "comm_s": self.comm_s,
                "bubble_s": self.bubble_s, "memory_bytes_per_device": list(self.memory_bytes_per_device),
                "memory_budget_bytes": self.memory_budget_bytes, **self.per_device}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Prediction:
        known = ("step_time_s", "compute_s", "comm_s", "bubble_s", "memory_bytes_per_device", "memory_budget_bytes")
        return cls(float(doc["step_time_s"]), float(doc["compute_s"]), float(doc["comm_s"]),
                   doc["memory_bytes_per_device"], float(doc["memory_budget_bytes"]), float(doc.get("bubble_s", 0.0)),
                   {k: v for k, v in doc.items() if k not in known})

    @property
    def max_memory_bytes(self) -> float:
        return max(self.memory_bytes_per_device, default=0.0)


@dataclass(frozen=True)
class Baseline:
    """A baseline strategy priced in the same cost model (predicted): its step, memory and whether
    it fits; `details` holds what else its search reported (gap, stage meshes, devices...)."""

    step_time_s: float | None
    feasible: bool
    memory_bytes_per_device: float | None = None
    details: Record = field(default_factory=dict)

    def to_json(self) -> Record:
        return {**self.details, "step_time_s": self.step_time_s, "feasible": self.feasible,
                "memory_bytes_per_device": self.memory_bytes_per_device}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Baseline:
        known = ("step_time_s", "feasible", "memory_bytes_per_device")
        return cls(doc.get("step_time_s"), bool(doc.get("feasible", True)), doc.get("memory_bytes_per_device"),
                   {k: v for k, v in doc.items() if k not in known})


@dataclass(frozen=True)
class ModelRef:
    """The source model a plan was made from."""

    path: str
    sha256: str


@dataclass(frozen=True)
class Plan:
    """plan.json: what `parc plan` decided, and what it predicts."""

    cluster: Cluster
    mesh: MeshLayout
    stages: tuple[Stage, ...]
    schedule: Schedule
    specs: dict[str, str]  # value -> layout (a value on several stages: the first stage's)
    strategies: dict[str, str]  # node -> its strategy's label per mesh axis
    predicted: Prediction
    phases: dict[str, str] = field(default_factory=dict)  # node -> BACKWARD or OPTIMIZER (absent: FORWARD)
    baselines: dict[str, Baseline] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)
    step: StepRoles | None = None  # None: not a training step
    solver: Record = field(default_factory=dict)  # level, time, gap, status, meshes (and pipelines) tried
    communication: tuple[Record, ...] | None = None  # each resharding edge's collectives and time (predicted)
    micro: Record | None = None  # microbatching: count, and each value's layout on the time axis
    transfers: tuple[Record, ...] = ()  # a pipeline's values crossing stages
    stage_search: Record | None = None  # a pipeline's stage ILP: status, tolerance, balance
    spmd_only: Record | None = None  # a pipeline: the best one-mesh plan's figures
    balance: Record | None = None  # mixed devices on one mesh: the shares per axis
    devices_given: Record | None = None  # a mixed cluster: the devices given, used and left idle
    hints: Record | None = None
    model: ModelRef | None = None
    simulation: Record | None = None  # `parc simulate`'s figures for one step (predicted)
    format_version: int = PLAN_FORMAT

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.communication is not None:
            object.__setattr__(self, "communication", tuple(self.communication))
        object.__setattr__(self, "transfers", tuple(self.transfers))

    @property
    def pipelined(self) -> bool:
        return len(self.stages) > 1

    @property
    def micro_batches(self) -> int:
        return self.schedule.micro_batches

    @property
    def ranks(self) -> int:
        return sum(len(s.devices) for s in self.stages)

    def replace(self, **changes: Any) -> Plan:
        """This plan with `changes` to its fields."""
        return replace(self, **changes)

    def to_json(self) -> Record:
        one = len(self.stages) == 1
        return {
            "format_version": self.format_version,
            "cluster": self.cluster.to_json(),
            "mesh": self.mesh.to_json(),
            "stages": [s.to_json(with_specs=not one) for s in self.stages],
            "schedule": self.schedule.to_json(),
            "specs": dict(self.specs),
            "strategies": dict(self.strategies),
            "phases": dict(self.phases),
            "predicted": self.predicted.to_json(),
            "baselines": {k: b.to_json() for k, b in self.baselines.items()},
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "step": self.step.to_json() if self.step is not None else None,
            "solver": dict(self.solver),
            "communication": [dict(c) for c in self.communication] if self.communication is not None else None,
            "micro_batches": self.micro,
            "transfers": [dict(t) for t in self.transfers],
            "stage_search": self.stage_search,
            "spmd_only": self.spmd_only,
            "balance": self.balance,
            "devices_given": self.devices_given,
            "hints": self.hints,
            "model": {"path": self.model.path, "sha256": self.model.sha256} if self.model else None,
            "simulation": self.simulation,
        }

    @classmethod
    def from_json(cls, doc: Any, where: str = "plan.json") -> Plan:
        """The Plan of a plan.json document, or PlanFormatError naming the first key missing or of
        the wrong type (an older format: one line saying to plan again)."""
        check_plan(doc, where)
        try:
            return cls._from_checked(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a nested value of the wrong shape
            raise PlanFormatError(f"{where}: malformed plan ({type(e).__name__}: {e})"[:300]) from None

    @classmethod
    def _from_checked(cls, doc: Mapping[str, Any]) -> Plan:
        specs = doc["specs"]
        model = doc.get("model")
        return cls(
            cluster=Cluster.from_json(doc["cluster"]),
            mesh=MeshLayout.from_json(doc["mesh"]),
            stages=tuple(Stage.from_json(s, specs) for s in doc["stages"]),
            schedule=Schedule.from_json(doc["schedule"]),
            specs=dict(specs), strategies=dict(doc["strategies"]), phases=dict(doc.get("phases") or {}),
            predicted=Prediction.from_json(doc["predicted"]),
            baselines={k: Baseline.from_json(v) for k, v in (doc.get("baselines") or {}).items()},
            tensors={k: Tensor.from_json(v) for k, v in (doc.get("tensors") or {}).items()},
            step=StepRoles.from_json(doc["step"]) if doc.get("step") else None,
            solver=dict(doc.get("solver") or {}),
            communication=tuple(doc["communication"]) if doc.get("communication") is not None else None,
            micro=doc.get("micro_batches"),
            transfers=tuple(doc.get("transfers") or ()),
            stage_search=doc.get("stage_search"), spmd_only=doc.get("spmd_only"), balance=doc.get("balance"),
            devices_given=doc.get("devices_given"), hints=doc.get("hints"),
            model=ModelRef(str(model["path"]), str(model["sha256"])) if model else None,
            simulation=doc.get("simulation"),
            format_version=int(doc["format_version"]),
        )


# -- checks ---------------------------------------------------------------------------------------

_NUMBER = (int, float)
# (dotted key, expected type, required): what readers of plan.json rely on. Optional keys may be
# absent or null, never of the wrong type.
_PLAN_KEYS: tuple[tuple[str, Any, bool], ...] = (
    ("format_version", int, True),
    ("cluster", dict, True),
    ("cluster.nodes", list, True),
    ("cluster.device_types", dict, True),
    ("mesh", dict, True),
    ("mesh.shape", list, True),
    ("stages", list, True),
    ("schedule", dict, True),
    ("schedule.kind", str, True),
    ("schedule.micro_batches", int, True),
    ("predicted", dict, True),
    ("predicted.step_time_s", _NUMBER, True),
    ("predicted.compute_s", _NUMBER, True),
    ("predicted.comm_s", _NUMBER, True),
    ("predicted.memory_bytes_per_device", list, True),
    ("predicted.memory_budget_bytes", _NUMBER, True),
    ("specs", dict, True),
    ("strategies", dict, True),
    ("phases", dict, False),
    ("tensors", dict, False),
    ("step", dict, False),
    ("model", dict, False),
    ("solver", dict, False),
    ("communication", list, False),
    ("baselines", dict, False),
    ("simulation", dict, False),
    ("simulation.step_time_s", _NUMBER, False),
    ("simulation.timeline", dict, False),
)
_STAGE_KEYS: tuple[tuple[str, Any], ...] = (
    ("id", int), ("devices", list), ("mesh", list), ("device_types", list), ("nodes", int),
    ("step_time_s", _NUMBER), ("memory_bytes_per_device", _NUMBER), ("parameters", int),
)


def check_plan(doc: Any, where: str = "plan.json") -> None:
    """Raise PlanFormatError unless `doc` is a plan.json of the format this parc reads."""
    if not isinstance(doc, dict):
        raise PlanFormatError(f"{where}: expected a JSON object, found {type(doc).__name__}")
    version = doc.get("format_version")
    if version in OLDER_FORMATS:
        raise PlanFormatError(f"{where}: a plan of format {version}, written by an older parc: plan the model "
                              f"again (this parc reads format {PLAN_FORMAT})")
    if "format_version" in doc and version != PLAN_FORMAT:
        raise PlanFormatError(f"{where}: unknown format_version {version!r} (this parc reads {PLAN_FORMAT})")
    for key, kind, required in _PLAN_KEYS:
        found, value = _lookup(doc, key)
        if not found or (value is None and not required):
            if required:
                raise PlanFormatError(f"{where}: missing key '{key}'")
            continue
        check_type(value, kind, where, key)
    shape = doc["mesh"]["shape"]
    if not shape or not all(is_int(n) and n > 0 for n in shape):
        raise PlanFormatError(f"{where}: mesh.shape should be a list of positive ints, found {shape!r}")
    if not doc["stages"]:
        raise PlanFormatError(f"{where}: key 'stages' should list at least one stage")
    for i, stage in enumerate(doc["stages"]):
        check_type(stage, dict, where, f"stages[{i}]")
        for key, kind in _STAGE_KEYS:
            if key not in stage:
                raise PlanFormatError(f"{where}: missing key 'stages[{i}].{key}'")
            check_type(stage[key], kind, where, f"stages[{i}].{key}")
    for name, b in (doc.get("baselines") or {}).items():
        check_type(b, dict, where, f"baselines.{name}")


def _lookup(doc: dict, dotted: str) -> tuple[bool, Any]:
    value: Any = doc
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def check_type(value: Any, kind: Any, where: str, key: str) -> None:
    """PlanFormatError unless `value` (at `key` of `where`) is of `kind` (a bool is no number)."""
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise PlanFormatError(f"{where}: key '{key}' should be {type_name(kind)}, found {type(value).__name__}")


def is_int(n: Any) -> bool:
    """An int that is not a bool (JSON's true is no count)."""
    return isinstance(n, int) and not isinstance(n, bool)


def type_name(kind: Any) -> str:
    if kind is _NUMBER:
        return "a number"
    if isinstance(kind, tuple):
        return " or ".join(type_name(k) for k in kind)
    names = {dict: "an object", list: "a list", int: "an integer", str: "a string", type(None): "null"}
    return names.get(kind, str(kind))
