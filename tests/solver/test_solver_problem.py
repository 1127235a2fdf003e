"""Problem: canonical form, validation messages, cost, JSON round trip, the generator."""

from __future__ import annotations

import numpy as np
import pytest
from solver_brute import brute_force

from parc.errors import ParcError
from parc.solver import Problem, ProblemError, random_problem
from parc.solver.generate import KINDS


def tiny(**kw) -> Problem:
    """a -> b -> c, and a -> c; 2, 3 and 1 strategies."""
    args = dict(
        comp=([1.0, 2.0], [0.0, 5.0, 1.0], [3.0]),
        edges=[(0, 1), (1, 2), (0, 2)],
        comm=([[0, 1, 2], [3, 0, 4]], [[1], [2], [0]], [[7], [0]]),
        mem=([4.0, 1.0], [0.0, 0.0, 0.0], [2.0]),
        names=("a", "b", "c"),
    )
    args.update(kw)
    return Problem(**args)


def test_cost_and_memory_by_hand():
    p = tiny()
    # x = (1, 2, 0): comp 2 + 1 + 3, comm (a,b)[1,2] = 4, (b,c)[2,0] = 0, (a,c)[1,0] = 0
    assert p.cost([1, 2, 0]) == 10.0
    assert p.memory([1, 2, 0]) == 3.0
    assert p.s.tolist() == [2, 3, 1] and p.offsets.tolist() == [0, 2, 5, 6]
    assert p.min_memory() == 3.0 and p.min_memory_choice().tolist() == [1, 0, 0]


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            dict(comm=([[0, 1], [3, 0]], [[1], [2], [0]], [[7], [0]])),
            r"comm of edge 0 \(node 0 \('a'\) -> node 1 \('b'\)\)",
        ),
        (
            dict(edges=[(0, 1), (1, 2), (2, 0)], comm=([[0, 1, 2], [3, 0, 4]], [[1], [2], [0]], [[7, 0]])),
            "cycle",
        ),
        (dict(edges=[(0, 1), (1, 1), (0, 2)]), "self-loop on node 1"),
        (dict(edges=[(0, 1), (1, 3), (0, 2)]), r"endpoints must lie in \[0, 3\)"),
        (dict(comp=([1.0, np.inf], [0.0, 5.0, 1.0], [3.0])), "comp of node 0"),
        (dict(mem=([4.0, -1.0], [0, 0, 0], [2.0])), "mem of node 0"),
        (dict(pins={1: [3]}), r"pins of node 1 \('b'\): expected a non-empty subset of \[0, 3\)"),
        (dict(pins=[(1, [0]), (1, [2])]), "leave no strategy"),
        (dict(budget=-1.0), "budget"),
        (dict(names=("a", "b")), "expected 3 names"),
        (dict(comp=()), "at least one node"),
    ],
)
def test_validation_names_what_is_wrong(kw, message):
    with pytest.raises(ProblemError, match=message):
        tiny(**kw)


def test_errors_belong_to_the_hierarchy():
    assert issubclass(ProblemError, ParcError) and issubclass(ProblemError, ValueError)


def test_pins_canonicalised_and_checked():
    p = tiny(pins={1: (2, 0, 2), 0: 1})
    assert p.pins == ((0, (1,)), (1, (0, 2)))
    assert p.allowed(1).tolist() == [True, False, True]
    with pytest.raises(ProblemError, match=r"strategy 1 is not among the pinned \[0, 2\]"):
        p.cost([1, 1, 0])
    with pytest.raises(ProblemError, match="expected 3 strategies"):
        p.cost([1, 0])
    assert p.restricted({1: [2]}).pins == ((0, (1,)), (1, (2,)))


def test_arrays_are_read_only():
    p = tiny()
    with pytest.raises(ValueError):
        p.comp[0][0] = 5.0
    with pytest.raises(ValueError):
        p.edges[0, 0] = 2


@pytest.mark.parametrize("seed", range(6))
def test_json_round_trip(seed):
    p = random_problem(seed, KINDS[seed % 4], 12, (1, 4), budget=0.5, pin_frac=0.3)
    q = Problem.from_json(p.to_json())
    assert q.to_json() == p.to_json()
    x = brute_force(p.with_budget(None))[1]
    assert q.cost(x) == p.cost(x) and q.memory(x) == p.memory(x)
    assert q.budget == p.budget and q.pins == p.pins and q.names == p.names


def test_json_rejects_other_formats():
    with pytest.raises(ProblemError, match="expected format"):
        Problem.from_json('{"format": "other/1"}')
    with pytest.raises(ProblemError, match="not valid JSON"):
        Problem.from_json("{")
    with pytest.raises(ProblemError, match="missing or malformed"):
        Problem.from_json('{"format": "parc.solver.problem/1", "comp": [[1]]}')


@pytest.mark.parametrize("kind", KINDS)
def test_generator_is_seeded_and_shaped(kind):
    a = random_problem(3, kind, 40, (2, 5), costs="spec", budget=0.2, pin_frac=0.1)
    assert (
        a.to_json() == random_problem(3, kind, 40, (2, 5), costs="spec", budget=0.2, pin_frac=0.1).to_json()
    )
    assert a.n == 40 and 2 <= a.s.min() and a.s.max() <= 5
    if kind in ("chain", "tree"):
        assert a.num_edges == 39
    assert a.min_memory() <= a.budget


def test_transformer_blocks_repeat():
    p = random_problem(0, "transformer", 60, (2, 2))
    assert [p.names[i] for i in range(1, 15)][::13] == ["L0.ln1", "L0.add2"]
    assert sum(name.endswith("add2") for name in p.names) == 4  # 1 + 4 * 14 = 57 nodes, then a head


@pytest.mark.parametrize("seed", range(10))
def test_trivial_bound_is_a_lower_bound(seed):
    p = random_problem(seed, "dag", 7, (1, 4), pin_frac=0.3)
    assert p.trivial_bound() <= brute_force(p)[0] + 1e-9
