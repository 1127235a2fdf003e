"""Hints (Whale 3.1-3.2): scopes requesting replicate(n) or split(n), pinned layouts, and the
ONNX multi-device annotations, turned into solver pins on each mesh (docs/hints.md)."""

from parc.hints.annotations import (
    AnnotationError,
    annotate,
    decode,
    encode,
    read_annotations,
    write_sharded_model,
)
from parc.hints.apply import (
    IneligibleMeshError,
    PinDivisionError,
    assign_scopes,
    check_mesh,
    param_names,
    scope_names,
    warn_once,
)
from parc.hints.file import Hints, Pin, Request, Scope, load_hints

__all__ = [
    "AnnotationError", "Hints", "IneligibleMeshError", "Pin", "PinDivisionError", "Request", "Scope", "annotate",
    "assign_scopes", "check_mesh", "decode", "encode", "load_hints", "param_names", "read_annotations",
    "scope_names", "warn_once", "write_sharded_model",
]
