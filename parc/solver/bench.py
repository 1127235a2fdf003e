"""Micro benchmark of the strategy solvers: `python -m parc.solver.bench`.

Times O3 and O2 on generated transformer-like instances (cost model "spec", 4-8 strategies per
node) and prints a Markdown table. O2 is run three ways: as solve() runs it (segment cores by
exact DP), with the cores forced through one ILP per (entry, exit) pair, and with one ILP per
entry strategy (exit free). With --classic it also compares the LP bound of Rhino's A >= X1 + X2
- 1 linearisation against the marginal form's.
"""

from __future__ import annotations

import argparse
import time

import highspy
import numpy as np

from parc.solver.generate import random_problem
from parc.solver.ilp import IlpOptions, build_model, lp_relaxation, new_highs, rowwise_lp
from parc.solver.problem import Problem, ragged
from parc.solver.search import SearchOptions, solve


def classic_lp_bound(p: Problem, time_limit: float = 600.0) -> float:
    """LP bound of Rhino 4.2's own linearisation: A_e,j1,j2 >= X_u,j1 + X_v,j2 - 1, A >= 0."""
    n, X = p.n, int(p.offsets[-1])
    e, j1, j2 = p.comm_entries
    A = len(e)
    u, v = p.edges[e, 0], p.edges[e, 1]
    owner, _ = ragged(p.s)
    rows = np.concatenate([owner, n + np.arange(A), n + np.arange(A), n + np.arange(A)])
    cols = np.concatenate([np.arange(X), X + np.arange(A), p.offsets[u] + j1, p.offsets[v] + j2])
    vals = np.concatenate([np.ones(X), np.ones(A), -np.ones(A), -np.ones(A)])
    cost = np.concatenate([p.comp_flat, p.comm_flat])
    upper = np.concatenate([p.allowed_flat.astype(np.float64), np.ones(A)])
    lp = rowwise_lp(cost, np.zeros(X + A), upper, [rows], [cols], [vals],
                    [np.ones(n), -np.ones(A)], [np.ones(n), np.full(A, highspy.kHighsInf)], n + A)
    h = new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", time_limit)
    h.passModel(lp)
    h.run()
    return h.getInfo().objective_function_value


def _pct(x: float) -> str:
    """A ratio as a percentage; '-' when unknown, no '-0.000%' from float noise."""
    return "-" if not np.isfinite(x) else f"{100 * x + 0.0:.3f}%" if abs(x) > 5e-7 else "0.000%"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m parc.solver.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[500, 2000, 5000])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--costs", nargs="+", default=["spec", "uniform"], help="cost models (generate.py)")
    ap.add_argument("--time-limit", type=float, default=300.0, help="seconds per ILP")
    ap.add_argument("--classic", action="store_true", help="also the LP bound of A >= X1 + X2 - 1")
    args = ap.parse_args(argv)
    ilp = IlpOptions(time_limit=args.time_limit)
    runs = [
        ("O3", "O3", SearchOptions(ilp=ilp)),
        ("O2", "O2", SearchOptions(ilp=ilp)),
        ("O2, ILP per (a, b)", "O2", SearchOptions(ilp=ilp, dp_limit=0)),
        ("O2, ILP per a", "O2", SearchOptions(ilp=ilp, dp_limit=0, segment_pairs="entry")),
    ]
    print(
        "| costs | nodes | edges | x cols | ILP cols | level | time s | status | objective | proven gap | vs O3 | LP bound | LP gap |"
    )
    print("|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|")
    classic = []
    for costs in args.costs:
        for n in args.sizes:
            p = random_problem(args.seed, "transformer", n, (4, 8), costs=costs)
            t0 = time.perf_counter()
            lp = lp_relaxation(p, ilp)
            lp_s = time.perf_counter() - t0
            cols = build_model(p).lp.num_col_
            o3 = None
            for label, level, opts in runs:
                sol = solve(p, level, opts)
                o3 = sol.cost if o3 is None else o3
                print(
                    f"| {costs} | {p.n} | {p.num_edges} | {int(p.offsets[-1])} | {cols} | {label} | {sol.time_s:.2f} "
                    f"| {sol.status} | {sol.cost:,.4f} | {_pct(sol.gap)} | {_pct(sol.cost / o3 - 1)} "
                    f"| {lp:,.4f} | {_pct((sol.cost - lp) / sol.cost)} |",
                    flush=True,
                )
            if args.classic:
                t0 = time.perf_counter()
                cl = classic_lp_bound(p)
                classic.append((costs, n, lp, lp_s, cl, time.perf_counter() - t0, o3))
    if classic:
        print(
            "\n| costs | nodes | O3 objective | marginal LP bound | gap | LP s | classic LP bound | gap | LP s |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for costs, n, lp, lp_s, cl, cl_s, opt in classic:
            print(
                f"| {costs} | {n} | {opt:,.4f} | {lp:,.4f} | {_pct((opt - lp) / opt)} | {lp_s:.2f} "
                f"| {cl:,.4f} | {_pct((opt - cl) / opt)} | {cl_s:.2f} |"
            )


if __name__ == "__main__":
    main()
