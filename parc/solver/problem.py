"""The strategy-selection problem of Rhino §4.2 as plain cost arrays, and what a solver returns.

Notation (Rhino §4.2, §4.4): nodes i = 0..n-1; node i has s_i strategies; x_i is the strategy
chosen for i; comp_i[j] is its compute cost and mem_i[j] its memory per device under strategy j;
each edge e = (u, v) has a resharding cost matrix comm_e of shape (s_u, s_v). The total cost is

    C(x) = sum_i comp_i[x_i] + sum_{e=(u,v)} comm_e[x_u, x_v]

to be minimised subject to sum_i mem_i[x_i] <= M (the per-device budget, when given) and to
pins (node i may only take strategies in allowed_i). The solver knows nothing about ONNX.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np

from parc.errors import InfeasiblePlanError, ParcError

FORMAT = "parc.solver.problem/1"
# id -> the frozen edge arrays already checked acyclic (derived problems share their parent's)
_ACYCLIC: dict[int, weakref.ref] = {}


class ProblemError(ParcError, ValueError):
    """A Problem's arrays are inconsistent (wrong shape, non-finite cost, cycle, bad pin...)."""


class MemoryBudgetError(InfeasiblePlanError):
    """No choice fits the memory budget M; `need` is the least memory any allowed choice uses."""

    def __init__(self, need: float, budget: float) -> None:
        super().__init__(
            f"memory need {need:.6g} per device (every node at its lowest-memory allowed strategy) "
            f"exceeds the budget M = {budget:.6g}"
        )
        self.need = need
        self.budget = budget


