"""The calibration file `parc profile` writes (`parc.calibrate.file`) is the one `parc plan
--calibration` reads."""

from __future__ import annotations

import pytest

from parc.calibrate.file import write_calibration
from parc.calibrate.fit import fit
from parc.cluster import load_constants, parse_devices
from tests.calibrate.samples import machine_rows


def test_the_file_written_is_the_calibration_plan_reads(tmp_path):
    measured = {1: machine_rows(0, 1, 0, 1), 2: machine_rows(20e-6, 3e9, 5e-4, 2), 4: machine_rows(40e-6, 1e9, 1e-3, 4, call=2e-4)}
    del measured[1]["all_reduce"]
    fitted = {k: fit(rows, k) for k, rows in measured.items()}
    out = tmp_path / "calib.yaml"
    write_calibration(out, fitted, measured, "cpu", "shm")
    assert out.read_text().startswith("# parc profile: ")
    calibration = load_constants(out)
    one = calibration.apply(parse_devices("1xcpu")).devices[0]
    assert one.peak("float32") == pytest.approx(1e11) and one.task_overhead == pytest.approx(4e-6)
    four = calibration.apply(parse_devices("4xcpu"))
    link = four.nodes[0].intra_link
    assert (link.latency, link.bandwidth, link.handoff, link.call) == pytest.approx((40e-6, 1e9, 1e-3, 2e-4))
    two = calibration.apply(parse_devices("2xcpu")).nodes[0].intra_link
    assert (two.handoff, two.call) == pytest.approx((5e-4, 0.0))
    assert calibration.cpus == 0 and not four.nodes[0].sharing  # the host's CPUs not given
    write_calibration(out, fitted, measured, "cpu", "shm", cpus=2)
    four = load_constants(out).apply(parse_devices("4xcpu"))  # 4 ranks on 2 CPUs: 2 computing run faster
    assert [a for a, _ in four.nodes[0].sharing] == [2]
    assert four.nodes[0].sharing[0][1][0] == load_constants(out).apply(parse_devices("2xcpu")).devices[0]


def test_a_k_rank_section_keeps_its_own_zero_floors_and_piece_costs(tmp_path):
    """Sharing sections are laid over one rank's figures: a k-rank fit of 0 (a floor, or a piece
    cost whose fit failed) is written, not left for one rank's figure to fill."""
    one = {**fit(machine_rows(0, 1, 0, 1), 1), "node_floor": 2e-6, "node_piece": 1e-8,
           "op_floor": {"Transpose": 3e-6}, "op_piece": {"Transpose": 1e-8}}
    two = {**fit(machine_rows(20e-6, 3e9, 5e-4, 2), 2), "node_floor": 0.0, "node_piece": 0.0,
           "op_floor": {"Transpose": 0.0}, "op_piece": {"Transpose": 0.0}}
    rows = {1: machine_rows(0, 1, 0, 1), 2: machine_rows(20e-6, 3e9, 5e-4, 2)}
    del rows[1]["all_reduce"]
    out = tmp_path / "c.yaml"
    write_calibration(out, {1: one, 2: two}, rows, "cpu", "shm")
    calibration = load_constants(out)
    alone = calibration.apply(parse_devices("1xcpu")).devices[0]
    shared = calibration.apply(parse_devices("2xcpu")).devices[0]
    assert (alone.node_floor, alone.piece_cost("Transpose"), alone.class_floor("Transpose")) == \
        pytest.approx((2e-6, 1e-8, 3e-6))
    assert (shared.node_floor, shared.node_piece, shared.piece_cost("Transpose"), shared.class_floor("Transpose")) == \
        (0.0, 0.0, 0.0, 0.0)
    # a piece fit that fails is a cost of 0 in the fit's output, not a missing class
    rows = machine_rows(0, 1, 0, 1)
    rows["memory"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 1024.0, "s": 1e-4, "bytes_per_s": 1e10}]
    rows["pieces"] = [{"op": "Transpose", "bytes": 1 << 20, "pieces": 32768.0, "s": 2e-5}]
    assert fit(rows, 1)["op_piece"] == {"Transpose": 0.0}
