"""The reference steps and their ratios (`parc.calibrate.reference`): `parc plan` and `parc run`
faked where a test is about the fit, the ratios written to the file and read back."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import parc.calibrate.reference as reference
from parc.calibrate.file import write_calibration
from parc.calibrate.fit import fit
from parc.calibrate.reference import STEP_RATIO_RANGE, fit_link_ratio, fit_step_ratio
from parc.cluster import load_constants, parse_devices
from parc.exec.runner import RunError
from tests.calibrate.samples import machine_rows


def test_the_step_ratio_is_what_makes_each_reference_step_take_its_measured_time(tmp_path):
    """A step simulated at 10 ms (8 ms of it compute) and measured at 12 ms needs its compute x
    1.25; one simulated at 20 ms (all compute) and measured at 20 ms, x 1: the ratio is their
    geometric mean. Written for each rank count, read back onto the device of that count."""
    rows = [{"model": "a", "simulated_s": 0.010, "compute_s": 0.008, "measured_s": 0.012},
            {"model": "b", "simulated_s": 0.020, "compute_s": 0.020, "measured_s": 0.020}]
    assert fit_step_ratio(rows[:1]) == pytest.approx(1.25)
    assert fit_step_ratio(rows) == pytest.approx(1.25 ** 0.5)
    # a reference far off is held within the range, and no reference at all leaves 1
    assert fit_step_ratio([{**rows[0], "measured_s": 1.0}]) == STEP_RATIO_RANGE[1]
    assert fit_step_ratio([]) == 1.0
    # run when the host had 80% of the speed the figures saw: 15 ms then is 12 ms at their speed
    assert fit_step_ratio([{**rows[0], "measured_s": 0.015, "host_speed": 0.8}]) == pytest.approx(1.25)
    rows[1]["host_speed"] = 1.0
    fitted = {k: {**fit(machine_rows(20e-6, 3e9, 0.0, k), k), "step_ratio": r} for k, r in ((1, 1.1), (2, 1.3))}
    measured = {1: machine_rows(20e-6, 3e9, 0.0, 1), 2: {**machine_rows(20e-6, 3e9, 0.0, 2), "steps": rows}}
    out = tmp_path / "c.yaml"
    write_calibration(out, fitted, measured, "cpu", "shm")
    text = out.read_text()
    assert ("reference steps (simulated / its busiest rank's compute / measured median, the host's speed then "
            "against when these figures were measured): a 0.01 / 0.008 / 0.012, b 0.02 / 0.02 / 0.02 at 1.00") in text
    calibration = load_constants(out)
    assert calibration.apply(parse_devices("1xcpu")).devices[0].step_ratio == pytest.approx(1.1)
    assert calibration.apply(parse_devices("2xcpu")).devices[0].step_ratio == pytest.approx(1.3)


def test_the_links_ratio_and_handoff_are_fitted_on_each_traced_collective(tmp_path):
    """Traced collectives that took 1.8x their figures plus 60 us times the share of the handoff
    they were charged (1 after compute, 0 after another collective, 0.5 on a half-crowded host):
    both come back, from two runs; with noise, they still add up to the runs' total. Written
    under the link with the bursts' handoff kept in the header, and read back onto a mesh of
    that rank count."""
    figures = [10e-6, 40e-6, 200e-6, 1e-3, 15e-6, 80e-6]
    shares = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0]
    points = [(f, 1.8 * f + 60e-6 * sh, sh) for f, sh in zip(figures, shares)]
    rows = [{"model": "a", "collectives": 6, "figures_s": sum(figures), "handoff_s": 0.0, "measured_s": 0.0,
             "points": points} for _ in range(2)]
    assert fit_link_ratio(rows) == (pytest.approx(1.8), pytest.approx(60e-6))
    # a run on a slow spell of the host (every collective 3x) does not move the median of three
    slow_run = {**rows[0], "points": [(f, 3 * t, sh) for f, t, sh in points]}
    assert fit_link_ratio([rows[0], slow_run, rows[1]]) == (pytest.approx(1.8), pytest.approx(60e-6))
    # each model's collectives are matched to their own runs' and fitted together
    other = [(f, 1.8 * f + 60e-6 * sh, sh) for f, sh in ((30e-6, 1.0), (500e-6, 0.0))]
    both = [*rows, *({**rows[0], "model": "b", "points": other} for _ in range(3))]
    assert fit_link_ratio(both) == (pytest.approx(1.8), pytest.approx(60e-6))
    # faster after compute than after another collective: no handoff, the ratio alone
    quick = [(f, 1.5 * f - 5e-6 * sh, sh) for f, sh in zip(figures, shares)]
    ratio, handoff = fit_link_ratio([{**rows[0], "points": quick}])
    assert handoff == 0.0 and ratio == pytest.approx(sum(t for _, t, _ in quick) / sum(figures))
    # noisy: whatever the split, the two give the runs' total
    rng = np.random.default_rng(0)
    noisy = [(f, t * rng.uniform(0.7, 1.3), sh) for f, t, sh in points]
    ratio, handoff = fit_link_ratio([{**rows[0], "points": noisy}])
    assert ratio * sum(figures) + handoff * sum(shares) == pytest.approx(sum(t for _, t, _ in noisy))
    assert 1.0 < ratio < 3.0 and handoff > 0
    # a ratio beyond the range is held at it, the handoff fitted with it
    slow = [(f, 10 * f + 60e-6 * sh, sh) for f, sh in zip(figures, shares)]
    ratio, handoff = fit_link_ratio([{**rows[0], "points": slow}])
    assert ratio == STEP_RATIO_RANGE[1] and handoff > 60e-6
    fitted = {1: fit(machine_rows(20e-6, 3e9, 0.0, 1), 1), 2: fit(machine_rows(20e-6, 3e9, 35e-6, 2), 2)}
    fitted[2].update(link_step_ratio=1.8, link_handoff=60e-6)
    measured = {1: machine_rows(20e-6, 3e9, 0.0, 1), 2: {**machine_rows(20e-6, 3e9, 35e-6, 2), "split": rows}}
    out = tmp_path / "c.yaml"
    write_calibration(out, fitted, measured, "cpu", "shm")
    assert "the link's step_ratio x1.8 and handoff 60 us (the bursts' first all-reduce: 35 us)" in out.read_text()
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert (link.step_ratio, link.handoff) == (pytest.approx(1.8), pytest.approx(60e-6))


def test_the_links_step_ratio_is_what_makes_the_traced_collectives_take_their_time(tmp_path):
    """Collectives whose traced times make the fit x2.25 with no handoff (none was charged):
    written on the link of that rank count, read back onto a mesh of it; a count without a ratio
    of its own keeps 1. No collective with a figure: ratio 1, the bursts' handoff kept."""
    points = [(0.001, 0.00225, 0.0), (0.002, 0.0045, 0.0)]
    rows = [{"model": "a", "collectives": 2, "figures_s": 0.003, "handoff_s": 0.0, "measured_s": 0.00675,
             "points": points}]
    assert fit_link_ratio(rows) == (pytest.approx(2.25), 0.0)
    assert fit_link_ratio([]) == (1.0, None)
    assert fit_link_ratio([{**rows[0], "points": [(0.0, 0.001, 1.0)]}]) == (1.0, None)
    fitted = {1: fit(machine_rows(20e-6, 3e9, 0.0, 1), 1), 2: {**fit(machine_rows(20e-6, 3e9, 0.0, 2), 2),
                                                           "link_step_ratio": 2.25}}
    measured = {1: machine_rows(20e-6, 3e9, 0.0, 1), 2: {**machine_rows(20e-6, 3e9, 0.0, 2), "split": rows}}
    out = tmp_path / "c.yaml"
    write_calibration(out, fitted, measured, "cpu", "shm")
    assert "a 2 collectives 0.00675 / 0 / 0.003" in out.read_text()
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.step_ratio == pytest.approx(2.25)
    # a count of ranks without a ratio of its own (4 sharing 2 cores) keeps 1, not 2's
    fitted[4] = fit(machine_rows(20e-6, 3e9, 0.0, 4), 4)
    measured[4] = machine_rows(20e-6, 3e9, 0.0, 4)
    write_calibration(out, fitted, measured, "cpu", "shm")
    calibration = load_constants(out)
    assert calibration.apply(parse_devices("4xcpu")).nodes[0].intra_link.step_ratio == 1.0
    assert calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link.step_ratio == pytest.approx(2.25)


