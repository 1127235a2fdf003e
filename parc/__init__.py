"""parc: automatic parallelization of ONNX training and inference programs.

`parc.plan`, `parc.simulate`, `parc.verify` and `parc.PlanOptions` are the library's entry
points (`parc.api`, docs/python-api.md). They load on first use, so that importing one of parc's
layers (an executor rank imports `parc.exec`) does not import the planner.
"""

from parc.version import __version__

_API = ("PlanOptions", "Planned", "Verification", "plan", "simulate", "verify")

__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import parc.api

        return getattr(parc.api, name)
    raise AttributeError(f"module 'parc' has no attribute {name!r}")
