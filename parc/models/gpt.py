"""GPT (GPT-2 style decoder-only LM) in Rhino Table 1's configurations.

Token + learned position embeddings, pre-LayerNorm blocks (causal self-attention with a fused
QKV projection, GELU MLP), a final LayerNorm and an LM head tied to the token embedding.
Inputs ``input_ids`` / ``labels`` int64 [batch, seq] (labels are the already shifted targets).
"""

from __future__ import annotations

from collections.abc import Callable

from onnx import TensorProto

from parc.models.config import Config, check, common_defaults
from parc.models.layers import ModelBuilder

FAMILY = "gpt"

# A function making the FFN of one block: (builder, x, scope, cfg) -> output.
MlpFn = Callable[[ModelBuilder, str, str, Config], str]


def _defaults(layers: int, hidden: int, ffn: int, heads: int, *, vocab: int = 51200, seq: int = 1024,
              batch: int = 4, weights: str = "sparse") -> dict[str, object]:
    return {"layers": layers, "hidden": hidden, "ffn": ffn, "heads": heads, "vocab": vocab, "seq": seq,
            **common_defaults(batch, weights)}


# (name, description, paper N_params, defaults); batch 4 = Rhino's SPMD-only global batch.
MODELS = [
    ("gpt-medium", "GPT-3 Medium, Rhino Table 1", 350_000_000, _defaults(24, 1024, 4096, 16)),
    ("gpt-large", "GPT-3 Large, Rhino Table 1", 760_000_000, _defaults(24, 1536, 6144, 16)),
    ("gpt-xl", "GPT-3 XL, Rhino Table 1", 1_300_000_000, _defaults(24, 2048, 8192, 32)),
    ("gpt-2.7b", "GPT-3 2.7B, Rhino Table 1", 2_700_000_000, _defaults(32, 2560, 10240, 32)),
    ("gpt-6.7b", "GPT-3 6.7B, Rhino Table 1", 6_700_000_000, _defaults(32, 4096, 16384, 32)),
    ("gpt-tiny", "2-layer GPT for tests (random weights)", None,
     _defaults(2, 64, 256, 4, vocab=128, seq=16, batch=2, weights="random")),
]


def validate(cfg: Config) -> None:
    """Reject configurations the graph cannot be built for."""
    check(cfg["hidden"] % cfg["heads"] == 0, f"hidden={cfg['hidden']} must be divisible by heads={cfg['heads']}")


def mlp(b: ModelBuilder, x: str, scope: str, cfg: Config) -> str:
    """The dense GELU MLP: hidden -> ffn -> hidden."""
    h = b.linear(x, cfg["hidden"], cfg["ffn"], f"{scope}.fc")
    h = b.gelu(h, f"{scope}.gelu")
    return b.linear(h, cfg["ffn"], cfg["hidden"], f"{scope}.proj")


def block(b: ModelBuilder, x: str, i: int, cfg: Config, mask: str, mlp_fn: MlpFn, mlp_scope: str) -> str:
    """One pre-LN decoder block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    h, p = cfg["hidden"], f"h.{i}"
    a = b.layer_norm(x, h, f"{p}.ln_1")
    a = b.attention(a, f"{p}.attn", hidden=h, heads=cfg["heads"], batch=cfg["batch"], seq=cfg["seq"], mask=mask)
    x = b.add(x, a, f"{p}.attn.residual")
    m = b.layer_norm(x, h, f"{p}.ln_2")
    m = mlp_fn(b, m, f"{p}.{mlp_scope}", cfg)
    return b.add(x, m, f"{p}.{mlp_scope}.residual")


def build_decoder_lm(b: ModelBuilder, cfg: Config, layer_fn: Callable[[int], tuple[MlpFn, str]]) -> None:
    """Embeddings, `layers` blocks (layer_fn(i) picks each block's FFN), final LN, tied LM loss."""
    bs, s, h, v = cfg["batch"], cfg["seq"], cfg["hidden"], cfg["vocab"]
    ids = b.input("input_ids", TensorProto.INT64, [bs, s])
    labels = b.input("labels", TensorProto.INT64, [bs, s])
    wte = b.param("wte.weight", [v, h])
    wpe = b.param("wpe.weight", [s, h], std=0.01)
    x = b.op("Gather", [wte, ids], "wte.gather", axis=0)
    x = b.add(x, wpe, "embed.add_positions")
    mask = b.causal_mask(s)
    for i in range(cfg["layers"]):
        mlp_fn, scope = layer_fn(i)
        x = block(b, x, i, cfg, mask, mlp_fn, scope)
    x = b.layer_norm(x, h, "ln_f")
    b.lm_loss(x, labels, batch=bs, seq=s, hidden=h, vocab=v, weight=wte, transposed=True)


def build(b: ModelBuilder, cfg: Config) -> None:
    """Build the GPT forward + loss graph into `b`."""
    build_decoder_lm(b, cfg, lambda i: (mlp, "mlp"))
