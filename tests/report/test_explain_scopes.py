"""Name rules of `parc explain`: scopes and strategies in words."""

from __future__ import annotations

import pytest

from parc.report import scopes


@pytest.mark.parametrize("name, scope", [
    ("h.0.attn.qkv.matmul", "h.0.attn"),
    ("h.0.attn.residual", "h.0.attn"),
    ("h.11.mlp.gelu.erf", "h.11.mlp"),
    ("h.0.attn.qkv.matmul.grad.MatMul_1", "h.0.attn"),  # backward: the forward node's scope
    ("h.0.attn.proj.bias.update.Add_0", "h.0.attn"),  # optimizer: the parameter's scope
    ("h.0.ln_1.layernorm", "h.0.ln_1"),
    ("h.3.residual", "h.3"),
    ("embed.add_positions", "embed"),
    ("lm_head.gemm.grad.Gemm_0", "lm_head"),
    ("wte.weight.update.Mul_3", "wte"),
    ("/transformer/h.0/attn/c_attn/MatMul", "transformer.h.0.attn"),
    ("MatMul_12", "(top level)"),
])
def test_scope_of(name, scope):
    assert scopes.scope_of(name) == scope


def test_split_axes_reads_strided_and_uneven_splits():
    assert scopes.split_axes("S(0)R") == ["S(0)", "R"]
    assert scopes.split_axes("S(1,3)P(sum)") == ["S(1,3)", "P(sum)"]
    assert scopes.split_axes("S(0,[3,5])") == ["S(0,[3,5])"]
    assert scopes.is_sharded("RS(1)") and not scopes.is_sharded("RR")
    assert scopes.spec_words("RS(1)") == "dim 1 split on axis 1"


@pytest.mark.parametrize("strategy, name, specs, words", [
    ("-", "h.0.attn.softmax", {}, "replicated"),
    ("-x-", "h.0.attn.softmax", {}, "replicated"),
    ("b0", "h.0.attn.qkv.matmul", {"h.0.attn.qkv.matmul": "S(0)"}, "data parallel (batch split) on axis 0"),
    ("n", "h.0.mlp.fc.matmul", {"h.0.mlp.fc.matmul": "S(2)"}, "column-split (n) on axis 0"),
    ("k", "h.0.mlp.proj.matmul", {"h.0.mlp.proj.matmul": "P(sum)"}, "partial sum (k) on axis 0"),
    ("k", "x.grad.MatMul_1", {}, "partial sum (k) on axis 0"),  # output spec unknown: the rule's k
    ("b0xn", "h.0.mlp.fc.matmul", {"h.0.mlp.fc.matmul": "S(0)S(2)"},
     "data parallel (batch split) on axis 0, column-split (n) on axis 1"),
    ("-xk", "h.0.mlp.proj.matmul", {"h.0.mlp.proj.matmul": "RP(sum)"}, "partial sum (k) on axis 1"),
    ("d2", "h.0.mlp.gelu.erf", {"h.0.mlp.gelu.erf": "S(2)"}, "dim 2 split on axis 0"),
])
def test_strategy_words(strategy, name, specs, words):
    assert scopes.strategy_words(strategy, name, specs) == words


def test_an_optimizer_node_shards_its_update():
    """The phase comes from plan.json's `phases`, not from the node's name."""
    assert scopes.strategy_words("d0", "w.update.Mul_0", {}, "optimizer") == "sharded update (dim 0) on axis 0"
    assert scopes.strategy_words("d0", "w.step_7", {}, "optimizer") == "sharded update (dim 0) on axis 0"


def test_backward_output_spec_is_found_under_the_lowercased_name():
    specs = {"x.grad.reducesum_0": "P(sum)"}
    assert scopes.strategy_words("d0", "x.grad.ReduceSum_0", specs) == "partial sum (d0) on axis 0"
