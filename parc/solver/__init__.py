"""Strategy solvers: pure functions from cost arrays (Rhino 4.2) to a choice of strategy per node.

`solve(problem, level)` is the entry point: O3 is one ILP (ilp.py), O2 is Rhino's three-level
merging (dp.py, graph.py, search.py). Nothing here knows about ONNX; the planner builds a
`Problem` from its cost model and applies the `Solution` to the graph.
"""

from parc.solver.coarsen import coarsen, solve_coarse
from parc.solver.dp import FactorGraph, chain_dp, fold_cones, tree_dp
from parc.solver.generate import random_problem
from parc.solver.graph import Segment, critical_nodes, segments
from parc.solver.ilp import IlpOptions, build_model, solve_ilp
from parc.solver.problem import MemoryBudgetError, Problem, ProblemError, Solution
from parc.solver.search import SearchOptions, memory_order, restrict_largest, solve, solve_o2

__all__ = [
    "FactorGraph",
    "IlpOptions",
    "MemoryBudgetError",
    "Problem",
    "ProblemError",
    "SearchOptions",
    "Segment",
    "Solution",
    "build_model",
    "chain_dp",
    "coarsen",
    "critical_nodes",
    "fold_cones",
    "memory_order",
    "random_problem",
    "restrict_largest",
    "segments",
    "solve",
    "solve_coarse",
    "solve_ilp",
    "solve_o2",
    "tree_dp",
]
