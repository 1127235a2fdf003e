"""`parc profile` end to end (`parc.calibrate.driver`): its flags, a short real run over 1 and 2
ranks, the host's probes, and the reference steps that end it (faked where a test is about
what a failure leaves)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

import parc.calibrate.driver as driver
import parc.calibrate.reference as reference
from parc.calibrate.catalogue import ALL_REDUCE_BYTES
from parc.calibrate.fit import fit
from parc.calibrate.reference import SPLIT_TRACES, fit_link_ratio, fit_step_ratio
from parc.cluster import load_constants, parse_devices
from parc.exec.engine_choice import gpu_available
from parc.exec.runner import RunError
from parc.plandir.manifest import sha256_file
from tests.calibrate.samples import conv_model
from tests.helpers import assert_one_line_error, needs_mpiexec, parc


@needs_mpiexec
def test_profile_over_two_ranks_writes_a_calibration_plan_accepts(tmp_path):
    out = tmp_path / "calib.yaml"
    model = conv_model(tmp_path / "conv.onnx")
    res = parc("profile", "-o", str(out), "--ranks", "2", "--seconds", "0.01", "--model", str(model), "--dim", "N=4",
               "--no-reference", timeout=300)
    assert res.returncode == 0, res.stderr
    calibration = load_constants(out)
    assert [n for n, _ in calibration.sharing] == [2]
    assert calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link.name == "shm"
    # the host's speed probed before each rank count and at the end, the first = 1
    line = next(x for x in out.read_text().splitlines() if x.startswith("# the host's speed"))
    speeds = [float(v) for v in line.split(": ")[1].split(", ")]
    assert len(speeds) == 3 and speeds[0] == 1.0 and all(v > 0 for v in speeds)
    # the model's convolution, measured at the whole batch alone and at half of it on each of two ranks
    rows = {piece.split(": ")[0].strip("# ") for line in out.read_text().splitlines() for piece in line.split(", ")}
    assert {"Conv 4x3x8x8 * 4x3x3x3", "Conv 2x3x8x8 * 4x3x3x3"} <= rows
    # the file names the model its figures were measured on (`parc plan` warns on another)
    assert calibration.fitted_on == (("conv.onnx", sha256_file(model)),)



def test_bad_profile_flags_are_one_line_errors(tmp_path):
    assert_one_line_error(parc("profile"), "-o FILE")
    assert_one_line_error(parc("profile", "-o", str(tmp_path)), "is a directory")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--seconds", "0"), "--seconds")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--ranks", "0"), "--ranks")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "none.onnx")),
                          "--model", "no such file")
    (tmp_path / "bad.onnx").write_text("not a model")
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--model", str(tmp_path / "bad.onnx")),
                          "--model", "bad.onnx")
    assert not (tmp_path / "c.yaml").exists()
    assert_one_line_error(parc("profile", "-o", str(tmp_path / "c.yaml"), "--dim", "N=4"), "--dim", "--model")


def test_a_host_that_moves_while_profiling_is_warned_about(tmp_path, monkeypatch):
    probes = iter([1.0, 1.3])  # the product took 30% longer at the end
    monkeypatch.setattr(driver, "host_probe", lambda *a, **k: next(probes))
    said = []
    driver.profile(tmp_path / "c.yaml", 1, budget=0.002, echo=said.append, reference=False)
    assert any(line.startswith("warning: this host's speed moved by 30%") for line in said)
    assert "(a fixed product, the first = 1): 1.00, 0.77" in (tmp_path / "c.yaml").read_text()


def test_profile_engine_flags_are_one_line_errors(tmp_path):
    out = str(tmp_path / "c.yaml")
    assert_one_line_error(parc("profile", "-o", out, "--engine", "tpu"), "--engine tpu")
    assert_one_line_error(parc("profile", "-o", out, "--device", "x9000"), "--device")
    if not _gpu():
        assert_one_line_error(parc("profile", "-o", out, "--engine", "cupy"), "--engine cupy")


def _gpu() -> bool:
    return gpu_available()


@pytest.mark.slow  # the whole `parc profile` with its reference runs (make test-all); make test runs the
@needs_mpiexec     # profile without them and the reference steps' failure paths
def test_profile_ends_with_reference_steps_that_set_the_step_ratio(tmp_path, monkeypatch):
    """`parc profile` on two ranks with a small reference: each count's reference step is planned
    with the figures just written, run with `parc run` and simulated; the ratio of each count is
    `fit_step_ratio` of those rows, and the file holds it and the rows."""
    monkeypatch.setattr(reference, "REFERENCE_STEPS", (("t5-tiny", ("batch=4",)),))
    monkeypatch.setattr(reference, "REFERENCE_RUNS", 8)
    out = tmp_path / "c.yaml"
    said: list[str] = []
    measured = driver.profile(out, 2, budget=0.002, echo=said.append)
    cores = (os.cpu_count() or 1) >= 2  # two ranks with a core each: the split reference is traced
    assert [line for line in said if line.startswith("running")] == [
        *(["running the reference step t5-tiny, every parameter split, on 2 ranks ..."] if cores else []),
        "running the reference step t5-tiny on 1 rank ...", "running the reference step t5-tiny on 2 ranks ..."]
    calibration = load_constants(out)
    # each kind the executor runs, measured in bursts through its calls, at every size
    assert sorted((r["kind"], r["bytes"]) for r in measured[2]["collectives"]) == sorted(
        (kind, b) for kind in ("reduce_scatter", "all_gather", "all_to_all") for b in ALL_REDUCE_BYTES)
    for k in (1, 2):
        (row,) = measured[k]["steps"]
        assert row["model"] == "t5-tiny" and 0 < row["compute_s"] <= row["simulated_s"] and row["measured_s"] > 0
        device = calibration.apply(parse_devices(f"{k}xcpu")).devices[0]
        assert device.step_ratio == pytest.approx(fit_step_ratio([row]))
    link = calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link
    if not cores:
        assert "split" not in measured[2] and link.step_ratio == 1.0
        return
    split = measured[2]["split"]
    assert len(split) == SPLIT_TRACES
    assert all(r["collectives"] > 0 and r["figures_s"] > 0 and r["measured_s"] > 0 for r in split)
    ratio, handoff = fit_link_ratio(split)
    assert all(len(r["points"]) == r["collectives"] for r in split)
    assert link.step_ratio == pytest.approx(ratio) and link.handoff == pytest.approx(handoff)


def test_a_reference_step_that_fails_leaves_the_benchmarks_calibration_with_a_warning(tmp_path, monkeypatch):
    def broken(*argv):
        raise RunError("parc profile's reference step `parc plan x.onnx ...` failed: no")

    monkeypatch.setattr(reference, "_parc", broken)
    out, said = tmp_path / "c.yaml", []
    driver.profile(out, 1, budget=0.002, echo=said.append)
    assert any(line.startswith("warning: parc profile's reference step `parc plan") and "without step_ratio" in line
               for line in said)
    assert "step_ratio" not in out.read_text()
    assert load_constants(out).apply(parse_devices("1xcpu")).devices[0].step_ratio == 1.0


@needs_mpiexec
def test_reference_steps_that_fail_after_the_split_one_leave_the_bursts_handoff(tmp_path, monkeypatch):
    """The traced split reference fits the link's ratio and handoff; where the reference steps
    after it fail, the calibration is written without ratios and with the bursts' handoff."""
    points = [(f, 1.8 * f + 60e-6 * sh, sh) for f, sh in ((10e-6, 1.0), (40e-6, 0.0), (200e-6, 1.0))]
    monkeypatch.setattr(driver, "reference_models", lambda *a, **k: ([], [("a", tmp_path / "a.onnx")]))
    monkeypatch.setattr(driver, "link_ratios", lambda *a, **k: {2: [{"model": "a", "collectives": 3, "figures_s": 0.0,
                                                                 "handoff_s": 0.0, "measured_s": 0.0,
                                                                 "points": points}]})

    def broken(*a, **k):
        raise RunError("parc profile's reference step `parc run ref0.1 ...` failed: no")

    monkeypatch.setattr(driver, "reference_steps", broken)
    out, said = tmp_path / "c.yaml", []
    measured = driver.profile(out, 2, budget=0.002, echo=said.append)
    link = load_constants(out).apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert link.step_ratio == 1.0 and link.handoff == pytest.approx(fit(measured[2], 2)["handoff"])
    assert "fitted on them" not in out.read_text()


