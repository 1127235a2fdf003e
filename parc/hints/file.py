"""The hints file (Whale 3.1.2): scopes that request replicate(n) or split(n), and pinned layouts.

```yaml
default: auto                    # auto (the search decides), replicate or split (over every device)
scopes:                          # first match wins; a Whale TaskGraph each
  - match: "h\\.[0-9]+\\.mlp\\."   # regex, searched in node names
    split: 4                     # tensor parallel: the scope's parameters sharded over 4 devices
  - match: "^embed"
    replicate: 4                 # data parallel over 4 devices, parameters replicated
  - match: "^h\\.1[2-9]\\."
    stage: 1                     # pipelines: these forward nodes on stage 1 (their backward follows)
pins:
  wte.weight: "S(0)"             # one axis spec per mesh axis, for a named tensor
```
What the requests mean on a mesh is `apply.py`'s business (docs/hints.md). Every error here is
one line naming the file, line and key (`hints.yaml:4: scopes[0].match: ...`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parc.cluster.yamlfile import Entry, read_yaml
from parc.errors import UsageError
from parc.sharding import ShardSpec, ShardSpecError

KINDS = ("replicate", "split")


def mesh_text(shape: tuple[int, ...]) -> str:
    """A mesh shape as messages and the `parc.mesh` annotation spell it: `2x4`."""
    return "x".join(map(str, shape))


@dataclass(frozen=True)
class Request:
    """Whale's primitive: `replicate(n)` (data parallel) or `split(n)` (tensor parallel)."""

    kind: str  # "replicate" | "split"
    n: int | None  # devices; None: every device of the mesh (Whale's replicate() without a count)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"hint request kind {self.kind!r}: expected one of {', '.join(KINDS)}")
        if self.n is not None and (isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1):
            raise ValueError(f"{self.kind}({self.n!r}): expected a positive device count")

    def devices(self, mesh_devices: int) -> int:
        return self.n if self.n is not None else mesh_devices

    def __str__(self) -> str:
        return f"{self.kind}({self.n if self.n is not None else 'all'})"

    def to_json(self) -> dict[str, Any]:
        return {self.kind: self.n}


@dataclass(frozen=True)
class Scope:
    """A TaskGraph: the nodes whose scope name `match` finds, with a requested strategy."""

    match: str
    request: Request | None  # None: a `stage:` scope that leaves the SPMD strategy to the search
    where: str = "<hints>"  # "file:line: scopes[i]" for messages
    stage: int | None = None  # Whale's pipeline annotation: the scope's forward nodes on stage K
    regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "regex", re.compile(self.match))
        except re.error as e:
            raise UsageError(f"{self.where}.match: invalid regular expression '{self.match}': {e}") from None

    def to_json(self) -> dict[str, Any]:
        return {"match": self.match, **(self.request.to_json() if self.request is not None else {}),
                **({"stage": self.stage} if self.stage is not None else {})}


@dataclass(frozen=True)
class Pin:
    """A tensor's layout, fixed: `spec` on any mesh with as many axes (or only on `mesh`)."""

    tensor: str
    spec: ShardSpec
    where: str = "<hints>"
    mesh: tuple[int, ...] | None = None  # the mesh shape the spec was written for (ONNX annotations)
    required: bool = True  # a tensor the graph lacks is an error (else a warning: folded away)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"spec": str(self.spec)}
        if self.mesh is not None:
            out["mesh"] = list(self.mesh)
        return out


@dataclass(frozen=True)
class Hints:
    """Everything a hints file (or an ONNX model's annotations) asks of the planner."""

    scopes: tuple[Scope, ...] = ()
    pins: tuple[Pin, ...] = ()
    default: Request | None = None  # the request of nodes no scope matches; None: auto
    default_where: str = "<hints>: default"
    source: str = ""

    @property
    def empty(self) -> bool:
        return not self.scopes and not self.pins and self.default is None

    def merged(self, other: Hints) -> Hints:
        """These hints, then `other`'s: its scopes after ours, its pins on tensors we do not pin,
        its default if ours is auto."""
        pinned = {p.tensor for p in self.pins}
        default, where = (self.default, self.default_where) if self.default is not None else (
            other.default, other.default_where)
        return Hints(self.scopes + other.scopes, self.pins + tuple(p for p in other.pins if p.tensor not in pinned),
                     default, where, "+".join(s for s in (self.source, other.source) if s))

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source,
                "default": self.default.to_json() if self.default is not None else "auto",
                "scopes": [s.to_json() for s in self.scopes],
                "pins": {p.tensor: p.to_json() for p in self.pins}}


def load_hints(path: str | Path) -> Hints:
    """Read a hints YAML file; raises UsageError naming file, line and key on any mistake."""
    doc = read_yaml(path)
    top = doc.mapping(("default", "scopes", "pins"))
    default, default_where = None, f"{doc.file}:{doc.line}: default"
    if "default" in top:
        default = _default(top["default"])
        default_where = _where(top["default"])
    scopes = tuple(_scope(e) for e in top["scopes"].list()) if "scopes" in top else ()
    pins = tuple(_pin(name, e) for name, e in top["pins"].items().items()) if "pins" in top else ()
    return Hints(scopes, pins, default, default_where, str(path))


def _where(e: Entry) -> str:
    return f"{e.file}:{e.line}: {e.key}"


def _default(e: Entry) -> Request | None:
    if isinstance(e.value, dict):
        return _request(e, e.mapping(KINDS))
    if e.value not in ("auto", *KINDS):
        raise e.fail(f"expected auto, replicate, split or a mapping {{replicate|split: N}}, found {e.value!r}")
    return None if e.value == "auto" else Request(e.value, None)


def _scope(e: Entry) -> Scope:
    keys = e.mapping(("match", *KINDS, "stage"), required=("match",))
    match = keys["match"]
    pattern = match.value if isinstance(match.value, str) else None
    if not pattern:
        raise match.fail(f"expected a regular expression (a non-empty string), found {match.value!r}")
    stage = None
    if "stage" in keys:
        k = keys["stage"]
        if isinstance(k.value, bool) or not isinstance(k.value, int) or k.value < 0:
            raise k.fail(f"expected a stage number >= 0, found {k.value!r}")
        stage = k.value
    request = _request(e, keys) if stage is None or any(k in keys for k in KINDS) else None
    return Scope(pattern, request, f"{match.file}:{match.line}: {e.key}", stage)  # compiles: bad regex fails


def _request(e: Entry, keys: dict[str, Entry]) -> Request:
    given = [k for k in KINDS if k in keys]
    if len(given) == 2:
        raise e.fail("give replicate: N or split: N, not both (one strategy per scope)")
    if not given:
        raise e.fail("missing replicate: N, split: N or stage: K")
    n = keys[given[0]]
    if isinstance(n.value, bool) or not isinstance(n.value, int) or n.value < 1:
        raise n.fail(f"expected a positive integer device count, found {n.value!r}")
    return Request(given[0], n.value)


def _pin(name: str, e: Entry) -> Pin:
    if not isinstance(e.value, str) or not e.value.strip():
        raise e.fail(f"expected a sharding spec string such as \"S(0)R\", found {e.value!r}")
    try:
        spec = ShardSpec.parse(e.value.strip())
    except ShardSpecError as err:
        raise e.fail(str(err)) from None
    return Pin(name, spec, _where(e))
