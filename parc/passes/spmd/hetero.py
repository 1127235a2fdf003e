"""Mixed devices on one mesh (Whale 3.3.1): who gets how much of the work, and what it costs.

A mesh over mixed devices splits each label unevenly along an axis whose coordinates have
different speeds, in proportion to them, so the slowest device does not set the step: the
global batch is kept, its samples (and any other split dim) go out in uneven pieces
(`S(d,[sizes])`). Each axis coordinate is a slice of devices that works at its slowest member's
pace (the other axes split evenly); its load share comes from one of two balancers over the
slices, in `parc/solver/balance.py`: Whale's Algorithm 1 (`whale_balance`) and the optimum of the
same problem (`exact_balance`, a small MILP).

The planner uses the exact shares and reports Algorithm 1's against them (plan.json
`balance`). Per device, a node's share costs that device's roofline time, and a step's node
costs its slowest device (`costs._device_costs`); memory is checked per device against its own budget by
scaling each device's bytes to the smallest budget (`costs._device_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parc.cluster import Cluster, Mesh
from parc.cluster.devices import DeviceSpec
from parc.cluster.work import of_graph
from parc.solver.balance import balanced_time, exact_balance, whale_balance


def device_times(graph, devices, floors: bool = False) -> dict[str, float]:
    """Per device type (by name), the graph's roofline compute time on one such device; the
    nodes' floors (`node_floor`) only with `floors` (they do not shrink with a device's share of a
    split node, but a pipeline stage pays every one of its nodes' floors)."""
    return {d.name: sum(w.seconds(d) - (0.0 if floors else w.floor(d)) for w in of_graph(graph, d) if w is not None)
            for d in set(devices)}


def stage_order(cluster: Cluster, count: int) -> list[int]:
    """Which block of N/count consecutive ranks each pipeline stage takes (Whale 3.3.2): blocks
    with more memory per device first (earlier stages keep more microbatches under 1F1B), then
    the higher peak float32 FLOP/s first; rank order among equals (a homogeneous cluster: 0, 1,
    2, ...)."""
    group = cluster.num_devices // count
    blocks = [cluster.devices[b * group:(b + 1) * group] for b in range(count)]
    return sorted(range(count), key=lambda b: (-min(d.memory_bytes for d in blocks[b]),
                                               -min(d.peak("float32") for d in blocks[b]), b))


def stage_capacity(cluster: Cluster, count: int, order: list[int], times: dict[str, float]) -> list[float]:
    """Each stage's share of the compute (sums to 1): its block's speed, the block working at its
    slowest device's pace (its SPMD plan splits evenly over it)."""
    group = cluster.num_devices // count
    speed = [group / max(times[d.name] for d in cluster.devices[b * group:(b + 1) * group]) for b in order]
    total = sum(speed)
    return [x / total for x in speed]


@dataclass(frozen=True)
class Balance:
    """How a mesh over mixed devices shares its work: per axis, each coordinate's share (1/n
    each on an axis whose slices are alike), and each mesh position's device and budget."""

    shares: tuple[tuple[float, ...], ...]
    devices: tuple[DeviceSpec, ...]  # per mesh position, row-major
    budgets: tuple[float, ...]  # bytes per mesh position
    report: dict  # what plan.json's `balance` says: capacity, Algorithm 1, optimum
    # per axis, the batch's samples per slice (the exact balance), or None: `solver.balance.label_sizes`
    cuts: tuple[tuple[int, ...] | None, ...]

    def uneven(self, axis: int) -> bool:
        s = self.shares[axis]
        return max(s) - min(s) > 1e-12

    @property
    def any_uneven(self) -> bool:
        return any(self.uneven(k) for k in range(len(self.shares)))


SHARE_UNITS = 1000  # an axis's shares are thousandths of its work


def mesh_balance(mesh: Mesh, cluster: Cluster, unit_time: dict[str, float], units: int,
                 mem_per_unit: float, fixed_bytes: float) -> Balance:
    """The shares of `mesh`'s axes. For each axis, its coordinates are slices of devices; a
    slice's time per unit is its slowest member's `unit_time` (seconds per unit of the whole
    work, by device name) divided by the slice's size, its memory the smallest member's budget
    times its size. The exact balance in thousandths gives the shares (each split label rounds
    its own extent to them); the batch's `units` as Algorithm 1 (over FLOP capacity), the exact
    balance and the even split give them are reported."""
    devices = tuple(cluster.devices[r] for r in mesh.devices)
    budgets = tuple(float(d.memory_bytes) for d in devices)
    grid = np.arange(len(devices)).reshape(mesh.shape)
    shares, cuts, report = [], [], {"axes": []}
    for k, n in enumerate(mesh.shape):
        slices = [np.take(grid, i, axis=k).ravel() for i in range(n)]
        size = len(slices[0])
        t = [max(unit_time[devices[j].name] for j in s) / size for s in slices]
        mem = [min(budgets[j] for j in s) * size for s in slices]
        flops = [min(devices[j].peak("float32") for j in s) * size for s in slices]
        names = ["+".join(sorted({devices[j].name for j in s})) for s in slices]
        if len(set(t)) == 1 and len(set(mem)) == 1:
            shares.append(tuple([1.0 / n] * n))
            cuts.append(None)
            continue
        # a slice of `size` devices: each holds the fixed part, a unit's activations are split over
        # them, so size * fixed + n_units * mem_per_unit <= size * (its smallest budget)
        fixed = [fixed_bytes * size] * n
        # the shares: the exact balance in thousandths (each label then rounds its own extent)
        fine = exact_balance(SHARE_UNITS, [x * units / SHARE_UNITS for x in t], mem,
                             mem_per_unit * units / SHARE_UNITS, fixed)
        if fine is None:  # no split fits every slice's memory: Algorithm 1's best effort
            fine = whale_balance(SHARE_UNITS, flops, mem, mem_per_unit * units / SHARE_UNITS, fixed)
        shares.append(tuple(c / SHARE_UNITS for c in fine))
        # what plan.json reports: the batch's samples by Algorithm 1, by the optimum and evenly
        opt = exact_balance(units, t, mem, mem_per_unit, fixed)
        cuts.append(None if opt is None else tuple(opt))
        whale = whale_balance(units, flops, mem, mem_per_unit, fixed)
        even = [units // n + (1 if i < units % n else 0) for i in range(n)]
        report["axes"].append({
            "axis": k, "slices": names, "shares": list(shares[-1]), "units": units,
            "optimum": opt, "algorithm1": whale, "even": even,
            "time_optimum_s": None if opt is None else balanced_time(opt, t),
            "time_algorithm1_s": balanced_time(whale, t), "time_even_s": balanced_time(even, t),
        })
    return Balance(tuple(shares), devices, budgets, report, tuple(cuts))


__all__ = ["Balance", "device_times", "mesh_balance", "stage_capacity", "stage_order"]
