"""T5 encoder-decoder (Whale's T5-Large) with a cross-entropy loss on the decoder outputs.

T5 v1.0 layout by default: shared token embedding, pre-norm blocks with scale-only RMS norm
(built from Mul/ReduceMean/Add/Sqrt/Div), attention without biases or 1/sqrt(d) scaling,
ReLU FFN (d_ff 4096). Relative position bias as in T5: one learned [buckets, heads] table per
stack, shared by all its layers, indexed by bucket ids that are computed at build time (T5's
log-bucketing, bidirectional in the encoder, causal in the decoder) and stored as an int64
constant. Cross-attention has no position bias. ``ffn_act=gated-gelu`` gives the v1.1 FFN.

The LM head is a separate [d_model, vocab] matrix by default (tie_embeddings=false): with it
T5-Large has 770.6M parameters, the paper's 770M; tied (as in HF's t5-large) it has 737.7M.
Inputs: input_ids [B, enc_seq], decoder_input_ids [B, dec_seq], labels [B, dec_seq] (-100 ignored).
"""

from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "t5"
FFN_ACTS = ("relu", "gated-gelu")


def _defaults(layers: int, d_model: int, d_ff: int, heads: int, d_kv: int, *, vocab: int = 32128,
              enc_seq: int = 512, dec_seq: int = 128, batch: int = 8, buckets: int = 32,
              max_distance: int = 128, weights: str = "sparse") -> dict[str, object]:
    return {"layers": layers, "dec_layers": layers, "d_model": d_model, "d_ff": d_ff, "heads": heads,
            "d_kv": d_kv, "vocab": vocab, "enc_seq": enc_seq, "dec_seq": dec_seq, "buckets": buckets,
            "max_distance": max_distance, "ffn_act": "relu", "tie_embeddings": False,
            **common_defaults(batch, weights)}


