"""Graph invariants: the verifier catches broken IR; the printer is deterministic."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import legacy_gpt_block_model

from parc.errors import VerifyError
from parc.ir import Graph, TensorData, from_model, print_graph
from parc.ir.dtypes import FLOAT
from parc.ir.graph import Value
from parc.ops import verify


def small_graph() -> Graph:
    g = Graph("g", {"": 18})
    x = g.add_input("x", FLOAT, (2, 3))
    w = g.add_constant(TensorData.from_array(np.ones((3, 4), np.float32)), "w", is_param=True)
    mm = g.add_node("MatMul", [x, w], output_names=["h"])
    relu = g.add_node("Relu", [mm.outputs[0]], output_names=["y"])
    mm.outputs[0].dtype, mm.outputs[0].shape = FLOAT, (2, 4)
    relu.outputs[0].dtype, relu.outputs[0].shape = FLOAT, (2, 4)
    g.outputs = [relu.outputs[0]]
    return g


def test_valid_graph_verifies():
    verify(small_graph())


def test_wrong_shape_is_caught():
    g = small_graph()
    g.nodes[1].outputs[0].shape = (2, 5)
    with pytest.raises(VerifyError, match="Relu"):
        verify(g)


def test_wrong_dtype_is_caught():
    g = small_graph()
    from parc.ir.dtypes import INT64
    g.nodes[0].outputs[0].dtype = INT64
    with pytest.raises(VerifyError):
        verify(g)


def test_non_topological_order_is_caught():
    g = small_graph()
    g.nodes.reverse()
    with pytest.raises(VerifyError, match="before it is defined"):
        verify(g)
    g.toposort()
    verify(g)


def test_dangling_value_is_caught():
    g = small_graph()
    g.nodes[1].set_input(0, Value("ghost", FLOAT, (2, 4)))
    with pytest.raises(VerifyError, match="ghost"):
        verify(g)


def test_broken_use_list_is_caught():
    g = small_graph()
    g.nodes[1].inputs[0].uses.clear()
    with pytest.raises(VerifyError, match="use-list"):
        verify(g)


def test_missing_shape_is_caught():
    g = small_graph()
    g.nodes[0].outputs[0].shape = None
    with pytest.raises(VerifyError, match="no static shape"):
        verify(g)


def test_use_lists_follow_edits():
    g = small_graph()
    h = g.nodes[0].outputs[0]
    assert [(n.op_type, i) for n, i in h.uses] == [("Relu", 0)]
    x = g.inputs[0]
    h.replace_all_uses_with(x)
    assert h.uses == [] and ("Relu", 0) in [(n.op_type, i) for n, i in x.uses]
    g.outputs = [g.nodes[1].outputs[0]]
    assert g.dead_code_elimination() == 2  # MatMul and its weight
    assert [n.op_type for n in g.nodes] == ["Relu"] and not g.constants


def test_name_authority_never_reuses_names():
    g = small_graph()
    names = {g.names.fresh("h") for _ in range(5)}
    assert len(names) == 5 and "h" not in names


GOLDEN = Path(__file__).parent / "golden" / "legacy_block.txt"


def test_printer_matches_golden_text():
    """Folding and printing are deterministic: the legacy block prints exactly as recorded."""
    text = print_graph(from_model(legacy_gpt_block_model(), {"batch": 2, "seq": 3}))
    assert text == print_graph(from_model(legacy_gpt_block_model(), {"batch": 2, "seq": 3}))
    assert text == GOLDEN.read_text()
