"""Read and check a plan directory's plan.json: the only input `parc explain` has.

The explainer never imports the planner (DESIGN guideline 8): it knows the plan.json format
versions it reads, and checks the keys it needs, naming the first one that is missing or of
the wrong type.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from parc.errors import PlanFormatError

PLAN_FILE = "plan.json"
FORMAT_VERSIONS = (1, 2)  # plan.json versions this explainer reads: 1 one mesh (parc.passes.spmd.search), 2 a pipeline (parc.passes.pipeline.plan)

# (dotted key, expected type, required): what the report reads. Optional keys may be absent
# (an older plan without `communication`), never of the wrong type.
_NUMBER = (int, float)
_KEYS: tuple[tuple[str, Any, bool], ...] = (
    ("format_version", int, True),
    ("mesh", dict, True),
    ("mesh.shape", list, True),
    ("predicted", dict, True),
    ("predicted.step_time_s", _NUMBER, True),
    ("predicted.compute_s", _NUMBER, True),
    ("predicted.comm_s", _NUMBER, True),
    ("predicted.memory_bytes_per_device", list, True),
    ("predicted.memory_budget_bytes", _NUMBER, True),
    ("specs", dict, True),
    ("strategies", dict, True),
    ("cluster", dict, False),
    ("cluster.nodes", list, False),
    ("mesh.links", list, False),
    ("model", dict, False),
    ("solver", dict, False),
    ("solver.meshes", list, False),
    ("communication", list, False),
    ("baselines", dict, False),
)


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


def load_plan(plan_dir: str | Path) -> dict[str, Any]:
    """The checked contents of PLAN_DIR/plan.json."""
    path = plan_path(plan_dir)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise PlanFormatError(f"{path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise PlanFormatError(f"{path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    check_plan(doc, str(path))
    return doc


def check_plan(doc: Any, where: str = PLAN_FILE) -> None:
    """Raise PlanFormatError unless `doc` is a plan.json this explainer reads."""
    if not isinstance(doc, dict):
        raise PlanFormatError(f"{where}: expected a JSON object, found {type(doc).__name__}")
    version = doc.get("format_version")
    if "format_version" in doc and version not in FORMAT_VERSIONS:
        readable = ", ".join(map(str, FORMAT_VERSIONS))
        raise PlanFormatError(f"{where}: unknown format_version {version!r} (this parc reads {readable})")
    for key, kind, required in _KEYS:
        found, value = _lookup(doc, key)
        if not found:
            if required:
                raise PlanFormatError(f"{where}: missing key '{key}'")
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise PlanFormatError(f"{where}: key '{key}' should be {_type_name(kind)}, "
                                  f"found {type(value).__name__}")
    if not doc["mesh"]["shape"] or not all(isinstance(n, int) and n > 0 for n in doc["mesh"]["shape"]):
        raise PlanFormatError(f"{where}: mesh.shape should be a list of positive ints, "
                              f"found {doc['mesh']['shape']!r}")


def _lookup(doc: dict, dotted: str) -> tuple[bool, Any]:
    value: Any = doc
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _type_name(kind: Any) -> str:
    if kind is _NUMBER:
        return "a number"
    return {dict: "an object", list: "a list", int: "an integer", str: "a string"}.get(kind, str(kind))
