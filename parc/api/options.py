"""PlanOptions: every choice `parc plan` takes besides the model and the cluster.

Each field mirrors a flag of `parc plan` (named in its comment); a bad value raises UsageError
naming that flag, so the command line and the library say the same thing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from parc.errors import UsageError
from parc.hints import Hints
from parc.passes.pipeline.stages import DEFAULT_TOLERANCE, tolerance_ok

LEVELS = ("O2", "O3")
MESH_DIMS = (1, 2, 3)


@dataclass(frozen=True)
class PlanOptions:
    """How to search a plan (docs/python-api.md); the defaults are `parc plan`'s."""

    level: str = "O3"  # -O2: segments stitched by DP; -O3: one ILP over the whole graph
    memory_limit_gib: float | None = None  # --mem-limit: memory per device (default: the device's)
    time_limit: float = 60.0  # --time-limit: seconds per solve (on time-out the best plan, with its gap)
    hints: Hints | str | Path | None = None  # --hints: a Hints object or a hints YAML file
    jobs: int | None = None  # --jobs: processes searching the meshes (default one per CPU; 1 in-process)
    micro_batches: int | None = None  # --micro-batches: M microbatches with gradient accumulation
    pipeline: str | int = "auto"  # --pipeline: "off", "auto" or a stage count >= 2
    pipeline_tolerance: float = DEFAULT_TOLERANCE  # --pipeline-tolerance: stage imbalance (Rhino 5.2's epsilon)
    all_devices: bool = False  # --all-devices: never leave the slower devices of a mixed cluster idle
    mesh_dims: int = 2  # --mesh-dims: device meshes of up to this many axes
    dims: Mapping[str, int] = field(default_factory=dict)  # --dim NAME=VALUE: bind symbolic dims
    calibration: str | Path | None = None  # --calibration: measured constants over the catalogue's

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise UsageError(f"level {self.level!r}: expected one of {', '.join(LEVELS)}")
        if not self.time_limit > 0:
            raise UsageError(f"--time-limit {self.time_limit}: expected a positive number of seconds")
        if self.memory_limit_gib is not None and not self.memory_limit_gib > 0:
            raise UsageError(f"--mem-limit {self.memory_limit_gib}: expected a positive number of GiB")
        if self.micro_batches is not None and self.micro_batches < 1:
            raise UsageError(f"--micro-batches {self.micro_batches}: expected a count >= 1")
        self.stages  # noqa: B018  (checks --pipeline)
        tolerance_ok(self.pipeline_tolerance)
        if self.mesh_dims not in MESH_DIMS:
            raise UsageError(f"--mesh-dims {self.mesh_dims}: expected 1, 2 or 3")
        if self.jobs is not None and self.jobs < 1:
            raise UsageError(f"--jobs {self.jobs}: expected a number of processes >= 1")
        for name, value in self.dims.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise UsageError(f"--dim {name}={value}: expected a positive integer")
        object.__setattr__(self, "dims", dict(self.dims))

    @property
    def stages(self) -> int:
        """--pipeline as a count: 0 for off, -1 for auto, else the stage count."""
        if isinstance(self.pipeline, int) and not isinstance(self.pipeline, bool):
            n = self.pipeline
        else:
            text = str(self.pipeline).strip().lower()
            if text == "off":
                return 0
            if text == "auto":
                return -1
            try:
                n = int(text)
            except ValueError:
                raise UsageError(f"--pipeline {self.pipeline}: expected off or a stage count") from None
        if n < 2:
            raise UsageError(f"--pipeline {self.pipeline}: a pipeline needs 2 or more stages (off: none)")
        return n

    @property
    def memory_budget(self) -> float | None:
        """Bytes per device, or None for each device's own memory."""
        return self.memory_limit_gib * 2**30 if self.memory_limit_gib is not None else None
