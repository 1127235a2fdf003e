"""GShard-style mixture-of-experts GPT in Rhino Table 2's configurations.

The GPT decoder of `gpt.py` where every other block (odd indices: 1, 3, ...) replaces its
MLP by `experts` expert MLPs with top-2 gating, written in standard ONNX ops:

    gate MatMul -> Softmax -> TopK(k=2) -> normalise the two gates -> OneHot
      -> dispatch mask [T, E] and combine weights [T, E]
      -> dispatch: [1, T, h] * mask[E, T, 1] -> [E, T, h]
      -> experts: batched MatMul with [E, h, ffn] and [E, ffn, h] (+ bias, GELU)
      -> combine: * weights[E, T, 1], ReduceSum over E -> [T, h]

Dispatch is dense (no capacity) by default: every expert computes on every token, with tokens
not routed to it zeroed on the way in and given weight 0 on the way out. Parameter count and the
per-expert weight shapes are GShard's; expert FLOPs are E/2 times GShard's at capacity factor 1.

`capacity_factor > 0` dispatches as GShard does instead: each sequence is a group, each expert
takes at most C = ceil(k * seq * capacity_factor / E) tokens per group (every first choice
before any second choice, in sequence order; the rest are dropped), and

    CumSum of the routing mask -> slot OneHot [B, S, E, C] (dispatch) and gate-weighted (combine)
      -> Einsum bsec,bsh->ebch: [E, B, C, h] -> experts on [E, B*C, h]
      -> Einsum bsec,ebch->bsh

The dispatched tensor holds k * capacity_factor tokens' worth per token, not E, so an
expert-split plan moves it between the batch split and the expert split with one all-to-all
(GShard's), which dense dispatch (E tokens' worth) cannot make cheaper than gathering tokens.
Vocabulary 32000, sequence 1024 follow Alpa's MoE benchmark, which Rhino's configurations copy.
"""

from __future__ import annotations

import math

from parc.models import gpt
from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "moe"


def _defaults(layers: int, hidden: int, ffn: int, heads: int, experts: int, *, vocab: int = 32000,
              seq: int = 1024, batch: int = 8, weights: str = "sparse") -> dict[str, object]:
    return {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "experts": experts,
            "top_k": 2, "capacity_factor": 0.0, "vocab": vocab, "seq": seq, **common_defaults(batch, weights)}


