"""Issue 4's planner quality bars on shape-only (sparse-weight) variants of zoo models, planned
on the flat mesh of 8 V100s (`parc plan --devices 8xv100-32g -O3`, through the library)."""

from __future__ import annotations

from collections import Counter

import pytest
from bars import (
    REDUCTIONS,
    collective_bytes,
    data_parallel_sync_bytes,
    gradient_sync_bytes,
    plan,
    strategies,
    training_step,
)


def _split_classifier_bar(p, graph, classifier: str) -> None:
    """Whale fig. 3: the classifier split on its class dim, gradient sync >= 85% below DP's."""
    assert strategies(p, classifier)[classifier] == "n"  # Gemm `m k, k n -> m n`: n is the classes
    assert gradient_sync_bytes(p) <= 0.15 * data_parallel_sync_bytes(graph, 8)


def test_vgg19_split_classifier_data_parallel_backbone(tmp_path):
    """VGG19 at 1/4 width, 128x128 images and a 200K-class head (96% of the parameters)."""
    graph = training_step("vgg19", tmp_path, base=16, fc=1024, image=128, batch=64, classes=200_000)
    p = plan(graph)
    _split_classifier_bar(p, graph, "classifier.fc3.gemm")
    convs = strategies(p, "features.conv", "Conv")
    # Stages 1-4 (activations well above weights) are data parallel; stage 5's 4x4 maps are
    # smaller than its weights and may be split on channels instead.
    assert all(s == "n" for name, s in convs.items() if not name.startswith("features.conv5")), convs


@pytest.mark.slow
def test_resnet50_1m_split_classifier_data_parallel_backbone(tmp_path):
    """ResNet50 at 1/4 width with a 200K-class head (14% of the real 1M head, 93% of params)."""
    graph = training_step("resnet50-1m", tmp_path, channels=16, image=224, batch=128, classes=200_000)
    p = plan(graph)
    _split_classifier_bar(p, graph, "fc.gemm")
    convs = Counter(strategies(p, op_type="Conv").values())
    assert convs["n"] > sum(convs.values()) / 2, convs  # mostly data parallel


def _expert_split_bar(p, scope: str) -> None:
    """GShard: both expert MatMuls split on the expert dim, tokens moved by all-to-all."""
    chosen = strategies(p, scope)
    assert chosen[f"{scope}.experts.fc.matmul"] == "b0"  # `b0 m k, b0 k n`: b0 is the expert dim
    assert chosen[f"{scope}.experts.proj.matmul"] == "b0"
    assert chosen[f"{scope}.dispatch"] == "b"  # the dispatch Einsum stays batch (group) split
    moved = {(e["value"], c["kind"]) for e in p.communication() for c in e["collectives"]}
    assert (f"{scope}.dispatch", "all_to_all") in moved
    assert collective_bytes(p)["all_to_all"] > 0
    specs = p.to_json()["specs"]
    for w in ("fc", "proj"):
        assert specs[f"{scope}.experts.{w}.weight"] == "S(0)"  # each device stores its experts only


def test_moe_experts_split_with_all_to_all(tmp_path):
    """An 8-expert MoE whose replicated experts and optimizer state exceed the 0.4 GiB limit."""
    graph = training_step("moe-tiny", tmp_path, experts=8, hidden=512, ffn=4096, seq=128, batch=16,
                          vocab=1024, capacity_factor=1)
    p = plan(graph, mem_gib=0.4)
    _expert_split_bar(p, "h.1.moe")


def test_moe_tiny_experts_split_with_all_to_all(tmp_path):
    """moe-tiny's 4 experts on 4 devices (hidden 256, ffn 2048, 8 x 128 tokens; at hidden 64
    every collective is latency-bound and replicating tokens wins), limit below DP's need."""
    graph = training_step("moe-tiny", tmp_path, batch=8, seq=128, hidden=256, ffn=2048, capacity_factor=1)
    p = plan(graph, "4xv100-16g", mem_gib=0.12)
    _expert_split_bar(p, "h.1.moe")


def test_gpt_mlp_column_then_row_parallel_under_memory_pressure(tmp_path):
    """Weights (0.4 GiB for two blocks of hidden 2048) that cannot be replicated in 0.3 GiB:
    each MLP's fc weight splits on its output dim, proj's on its input dim, and proj's partial
    sums are reduced once (all-reduce, or reduce-scatter as in sequence parallelism), before the
    bias Add or after it."""
    graph = training_step("gpt-tiny", tmp_path, hidden=2048, ffn=8192, seq=64, batch=8, layers=2,
                          vocab=1024, heads=16)
    p = plan(graph, mem_gib=0.3)
    specs = p.to_json()["specs"]
    for layer in (0, 1):
        mlp = f"h.{layer}.mlp"
        chosen = strategies(p, mlp, "MatMul")
        assert chosen == {f"{mlp}.fc.matmul": "n", f"{mlp}.proj.matmul": "k"}
        assert specs[f"{mlp}.fc.weight"] == "S(1)" and specs[f"{mlp}.proj.weight"] == "S(0)"
        # before the bias Add or after it (the bias added to one device's partial sum)
        reduced = [c["kind"] for e in p.communication() if e["value"] in (f"{mlp}.proj.matmul", f"{mlp}.proj.add")
                   for c in e["collectives"] if c["kind"] in REDUCTIONS]
        assert reduced in (["all_reduce"], ["reduce_scatter"])
