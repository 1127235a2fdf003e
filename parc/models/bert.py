"""BERT encoders with a masked-LM loss: BERT-Large (Whale) and DNABERT (Rhino Table 3).

Word + learned position + token-type embeddings (type 0 for every token), post-LayerNorm
encoder layers (fused-QKV self-attention, GELU FFN), and the MLM head (dense + GELU + LayerNorm,
decoder tied to the word embedding, with its own bias). No pooler / NSP head: the loss is MLM
only. Inputs ``input_ids`` / ``labels`` int64 [batch, seq]; labels equal to -100 are ignored.

DNABERT is the same network on DNA 6-mers (vocabulary 4^6 + 5 special tokens = 4101) with a
long context; see docs/models.md for how its size was chosen.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "bert"
FAMILIES = {"dnabert": "dnabert", "dnabert-tiny": "dnabert"}
IGNORE_INDEX = -100


def _defaults(layers: int, hidden: int, ffn: int, heads: int, vocab: int, seq: int, batch: int, *,
              max_positions: int | None = None, weights: str = "sparse") -> dict[str, object]:
    return {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "vocab": vocab, "seq": seq,
            "max_positions": max_positions or seq, "type_vocab": 2, **common_defaults(batch, weights)}


MODELS = [
    ("bert-large", "BERT-Large with MLM loss (Whale)", 340_000_000,
     _defaults(24, 1024, 4096, 16, 30522, 512, 8)),
    ("bert-tiny", "2-layer BERT for tests (random weights)", None,
     _defaults(2, 64, 256, 4, 128, 16, 2, weights="random")),
    ("dnabert", "DNABERT on 6-mers, 12x1024, 4096-token context (Rhino Table 3)", 162_000_000,
     _defaults(12, 1024, 4096, 16, 4101, 4096, 32)),
    ("dnabert-tiny", "2-layer DNABERT on 3-mers for tests (random weights)", None,
     _defaults(2, 64, 256, 4, 4**3 + 5, 64, 2, weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    check(cfg["hidden"] % cfg["heads"] == 0, f"hidden={cfg['hidden']} must be divisible by heads={cfg['heads']}")
    check(cfg["seq"] <= cfg["max_positions"], f"seq={cfg['seq']} must be <= max_positions={cfg['max_positions']}")


def embeddings(b: ModelBuilder, ids: str, cfg: Config) -> tuple[str, str]:
    """word + position + token-type(0) embeddings, LayerNorm; returns (output, word table)."""
    s, h = cfg["seq"], cfg["hidden"]
    word = b.param("embeddings.word.weight", [cfg["vocab"], h])
    pos = b.param("embeddings.position.weight", [cfg["max_positions"], h])
    ttype = b.param("embeddings.token_type.weight", [cfg["type_vocab"], h])
    x = b.op("Gather", [word, ids], "embeddings.word.gather", axis=0)
    if s < cfg["max_positions"]:
        pos = b.op("Slice", [pos, b.ints([0]), b.ints([s]), b.ints([0])], "embeddings.position.slice")
    x = b.add(x, pos, "embeddings.add_position")
    type0 = b.op("Gather", [ttype, b.const(np.int64(0))], "embeddings.token_type.gather", axis=0)
    x = b.add(x, type0, "embeddings.add_token_type")
    return b.layer_norm(x, h, "embeddings.ln", eps=1e-12), word


def encoder_layer(b: ModelBuilder, x: str, i: int, cfg: Config) -> str:
    """Post-LN encoder layer: LN(x + attn(x)), then LN(x + ffn(x))."""
    h, p = cfg["hidden"], f"layer.{i}"
    a = b.attention(x, f"{p}.attn", hidden=h, heads=cfg["heads"], batch=cfg["batch"], seq=cfg["seq"])
    x = b.layer_norm(b.add(x, a, f"{p}.attn.residual"), h, f"{p}.attn.ln", eps=1e-12)
    f = b.linear(x, h, cfg["ffn"], f"{p}.ffn.fc")
    f = b.linear(b.gelu(f, f"{p}.ffn.gelu"), cfg["ffn"], h, f"{p}.ffn.proj")
    return b.layer_norm(b.add(x, f, f"{p}.ffn.residual"), h, f"{p}.ffn.ln", eps=1e-12)


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the BERT MLM forward + loss graph into `b`."""
    bs, s, h, v = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["vocab"]
    ids = b.input("input_ids", TensorProto.INT64, [bs, s])
    labels = b.input("labels", TensorProto.INT64, [bs, s])
    x, word = embeddings(b, ids, cfg)
    for i in range(cfg["layers"]):
        x = encoder_layer(b, x, i, cfg)
    t = b.gelu(b.linear(x, h, h, "mlm.transform"), "mlm.gelu")
    t = b.layer_norm(t, h, "mlm.ln", eps=1e-12)
    bias = b.param("mlm.decoder.bias", [v], "zeros")
    b.lm_loss(t, labels, batch=bs, seq=s, hidden=h, vocab=v, weight=word, transposed=True, bias=bias,
              prefix="mlm.decoder", ignore_index=IGNORE_INDEX)
