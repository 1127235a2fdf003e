"""3-D meshes in the search: enumerated within node boundaries, planned, explained, annotated."""

from __future__ import annotations

import json
import math

import onnx
import pytest
from helpers import parc
from test_plan_parallel import mlp_model

from parc.cluster import enumerate_meshes, parse_devices
from parc.hints import Hints, Request, Scope
from parc.ir.importer import from_model
from parc.passes.spmd.costs import build
from parc.passes.spmd.pins import hint_pins
from parc.passes.spmd.search import plan_graph
from parc.sharding import Split


def test_meshes_of_8_and_2x8_devices():
    assert [m.shape for m in enumerate_meshes(parse_devices("8xa100-80g"))] == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    meshes = [m for m in enumerate_meshes(parse_devices("2x8xa100-80g")) if m.ndim == 3]
    assert [m.shape for m in meshes] == [(2, 2, 4), (2, 4, 2), (4, 2, 2)]
    for m in meshes:  # the outer axis strides across the 2 nodes, the inner two stay inside one
        assert m.spans_nodes == (True, False, False)
        assert all(len({r // 8 for r in g}) == 1 for axis in (1, 2) for g in m.axis_groups(axis))


def test_plan_searches_the_3d_mesh_but_runs_megatron_on_2d_only():
    plan = plan_graph(from_model(mlp_model()), parse_devices("8xa100-80g"), time_limit=10, max_mesh_dims=3)
    doc = plan.to_json()
    assert [m["shape"] for m in doc["solver"]["meshes"]] == [[8], [2, 4], [4, 2], [2, 2, 2]]
    assert all(m["feasible"] for m in doc["solver"]["meshes"])
    assert list(doc["baselines"]) == ["data-parallel", "zero-3", "megatron-tp4", "megatron-tp2"]


@pytest.fixture(scope="module")
def cube():
    """The MLP's cost model on the 2x2x2 mesh of 8 devices."""
    cluster = parse_devices("8xa100-80g")
    mesh = next(m for m in enumerate_meshes(cluster) if m.shape == (2, 2, 2))
    return build(from_model(mlp_model()), mesh, cluster)


def test_split_hint_uses_two_axes_of_the_cube(cube):
    pins, warnings = hint_pins(cube, Hints(scopes=(Scope("fc", Request("split", 4)),)))
    assert not warnings
    fc1 = next(k for k, n in enumerate(cube.graph.nodes) if n.name == "fc1")
    allowed = [cube.strategies[fc1][j] for j in pins[cube.node_index(fc1)]]
    w1 = 1  # fc1 reads x, w1
    assert allowed and all(math.prod(m for a, m in zip(s.inputs[w1], (2, 2, 2)) if isinstance(a, Split)) == 4
                           for s in allowed)


def test_cli_plans_explains_and_annotates_a_3d_plan(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(mlp_model(), path)
    hints = tmp_path / "hints.yaml"
    hints.write_text('pins:\n  w1: "RS(1)S(0)"\n')  # a 3-axis pin: only 3-D meshes are eligible
    out = tmp_path / "p"
    res = parc("plan", str(path), "--devices", "8xa100-80g", "--mesh-dims", "3", "--time-limit", "10", "--hints", str(hints),
               "-o", str(out))
    assert res.returncode == 0, res.stderr
    doc = json.loads((out / "plan.json").read_text())
    assert doc["mesh"]["shape"] == [2, 2, 2] and doc["specs"]["w1"] == "RS(1)S(0)"
    assert all(len(s.split("x")) == 3 for s in doc["strategies"].values())
    assert [m.get("skipped") is not None for m in doc["solver"]["meshes"]] == [True, True, True, False]

    res = parc("explain", str(out))
    assert res.returncode == 0, res.stderr
    assert "(2, 2, 2)" in res.stdout and "no (hints)" in res.stdout and "mesh (8,) was skipped" in res.stdout

    sharded = onnx.load(out / "model.sharded.onnx")
    onnx.checker.check_model(sharded)
    assert {p.key: p.value for p in sharded.metadata_props}["parc.mesh"] == "2x2x2"
    # The annotations read back as pins: planning the annotated model gives the same layouts.
    res = parc("plan", str(out / "model.sharded.onnx"), "--devices", "8xa100-80g", "--mesh-dims", "3", "--time-limit", "10",
               "-o", str(tmp_path / "q"))
    assert res.returncode == 0, res.stderr
    again = json.loads((tmp_path / "q" / "plan.json").read_text())
    assert again["mesh"]["shape"] == [2, 2, 2] and again["specs"] == doc["specs"]


@pytest.mark.slow
def test_gpt_tiny_step_on_8_devices_searches_2x2x2(tmp_path):
    """A 1-layer gpt-tiny AdamW step: the 2x2x2 cost model alone takes ~50 s to build."""
    path = tmp_path / "gpt.onnx"
    res = parc("models", "build", "gpt-tiny", "--set", "layers=1", "--set", "batch=8", "--set", "hidden=16",
               "--set", "ffn=32", "--set", "heads=2", "--set", "seq=8", "--set", "vocab=16", "--train", "adamw",
               "-o", str(path))
    assert res.returncode == 0, res.stderr
    res = parc("plan", str(path), "--devices", "8xa100-80g", "--mesh-dims", "3", "-O2", "--time-limit", "5", "-o", str(tmp_path / "p"))
    assert res.returncode == 0, res.stderr
    doc = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert [m["shape"] for m in doc["solver"]["meshes"]] == [[8], [2, 4], [4, 2], [2, 2, 2]]
    assert doc["solver"]["meshes"][3]["feasible"]
