"""The calibration's fields fitted from one rank count's measured rows (`measure_rank`): rates and
efficiencies per class, floors, piece costs, the caches' reach, cold reads, and each collective's
call, alpha and beta (`fit`)."""

from __future__ import annotations

import math
import statistics
from statistics import geometric_mean

import numpy as np

from parc.calibrate.catalogue import MEMORY_CLASSES, RUN_OPS, matmul_class
from parc.cluster.cost import _VOLUME, STEPS

CACHE_RATIO = 1.5  # a rate counts as the caches' where it is at least this many times memory's
COLD_RATIO = 1.2  # the least warm / cold rate worth pricing


def fit_cold(rows: list[dict]) -> tuple[float, float]:
    """(cold_bandwidth, cache_share) from `_cold_reads`' rows: the Add's rate after the most
    writing, and the traffic (each written byte read and written: twice the bytes) at which its
    rate falls to the geometric mean of that and its rate after none, interpolated on a log
    scale between the rows around it. (0, 0) where the rate does not fall by COLD_RATIO (the
    caches hold it all, or none of it: every read at memory's rates)."""
    rates = [(r["touched"], r["bytes"] / r["s"]) for r in sorted(rows, key=lambda r: r["touched"])]
    warm, cold = rates[0][1], rates[-1][1]
    if warm < COLD_RATIO * cold:
        return 0.0, 0.0
    mid = math.sqrt(warm * cold)
    for (x0, r0), (x1, r1) in zip(rates, rates[1:]):
        if r1 <= mid:
            if x0 == 0 or r0 <= r1:
                return cold, 2.0 * x1
            share = math.exp(math.log(x0) + (math.log(x1) - math.log(x0)) * (r0 - mid) / (r0 - r1))
            return cold, 2.0 * share
    return cold, 2.0 * rates[-1][0]


def fit_collectives(measured: list[dict]) -> dict:
    """A link's `call`, `latency` and `bandwidth` from all-reduce bursts: t = call + alpha *
    steps + volume / beta, the all-reduce's ring steps and volume (`parc.cluster.cost.STEPS`,
    `_VOLUME`: 2(n-1) and 2(n-1)/n B), least squares on the relative
    error with every coefficient >= 0 (the best of the column subsets that keep them so). The
    call cost needs rows of two group sizes to tell it from alpha; with one it is 0. Where ranks
    outnumber the cores, a small all-reduce costs about as much among all ranks as among pairs
    while the other pairs compute: the cost is waiting for the members to run, one per call, not
    per ring step (alpha alone prices the pairs' and a pipeline stage's small collectives far
    under their measured time)."""
    t = np.array([r["s"] for r in measured])
    cols = {"call": np.ones(len(t)), "latency": np.array([STEPS["all_reduce"](r["n"]) for r in measured], float),
            "inv_beta": np.array([_VOLUME["all_reduce"](r["n"]) * r["bytes"] for r in measured])}
    subsets = [("latency", "inv_beta")]
    if len({r["n"] for r in measured}) > 1:
        subsets += [("call", "inv_beta"), ("call", "latency", "inv_beta")]
    best: tuple[float, dict] | None = None
    for names in subsets:
        a = np.stack([cols[c] / t for c in names], 1)
        coef, *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        if "call" in names and (coef <= 0).any():
            continue  # a subset with a call cost counts only where every coefficient is positive
        coef = np.maximum(coef, [1e-7 if c == "latency" else 1e-12 for c in names])  # as before
        resid = float(np.sum((a @ coef - 1) ** 2))
        if best is None or resid < best[0]:
            best = (resid, dict(zip(names, map(float, coef))))
    assert best is not None  # the first subset always counts
    c = best[1]
    return {"call": c.get("call", 0.0), "latency": c.get("latency", 1e-7), "bandwidth": 1.0 / c["inv_beta"]}


def fit_kind(measured: list[dict], kind: str, call: float) -> tuple[float, float]:
    """(latency, bandwidth) of one collective kind from its bursts: t = call + alpha * steps +
    volume / beta with the kind's ring steps and volume (`parc.cluster.cost.STEPS`, `_VOLUME`)
    and the link's call cost, least squares on the relative error, alpha >= 0."""
    t = np.array([r["s"] for r in measured])
    a = np.stack([np.array([STEPS[kind](r["n"]) for r in measured], float) / t,
                  np.array([_VOLUME[kind](r["n"]) * r["bytes"] for r in measured]) / t], 1)
    rhs = 1.0 - call / t
    coef, *_ = np.linalg.lstsq(a, rhs, rcond=None)
    if coef[0] < 0:  # no latency: the bandwidth alone
        coef = np.array([0.0, float(np.linalg.lstsq(a[:, 1:], rhs, rcond=None)[0][0])])
    return max(float(coef[0]), 0.0), 1.0 / max(float(coef[1]), 1e-15)


