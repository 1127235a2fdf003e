"""The plan on one mesh: follow coarsening, its polish and large-neighbourhood steps, the exact
finish, the diffusion bound, and the parameter-led second candidate (docs/solver.md).

`search_plan` is what one mesh's "plan" job runs (`parc.passes.spmd.search.plan_graph`), and what
the baselines are solved with; `needs_second`, `second_plan` and `raced` are the second
candidate, which `plan_graph` decides once every mesh has its first plan.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from parc.errors import InfeasiblePlanError
from parc.passes.spmd.costs import CostModel
from parc.passes.spmd.follow import model_grouping, training_grouping
from parc.passes.spmd.pool import SharedMinimum
from parc.solver import IlpOptions, Problem, SearchOptions, Solution, solve
from parc.solver.bound import dual_bound
from parc.solver.follow import Grouping, lp_columns, polish, refine, solve_follow
from parc.solver.problem import relative_gap
from parc.solver.search import mixer, search_price

log = logging.getLogger("parc.plan")


def search_plan(model: CostModel, problem: Problem, level: str, options: SearchOptions,
                exact_columns: int = 150_000, refine_steps: int = 1, prove: bool = True,
                incumbent: SharedMinimum | None = None) -> Solution:
    """The plan on one mesh. A training step is first solved with its backward and optimizer
    nodes following their forward node and parameter (`parc.solver.follow`), then polished on
    the whole problem, then gets up to `refine_steps` large-neighbourhood steps
    (`parc.solver.follow.refine`: every node restricted to its two best strategies around the
    plan and the plan's own, solved exactly). That is O2's plan unless the whole problem's ILP is
    small (at most `exact_columns` edge columns after coarsening: its LP costs a few seconds at
    most) and the diffusion bound leaves more than O2_EXACT_GAP: then, as always at O3, the
    exact ILP starts from it (never worse; no branch and bound when the LP bound proves it).
    When the grouped plan does not fit a budget, memory is priced on the whole problem around
    follow (`search_price`); without a backward, or when that fails too, O2 and O3 solve the
    whole problem directly. `exact_columns=0` and `refine_steps=0`: O2's plan is the follow plan
    (the baselines'). With `prove`, a plan not proven within `PROVE_GAP` gets the diffusion
    bound (`parc.solver.bound`) as its lower bound when higher. A plan still far from its bound
    may then be raced against the parameter-led grouping's plan: `needs_second`, `second_plan`
    and `raced`, which `plan_graph` runs once every mesh has its first plan.

    `incumbent`: the cheapest plan found on other meshes. A mesh whose follow plan's proven
    bound is above it cannot win: it skips the exact ILP (at O3 too) and keeps its follow plan,
    marked "(dominated)". The plan chosen over all meshes is the same whichever meshes finish
    first."""
    sol, proven = _search_plan(model, problem, level, options, exact_columns, refine_steps, prove, incumbent)
    if prove and not proven:
        sol = _proven(model, problem, sol)
    return sol


def _dominated(sol: Solution, incumbent: SharedMinimum | None) -> bool:
    """sol's mesh cannot beat the incumbent: its proven lower bound is above it."""
    return incumbent is not None and sol.lower_bound > incumbent.value * (1 + 1e-6)


def needs_second(sol: Solution, best: float = math.inf) -> bool:
    """Whether sol is raced against the parameter-led plan (`second_plan`): its mesh may hold a
    plan more than SECOND_GAP below both sol and `best`, the cheapest first plan of any mesh.
    A plan proven within SECOND_GAP needs none; nor does a mesh whose bound is within SECOND_GAP
    of a plan found elsewhere, since the plan chosen is then within SECOND_GAP of anything the
    mesh holds (docs/solver.md)."""
    return relative_gap(min(sol.cost, best), sol.lower_bound) > SECOND_GAP


def second_plan(model: CostModel, problem: Problem, options: SearchOptions, refine_steps: int = 1
                ) -> Solution | None:
    """The plan of the second grouping (optimizer chains led by their parameter), with its
    large-neighbourhood steps; None without a backward or when it does not fit. Follow's plan is
    a local optimum of its grouping, and neither grouping is better everywhere
    (`parc.passes.spmd.follow`; docs/solver.md), hence a second candidate for a plan not proven
    close (`needs_second`). It does not depend on the first plan, so it can run beside it."""
    grouping = training_grouping(model, lead="param")
    if grouping is None:
        return None
    t0 = time.perf_counter()
    try:
        alt = _follow(problem, grouping, options)
    except InfeasiblePlanError:
        return None
    if refine_steps:
        alt = _refined(problem, alt, options, refine_steps)
    log.info("mesh %s: parameter-led plan %.6g s (%.2f s)", model.mesh.shape, alt.cost, time.perf_counter() - t0)
    return replace(alt, time_s=time.perf_counter() - t0)


def needs_polish(sol: Solution, best: float = math.inf) -> bool:
    """Whether sol is raced against its mesh's cheapest baseline polished (`from_baseline`):
    as `needs_second`, at O2's exact-finish gap (PROVE_GAP) instead of SECOND_GAP. A baseline's
    plan is a start in another basin than the grouped optimum's (gpt-medium's 2 x 4 mesh: the
    follow plan shards the batch over the 4-way axis, the optimum and Megatron's recipe over the
    2-way one; docs/solver.md)."""
    return relative_gap(min(sol.cost, best), sol.lower_bound) > PROVE_GAP


def from_baseline(model: CostModel, problem: Problem, start, options: SearchOptions, refine_steps: int = 0,
                  name: str = "baseline") -> Solution | None:
    """The plan polished from `start`, a baseline's fitting choice: the follow polish's block
    coordinate descent (up to START_ROUNDS rounds), then `refine_steps` large-neighbourhood
    steps (none by default: after the polish they gained nothing for their time). None
    without a backward (no blocks) or when the start does not fit."""
    grouping = model_grouping(model)
    if grouping is None or not problem.fits(start):
        return None
    t0 = time.perf_counter()
    mixed = _mixed(options)
    sol = polish(problem, grouping, start, lambda r: solve(r, "O2", mixed), rounds=START_ROUNDS, method=f"{name}+polish")
    if refine_steps:
        sol = _refined(problem, sol, options, refine_steps)
    log.info("mesh %s: plan from %s %.6g s (%.2f s)", model.mesh.shape, name, sol.cost, time.perf_counter() - t0)
    return replace(sol, time_s=time.perf_counter() - t0)


def raced(sol: Solution, alt: Solution | None, how: str = "parameter-led") -> Solution:
    """sol, or `alt` (the parameter-led plan; a baseline's plan polished) when that is cheaper,
    with the better lower bound of the problem (sol's: it bounds the problem whatever found the
    plan); either way the time both took. `how` goes into the method."""
    spent = alt.time_s if alt is not None else 0.0
    if alt is None or alt.cost >= sol.cost * (1 - 1e-9):
        return replace(sol, time_s=sol.time_s + spent)
    lower = min(sol.lower_bound, alt.cost)
    gap = relative_gap(alt.cost, lower)
    return Solution(alt.choice, alt.cost, lower, gap, "optimal" if gap <= 1e-9 else alt.status,
                    sol.time_s + spent, f"{alt.method}({how})")


def _proven(model: CostModel, problem: Problem, sol: Solution) -> Solution:
    """sol with the diffusion bound as its lower bound when that is higher (its gap above PROVE_GAP)."""
    if sol.gap <= PROVE_GAP:
        return sol
    t0 = time.perf_counter()
    lower = min(max(sol.lower_bound, dual_bound(problem, sol.cost, gap=PROVE_GAP, time_limit=PROVE_TIME_S)), sol.cost)
    gap = relative_gap(sol.cost, lower)
    log.info("mesh %s: proven gap %.4g -> %.4g (%.2f s)", model.mesh.shape, sol.gap, gap, time.perf_counter() - t0)
    return replace(sol, lower_bound=lower, gap=gap, status="optimal" if gap <= 1e-9 else sol.status,
                   time_s=sol.time_s + time.perf_counter() - t0)


def _search_plan(model: CostModel, problem: Problem, level: str, options: SearchOptions, exact_columns: int,
                 refine_steps: int, prove: bool, incumbent: SharedMinimum | None = None) -> tuple[Solution, bool]:
    """search_plan's plan, and whether it has had the diffusion bound already."""
    problem.check_budget()  # before any search: no choice fits when the least memory does not
    grouping = model_grouping(model)
    follow = None
    if grouping is not None:
        try:
            follow = _follow(problem, grouping, options)
        except InfeasiblePlanError:
            follow = None
        if follow is None:
            log.info("mesh %s: the follow-coarsened plan does not fit; solving the whole problem", model.mesh.shape)
    if follow is None:
        return solve(problem, level, pruned(options) if level == "O3" else options), False
    proven = False
    if level == "O2":
        if follow.gap <= options.ilp.mip_gap:
            return follow, False
        if refine_steps:
            follow = _refined(problem, follow, options, refine_steps)
        if exact_columns <= 0 or lp_columns(problem) > exact_columns:  # (no coarsening to count them for 0)
            return follow, False
        if prove:  # the exact finish only when the bound leaves more than its gap (it costs seconds)
            follow, proven = _proven(model, problem, follow), True
            if follow.gap <= O2_EXACT_GAP:
                return follow, True
        options = replace(options, ilp=replace(options.ilp, mip_gap=max(options.ilp.mip_gap, O2_EXACT_GAP),
                                               time_limit=min(options.ilp.time_limit, O2_EXACT_TIME_S)))
    elif prove and incumbent is not None and math.isfinite(incumbent.value):
        # O3: can the exact ILP still make this mesh win?
        follow, proven = _proven(model, problem, follow), True
    if prove and _dominated(follow, incumbent):
        log.info("mesh %s: bound %.6g s above the best plan so far, %.6g s: no exact ILP", model.mesh.shape,
                 follow.lower_bound, incumbent.value)  # type: ignore[union-attr]
        return replace(follow, method=f"{follow.method}(dominated)"), True
    exact = solve(problem, "O3", pruned(options), start=follow.choice)
    # the follow plan is kept when the ILP stopped above it (a time-out); the better bound either way
    # (a diffusion bound already paid for is not run again: search_plan's `proven`)
    best = follow if follow.cost < exact.cost else exact
    lower = min(max(follow.lower_bound, exact.lower_bound), best.cost)
    gap = relative_gap(best.cost, lower)
    return Solution(best.choice, best.cost, lower, gap, "optimal" if gap <= 1e-9 else best.status,
                    follow.time_s + exact.time_s, best.method), proven


def _follow(problem: Problem, grouping: Grouping, options: SearchOptions) -> Solution:
    """The follow plan of `grouping` with its polish; when the grouped problem's plan does not
    fit a budget (its members take their best responses, not their least memory), memory is
    priced on the whole problem instead, each priced problem solved by follow and its polish,
    which frees the members. Raises InfeasiblePlanError when neither fits."""
    options = _mixed(options)

    def free(q: Problem) -> Solution:
        return solve_follow(q, grouping, lambda r: solve(r, "O2", options), rounds=POLISH_ROUNDS)

    try:
        return free(problem)
    except InfeasiblePlanError:
        if problem.budget is None:
            raise
    return search_price(problem, free, mix=mixer(options))


def _mixed(options: SearchOptions) -> SearchOptions:
    """options whose price searches end in an exact mix (the follow plan's block solves)."""
    return replace(options, mix=replace(_exact_ilp(options), mip_gap=max(options.ilp.mip_gap, O2_EXACT_GAP)))


def _exact_ilp(options: SearchOptions) -> IlpOptions:
    """The ILP of a bounded exact step (a large-neighbourhood step, a price search's mix):
    pruned, capped at O2_EXACT_TIME_S."""
    return replace(options.ilp, prune=True, time_limit=min(options.ilp.time_limit, O2_EXACT_TIME_S))


def _refined(problem: Problem, sol: Solution, options: SearchOptions, refine_steps: int) -> Solution:
    """sol after up to `refine_steps` large-neighbourhood steps (`refine`), each ILP capped at
    O2_EXACT_TIME_S."""
    t0 = time.perf_counter()
    lns = replace(options, ilp=_exact_ilp(options))
    x, cost = refine(problem, sol.choice, lambda q, start: solve(q, "O3", lns, start=start), rounds=refine_steps)
    lower = min(sol.lower_bound, cost)
    return Solution(x, cost, lower, relative_gap(cost, lower), "heuristic", sol.time_s + time.perf_counter() - t0,
                    f"{sol.method}+lns")


# a plan not proven within SECOND_GAP after the diffusion bound, nor within it of the best plan
# elsewhere, gets a second candidate, the parameter-led grouping's plan (`needs_second`,
# `second_plan`; docs/solver.md has where it pays)
SECOND_GAP = 2e-2
# O2's exact finish on a small problem stops at this relative gap and time: a binding memory
# budget makes the ILP a knapsack whose last tenths of a percent take its whole time limit
O2_EXACT_GAP = 1e-2
O2_EXACT_TIME_S = 20.0
# a plan's lower bound is improved by min-sum diffusion when its gap is above PROVE_GAP, for at
# most PROVE_TIME_S (the trivial bound sits far below a training step's plan, and diffusion
# closes most of that well within it). PROVE_GAP is O2's exact-finish gap: proving more buys no
# better plan, only a figure, and its last half percent costs seconds (docs/solver.md)
PROVE_GAP = O2_EXACT_GAP
PROVE_TIME_S = 5.0
# rounds of the polish from a baseline's plan (`from_baseline`): far from a local optimum, it
# gains over several rounds (docs/solver.md), and stops at the first round that gains nothing
START_ROUNDS = 3
# rounds of the follow plan's polish (each frees the backward side, then the forward side): a
# second round gains little for its time (docs/solver.md), and the exact finish or the
# large-neighbourhood step after it does more
POLISH_ROUNDS = 1


def pruned(options: SearchOptions) -> SearchOptions:
    """Options whose ILPs drop dominated strategies first (`IlpOptions.prune`): every exact ILP
    the planner runs (O3, O2's exact finish and large-neighbourhood steps, the baselines)."""
    return replace(options, ilp=replace(options.ilp, prune=True))
