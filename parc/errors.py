"""The one error hierarchy of parc: the CLI turns any ParcError into one line and exit code 2."""

from __future__ import annotations


def first_line(e: BaseException, typed: bool = False) -> str:
    """The first line of an exception's message for a one-line report (its type's name when the
    message is empty); `typed`: 'TypeName: first line'."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    return f"{type(e).__name__}: {text.splitlines()[0]}" if typed else text.splitlines()[0]


class ParcError(Exception):
    """Base of every error parc raises on bad input; its message is one line for a person."""


class UsageError(ParcError):
    """A flag or argument has a value parc cannot use."""


class OnnxImportError(ParcError):
    """The ONNX file cannot be read or is not a valid model."""


class UnboundDimError(OnnxImportError):
    """Symbolic dims remain that no --dim binds."""

    def __init__(self, dims: list[str], message: str) -> None:
        super().__init__(message)
        self.dims = dims


class ShapeError(ParcError):
    """Shapes or dtypes of a node are inconsistent."""


class UnsupportedOpError(ParcError):
    """An op parc cannot handle where it must."""


class VerifyError(ParcError):
    """The IR breaks one of its invariants (an internal error when raised by a pass)."""


class InfeasiblePlanError(ParcError):
    """No plan fits the devices; carries the numbers."""


class PlanFormatError(ParcError):
    """A plan directory is malformed, tampered with, or of an unknown format version."""


class WorkerDiedError(ParcError):
    """A worker process of the planner was killed (most often by the system, out of memory)."""
