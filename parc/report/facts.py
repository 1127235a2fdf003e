"""The report's facts: frozen dataclasses whose fields are the keys of `parc explain --format json`.

`dataclasses.asdict` of a Report, with `format` added, is the JSON object (docs/explain.md lists
every key); the text, Markdown and HTML renderers read the same object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

REPORT_FORMAT = "parc.explain/1"


@dataclass(frozen=True)
class MeshAxis:
    """One axis of the chosen mesh and the link its collectives run on."""

    size: int
    link: str | None
    bandwidth: float | None  # bytes/s
    latency: float | None  # s
    spans_nodes: bool | None
    call: float | None = None  # s each collective pays once (a calibrated host whose ranks share cores)
    handoff: float | None = None  # s the first after compute pays more
    kinds: dict | None = None  # collective kind -> [latency s, bandwidth B/s] of its own (`LinkSpec.kinds`)
    step_ratio: float | None = None  # what a collective in a step takes against its figures (a calibration's)
    groups: list[list[int]] | None = None  # the device groups whose collectives run along this axis


@dataclass(frozen=True)
class MeshTried:
    """One mesh the solver tried (feasible or not) and its predicted step time."""

    shape: list[int]
    feasible: bool
    step_time_s: float | None
    gap: float | None
    chosen: bool
    skipped: str | None = None  # why the hints rule the mesh out (not tried)
    stage: int | None = None  # a pipelined plan: the stage whose group it is a mesh of
    lower_bound_s: float | None = None  # proven: no plan on this mesh is faster


@dataclass(frozen=True)
class Summary:
    """Devices, the chosen mesh, the meshes tried, and the solver's statistics."""

    devices: int
    nodes: int  # machines in the cluster
    device_types: dict[str, int]  # type name -> count
    cluster: str  # one line in words
    mesh_shape: list[int]
    mesh_axes: list[MeshAxis]
    meshes: list[MeshTried]
    solver_level: str | None
    solver_time_s: float | None
    solver_gap: float | None
    solver_status: str | None
    solver_nodes: int | None  # problem nodes (sources and ops)
    solver_gap_over_meshes: float | None = None  # how much faster any mesh's plan can be


@dataclass(frozen=True)
class Step:
    """The predicted step time of the plan and its split into compute and communication."""

    step_time_s: float
    compute_s: float
    comm_s: float
    comm_fraction: float  # comm_s / step_time_s


@dataclass(frozen=True)
class Group:
    """The nodes of one scope (layer) and the strategies they run with."""

    scope: str
    nodes: int
    phases: dict[str, int]  # forward / backward / optimizer -> node count
    strategy: str | None  # the dominant strategy of its forward and backward nodes, in words (None: none)
    strategy_nodes: int  # forward and backward nodes that run it
    optimizer_strategy: str | None  # the dominant strategy of its optimizer nodes (None: none)
    optimizer_nodes: int  # optimizer nodes that run it
    strategies: dict[str, int]  # every strategy in words -> node count


@dataclass(frozen=True)
class Parameter:
    """One trained parameter: its layout and its optimizer state's."""

    name: str
    scope: str
    spec: str
    layout: str  # the spec in words
    sharded: bool
    new_spec: str | None  # the layout the step's update leaves it in (spec of X.new)
    state: dict[str, str]  # state name -> spec
    bytes: int | None  # whole tensor; None: plan.json has no sizes


@dataclass(frozen=True)
class Parameters:
    """Parameter layouts: how many are replicated and how many sharded (and bytes when known)."""

    rule: str
    count: int
    replicated: int
    sharded: int
    state_tensors: int
    state_sharded: int
    relaid: int  # parameters and state tensors whose X.new layout differs from X's (resharded between steps)
    replicated_bytes: int | None
    sharded_bytes: int | None
    items: list[Parameter]


@dataclass(frozen=True)
class CommStat:
    """Collectives of one kind or on one mesh axis."""

    key: str  # the kind (all_gather...) or the axis ("0", "1")
    count: int
    bytes_per_device: float
    time_s: float


@dataclass(frozen=True)
class Edge:
    """One resharded edge: a value turned from one layout into another for a consumer."""

    value: str
    consumer: str
    src: str  # plan.json's `from`
    dst: str  # plan.json's `to`
    collectives: list[str]  # `kind@axis` each
    bytes_per_device: float
    time_s: float


@dataclass(frozen=True)
class Communication:
    """Communication of one step: totals over plan.json's edges, by kind, by axis, the top edges."""

    recorded: bool  # plan.json has a `communication` list
    edges: int
    collectives: int
    bytes_per_device: float  # sum over edges and their collectives
    time_s: float  # sum of the edges' time_s
    predicted_s: float  # predicted.comm_s
    unitemized_s: float  # predicted_s - time_s (no edge in plan.json carries it)
    by_kind: list[CommStat]
    by_axis: list[CommStat]
    top_edges: list[Edge]  # at most 10, slowest first


@dataclass(frozen=True)
class Memory:
    """Predicted memory per device against the budget."""

    per_device_bytes: list[float]
    max_bytes: float
    budget_bytes: float
    fraction: float  # max_bytes / budget_bytes


@dataclass(frozen=True)
class Baseline:
    """A baseline strategy priced in the same cost model, relative to the plan."""

    name: str
    feasible: bool
    step_time_s: float | None
    time_ratio: float | None  # baseline / plan step time
    memory_bytes_per_device: float | None
    memory_ratio: float | None  # baseline / plan memory per device




@dataclass(frozen=True)
class SimRank:
    """One rank's share of the simulated step."""

    rank: int
    busy_s: float
    compute_s: float
    comm_s: float
    wait_s: float
    peak_bytes: int | None  # None: the simulation does not track memory


@dataclass(frozen=True)
class Simulation:
    """One step replayed on the task graph, as plan.json's `simulation` records it."""

    step_time_s: float
    bubble_s: float
    exposed_comm_s: float  # communication no compute overlaps
    hidden_comm_s: float  # communication that overlaps compute
    ranks: list[SimRank]
    # rank (a string, as in JSON) -> spans (start_s, end_s, kind in SPAN_KINDS, label); at most 16 ranks
    timeline: dict[str, list[tuple[float, float, str, str]]]
    critical_path: list[str]  # task ids


@dataclass(frozen=True)
class Report:
    """Everything `parc explain` says about one plan."""

    plan: str  # the plan.json read
    format_version: int
    model: str | None  # model.path in plan.json
    summary: Summary
    step: Step
    groups: list[Group]
    strategy_mix: dict[str, dict[str, int]]  # phase -> strategy in words -> node count
    parameters: Parameters
    communication: Communication
    memory: Memory
    baselines: list[Baseline]
    why: list[str]
    # a pipelined plan (plan.json format 2): its stages, schedule, transfers and what it beat
    pipeline: dict[str, Any] | None = None
    # a mesh of mixed devices: per device its type, compute and memory, and the axes' balance
    mixed: dict[str, Any] | None = None
    # on a mixed cluster, plan.json's `devices_given`: the cluster given, the nodes used, the
    # device types left idle, and each set of nodes planned on
    given: dict[str, Any] | None = None
    # plan.json's `simulation`: the step replayed task by task (None: the plan has none)
    simulation: Simulation | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format": REPORT_FORMAT, **asdict(self)}