MODELS = [
    ("t5-large", "T5-Large (v1.0, 24+24 layers) (Whale)", 770_000_000, _defaults(24, 1024, 4096, 16, 64)),
    ("t5-tiny", "2+2-layer T5 for tests (random weights)", None,
     _defaults(2, 64, 128, 4, 16, vocab=128, enc_seq=16, dec_seq=8, batch=2, buckets=8, max_distance=16,
               weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    check(cfg["ffn_act"] in FFN_ACTS, f"ffn_act={cfg['ffn_act']!r} must be one of {', '.join(FFN_ACTS)}")
    check(cfg["buckets"] >= 4, f"buckets={cfg['buckets']} must be >= 4")


def relative_buckets(q_len: int, k_len: int, bidirectional: bool, buckets: int, max_distance: int) -> np.ndarray:
    """T5's relative position bucket of every (query, key) pair, int64 [q_len, k_len]."""
    rel = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
    out = np.zeros_like(rel)
    if bidirectional:
        buckets //= 2
        out += (rel > 0) * buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    exact = buckets // 2
    # float32 arithmetic as in the reference implementation, so boundary buckets agree
    safe = np.maximum(rel, 1).astype(np.float32)
    scaled = np.log(safe / np.float32(exact)) / np.float32(math.log(max_distance / exact)) * np.float32(buckets - exact)
    large = exact + scaled.astype(np.int64)
    large = np.minimum(large, buckets - 1)
    return (out + np.where(rel < exact, rel, large)).astype(np.int64)


def position_bias(b: ModelBuilder, stack: str, seq: int, bidirectional: bool, cfg: Config) -> str:
    """[heads, seq, seq] bias from the stack's learned table, shared by all its layers."""
    table = b.param(f"{stack}.rel_bias.weight", [cfg["buckets"], cfg["heads"]])
    ids = relative_buckets(seq, seq, bidirectional, cfg["buckets"], cfg["max_distance"])
    ids_name = b.const(ids, name=f"{stack}.rel_bias.bucket_ids")
    bias = b.op("Gather", [table, ids_name], f"{stack}.rel_bias.gather", axis=0)  # [S, S, H]
    return b.transpose(bias, [2, 0, 1], f"{stack}.rel_bias.transpose")


def ffn(b: ModelBuilder, x: str, scope: str, cfg: Config) -> str:
    """T5 FFN: ReLU (v1.0) or gated GELU (v1.1), no biases."""
    d, f = cfg["d_model"], cfg["d_ff"]
    if cfg["ffn_act"] == "relu":
        h = b.relu(b.linear(x, d, f, f"{scope}.wi", bias=False), f"{scope}.relu")
    else:
        g = b.gelu(b.linear(x, d, f, f"{scope}.wi_0", bias=False), f"{scope}.gelu")
        h = b.mul(g, b.linear(x, d, f, f"{scope}.wi_1", bias=False), f"{scope}.gate")
    return b.linear(h, f, d, f"{scope}.wo", bias=False)


def _attn(b: ModelBuilder, x: str, scope: str, seq: int, cfg: Config, **kw: object) -> str:
    return b.attention(x, scope, hidden=cfg["d_model"], heads=cfg["heads"], head_dim=cfg["d_kv"],
                       batch=cfg["batch"], seq=seq, fused_qkv=False, bias=False, scale=False,
                       out_name="o", **kw)


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the T5 forward + loss graph into `b`."""
    bs, se, sd, d, v = cfg["batch"], cfg["enc_seq"], cfg["dec_seq"], cfg["d_model"], cfg["vocab"]
    ids = b.input("input_ids", TensorProto.INT64, [bs, se])
    dec_ids = b.input("decoder_input_ids", TensorProto.INT64, [bs, sd])
    labels = b.input("labels", TensorProto.INT64, [bs, sd])
    shared = b.param("shared.weight", [v, d], std=1.0 if cfg["tie_embeddings"] else 0.02)

    x = b.op("Gather", [shared, ids], "encoder.embed", axis=0)
    bias = position_bias(b, "encoder", se, True, cfg)
    for i in range(cfg["layers"]):
        p = f"encoder.block.{i}"
        x = b.add(x, _attn(b, b.rms_norm(x, d, f"{p}.attn_norm"), f"{p}.attn", se, cfg, pos_bias=bias),
                  f"{p}.attn.residual")
        x = b.add(x, ffn(b, b.rms_norm(x, d, f"{p}.ffn_norm"), f"{p}.ffn", cfg), f"{p}.ffn.residual")
    enc = b.rms_norm(x, d, "encoder.final_norm")

    y = b.op("Gather", [shared, dec_ids], "decoder.embed", axis=0)
    bias = position_bias(b, "decoder", sd, False, cfg)
    mask = b.causal_mask(sd)
    for i in range(cfg["dec_layers"]):
        p = f"decoder.block.{i}"
        a = _attn(b, b.rms_norm(y, d, f"{p}.self_attn_norm"), f"{p}.self_attn", sd, cfg, pos_bias=bias, mask=mask)
        y = b.add(y, a, f"{p}.self_attn.residual")
        c = _attn(b, b.rms_norm(y, d, f"{p}.cross_attn_norm"), f"{p}.cross_attn", sd, cfg, kv=enc, kv_seq=se)
        y = b.add(y, c, f"{p}.cross_attn.residual")
        y = b.add(y, ffn(b, b.rms_norm(y, d, f"{p}.ffn_norm"), f"{p}.ffn", cfg), f"{p}.ffn.residual")
    y = b.rms_norm(y, d, "decoder.final_norm")

    if cfg["tie_embeddings"]:  # T5 rescales before a tied softmax layer
        y = b.mul(y, b.scalar(d**-0.5), "lm_head.rescale")
        weight, transposed = shared, True
    else:
        weight, transposed = b.param("lm_head.weight", [d, v]), False
    b.lm_loss(y, labels, batch=bs, seq=sd, hidden=d, vocab=v, weight=weight, transposed=transposed,
              prefix="lm_head", ignore_index=-100)
