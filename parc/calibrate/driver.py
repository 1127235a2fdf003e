"""`parc profile`'s driver: measure 1, 2, 4, ... ranks sharing this host (`measure_rank`, in an
MPI job of k ranks for k > 1), fit each count's figures (`fit`), write the calibration file, and
on CPUs fit the links' and the devices' step ratios on reference steps (`reference`) and write it
again with them."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from parc.calibrate.cases import measurable_cases, model_cases, write_cases
from parc.calibrate.catalogue import BUDGET
from parc.calibrate.file import write_calibration
from parc.calibrate.fit import fit
from parc.calibrate.host import engine_text, gpu_device_type, host_probe
from parc.calibrate.measure import Solo, measure_rank
from parc.calibrate.reference import (
    fit_link_ratio,
    fit_step_ratio,
    link_ratios,
    reference_models,
    reference_steps,
)
from parc.errors import UsageError
from parc.exec.engine_choice import pick_engine, rank_threads
from parc.exec.launch import launch
from parc.exec.runner import RunError

STEADY = 1.15  # a profile whose probes differ by more than this factor warns that the host moved


def profile(output: Path, max_ranks: int | None, budget: float = BUDGET, device: str | None = None, link: str = "shm",
            echo=print, engine: str = "ort", models: Sequence[str] = (),
            dims: Mapping[str, int] | None = None, reference: bool = True) -> dict[int, dict]:
    """Measure with 1, 2, 4, ... ranks (up to `max_ranks`; None: 1 on a GPU, else 4) on `engine`
    (`parc run --engine`'s names) and write the calibration file for device type `device` (by default `cpu`, or the
    catalogue's name of the GPU that `--engine cupy` measures). `models`: ONNX files whose own
    products and convolutions calibrate the classes they have (`model_cases`; `dims` binds their
    symbolic dims). `reference` (on CPUs): then run the reference steps (`reference_steps`) with
    the calibration written and write it again with each rank count's `step_ratio`."""
    kind = pick_engine(engine)  # refuses cupy without a usable GPU, in one line
    if max_ranks is None:
        max_ranks = 1 if kind[1] == "gpu" else 4
    if kind[1] == "gpu" and max_ranks != 1:
        raise UsageError(f"--ranks {max_ranks}: --engine cupy measures one GPU (--ranks 1); links between GPUs "
                         "are not measured yet (the catalogue's or a cluster file's figures are used)")
    if device is None:
        device = gpu_device_type() if kind[1] == "gpu" else "cpu"
    counts = [1]
    while counts[-1] * 2 <= max_ranks:
        counts.append(counts[-1] * 2)
    if max_ranks not in counts:
        counts.append(max_ranks)
    cases, own = measurable_cases(model_cases(models, dims), counts)
    measured: dict[int, dict] = {}
    probes: list[float] = []
    with tempfile.TemporaryDirectory(prefix="parc-profile-") as tmp:
        cases_file = Path(tmp) / "cases.json"
        write_cases(cases_file, cases)
        for k in counts:
            probes.append(host_probe(rank_threads(1), kind))
            path = Path(tmp) / f"rows.{k}.json"
            where = "on the GPU" if kind[1] == "gpu" else (
                f"({rank_threads(k)} thread{'s' if rank_threads(k) > 1 else ''} each)")
            echo(f"measuring {k} rank{'s' if k > 1 else ''} {where} ...")
            if k == 1:
                measured[k] = measure_rank(Solo(), rank_threads(1), budget, kind, cases)
            else:
                rc = launch(k, ["profile", "--worker", str(path), "--seconds", str(budget), "--engine", engine,
                                "--cases", str(cases_file)])
                if rc:
                    raise RunError(f"the profiling job of {k} ranks failed (exit {rc})")
                measured[k] = json.loads(path.read_text())
    probes.append(host_probe(rank_threads(1), kind))
    speeds = [probes[0] / t for t in probes]  # the host's speed against the first probe's
    if max(probes) > STEADY * min(probes):
        echo(f"warning: this host's speed moved by {max(probes) / min(probes) - 1:.0%} while profiling (a fixed "
             f"product ran at {', '.join(f'{v:.2f}' for v in speeds)} of its first speed): the figures are of a "
             f"mix of its speeds; profile again when it is quieter, or with a longer --seconds")
    fitted = {k: fit(rows, k) for k, rows in measured.items()}
    text = (f"{', '.join(map(str, models))} ({own or 'no float32 products or convolutions'})" if models else "",
            speeds, (os.cpu_count() or 0) if kind[1] == "cpu" else 0, models)
    write_calibration(output, fitted, measured, device, link, engine_text(kind), *text)
    if reference and kind[1] == "cpu":
        try:
            with tempfile.TemporaryDirectory(prefix="parc-profile-") as tmp:
                refs = reference_models(Path(tmp), models, dims)
                try:
                    links = link_ratios(output, counts, text[2], device, engine, Path(tmp), echo, refs)
                except RunError as e:  # a model that cannot be split evenly, say: the links keep their figures
                    echo(f"warning: {e}; the links are written without step_ratio")
                    links = {}
                for k, rows in links.items():
                    fitted[k]["link_step_ratio"], handoff = fit_link_ratio(rows)
                    if handoff is not None:  # in a step's terms, as the ratio is (the bursts' stays in "handoff")
                        fitted[k]["link_handoff"] = handoff
                    measured[k]["split"] = rows
                if links:  # the compute's ratio is fitted with the collectives' in place
                    write_calibration(output, fitted, measured, device, link, engine_text(kind), *text)
                steps = reference_steps(output, counts, device, engine, Path(tmp), echo, refs=refs,
                                        probes=dict(zip(counts, probes)))
        except RunError as e:  # the benchmarks' figures are written and stand without the ratios
            for k in fitted:
                fitted[k].pop("link_step_ratio", None)
                fitted[k].pop("link_handoff", None)
                measured[k].pop("split", None)
            write_calibration(output, fitted, measured, device, link, engine_text(kind), *text)
            echo(f"warning: {e}; {output} is written without step_ratio (node times as the benchmarks price them)")
            return measured
        for k, rows in steps.items():
            fitted[k]["step_ratio"] = fit_step_ratio(rows)
            measured[k]["steps"] = rows
        write_calibration(output, fitted, measured, device, link, engine_text(kind), *text)
    return measured
