"""Solvers on checked-in problems (tests/solver/data), against their recorded optima.

The files come from the generator with fixed seeds (RECORDED); `python
tests/solver/test_solver_recorded.py` rewrites them and data/expected.json (optima by brute
force where small, else by the O3 ILP with mip_gap 0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parc.solver import IlpOptions, Problem, SearchOptions, random_problem, solve

DATA = Path(__file__).parent / "data"
RECORDED = {
    "dag8_pins_budget": dict(seed=11, kind="dag", n=8, strategies=(1, 4), budget=0.3, pin_frac=0.25),
    "tree12_spec": dict(seed=12, kind="tree", n=12, strategies=(2, 4), costs="spec"),
    "transformer60_spec_budget": dict(
        seed=13, kind="transformer", n=60, strategies=(2, 6), costs="spec", budget=0.2
    ),
    "transformer45_uniform_pins": dict(seed=14, kind="transformer", n=45, strategies=(2, 5), pin_frac=0.1),
}
EXACT = SearchOptions(ilp=IlpOptions(mip_gap=0.0))


def load(name: str) -> Problem:
    return Problem.from_json((DATA / f"{name}.json").read_text())


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_problem(name):
    p = load(name)
    expected = json.loads((DATA / "expected.json").read_text())[name]
    assert p.to_json() == (DATA / f"{name}.json").read_text()
    o3 = solve(p, "O3", EXACT)
    assert o3.cost == pytest.approx(expected["optimum"], rel=1e-9) and o3.status == "optimal"
    o2 = solve(p, "O2", EXACT)
    assert p.fits(o2.choice)
    if p.budget is None:
        assert o2.cost == pytest.approx(expected["optimum"], rel=1e-9)
    else:  # memory priced: between the optimum and Rhino 4.4's restriction here, with a valid bound
        assert expected["optimum"] - 1e-9 <= o2.cost <= expected["o2_restrict"] + 1e-9
        assert o2.lower_bound <= expected["optimum"] + 1e-9
        restrict = solve(p, "O2", SearchOptions(ilp=EXACT.ilp, memory="restrict"))
        assert restrict.cost == pytest.approx(expected["o2_restrict"], rel=1e-9)


def regenerate() -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from solver_brute import brute_force

    expected = {}
    for name, kw in RECORDED.items():
        kw = dict(kw)
        p = random_problem(kw.pop("seed"), kw.pop("kind"), kw.pop("n"), kw.pop("strategies"), **kw)
        (DATA / f"{name}.json").write_text(p.to_json())
        opt = brute_force(p)[0] if p.n <= 12 else solve(p, "O3", EXACT).cost
        expected[name] = {"optimum": opt}
        if p.budget is not None:
            expected[name]["o2_restrict"] = solve(p, "O2", SearchOptions(ilp=EXACT.ilp, memory="restrict")).cost
    (DATA / "expected.json").write_text(json.dumps(expected, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    regenerate()
