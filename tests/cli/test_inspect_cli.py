"""`parc inspect` and `parc models` as a person runs them."""

from __future__ import annotations

import json

import onnx
from click.testing import CliRunner
from helpers import legacy_gpt_block_model

from parc.cli.main import cli


def test_table_output_names_the_figures(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(legacy_gpt_block_model(), path)
    res = CliRunner().invoke(cli, ["inspect", str(path), "--dim", "batch=2", "--dim", "seq=4"])
    assert res.exit_code == 0, res.output
    for text in ("parameters", "64 (64) in 1 tensors", "FLOPs / forward", "activation peak",
                 "x float[2, 4, 8]", "Softmax"):
        assert text in res.output


def test_dump_after_prints_ir_before_and_after_folding(tmp_path):
    path = tmp_path / "block.onnx"
    onnx.save(legacy_gpt_block_model(), path)
    args = ["inspect", str(path), "--dim", "batch=2", "--dim", "seq=4", "--json", "--dump-after"]
    before = CliRunner().invoke(cli, [*args, "import"])
    after = CliRunner().invoke(cli, [*args, "fold-shapes"])
    assert before.exit_code == after.exit_code == 0
    assert "= Shape(%x)" in before.stderr and "= Shape(" not in after.stderr
    assert json.loads(after.stdout)["shape_dependent_values"] == 0


def test_models_build_then_inspect(tmp_path):
    out = tmp_path / "gpt.onnx"
    res = CliRunner().invoke(cli, ["models", "build", "gpt-tiny", "--set", "layers=1", "-o", str(out)])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["inspect", str(out), "--json"])
    report = json.loads(res.stdout)
    assert report["unbound_dims"] == [] and report["replicate_only_ops"] == []
    listed = CliRunner().invoke(cli, ["models", "list", "--json"])
    names = [m["name"] for m in json.loads(listed.stdout)]
    assert "gpt-6.7b" in names and "moe-32e-10b" in names