def test_the_links_are_fitted_over_every_reference_that_runs_split(tmp_path, monkeypatch):
    """Each reference step is planned split and traced on each count of ranks with a core each;
    one the split hints cannot plan is left out with a warning, the others' collectives kept."""
    planned = []

    def fake(*argv):
        argv = [str(a) for a in argv]
        planned.append(argv[1])
        if argv[1].endswith("a.onnx"):
            raise RunError("parc profile's reference step `parc plan a.onnx ...` failed: ineligible")
        return ""

    monkeypatch.setattr(reference, "_parc", fake)
    monkeypatch.setattr(reference, "_traced_collectives", lambda plan, name, engine, stem: [{"model": name, "at": plan.name}])
    refs = ([], [(n, tmp_path / f"{n}.onnx") for n in ("a", "b", "c")])
    said: list[str] = []
    rows = reference.link_ratios(tmp_path / "c.yaml", [1, 2, 4], 2, "cpu", "ort", tmp_path, said.append, refs)
    assert planned == [str(tmp_path / f"{n}.onnx") for n in ("a", "b", "c")]  # on 2 ranks only: 4 share 2 cores
    assert rows == {2: [{"model": "b", "at": "split.2.1"}, {"model": "c", "at": "split.2.2"}]}
    assert said[-1] == ("warning: parc profile's reference step `parc plan a.onnx ...` failed: ineligible; "
                        "the links are fitted without a")
    # none can run split: the first failure is raised (the caller writes the links' figures)
    with pytest.raises(RunError, match="a.onnx"):
        reference.link_ratios(tmp_path / "c.yaml", [2], 2, "cpu", "ort", tmp_path, said.append, ([], refs[1][:1]))


