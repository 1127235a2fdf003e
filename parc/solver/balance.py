"""Load balance over mixed devices (Whale 3.3.1): how many units of work (samples) each device takes.

Device i has FLOP capacity flops_i (or a time per unit t_i), memory M_i, and holding n_i units
needs fixed_i + n_i a bytes. Two balancers, and the rounding of shares to a dim's pieces:

- `whale_balance`: Whale's Algorithm 1. Load ratios from FLOP capacity; while some device is over
  its memory, shift the most overloaded device's excess to the free device with the lowest FLOP
  (then memory) utilisation, as much as that device can take (Whale's shift_load).
- `exact_balance`: the optimum of the same problem, a small MILP (highspy):

      min   t
      (a)   fixed_time_i + n_i t_i <= t        every i    the slowest device sets the step
      (b)   sum_i n_i = units                             every unit placed
      (c)   0 <= n_i <= (M_i - fixed_i) / a    every i    memory, as n_i's column bound
            n_i integral

- `split_sizes` / `label_sizes`: an extent cut in proportion to shares (largest remainders).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import highspy
import numpy as np

from parc.solver.ilp import new_highs


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
        b = max(0, min(excess, room, load[peak]))  # shift_load(peak, valley, b)
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
    fixed[i] + n_i * mem_per_unit <= memory[i], sum n_i = units, n_i integral (the MILP of the
    module docstring, len(unit_time) + 1 columns); None when no split fits."""
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
    # (c) memory: at most this many units on device i (-1: not even its fixed part fits)
    upper = [units if mem_per_unit <= 0 else max(-1.0, math.floor((memory[i] - fixed[i]) / mem_per_unit + 1e-9))
             for i in range(n)]
    if sum(max(u, 0) for u in upper) < units:
        return None
    for i in range(n):  # n_i
        h.addVar(0.0, float(max(upper[i], 0)))
    h.addVar(0.0, inf)  # t
    h.changeColsIntegrality(n, np.arange(n, dtype=np.int32), np.full(n, highspy.HighsVarType.kInteger))
    h.changeColCost(n, 1.0)
    for i in range(n):  # (a) fixed_time_i + n_i t_i <= t
        h.addRow(-inf, -fixed_time[i] * scale, 2, np.array([i, n], dtype=np.int32),
                 np.array([unit_time[i] * scale, -1.0]))
    h.addRow(float(units), float(units), n, np.arange(n, dtype=np.int32), np.ones(n))  # (b) sum_i n_i = units
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
    such edge would reshard (benchmarks/LOG.md: bert-large on 8 V100 + 8 P100)."""
    if cut is not None and len(set(cut)) > 1 and min(cut) >= 1 and extent % sum(cut) == 0:
        return tuple(c * (extent // sum(cut)) for c in cut)
    return split_sizes(extent, shares)


__all__ = ["balanced_time", "exact_balance", "label_sizes", "split_sizes", "whale_balance"]