def ragged(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, local) for a ragged layout: item k of owner o has local index k - start(o)."""
    counts = np.asarray(counts, dtype=np.int64)
    owner = np.repeat(np.arange(len(counts)), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return owner, np.arange(int(counts.sum()), dtype=np.int64) - starts[owner]


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class Problem:
    """Cost arrays of one strategy-selection problem (Rhino §4.2); canonicalised and validated."""

    comp: tuple[np.ndarray, ...]  # comp_i[j]: compute cost of node i under strategy j, shape (s_i,)
    edges: np.ndarray  # (|E|, 2) int64; row e is the edge (u, v), u's output consumed by v
    comm: tuple[np.ndarray, ...]  # comm_e[j1, j2]: resharding cost on edge e, shape (s_u, s_v)
    mem: tuple[np.ndarray, ...] = ()  # mem_i[j]: bytes per device of node i under j (empty: zeros)
    budget: float | None = None  # M, the memory budget per device (Rhino §4.4); None: unconstrained
    pins: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (i, allowed_i) sorted by i; unlisted: all
    names: tuple[str, ...] = field(default=())  # node names for messages (empty: "node i")

    def __post_init__(self) -> None:
        comp = tuple(_frozen(np.array(c, dtype=np.float64).reshape(-1)) for c in self.comp)
        n = len(comp)
        if n == 0:
            raise ProblemError("a problem needs at least one node, found none")
        names = tuple(str(s) for s in self.names)
        if names and len(names) != n:
            raise ProblemError(f"names: expected {n} names (one per node), found {len(names)}")
        object.__setattr__(self, "names", names)
        s = np.array([c.size for c in comp], dtype=np.int64)
        if (s == 0).any() or not np.isfinite(np.concatenate(comp)).all():
            i = next(i for i, c in enumerate(comp) if c.size == 0 or not np.isfinite(c).all())
            raise ProblemError(f"comp of {self.name(i)}: expected >= 1 finite costs, found {comp[i].tolist()}")
        mem = self.mem if len(self.mem) else tuple(np.zeros(k) for k in s)
        mem = tuple(_frozen(np.array(m, dtype=np.float64).reshape(-1)) for m in mem)
        if len(mem) != n:
            raise ProblemError(f"mem: expected {n} vectors (one per node), found {len(mem)}")
        flat = np.concatenate(mem)
        if (np.array([m.size for m in mem]) != s).any() or not np.isfinite(flat).all() or (flat < 0).any():
            i = next(i for i, m in enumerate(mem) if m.size != s[i] or not np.isfinite(m).all() or (m < 0).any())
            raise ProblemError(
                f"mem of {self.name(i)}: expected {s[i]} finite values >= 0, found {mem[i].tolist()}"
            )
        edges = self.edges
        if not (isinstance(edges, np.ndarray) and edges.dtype == np.int64 and edges.ndim == 2
                and not edges.flags.writeable):  # a frozen edge array is another problem's: shared
            edges = np.array(edges, dtype=np.int64).reshape(-1, 2)
        if ((edges < 0) | (edges >= n)).any():
            raise ProblemError(
                f"edges: endpoints must lie in [0, {n}), found {edges[((edges < 0) | (edges >= n)).any(1)][0].tolist()}"
            )
        if (edges[:, 0] == edges[:, 1]).any():
            i = int(edges[edges[:, 0] == edges[:, 1]][0, 0])
            raise ProblemError(f"edges: self-loop on {self.name(i)}")
        if len(self.comm) != len(edges):
            raise ProblemError(f"comm: expected {len(edges)} matrices (one per edge), found {len(self.comm)}")
        comm = [c if isinstance(c, np.ndarray) and c.dtype == np.float64 and not c.flags.writeable
                else _frozen(np.array(c, dtype=np.float64)) for c in self.comm]  # frozen arrays are shared
        shapes = np.array([c.shape if c.ndim == 2 else (-1, -1) for c in comm], dtype=np.int64).reshape(-1, 2)
        finite = np.isfinite(np.concatenate([c.reshape(-1) for c in comm])).all() if comm else True
        bad = np.flatnonzero((shapes != np.stack([s[edges[:, 0]], s[edges[:, 1]]], axis=1)).any(axis=1))
        if len(bad) or not finite:
            e = int(bad[0]) if len(bad) else next(k for k, c in enumerate(comm) if not np.isfinite(c).all())
            u, v = edges[e].tolist()
            raise ProblemError(
                f"comm of edge {e} ({self.name(u)} -> {self.name(v)}): expected finite "
                f"({s[u]}, {s[v]}) matrix, found shape {comm[e].shape}"
            )
        budget = self.budget
        if budget is not None:
            budget = float(budget)
            if not math.isfinite(budget) or budget < 0:
                raise ProblemError(f"budget: expected a finite M >= 0, found {budget}")
        pins_in = self.pins.items() if isinstance(self.pins, Mapping) else self.pins
        pins = {}
        for i, allowed in pins_in:
            i = int(i)
            if not 0 <= i < n:
                raise ProblemError(f"pins: node {i} out of range [0, {n})")
            allowed = (allowed,) if isinstance(allowed, int | np.integer) else tuple(allowed)
            allowed = tuple(sorted({int(j) for j in allowed}))
            if not allowed or allowed[0] < 0 or allowed[-1] >= s[i]:
                raise ProblemError(
                    f"pins of {self.name(i)}: expected a non-empty subset of [0, {s[i]}), found {list(allowed)}"
                )
            pins[i] = tuple(sorted(set(pins.get(i, allowed)) & set(allowed)))
            if not pins[i]:
                raise ProblemError(f"pins of {self.name(i)}: two pins leave no strategy allowed")
        object.__setattr__(self, "comp", comp)
        object.__setattr__(self, "mem", mem)
        object.__setattr__(self, "edges", _frozen(edges))
        object.__setattr__(self, "comm", tuple(comm))
        object.__setattr__(self, "budget", budget)
        object.__setattr__(self, "pins", tuple(sorted(pins.items())))
        key = id(edges)
        if _ACYCLIC.get(key, lambda: None)() is not edges:
            _ = self.topo_order  # raises on a cycle
            _ACYCLIC[key] = weakref.ref(edges, lambda _, k=key: _ACYCLIC.pop(k, None))

    # ---- sizes and flat layouts -------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.comp)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    def name(self, i: int) -> str:
        return f"node {i} ({self.names[i]!r})" if self.names else f"node {i}"

    @cached_property
    def s(self) -> np.ndarray:
        """s_i, the number of strategies of each node."""
        return _frozen(np.array([c.size for c in self.comp], dtype=np.int64))

    @cached_property
    def offsets(self) -> np.ndarray:
        """Start of node i's strategies in the flat layout (length n + 1)."""
        return _frozen(np.concatenate([[0], np.cumsum(self.s)]).astype(np.int64))

    @cached_property
    def comp_flat(self) -> np.ndarray:
        return _frozen(np.concatenate(self.comp))

    @cached_property
    def mem_flat(self) -> np.ndarray:
        return _frozen(np.concatenate(self.mem))

    @cached_property
    def allowed_flat(self) -> np.ndarray:
        """Boolean mask over the flat layout: strategy j of node i is allowed by the pins."""
        mask = np.ones(int(self.offsets[-1]), dtype=bool)
        for i, allowed in self.pins:
            mask[self.offsets[i] : self.offsets[i + 1]] = False
            mask[self.offsets[i] + np.array(allowed)] = True
        return _frozen(mask)

    def allowed(self, i: int) -> np.ndarray:
        return self.allowed_flat[self.offsets[i] : self.offsets[i + 1]]

    @cached_property
    def comm_offsets(self) -> np.ndarray:
        sizes = self.s[self.edges[:, 0]] * self.s[self.edges[:, 1]]
        return _frozen(np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))

    @cached_property
    def comm_flat(self) -> np.ndarray:
        return _frozen(np.concatenate([c.reshape(-1) for c in self.comm]) if self.comm else np.zeros(0))

    @cached_property
    def comm_entries(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(e, j1, j2) of every entry of comm_flat."""
        e, local = ragged(np.diff(self.comm_offsets))
        sv = self.s[self.edges[e, 1]]
        return e, local // sv, local % sv

    @cached_property
    def topo_order(self) -> np.ndarray:
        """A topological order of the nodes (Kahn, smallest index first among ready nodes)."""
        indeg = np.bincount(self.edges[:, 1], minlength=self.n)
        succ = [[] for _ in range(self.n)]
        for u, v in self.edges.tolist():
            succ[u].append(v)
        ready = sorted(np.flatnonzero(indeg == 0).tolist(), reverse=True)
        order = []
        while ready:
            u = ready.pop()
            order.append(u)
            for v in succ[u]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != self.n:
            stuck = self.name(int(np.flatnonzero(indeg > 0)[0]))
            raise ProblemError(f"edges: the graph has a cycle (through {stuck}); expected a DAG")
        return _frozen(np.array(order, dtype=np.int64))

    # ---- evaluating a choice ----------------------------------------------------------------
    def check(self, choice: Iterable[int]) -> np.ndarray:
        """The choice as an int64 array, after checking its length, range and pins."""
        x = np.asarray(choice, dtype=np.int64).reshape(-1)
        if x.size != self.n:
            raise ProblemError(f"choice: expected {self.n} strategies (one per node), found {x.size}")
        bad = np.flatnonzero((x < 0) | (x >= self.s))
        if bad.size:
            i = int(bad[0])
            raise ProblemError(
                f"choice of {self.name(i)}: expected a strategy in [0, {self.s[i]}), found {x[i]}"
            )
        off = ~self.allowed_flat[self.offsets[:-1] + x]
        if off.any():
            i = int(np.flatnonzero(off)[0])
            raise ProblemError(
                f"choice of {self.name(i)}: strategy {x[i]} is not among the pinned {list(dict(self.pins)[i])}"
            )
        return x

    def cost(self, choice: Iterable[int]) -> float:
        """C(x) = sum_i comp_i[x_i] + sum_(u,v) comm_e[x_u, x_v] (Rhino §4.2)."""
        x = self.check(choice)
        u, v = self.edges[:, 0], self.edges[:, 1]
        idx = self.comm_offsets[:-1] + x[u] * self.s[v] + x[v]
        return float(self.comp_flat[self.offsets[:-1] + x].sum() + self.comm_flat[idx].sum())

    def memory(self, choice: Iterable[int]) -> float:
        """sum_i mem_i[x_i], the memory per device of a choice (Rhino §4.4)."""
        x = self.check(choice)
        return float(self.mem_flat[self.offsets[:-1] + x].sum())

    def fits(self, choice: Iterable[int]) -> bool:
        """The choice respects the pins and the memory budget."""
        return self.budget is None or self.memory(choice) <= self.budget * (1 + 1e-9) + 1e-9

    def min_memory_choice(self) -> np.ndarray:
        """Each node at its lowest-memory allowed strategy (ties: lowest compute, then index)."""
        mem = np.where(self.allowed_flat, self.mem_flat, np.inf)
        return segment_argmin(self, mem, self.comp_flat)

    def min_memory(self) -> float:
        """The least memory per device of any allowed choice: the 'need' against the budget."""
        return self.memory(self.min_memory_choice())

    def trivial_bound(self) -> float:
        """sum_i min_j comp_i[j] + sum_e min comm_e over allowed strategies: a valid lower bound."""
        comp = np.where(self.allowed_flat, self.comp_flat, np.inf)
        bound = float(np.minimum.reduceat(comp, self.offsets[:-1]).sum())
        if self.num_edges:
            e, j1, j2 = self.comm_entries
            u, v = self.edges[e, 0], self.edges[e, 1]
            ok = self.allowed_flat[self.offsets[u] + j1] & self.allowed_flat[self.offsets[v] + j2]
            comm = np.where(ok, self.comm_flat, np.inf)
            bound += float(np.minimum.reduceat(comm, self.comm_offsets[:-1]).sum())
        return bound

    def check_budget(self) -> None:
        """Raise MemoryBudgetError when even the lowest-memory choice exceeds M."""
        if self.budget is not None and not self.fits(self.min_memory_choice()):
            raise MemoryBudgetError(self.min_memory(), self.budget)

    # ---- derived problems -------------------------------------------------------------------
    def with_budget(self, budget: float | None) -> Problem:
        return replace(self, budget=budget)

    def restricted(self, allowed: Mapping[int, Iterable[int]]) -> Problem:
        """The same problem with more pins (intersected with the existing ones)."""
        return replace(self, pins=[*self.pins, *((i, tuple(a)) for i, a in allowed.items())])

    # ---- JSON -------------------------------------------------------------------------------
    def to_json(self) -> str:
        d = {
            "format": FORMAT,
            "names": list(self.names),
            "comp": [c.tolist() for c in self.comp],
            "mem": [m.tolist() for m in self.mem] if self.mem_flat.any() else [],
            "edges": self.edges.tolist(),
            "comm": [c.tolist() for c in self.comm],
            "budget": self.budget,
            "pins": {str(i): list(a) for i, a in self.pins},
        }
        return json.dumps(d, separators=(",", ":")) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Problem:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ProblemError(f"problem JSON: not valid JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            found = d.get("format") if isinstance(d, dict) else type(d).__name__
            raise ProblemError(f"problem JSON: expected format {FORMAT!r}, found {found!r}")
        try:
            return cls(
                comp=tuple(d["comp"]),
                edges=np.array(d["edges"], dtype=np.int64).reshape(-1, 2),
                comm=tuple(d["comm"]),
                mem=tuple(d.get("mem") or ()),
                budget=d.get("budget"),
                pins=tuple((int(i), tuple(a)) for i, a in d.get("pins", {}).items()),
                names=tuple(d.get("names") or ()),
            )
        except (KeyError, TypeError) as exc:
            raise ProblemError(f"problem JSON: missing or malformed field ({exc!r})") from None


def segment_argmin(problem: Problem, key: np.ndarray, tie: np.ndarray | None = None) -> np.ndarray:
    """Per node, the strategy minimising `key` over the flat layout (ties: `tie`, then index)."""
    owner = np.repeat(np.arange(problem.n), problem.s)
    keys = (key,) if tie is None else (tie, key)
    order = np.lexsort((*keys, owner))  # last key is primary: by node, then key, then tie
    first = order[problem.offsets[:-1]]
    return first - problem.offsets[:-1]


@dataclass(frozen=True, eq=False)
class Solution:
    """A choice x and what is known about its quality."""

    choice: np.ndarray  # x_i, the strategy chosen for node i
    cost: float  # C(x)
    lower_bound: float  # a proven lower bound on the optimum (-inf when none is known)
    gap: float  # (cost - lower_bound) / |cost|: 0 when proven optimal, inf when no bound
    status: str  # "optimal" (within the asked mip gap), "time_limit" (incumbent + bound), "heuristic"
    time_s: float  # wall time of the solve
    method: str = ""  # which solver produced it ("ilp", "tree-dp", "O2", ...)


def relative_gap(cost: float, lower_bound: float) -> float:
    """(cost - lower_bound) / |cost|, 0 within float noise, inf without a bound."""
    if not math.isfinite(lower_bound):
        return math.inf
    diff = cost - lower_bound
    scale = max(abs(cost), 1e-12)
    return 0.0 if diff <= 1e-9 * max(1.0, abs(cost)) else diff / scale
