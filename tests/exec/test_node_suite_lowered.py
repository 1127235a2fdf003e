"""ONNX's own backend node tests through the lowering and the executor on 2 ranks.

For each single-node case with a sharding rule (imported as tests/ops/test_onnx_node_suite.py
does), a 2-rank plan is made by hand from the node's strategies: its most split strategy with
the inputs given replicated (so they are sliced locally, and the outputs are gathered or
reduced back) and the same strategy with the inputs already in its layout. The plan directory
is written by the same code as `parc plan`'s, run by the same `Rank` programs (as threads, with
collectives over shared memory), and its outputs compared with onnxruntime on the whole node.
The fast suite runs every fifth case; `make test-all` runs them all.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from parc.passes.spmd.strategies import node_strategies
from parc.sharding import ShardSpec
from parc.sharding.spec import Replicated
from tests.ops.test_onnx_node_suite import CASE_NAMES, Skip, prepare, single_node_cases

ort = pytest.importorskip("onnxruntime")

MESH = (2,)
WITHOUT_SPLIT_FILE = Path(__file__).parent / "data" / "node_cases_without_split.txt"
WITHOUT_SPLIT = {line for line in WITHOUT_SPLIT_FILE.read_text().split("\n") if line and not line.startswith("#")}


def _reference(graph, feeds):
    from parc.ir.exporter import to_onnx

    model = to_onnx(graph)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def run_lowered(name: str, tmp_path) -> int:
    """Lower and run the case's node under two layouts; the number of runs compared (0 for the
    cases listed as having no split strategy, which is checked)."""
    from parc.exec.threads import run_threads
    from parc.passes.emit import write_programs_for

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            graph, node, arrays = prepare(single_node_cases()[name])
        except Skip as s:
            pytest.skip(str(s)[:200])
    feeds = {v.name: a for v, a in zip(node.inputs, arrays) if v is not None and a is not None}
    if any(a.size == 0 for a in feeds.values()):
        pytest.skip("empty tensor")
    try:
        want = _reference(graph, feeds)
    except Exception as e:  # onnxruntime raises its own types
        pytest.skip(f"onnxruntime cannot run the node: {str(e).splitlines()[0][:150]}")
    split = [s for s in node_strategies(node, MESH) if s.split > 1]
    if name in WITHOUT_SPLIT:
        assert not split, f"{name} now has a split strategy: remove it from {WITHOUT_SPLIT_FILE.name}"
        return 0
    assert split, f"{name}: no split strategy on 2 devices (a rule lost its splits?); see {WITHOUT_SPLIT_FILE.name}"
    s = split[0]
    rep = ShardSpec((Replicated(),))
    runs = 0
    for given in ("replicated", "in layout"):
        specs = {}
        for v, spec in zip(node.inputs, s.inputs):
            if v is not None:
                specs[v.name] = rep if given == "replicated" or v.const is not None else spec
        out = tmp_path / given.replace(" ", "_")
        write_programs_for(graph, MESH, [s], specs, 1, out)
        got, _ = run_threads(out, [feeds], timeout=30)
        for k, w in want.items():
            g = got[0][k]
            assert g.shape == w.shape, (k, s.labels, given)
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=f"{k} {s} {given}")
            else:
                np.testing.assert_array_equal(g, w, err_msg=f"{k} {s} {given}")
        runs += 1
    return runs


SAMPLED = CASE_NAMES[::5]


@pytest.mark.parametrize("name", SAMPLED)
def test_node_case_lowered_on_two_ranks(name, tmp_path):
    assert run_lowered(name, tmp_path) == (0 if name in WITHOUT_SPLIT else 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(CASE_NAMES) - set(SAMPLED)))
def test_node_case_lowered_on_two_ranks_all(name, tmp_path):
    assert run_lowered(name, tmp_path) == (0 if name in WITHOUT_SPLIT else 2)