def fit_cache(rows: dict) -> tuple[float, float]:
    """(cache_bytes, cache_speedup) from one rank count's Adds (the memory rows' and the
    sweep's): the largest size up to which every Add streamed at least `CACHE_RATIO` times the
    rate of the two largest (memory's), and the geometric mean of those Adds' rates over memory's.
    A plain stream: the other classes' rows mix in their pieces and floors, which `fit_pieces` and
    the floors take apart. (0, 1) where no sweep was measured (a GPU's inputs rotate through more
    than its caches) or the smallest Add is not that much faster."""
    if not rows.get("sweep"):
        return 0.0, 1.0
    adds = sorted((r["bytes"], r["bytes_per_s"]) for r in rows["memory"] + rows["sweep"] if r["op"] == "Add")
    slow = geometric_mean([rate for _, rate in adds[-2:]])
    within = []
    for nbytes, rate in adds[:-2]:
        if rate < CACHE_RATIO * slow:
            break
        within.append((nbytes, rate))
    if not within:
        return 0.0, 1.0
    return float(within[-1][0]), geometric_mean([rate for _, rate in within]) / slow


def _from_memory(nbytes: float, cache: tuple[float, float]) -> float:
    """The share of a row's rate that is memory's: 1 / cache_speedup within the cache, else 1."""
    return 1.0 / cache[1] if 0 < nbytes <= cache[0] else 1.0


def fit_pieces(rows: dict, streams: dict, cache: tuple[float, float]) -> dict[str, float]:
    """Per class with piece cases (`PIECE_OPS`): seconds per piece, fitted with the class's rate
    to its rows (the built-in sizes' and the piece case: t - launch floor = bytes / rate + pieces *
    cost, least squares on the relative error; a row within the cache, `fit_cache`, streams
    cache_speedup times the rate). `streams` (bytes/s per class) takes the fitted
    rates. A class whose fit needs a negative coefficient keeps its rate and has a piece cost of 0
    (not none: a k-rank section of the file laid over one rank's would inherit that one's)."""
    out: dict[str, float] = {}
    floor = rows["launch_floor_s"]
    classes = {MEMORY_CLASSES.get(r["op"]) for r in rows.get("pieces", [])}
    if rows.get("pieces"):
        classes |= {MEMORY_CLASSES.get(op) for op in RUN_OPS}  # their memory rows differ in runs
    for cls in classes:
        measured = [r for r in rows["memory"] + rows.get("pieces", []) if MEMORY_CLASSES.get(r["op"]) == cls]
        if not measured:
            continue
        t = np.array([max(r["s"] - floor, 1e-9) for r in measured])
        a = np.array([[r["bytes"] * _from_memory(r["bytes"], cache), r.get("pieces", 0.0)]
                      for r in measured]) / t[:, None]
        (inv_rate, cost), *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        out[cls] = 0.0  # written as 0: a k-rank section must not inherit one rank's cost
        if inv_rate > 0 and cost > 0:
            streams[cls], out[cls] = float(1.0 / inv_rate), float(cost)
    return out


def fit_conv_pieces(convs: list[dict], rates: dict, cap: float, floor: float) -> dict[str, float]:
    """Per convolution class whose built-in rows carry pieces (`parc.ops.node_pieces`: the elements
    of the lowering): seconds per piece, fitted with the class's rate (t - launch floor = FLOPs /
    rate + pieces * cost, least squares on the relative error), the rate going into `rates`. A rate
    above `cap` (the 2-D product's: a convolution is one) is held at it and the cost fitted alone; a
    class whose cost comes out negative keeps its mean rate and a cost of 0, as does a class
    measured at a model's own shapes (rows with a `count`: their total rate is the model's step)."""
    out: dict[str, float] = {}
    for cls in {r["class"] for r in convs}:
        out[cls] = 0.0  # written as 0: a k-rank section must not inherit one rank's cost
        measured = [r for r in convs if r["class"] == cls and "pieces" in r]
        if len(measured) < 2 or any("count" in r for r in convs if r["class"] == cls):
            continue
        t = np.array([max(r["s"] - floor, 1e-9) for r in measured])
        a = np.array([[r["flops"], r["pieces"]] for r in measured]) / t[:, None]
        (inv_rate, cost), *_ = np.linalg.lstsq(a, np.ones(len(t)), rcond=None)
        if inv_rate < 1.0 / cap:
            inv_rate = 1.0 / cap
            rest = 1.0 - a[:, 0] * inv_rate
            cost = float(a[:, 1] @ rest / (a[:, 1] @ a[:, 1]))
        if cost > 0:
            rates[cls], out[cls] = float(1.0 / inv_rate), float(cost)
    return out