def test_the_models_given_are_the_reference_steps(tmp_path, monkeypatch):
    """With `--model` files the references are those models (their dims bound as given), not the
    zoo's: a calibration from a model's own shapes is meant for that model."""
    calls = []

    def fake(*argv):
        calls.append([str(a) for a in argv])
        if argv[0] == "run":
            return "\n".join('{"step_time_s": 0.012}' for _ in range(reference.REFERENCE_RUNS))
        return ""

    monkeypatch.setattr(reference, "_parc", fake)
    # the plan's own replay (plan.json's `simulation`, what `parc simulate` gives)
    monkeypatch.setattr(reference, "load_plan",
                        lambda d: SimpleNamespace(simulation={"step_time_s": 0.010, "ranks": [{"compute_s": 0.008}]}))
    rows = reference.reference_steps(tmp_path / "c.yaml", [1, 2], "cpu", "ort", tmp_path, lambda s: None,
                                models=[tmp_path / "mine.train.onnx"], dims={"N": 4})
    assert not any(c[0] == "models" for c in calls)
    plans = [c for c in calls if c[0] == "plan"]
    assert [c[1] for c in plans] == [str(tmp_path / "mine.train.onnx")] * 2
    assert all(c[c.index("--dim") + 1] == "N=4" for c in plans) and [c[c.index("--devices") + 1] for c in plans] == \
        ["1xcpu", "2xcpu"]
    assert rows[2] == [{"model": "mine.train.onnx", "simulated_s": 0.010, "compute_s": 0.008, "measured_s": 0.012}]
    assert fit_step_ratio(rows[2]) == pytest.approx(1.25)
    # with the probes of each count's figures, each run is probed before it: its host_speed
    probed = iter([0.5, 0.4])  # the host's probe before each run: slower, then as before
    monkeypatch.setattr(reference, "host_probe", lambda *a, **k: next(probed))
    timed = reference.reference_steps(tmp_path / "c.yaml", [1, 2], "cpu", "ort", tmp_path, lambda s: None,
                                 models=[tmp_path / "mine.train.onnx"], probes={1: 0.4, 2: 0.4})
    assert [r["host_speed"] for k in (1, 2) for r in timed[k]] == [pytest.approx(0.8), pytest.approx(1.0)]
    assert fit_step_ratio(timed[1]) == pytest.approx(1 + (0.012 * 0.8 - 0.010) / 0.008)