@needs_mpiexec
def test_a_split_reference_that_fails_leaves_the_links_figures_and_the_node_ratios(tmp_path, monkeypatch):
    """A model the split hints cannot plan (a user's `--model`, say) costs the links their
    ratio, with a warning, and nothing else: the reference steps still set the node ratios."""
    def fake(*argv):
        argv = [str(a) for a in argv]
        if argv[0] == "plan" and "--hints" in argv:
            raise RunError("parc profile's reference step `parc plan x.onnx ...` failed: ineligible")
        if argv[0] == "run":
            return "\n".join('{"step_time_s": 0.012}' for _ in range(reference.REFERENCE_RUNS))
        return ""

    monkeypatch.setattr(reference, "_parc", fake)
    for module in (driver, reference):  # a host as fast throughout
        monkeypatch.setattr(module, "host_probe", lambda *a, **k: 0.01)
    monkeypatch.setattr(driver.os, "cpu_count", lambda: 2)  # two ranks with a core each
    monkeypatch.setattr(reference, "load_plan",
                        lambda d: SimpleNamespace(simulation={"step_time_s": 0.010, "ranks": [{"compute_s": 0.008}]}))
    out, said = tmp_path / "c.yaml", []
    driver.profile(out, 2, budget=0.002, echo=said.append)
    assert any(line.startswith("warning: parc profile's reference step") and "links are written without" in line
               for line in said)
    calibration = load_constants(out)
    assert calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link.step_ratio == 1.0
    assert calibration.apply(parse_devices("2xcpu")).devices[0].step_ratio == pytest.approx(1.25)