def fit(rows: dict, k: int) -> dict:
    """Calibration fields (SI) from one rank's measured rows. Each class's rate is the geometric
    mean of its sizes' (a model's own products and convolutions, rows with a `count`: its FLOPs
    over its time); the fastest class's is the peak (FLOP/s, bytes/s) and the others are fractions of it: matmuls
    are `MatMul` (a 2-D product) or `BatchMatMul`, convolutions their classes; memory-bound ops the
    elementwise default or their own class (`MEMORY_CLASSES`)."""
    def by_class(items) -> dict:
        groups: dict = {}
        for cls, rate in items:
            groups.setdefault(cls, []).append(rate)
        return {cls: geometric_mean(rates) for cls, rates in groups.items()}

    rates = by_class((r["class"] if "class" in r else matmul_class(r["shape"]), r["flops_per_s"])
                     for r in rows["matmul"] if "count" not in r)
    convs = rows.get("conv", [])
    rates.update(by_class((r["class"], r["flops_per_s"]) for r in convs if "count" not in r))
    # a model's own products and convolutions: its total FLOPs over its total time, each shape as
    # often as the model has it (what a step of it costs, not a typical size's rate)
    own: dict[str, list[float]] = {}
    for r in rows["matmul"] + convs:
        if "count" in r:
            acc = own.setdefault(r["class"], [0.0, 0.0])
            acc[0] += r["count"] * r["flops"]
            acc[1] += r["count"] * r["flops"] / r["flops_per_s"]
    rates.update({cls: flops / seconds for cls, (flops, seconds) in own.items()})
    conv_piece = fit_conv_pieces(convs, rates, rates.get("MatMul", max(rates.values())), rows["launch_floor_s"])
    peak = max(rates.values())  # efficiencies are fractions of the fastest class's rate
    main = rates.get("MatMul", peak)
    cache = fit_cache(rows)  # a row within the caches gives memory's rate as its own / cache_speedup
    streams = by_class((MEMORY_CLASSES.get(r["op"]), r["bytes_per_s"] * _from_memory(r.get("bytes", 0), cache))
                       for r in rows["memory"])
    piece = {**fit_pieces(rows, streams, cache), **conv_piece}
    bandwidth = max(streams.values())
    default = streams.get(None, bandwidth)
    # each class's floor: what its small cases take beyond the launch floor and what its rate
    # and piece cost give them (the mean over its cases; none below 0)
    floors: dict = {}
    for r in rows.get("small", []):
        if "op" in r:
            cls = MEMORY_CLASSES.get(r["op"])
            work = r["bytes"] * _from_memory(r["bytes"], cache) / streams.get(cls, default) + \
                r.get("pieces", 0.0) * piece.get(cls, piece.get(None, 0.0))
        else:
            cls = matmul_class(r["shape"])
            work = r["flops"] / rates.get(cls, main)
        floors.setdefault(cls, []).append(max(0.0, r["s"] - rows["launch_floor_s"] - work))
    floor = {cls: statistics.fmean(v) for cls, v in floors.items()}
    if "MatMul" in floor:
        floor.setdefault("Gemm", floor["MatMul"])  # a Gemm is a 2-D product with a bias
    out = {"peak_float32": peak, "compute_efficiency": main / peak,
           "op_efficiency": {cls: rate / peak for cls, rate in rates.items() if cls != "MatMul"},
           "memory_bandwidth": bandwidth, "memory_efficiency": default / bandwidth,
           "memory_op_efficiency": {cls: rate / bandwidth for cls, rate in streams.items() if cls is not None},
           "launch_floor": rows["launch_floor_s"], "task_overhead": rows["task_overhead_s"],
           "node_floor": floor.pop(None, 0.0), "op_floor": floor, "node_piece": piece.pop(None, 0.0),
           "op_piece": piece, "cache_bytes": cache[0], "cache_speedup": cache[1]}
    if rows.get("cold"):
        out["cold_bandwidth"], out["cache_share"] = fit_cold(rows["cold"])
    if k > 1 and rows.get("all_reduce"):
        measured = rows["all_reduce"]
        out.update(fit_collectives(measured))
        # the handoff: the first's excess where the message is only latency (the smallest size);
        # larger firsts also move their bytes through caches the compute evicted while other
        # ranks contend for memory, a cost of the size the burst does not see, and averaging them
        # in overcharges every small message after compute
        smallest = min(r["bytes"] for r in measured)
        out["handoff"] = max(0.0, statistics.fmean(r["first_s"] - r["s"] for r in measured if r["bytes"] == smallest))
        if rows.get("collectives"):  # reduce-scatters, all-gathers and all-to-alls at figures of their own
            out["kinds"] = {kind: fit_kind([r for r in rows["collectives"] if r["kind"] == kind], kind, out["call"])
                            for kind in sorted({r["kind"] for r in rows["collectives"]})}
    return out
