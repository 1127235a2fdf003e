"""What every pass returns, and the log line it leaves."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from parc.ir.graph import Graph

log = logging.getLogger("parc.passes")  # every pass logs under one name, wherever it lives


@dataclass(frozen=True)
class PassResult:
    """A pass's outcome: the graph (changed in place), whether it changed, one summary line."""

    name: str
    graph: Graph
    modified: bool
    summary: str

    def __post_init__(self) -> None:
        log.info("%s: %s", self.name, self.summary)
