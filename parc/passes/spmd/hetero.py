"""Mixed devices on one mesh (Whale 3.3.1): who gets how much of the work, and what it costs.

A mesh over mixed devices splits each label unevenly along an axis whose coordinates have
different speeds, in proportion to them, so the slowest device does not set the step: the
global batch is kept, its samples (and any other split dim) go out in uneven pieces
(`S(d,[sizes])`). Each axis coordinate is a slice of devices that works at its slowest member's
pace (the other axes split evenly); its load share comes from one of two balancers over the
slices:

- `whale_balance`: Whale's Algorithm 1. Load ratios from FLOP capacity; while a device is over
  its memory, shift the most overloaded device's excess to the free device with the lowest
  FLOP (then memory) utilisation, as much as that device can take.
- `exact_balance`: the optimum of the same problem, a small MILP (highspy): minimise the slowest
  device's time, each device under its memory, the units (samples) integral.

The planner uses the exact shares and reports Algorithm 1's against them (plan.json
`balance`). Per device, a node's share costs that device's roofline time, and a step's node
costs its slowest device (`costs._device_costs`); memory is checked per device against its own budget by
scaling each device's bytes to the smallest budget (`costs._device_bytes`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

from parc.cluster import Cluster, Mesh, compute_time, node_floor
from parc.cluster.devices import DeviceSpec
from parc.ops import node_pieces, node_work, op_class
from parc.solver.ilp import new_highs


def device_times(graph, devices, floors: bool = False) -> dict[str, float]:
    """Per device type (by name), the graph's roofline compute time on one such device; the
    nodes' floors (`node_floor`) only with `floors` (they do not shrink with a device's share of a
    split node, but a pipeline stage pays every one of its nodes' floors)."""
    work = [(*node_work(n), op_class(n), node_pieces(n)) for n in graph.nodes]  # once, then priced on each type
    return {d.name: sum(compute_time(flops, nbytes, d, dtype, cls, pieces=pieces)
                        - (0.0 if floors else node_floor(flops, nbytes, d, cls))
                        for flops, nbytes, dtype, cls, pieces in work)
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


def whale_balance(units: int, flops: Sequence[float], memory: Sequence[float], mem_per_unit: float,
                  fixed: Sequence[float] | None = None) -> list[int]:
    """Whale's Algorithm 1 over devices with FLOP capacity `flops` and memory `memory`: units
    per device. A device holding n units needs fixed[i] + n * mem_per_unit bytes. The ratios
    start proportional to FLOP capacity (largest remainders, so they sum to `units`); then, while
    some device is over its memory and some other has room, the device with the highest memory
    utilisation sheds its excess to the free device with the lowest (FLOP, memory) utilisation,
    at most what that device can take without going over (Whale's shift_load); a device that
    can take nothing more leaves the free list."""
    n = len(flops)
    fixed = list(fixed) if fixed is not None else [0.0] * n
    load = _proportional(units, flops)

    def mem_util(i: int) -> float:
        return (fixed[i] + load[i] * mem_per_unit) / memory[i]

    def flop_util(i: int) -> float:
        return load[i] / flops[i]

    oom = [i for i in range(n) if mem_util(i) > 1]
    free = [i for i in range(n) if mem_util(i) <= 1]
    while oom and free:
        peak = max(oom, key=mem_util)
        valley = min(free, key=lambda i: (flop_util(i), mem_util(i)))
        excess = math.ceil((fixed[peak] + load[peak] * mem_per_unit - memory[peak]) / mem_per_unit - 1e-9) \
            if mem_per_unit > 0 else load[peak]
        room = math.floor((memory[valley] - fixed[valley]) / mem_per_unit - load[valley] + 1e-9) \
            if mem_per_unit > 0 else units
        b = max(0, min(excess, room, load[peak]))
        load[peak] -= b
        load[valley] += b
        if b >= excess:
            oom.remove(peak)
        else:
            free.remove(valley)
    return load


def exact_balance(units: int, unit_time: Sequence[float], memory: Sequence[float], mem_per_unit: float,
                  fixed: Sequence[float] | None = None, fixed_time: Sequence[float] | None = None,
                  time_limit: float = 5.0) -> list[int] | None:
    """Units per device minimising max_i fixed_time[i] + n_i * unit_time[i] subject to
    fixed[i] + n_i * mem_per_unit <= memory[i], sum n_i = units, n_i integral (a MILP of
    len(unit_time) + 1 columns); None when no split fits."""
    n = len(unit_time)
    fixed = list(fixed) if fixed is not None else [0.0] * n
    fixed_time = list(fixed_time) if fixed_time is not None else [0.0] * n
    scale = 1.0 / max(max(unit_time) * units, 1e-300)  # seconds to O(1): HiGHS's tolerances are absolute
    h = new_highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)  # as every HiGHS in parc: the first one fixes the process's scheduler
    h.setOptionValue("time_limit", time_limit)
    h.setOptionValue("mip_rel_gap", 0.0)
    inf = highspy.kHighsInf
    upper = [units if mem_per_unit <= 0 else max(-1.0, math.floor((memory[i] - fixed[i]) / mem_per_unit + 1e-9))
             for i in range(n)]
    if sum(max(u, 0) for u in upper) < units:
        return None
    for i in range(n):  # n_i
        h.addVar(0.0, float(max(upper[i], 0)))
    h.addVar(0.0, inf)  # t
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.full(n, highspy.HighsVarType.kInteger))
    h.changeColCost(n, 1.0)
    for i in range(n):  # fixed_time_i + n_i unit_time_i <= t
        h.addRow(-inf, -fixed_time[i] * scale, 2, np.array([i, n], dtype=np.int32),
                 np.array([unit_time[i] * scale, -1.0]))
    h.addRow(float(units), float(units), n, np.arange(n, dtype=np.int32), np.ones(n))
    h.run()
    if h.getModelStatus() not in (highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
        return None
    x = np.asarray(h.getSolution().col_value[:n])
    load = [int(round(v)) for v in x]
    return load if sum(load) == units else None


def balanced_time(load: Sequence[int], unit_time: Sequence[float], fixed_time: Sequence[float] | None = None) -> float:
    """The slowest device's time under `load`."""
    fixed_time = fixed_time or [0.0] * len(load)
    return max(f + n * t for n, t, f in zip(load, unit_time, fixed_time))


def _proportional(units: int, weights: Sequence[float]) -> list[int]:
    """units split in proportion to weights, largest remainders first (sums to units)."""
    total = float(sum(weights))
    raw = [units * w / total for w in weights]
    out = [math.floor(r) for r in raw]
    for i in sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))[: units - sum(out)]:
        out[i] += 1
    return out


