"""`PARC_TEST_FAULT`: a bug the tests of `parc verify` inject into a rank's collectives, to show
that verify catches it (never set it otherwise).

`scale:<tensor substring>:<factor>` multiplies the result of every collective on a matching tensor
by the factor (a missing 1/n); `skip:<tensor substring>` makes each such collective do nothing
where its result has its input's shape (a missing reduction). `parc run`'s own fault switch, which
kills, stops or fails a rank (`PARC_FAULT`), is `parc.exec.watch.with_fault`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from parc.errors import ParcError

TEST_FAULT_ENV = "PARC_TEST_FAULT"


@dataclass(frozen=True)
class CollectiveFault:
    """A bug injected into the collectives on the tensors whose names hold `tensor`."""

    kind: str  # "scale" or "skip"
    tensor: str  # a substring of the names of the tensors it strikes
    factor: float = 1.0  # what "scale" multiplies by

    @classmethod
    def from_env(cls) -> CollectiveFault | None:
        """The fault `PARC_TEST_FAULT` names, or None where it is not set."""
        spec = os.environ.get(TEST_FAULT_ENV)
        if not spec:
            return None
        kind, _, rest = spec.partition(":")
        if kind == "scale":
            name, _, factor = rest.rpartition(":")
            return cls("scale", name, float(factor))
        if kind == "skip":
            return cls("skip", rest)
        raise ParcError(f"{TEST_FAULT_ENV}={spec}: expected scale:<tensor>:<factor> or skip:<tensor>")

    def strikes(self, tensor: str) -> bool:
        """Whether the collectives on `tensor` go wrong."""
        return self.tensor in tensor

    def apply(self, before: Any, after: Any) -> Any:
        """What a struck collective gives instead of `after`, its result on `before`."""
        if self.kind == "scale":
            return after * after.dtype.type(self.factor)
        return before if before.shape == after.shape else after
