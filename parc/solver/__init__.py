"""Solvers: pure functions from cost arrays to plans.

Strategy solvers (Rhino 4.2) choose a strategy per node: `solve(problem, level)` is the entry
point; O3 is one ILP (ilp.py), O2 is Rhino's three-level merging (dp.py, graph.py, search.py).
`solve_stages` is Rhino 5.1-5.2's stage ILP (stages.py); `whale_balance` and `exact_balance`
share work over mixed devices (balance.py, Whale 3.3.1). Nothing here knows about ONNX; the
planner builds the arrays from its cost model and applies the result to the graph.
"""

from parc.solver.balance import exact_balance, whale_balance
from parc.solver.coarsen import coarsen, solve_coarse
from parc.solver.dp import FactorGraph, chain_dp, fold_cones, tree_dp
from parc.solver.generate import random_problem
from parc.solver.graph import Segment, critical_nodes, segments
from parc.solver.ilp import IlpOptions, build_model, solve_ilp
from parc.solver.problem import MemoryBudgetError, Problem, ProblemError, Solution
from parc.solver.search import SearchOptions, memory_order, restrict_largest, solve, solve_o2
from parc.solver.stages import StageCut, solve_stages

__all__ = [
    "FactorGraph",
    "IlpOptions",
    "MemoryBudgetError",
    "Problem",
    "ProblemError",
    "SearchOptions",
    "Segment",
    "Solution",
    "StageCut",
    "build_model",
    "chain_dp",
    "coarsen",
    "critical_nodes",
    "exact_balance",
    "fold_cones",
    "memory_order",
    "random_problem",
    "restrict_largest",
    "segments",
    "solve",
    "solve_coarse",
    "solve_ilp",
    "solve_o2",
    "solve_stages",
    "tree_dp",
    "whale_balance",
]