# batch 8 = Rhino's SPMD-only global batch for MoE. Paper N_params: see docs/models.md for
# MoE-8E-380M, whose table entry (350M) contradicts its own name and dimensions.
MODELS = [
    ("moe-8e-380m", "GShard MoE 380M (8 experts), Rhino Table 2 (table: 350M; ours 384M, see docs)", 350_000_000,
     _defaults(8, 768, 6144, 16, 8)),
    ("moe-8e-760m", "GShard MoE 760M (8 experts), Rhino Table 2 (ours 743M)", 760_000_000,
     _defaults(16, 768, 6144, 16, 8)),
    ("moe-16e-1.3b", "GShard MoE 1.3B (16 experts), Rhino Table 2 (ours 1.35B, as Alpa's)", 1_300_000_000,
     _defaults(16, 768, 6144, 16, 16)),
    ("moe-16e-2.4b", "GShard MoE 2.4B (16 experts), Rhino Table 2", 2_400_000_000,
     _defaults(16, 1024, 8192, 16, 16)),
    ("moe-32e-10b", "GShard MoE 10B (32 experts), Rhino Table 2", 10_000_000_000,
     _defaults(16, 1536, 12288, 16, 32)),
    ("moe-tiny", "2-layer MoE GPT with 4 experts for tests (random weights)", None,
     _defaults(2, 64, 128, 4, 4, vocab=128, seq=16, batch=2, weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    gpt.validate(cfg)
    check(cfg["top_k"] <= cfg["experts"], f"top_k={cfg['top_k']} must be <= experts={cfg['experts']}")
    check(cfg["capacity_factor"] >= 0, f"capacity_factor={cfg['capacity_factor']} must be >= 0 (0: dense dispatch)")


def capacity(cfg: Config) -> int:
    """Tokens each expert takes per group (sequence) under capacity dispatch."""
    return max(1, math.ceil(cfg["top_k"] * cfg["seq"] * cfg["capacity_factor"] / cfg["experts"]))


def moe_mlp(b: ModelBuilder, x: str, scope: str, cfg: Config) -> str:
    """Top-k gated mixture of expert MLPs; x [B, S, h] -> [B, S, h]."""
    if cfg["capacity_factor"] > 0:
        return _capacity_moe_mlp(b, x, scope, cfg)
    bs, s, h, e, k = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["experts"], cfg["top_k"]
    t = bs * s
    x2d = b.reshape(x, [t, h], f"{scope}.tokens")
    # Gating: softmax over experts, keep the top k and renormalise them (GShard).
    logits = b.op("MatMul", [x2d, b.param(f"{scope}.gate.weight", [h, e])], f"{scope}.gate.matmul")
    probs = b.op("Softmax", [logits], f"{scope}.gate.softmax", axis=-1)
    top_p, top_i = b.op("TopK", [probs, b.ints([k])], f"{scope}.gate.topk", n_out=2, axis=-1)
    denom = b.op("ReduceSum", [top_p, b.ints([-1])], f"{scope}.gate.sum", keepdims=1)
    gates = b.op("Div", [top_p, denom], f"{scope}.gate.normalize")
    onehot = b.op("OneHot", [top_i, b.const(e, dtype="int64"), b.const([0.0, 1.0], dtype="float32")],
                  f"{scope}.gate.onehot", axis=-1)  # [T, k, E]
    dispatch = b.op("ReduceSum", [onehot, b.ints([1])], f"{scope}.dispatch_mask", keepdims=0)  # [T, E]
    weighted = b.mul(onehot, b.unsqueeze(gates, [2], f"{scope}.gate.unsqueeze"), f"{scope}.gate.weight_onehot")
    combine = b.op("ReduceSum", [weighted, b.ints([1])], f"{scope}.combine_weights", keepdims=0)  # [T, E]
    # Dispatch: every expert gets all tokens, the ones not routed to it zeroed.
    mask_e = b.unsqueeze(b.transpose(dispatch, [1, 0], f"{scope}.dispatch_mask_t"), [2], f"{scope}.dispatch_mask_e")
    x_e = b.mul(b.unsqueeze(x2d, [0], f"{scope}.tokens_e"), mask_e, f"{scope}.dispatch")  # [E, T, h]
    y = _experts(b, x_e, scope, cfg)  # batched MatMul over the expert dimension
    # Combine: weight each expert's output by its gate and sum over experts.
    comb_e = b.unsqueeze(b.transpose(combine, [1, 0], f"{scope}.combine_weights_t"), [2], f"{scope}.combine_weights_e")
    y = b.mul(y, comb_e, f"{scope}.combine")
    y = b.op("ReduceSum", [y, b.ints([0])], f"{scope}.combine_sum", keepdims=0)  # [T, h]
    return b.reshape(y, [bs, s, h], f"{scope}.untokens")


def _experts(b: ModelBuilder, x_e: str, scope: str, cfg: Config) -> str:
    """The expert MLPs, batched over the expert dim: x_e [E, N, h] -> [E, N, h]."""
    h, f, e = cfg["hidden"], cfg["ffn"], cfg["experts"]
    w1 = b.param(f"{scope}.experts.fc.weight", [e, h, f])
    b1 = b.unsqueeze(b.param(f"{scope}.experts.fc.bias", [e, f], "zeros"), [1], f"{scope}.experts.fc.bias_e")
    w2 = b.param(f"{scope}.experts.proj.weight", [e, f, h])
    b2 = b.unsqueeze(b.param(f"{scope}.experts.proj.bias", [e, h], "zeros"), [1], f"{scope}.experts.proj.bias_e")
    y = b.add(b.op("MatMul", [x_e, w1], f"{scope}.experts.fc.matmul"), b1, f"{scope}.experts.fc.add")
    y = b.gelu(y, f"{scope}.experts.gelu")
    return b.add(b.op("MatMul", [y, w2], f"{scope}.experts.proj.matmul"), b2, f"{scope}.experts.proj.add")


def _capacity_moe_mlp(b: ModelBuilder, x: str, scope: str, cfg: Config) -> str:
    """GShard dispatch with per-sequence groups and expert capacity; x [B, S, h] -> [B, S, h]."""
    bs, s, h, e, k = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["experts"], cfg["top_k"]
    c = capacity(cfg)
    logits = b.op("MatMul", [x, b.param(f"{scope}.gate.weight", [h, e])], f"{scope}.gate.matmul")
    probs = b.op("Softmax", [logits], f"{scope}.gate.softmax", axis=-1)
    top_p, top_i = b.op("TopK", [probs, b.ints([k])], f"{scope}.gate.topk", n_out=2, axis=-1)  # [B, S, k]
    denom = b.op("ReduceSum", [top_p, b.ints([-1])], f"{scope}.gate.sum", keepdims=1)
    gates = b.op("Div", [top_p, denom], f"{scope}.gate.normalize")
    onehot = b.op("OneHot", [top_i, b.const(e, dtype="int64"), b.const([0.0, 1.0], dtype="float32")],
                  f"{scope}.gate.onehot", axis=-1)  # [B, S, k, E]
    # Slot of each (choice, expert) in its expert's buffer: choices ranked first by k, then by
    # position, so every first choice is served before any second one (GShard).
    ranked = b.reshape(b.transpose(onehot, [0, 2, 1, 3], f"{scope}.route.by_rank"), [bs, k * s, e],
                       f"{scope}.route.mask")  # [B, kS, E]
    before = b.op("CumSum", [ranked, b.const(1, dtype="int64")], f"{scope}.route.cumsum", exclusive=1)
    slot = b.op("Cast", [before], f"{scope}.route.slot", to=7)  # int64
    # OneHot of a slot >= C is all zeros: that choice is dropped.
    slots = b.op("OneHot", [slot, b.const(c, dtype="int64"), b.const([0.0, 1.0], dtype="float32")],
                 f"{scope}.route.slot_onehot", axis=-1)  # [B, kS, E, C]
    slots = b.mul(slots, b.unsqueeze(ranked, [3], f"{scope}.route.mask_c"), f"{scope}.route.slots")
    slots = b.reshape(slots, [bs, k, s, e, c], f"{scope}.route.slots_k")
    dispatch = b.op("ReduceSum", [slots, b.ints([1])], f"{scope}.dispatch_mask", keepdims=0)  # [B, S, E, C]
    g = b.reshape(b.transpose(gates, [0, 2, 1], f"{scope}.gate.by_rank"), [bs, k, s, 1, 1], f"{scope}.gate.slots")
    combine = b.op("ReduceSum", [b.mul(slots, g, f"{scope}.gate.weight_slots"), b.ints([1])],
                   f"{scope}.combine_weights", keepdims=0)  # [B, S, E, C]
    x_e = b.op("Einsum", [dispatch, x], f"{scope}.dispatch", equation="bsec,bsh->ebch")  # [E, B, C, h]
    y = _experts(b, b.reshape(x_e, [e, bs * c, h], f"{scope}.expert_tokens"), scope, cfg)
    y = b.reshape(y, [e, bs, c, h], f"{scope}.expert_slots")
    return b.op("Einsum", [combine, y], f"{scope}.combine", equation="bsec,ebch->bsh")


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the MoE GPT forward + loss graph into `b`: odd blocks are MoE, even blocks dense."""
    gpt.build_decoder_lm(b, cfg, lambda i: (moe_mlp, "moe") if i % 2 == 1 else (gpt.mlp, "mlp"))