def split_sizes(extent: int, shares: Sequence[float]) -> tuple[int, ...] | None:
    """`extent` cut in proportion to `shares` (largest remainders), every piece at least 1; None
    when the extent is too small for that or the pieces come out even."""
    if extent < len(shares):
        return None
    sizes = _proportional(extent, shares)
    while min(sizes) < 1:  # a piece of 0 rows: take one from the largest
        sizes[sizes.index(max(sizes))] -= 1
        sizes[sizes.index(0)] += 1
    if len(set(sizes)) == 1:
        return None
    return tuple(sizes)


def label_sizes(extent: int, shares: Sequence[float], cut: Sequence[int] | None) -> tuple[int, ...] | None:
    """A label's pieces on an uneven axis: an extent holding whole batches (the batch dim, and the
    batch flattened with the sequence or the heads) is cut where the batch is (`cut`, the
    batch's samples per slice, when uneven); any other by `split_sizes`. Rounded apart, a
    Reshape from [B, S, H] to [B*S, H] would hand its consumer pieces of other sizes, and every
    such edge would reshard (bert-large, 8 V100 + 8 P100, batch 64: 330 ms of a 1.19 s step)."""
    if cut is not None and len(set(cut)) > 1 and min(cut) >= 1 and extent % sum(cut) == 0:
        return tuple(c * (extent // sum(cut)) for c in cut)
    return split_sizes(extent, shares)


@dataclass(frozen=True)
class Balance:
    """How a mesh over mixed devices shares its work: per axis, each coordinate's share (1/n
    each on an axis whose slices are alike), and each mesh position's device and budget."""

    shares: tuple[tuple[float, ...], ...]
    devices: tuple[DeviceSpec, ...]  # per mesh position, row-major
    budgets: tuple[float, ...]  # bytes per mesh position
    report: dict  # what plan.json's `balance` says: capacity, Algorithm 1, optimum
    # per axis, the batch's samples per slice (the exact balance), or None: `label_sizes`
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


__all__ = ["Balance", "balanced_time", "device_times", "exact_balance", "label_sizes", "mesh_balance", "split_sizes",
           "stage_capacity", "stage_order", "whale_balance"]
