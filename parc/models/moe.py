"""GShard-style mixture-of-experts GPT in Rhino Table 2's configurations.

The GPT decoder of `gpt.py` where every other block (odd indices: 1, 3, ...) replaces its
MLP by `experts` expert MLPs with top-2 gating, written in standard ONNX ops:

    gate MatMul -> Softmax -> TopK(k=2) -> normalise the two gates -> OneHot
      -> dispatch mask [T, E] and combine weights [T, E]
      -> dispatch: [1, T, h] * mask[E, T, 1] -> [E, T, h]
      -> experts: batched MatMul with [E, h, ffn] and [E, ffn, h] (+ bias, GELU)
      -> combine: * weights[E, T, 1], ReduceSum over E -> [T, h]

Dispatch is dense (no capacity): every expert computes on every token, with tokens not routed
to it zeroed on the way in and given weight 0 on the way out. Parameter count and the
per-expert weight shapes are GShard's; expert FLOPs are E/2 times GShard's at capacity factor 1.
Vocabulary 32000, sequence 1024 follow Alpa's MoE benchmark, which Rhino's configurations copy.
"""

from __future__ import annotations

from parc.models import gpt
from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "moe"


def _defaults(layers: int, hidden: int, ffn: int, heads: int, experts: int, *, vocab: int = 32000,
              seq: int = 1024, batch: int = 8, weights: str = "sparse") -> dict[str, object]:
    return {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "experts": experts,
            "top_k": 2, "vocab": vocab, "seq": seq, **common_defaults(batch, weights)}


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


def moe_mlp(b: ModelBuilder, x: str, scope: str, cfg: Config) -> str:
    """Top-k gated mixture of expert MLPs with dense dispatch; x [B, S, h] -> [B, S, h]."""
    bs, s, h, f, e, k = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"]
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
    # Experts: batched MatMul over the expert dimension.
    w1 = b.param(f"{scope}.experts.fc.weight", [e, h, f])
    b1 = b.unsqueeze(b.param(f"{scope}.experts.fc.bias", [e, f], "zeros"), [1], f"{scope}.experts.fc.bias_e")
    w2 = b.param(f"{scope}.experts.proj.weight", [e, f, h])
    b2 = b.unsqueeze(b.param(f"{scope}.experts.proj.bias", [e, h], "zeros"), [1], f"{scope}.experts.proj.bias_e")
    y = b.add(b.op("MatMul", [x_e, w1], f"{scope}.experts.fc.matmul"), b1, f"{scope}.experts.fc.add")
    y = b.gelu(y, f"{scope}.experts.gelu")
    y = b.add(b.op("MatMul", [y, w2], f"{scope}.experts.proj.matmul"), b2, f"{scope}.experts.proj.add")
    # Combine: weight each expert's output by its gate and sum over experts.
    comb_e = b.unsqueeze(b.transpose(combine, [1, 0], f"{scope}.combine_weights_t"), [2], f"{scope}.combine_weights_e")
    y = b.mul(y, comb_e, f"{scope}.combine")
    y = b.op("ReduceSum", [y, b.ints([0])], f"{scope}.combine_sum", keepdims=0)  # [T, h]
    return b.reshape(y, [bs, s, h], f"{scope}.untokens")


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the MoE GPT forward + loss graph into `b`: odd blocks are MoE, even blocks dense."""
    gpt.build_decoder_lm(b, cfg, lambda i: (moe_mlp, "moe") if i % 2 == 1 else (gpt.mlp, "mlp"))
