"""What the SPMD search decided on one mesh, apart from the cost model it was priced in.

The search solves a `CostModel`'s Problem; its answer is a choice index per source and node.
`Decision` turns that answer into what the lowering applies and plan.json records: a strategy
per node and a layout per source. Emit, the pipeline's transfer routes and plan.json read this,
never the model's candidate tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from parc.ir.graph import Graph
from parc.passes.spmd.costs import CostModel
from parc.passes.spmd.strategies import Strategy
from parc.sharding.spec import ShardSpec


@dataclass(frozen=True)
class Decision:
    """One mesh's decision: the graph, the model mesh (time axis first when microbatched), the
    chosen strategy per node (graph order), each source's layout and the microbatch count."""

    graph: Graph
    mesh: tuple[int, ...]
    strategies: tuple[Strategy, ...]
    specs: dict[str, ShardSpec]
    micro_batches: int

    @classmethod
    def of(cls, model: CostModel, choice: Sequence[int]) -> Decision:
        """The decision that `choice` (a solver solution over `model`'s Problem) stands for."""
        return cls(model.graph, tuple(model.mesh.shape), node_strategies(model, choice),
                   source_specs(model, choice), model.micro.count if model.micro is not None else 1)


def node_strategies(model: CostModel, choice: Sequence[int]) -> tuple[Strategy, ...]:
    """The chosen strategy of every node of `model`'s graph, in graph order."""
    return tuple(model.strategies[pos][choice[model.node_index(pos)]] for pos in range(len(model.graph.nodes)))


def source_specs(model: CostModel, choice: Sequence[int]) -> dict[str, ShardSpec]:
    """Source name -> its chosen layout (time axis first when microbatched)."""
    return {v.name: model.source_specs[k][choice[k]] for k, v in enumerate(model.sources)}
