"""Reference training steps (on CPUs): zoo models or the `--model` files planned with the figures
just written and run with `parc run` as a user runs them, whose measured time over their
simulation is the device's `step_ratio` (`reference_steps`, `fit_step_ratio`); and the same steps
with every parameter split, traced, whose collectives' time over their figures is the link's
(`link_ratios`, `fit_link_ratio`). parc is run in a subprocess (`_parc`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import geometric_mean

import numpy as np

from parc.calibrate.host import host_probe
from parc.exec.engine_choice import pick_engine, rank_threads
from parc.exec.runner import RunError
from parc.exec.trace import collective_seconds
from parc.plandir import load_plan
from parc.plandir.simulation import COMM
from parc.plandir.taskgraph import load_taskgraph

# the reference training steps (`reference_steps`): zoo models, `parc models build NAME --set ...
# --train momentum`, a convolutional net and an encoder-decoder, each step long enough that the
# median of a few steps is steady (the zoo's default t5-tiny steps are too short: where ranks
# share cores, their ratio moves run to run)
REFERENCE_STEPS = (("unet-tiny", ("batch=16",)),
                   ("t5-tiny", ("batch=16", "d_model=128", "d_ff=512", "enc_seq=64", "dec_seq=32")))
REFERENCE_RUNS, REFERENCE_WARMUP = 20, 5  # steps each reference runs; the median is of those after the warm-up
STEP_RATIO_RANGE = (0.5, 4.0)  # a ratio outside says the reference went wrong, not the benchmarks
# the tensor-parallel references (`link_ratios`): every reference step with every parameter
# split over all ranks (Whale's split), so that a collective runs between most of its modules;
# each traced this many times (the trace is of a run's last step), each run this many steps
SPLIT_HINTS, SPLIT_TRACES, SPLIT_STEPS = "default: split\n", 3, 6


def _parc(*argv: object) -> str:
    """`parc ARGV`'s stdout, run as a user runs it; a failure is a RunError naming the command."""
    cmd = [sys.executable, "-m", "parc.cli.main", *map(str, argv)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise RunError(f"parc profile's reference step `parc {' '.join(map(str, argv[:2]))} ...` failed: {last}")
    return res.stdout


def reference_models(tmp: Path, models: Sequence[str | Path] = (),
                     dims: Mapping[str, int] | None = None) -> tuple[list[str], list[tuple[str, Path]]]:
    """The reference training steps: `models` (`dims` bound by the `--dim` arguments returned)
    where given, else the zoo's `REFERENCE_STEPS`, built into `tmp`: (arguments, [(name, file)])."""
    if models:
        return ([x for name, value in (dims or {}).items() for x in ("--dim", f"{name}={value}")],
                [(Path(m).name, Path(m)) for m in models])
    steps = []
    for name, sets in REFERENCE_STEPS:
        steps.append((name, tmp / f"{name}.train.onnx"))
        _parc("models", "build", name, *(x for s in sets for x in ("--set", s)), "--train", "momentum",
              "-o", steps[-1][1])
    return [], steps


def link_ratios(calibration: Path, counts: Sequence[int], cpus: int, device: str, engine: str, tmp: Path,
                echo=print, refs: tuple[list[str], list[tuple[str, Path]]] = ([], [])) -> dict[int, list[dict]]:
    """Per rank count k whose ranks have a core each (2 <= k <= `cpus`): every reference step
    planned on k ranks with every parameter split (`SPLIT_HINTS`) and `calibration`, run with
    `parc run --trace` `SPLIT_TRACES` times: per run, the seconds its collectives took from their
    last member's arrival to their end (what the simulation holds them for), the handoff the
    simulation charged them on top of their figures, and their figures' seconds (`time_s`).

    The burst benchmarks time collectives back to back on one buffer; in a step each runs after
    modules that filled the caches with their own tensors. Where ranks outnumber the cores the
    collectives' time is mostly waiting for a core (the handoff, priced as the host was crowded),
    and no ratio is fitted: there the traced tensor-parallel step's collectives run far over
    their figures while a data-parallel step's gradient all-reduce takes its figure and handoff.
    A reference that cannot be planned split (a model whose dims the ranks
    do not divide, say) is left out with a warning; the links are fitted on the others."""
    bound, steps = refs
    if not steps:
        return {}
    hints = tmp / "split.yaml"
    hints.write_text(SPLIT_HINTS)
    rows: dict[int, list[dict]] = {}
    for k in counts:
        if not 2 <= k <= cpus:
            continue
        rows[k], failed = [], []
        for j, (name, model) in enumerate(steps):
            echo(f"running the reference step {name}, every parameter split, on {k} ranks ...")
            plan = tmp / f"split.{k}.{j}"
            try:
                _parc("plan", model, "--devices", f"{k}x{device}", "--calibration", calibration, "--hints", hints,
                      *bound, "-o", plan)
                rows[k].extend(_traced_collectives(plan, name, engine, tmp / f"split.{k}.{j}"))
            except RunError as e:
                failed.append((name, e))
        if not rows[k]:
            raise failed[0][1]
        for name, e in failed:
            echo(f"warning: {e}; the links are fitted without {name}")
    return rows


def _traced_collectives(plan: Path, name: str, engine: str, stem: Path) -> list[dict]:
    """`link_ratios`' rows of one split plan: it is run `SPLIT_TRACES` times with `--trace`."""
    graph = load_taskgraph(plan / "taskgraph.json")
    collectives = {tid for tid, t in graph.tasks.items() if t["kind"] == "collective" and len(t["group"]) > 1}
    held: dict[str, float] = {}  # from the replay `parc plan` wrote (every rank is in every collective)
    for spans in (load_plan(plan).simulation or {})["timeline"].values():
        for a, b, kind, label in spans:
            if kind == COMM and label in collectives:
                held[label] = b - a
    figures = sum(graph.tasks[tid]["time_s"] for tid in collectives)
    charged = {tid: max(0.0, held.get(tid, 0.0) - graph.tasks[tid]["time_s"]) for tid in collectives}
    # the share of the link's handoff each was charged: 0 after another collective, up to 1
    # after compute on a crowded host (`stepsim.handoff_share`)
    shares = {tid: min(1.0, charged[tid] / graph.tasks[tid]["handoff_s"]) if graph.tasks[tid].get("handoff_s")
              else 0.0 for tid in collectives}
    rows = []
    for i in range(SPLIT_TRACES):
        trace = stem.with_name(f"{stem.name}.{i}.json")
        _parc("run", plan, "--steps", SPLIT_STEPS, "--trace", trace, "--engine", engine)
        took = collective_seconds(trace)
        rows.append({"model": name, "collectives": len(collectives), "figures_s": figures,
                     "handoff_s": sum(charged.values()), "measured_s": sum(took.get(tid, 0.0) for tid in collectives),
                     "points": [(graph.tasks[tid]["time_s"], took.get(tid, 0.0), shares[tid])
                                for tid in sorted(collectives)]})
    return rows


def fit_link_ratio(rows: Sequence[dict]) -> tuple[float, float | None]:
    """(the link's `step_ratio`, its handoff) for one rank count from its traced runs
    (`link_ratios`): each collective took t = ratio x its figure + handoff x the share of the
    handoff the simulation charged it (1 after compute with every rank computing, 0 after another
    collective), t the median of its runs' (`_typical_points`). The two are fitted by least squares
    over the collectives of every reference, constrained to give their total (what a step's
    prediction adds up), the ratio within `STEP_RATIO_RANGE`
    and the handoff >= 0. The burst benchmarks time collectives back to back on one buffer, and
    their handoff is a 64 B all-reduce's after one product; in a step a collective moves tensors
    the modules just wrote, and the first after a module waits for the ranks to let go of their
    engines. A ratio and a handoff fitted together price collectives back to back after a step's
    compute closer to their traced time than one ratio over the bursts' handoff does. No
    collective with a figure: (1, None), the bursts' handoff kept."""
    points = [p for p in _typical_points(rows) if p[0] > 0]
    if not points:
        return 1.0, None
    low, high = STEP_RATIO_RANGE
    f, t, share = (np.array(column, float) for column in zip(*points))
    total_f, total_s, total_t = f.sum(), share.sum(), t.sum()
    # on the line ratio x total_f + handoff x total_s = total_t: the handoff that fits best
    u, v = share - total_s * f / total_f, total_t / total_f * f - t
    handoff = max(0.0, -float(v @ u) / float(u @ u)) if total_s > 0 and u @ u > 0 else 0.0
    ratio = (total_t - handoff * total_s) / total_f
    if not low <= ratio <= high:  # held at the range, the handoff taking the rest
        ratio = min(high, max(low, ratio))
        handoff = max(0.0, (total_t - ratio * total_f) / total_s) if total_s > 0 else 0.0
    return float(ratio), float(handoff)


def _typical_points(rows: Sequence[dict]) -> list[tuple[float, float, float]]:
    """Each traced collective once: (its figure, the median of its runs' times, its share of the
    handoff). A run traces one step, and a shared host's slow spell can fall on it: the same
    collectives can take several times as long in one run as in the next, and a fit over every
    run's collectives prices a split step over its measured median."""
    runs: dict[str, list[list]] = {}
    for r in rows:
        runs.setdefault(r["model"], []).append(r["points"])
    return [(same[0][0], statistics.median(p[1] for p in same), same[0][2])
            for each in runs.values() for same in zip(*each)]


def reference_steps(calibration: Path, counts: Sequence[int], device: str, engine: str, tmp: Path,
                    echo=print, models: Sequence[str | Path] = (),
                    dims: Mapping[str, int] | None = None,
                    refs: tuple[list[str], list[tuple[str, Path]]] | None = None,
                    probes: Mapping[int, float] | None = None) -> dict[int, list[dict]]:
    """Per rank count k, each reference training step planned on k ranks with `calibration` and
    run with `parc run`, as a user would: its simulated step, the compute of its busiest rank in
    that simulation, and the measured median step. With `probes` (k -> `host_probe`'s seconds
    when k's figures were measured), also `host_speed`: how fast the host ran the probe just
    before the run against then (0.84: the run had 84% of the speed k's figures saw), which
    `fit_step_ratio` takes out of the measured step: a shared VM's speed moves over the minutes
    a profile takes, and a reference run in a slow spell otherwise makes every step of k ranks
    look slow. The references are `models` (training steps;
    `dims` binds their symbolic dims) where given, else the zoo's `REFERENCE_STEPS`: a calibration
    from `--model` prices the classes the model has at its own shapes, a figure meant for that
    model, which another model's step would be measured against. The benchmarks price each node
    warm and alone; in a step the nodes run one after another on tensors other nodes wrote, the
    ranks' modules finish apart and each collective waits for the last, so a step runs over its
    simulation."""
    bound, steps = refs if refs is not None else reference_models(tmp, models, dims)
    rows: dict[int, list[dict]] = {k: [] for k in counts}
    for i, (name, model) in enumerate(steps):
        for k in counts:
            echo(f"running the reference step {name} on {k} rank{'s' if k > 1 else ''} ...")
            plan = tmp / f"ref{i}.{k}"
            _parc("plan", model, "--devices", f"{k}x{device}", "--calibration", calibration, *bound, "-o", plan)
            sim = load_plan(plan).simulation  # the replay `parc simulate` gives, written by `parc plan`
            speed = probes[k] / host_probe(rank_threads(1), pick_engine(engine)) if probes and k in probes else None
            out = _parc("run", plan, "--steps", REFERENCE_RUNS, "--json", "--engine", engine)
            times = [json.loads(line)["step_time_s"] for line in out.splitlines() if line.startswith("{")]
            rows[k].append({"model": name, "simulated_s": sim["step_time_s"],
                            "compute_s": max(r["compute_s"] for r in sim["ranks"]),
                            "measured_s": statistics.median(times[REFERENCE_WARMUP:]),
                            **({"host_speed": speed} if speed is not None else {})})
    return rows


def fit_step_ratio(rows: Sequence[dict]) -> float:
    """The `step_ratio` of one rank count from its reference steps: each step's ratio is what its
    simulated compute must be multiplied by for the simulation to take the measured time (1 +
    (measured - simulated) / compute, the compute on the simulation's critical path taken as the
    busiest rank's; the measured time at the speed the host had when the figures were measured:
    times its `host_speed` where the row has one), and the figure is their geometric mean, within
    `STEP_RATIO_RANGE`."""
    ratios = [1.0 + (r["measured_s"] * r.get("host_speed", 1.0) - r["simulated_s"]) / r["compute_s"]
              for r in rows if r["compute_s"] > 0]
    if not ratios:
        return 1.0
    low, high = STEP_RATIO_RANGE
    return geometric_mean([min(high, max(low, x)) for x in ratios])  # a mean of values in the range stays in it
