"""manifest.json: `parc plan` hashes every file it writes; a changed, missing or unlisted file,
or an unknown manifest format, is refused with one line."""

from __future__ import annotations

import json

import pytest
from helpers import assert_one_line_error, parc

from parc.errors import PlanFormatError
from parc.plandir.manifest import MANIFEST, check_manifest, sha256_file


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifest")
    assert parc("models", "build", "gpt-tiny", "--train", "adamw", "-o", str(root / "step.onnx")).returncode == 0
    res = parc("plan", str(root / "step.onnx"), "--devices", "2xa100-80g", "-o", str(root / "plan"))
    assert res.returncode == 0, res.stderr
    return root / "plan"


def copy(plan_dir, tmp_path):
    import shutil

    return shutil.copytree(plan_dir, tmp_path / "plan")


def test_plan_writes_a_manifest_of_every_file_and_the_models_hash(plan_dir):
    files = check_manifest(plan_dir)
    assert {"plan.json", "model.sharded.onnx"} <= set(files)
    doc = json.loads((plan_dir / "plan.json").read_text())
    assert doc["model"]["sha256"] == sha256_file(plan_dir.parent / "step.onnx")


def test_a_changed_file_is_refused(plan_dir, tmp_path):
    d = copy(plan_dir, tmp_path)
    doc = json.loads((d / "plan.json").read_text())
    doc["predicted"]["step_time_s"] /= 2
    (d / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanFormatError, match=r"plan.json does not match its sha256"):
        check_manifest(d)
    assert_one_line_error(parc("explain", str(d)), "plan.json does not match its sha256")


def test_a_missing_or_unlisted_file_is_refused(plan_dir, tmp_path):
    d = copy(plan_dir, tmp_path)
    (d / "model.sharded.onnx").unlink()
    with pytest.raises(PlanFormatError, match=r"model.sharded.onnx is listed in manifest.json but missing"):
        check_manifest(d)
    d2 = copy(plan_dir, tmp_path / "b")
    (d2 / "extra.onnx").write_bytes(b"x")
    with pytest.raises(PlanFormatError, match=r"extra.onnx is not listed"):
        check_manifest(d2)
    check_manifest(d2, extra_ok=True)  # explain's check: reports written beside the plan are fine


def test_a_bad_manifest_is_refused(plan_dir, tmp_path):
    d = copy(plan_dir, tmp_path)
    (d / MANIFEST).write_text(json.dumps({"format": "parc.manifest/9", "files": {}}))
    with pytest.raises(PlanFormatError, match=r"unknown manifest format 'parc.manifest/9'"):
        check_manifest(d)
    (d / MANIFEST).write_text(json.dumps({"format": "parc.manifest/1", "files": {"../x": {"sha256": "0"}}}))
    with pytest.raises(PlanFormatError, match=r"leaves the plan directory"):
        check_manifest(d)
    (d / MANIFEST).unlink()
    with pytest.raises(PlanFormatError, match=r"no manifest.json"):
        check_manifest(d)


def test_external_data_outside_the_plan_directory_is_refused(plan_dir, tmp_path):
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from parc.plandir.manifest import write_manifest

    d = copy(plan_dir, tmp_path)
    (tmp_path / "outside.bin").write_bytes(np.zeros(4, np.float32).tobytes())
    w = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    w.ClearField("raw_data")
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "../outside.bin"), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])], [w])
    onnx.save(helper.make_model(graph), str(d / "rank_0.onnx"))
    write_manifest(d)
    with pytest.raises(PlanFormatError, match=r"rank_0.onnx: initializer 'w' reads external data from "
                                              r"'../outside.bin', outside the plan directory"):
        check_manifest(d)


@pytest.mark.parametrize("layout", ["sparse", "dense", "empty", "hole-at-end", "hole-at-start"])
def test_sha256_of_sparse_files_is_the_plain_sha256(tmp_path, layout):
    """Holes are hashed as zeros without being read; the digest is sha256sum's."""
    import hashlib
    import os

    path = tmp_path / "f.bin"
    with open(path, "wb") as f:
        if layout == "sparse":
            f.seek(3_000_000)
            f.write(b"abc" * 1000)
            f.seek(9_000_000)
            f.write(b"x")
            f.truncate(12_000_000)
        elif layout == "dense":
            f.write(os.urandom(2_500_001))
        elif layout == "hole-at-end":
            f.write(b"hello")
            f.truncate(5_000_000)
        elif layout == "hole-at-start":
            f.seek(4_000_000)
            f.write(b"tail")
    assert sha256_file(path) == hashlib.sha256(path.read_bytes()).hexdigest()
