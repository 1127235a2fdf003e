"""Layer helpers on top of GraphBuilder: linear, norms, GELU, attention, conv-bn-relu, losses.

Every helper takes a scope name (``h.0.attn``) and creates parameters ``<scope>.weight`` /
``<scope>.bias`` and nodes ``<scope>.<op>``, so names in the ONNX file read like a state dict.
Shapes are static: helpers that reshape are told the batch and sequence sizes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from parc.models.builder import GraphBuilder

NEG_INF = -1e9  # additive mask value; finite so a fully masked row cannot make NaN


class ModelBuilder(GraphBuilder):
    """GraphBuilder plus the layers the model families are made of."""

    # ---- elementwise and shape ----------------------------------------------------------------
    def add(self, a: str, b: str, name: str) -> str:
        return self.op("Add", [a, b], name)

    def mul(self, a: str, b: str, name: str) -> str:
        return self.op("Mul", [a, b], name)

    def relu(self, x: str, name: str) -> str:
        return self.op("Relu", [x], name)

    def reshape(self, x: str, shape: Sequence[int], name: str) -> str:
        return self.op("Reshape", [x, self.ints(shape)], name)

    def transpose(self, x: str, perm: Sequence[int], name: str) -> str:
        return self.op("Transpose", [x], name, perm=list(perm))

    def unsqueeze(self, x: str, axes: Sequence[int], name: str) -> str:
        return self.op("Unsqueeze", [x, self.ints(axes)], name)

    def gelu(self, x: str, name: str) -> str:
        """Exact GELU, 0.5 * x * (1 + erf(x / sqrt 2)); opset 18 has no Gelu op."""
        t = self.op("Div", [x, self.scalar(math.sqrt(2.0))], f"{name}.div")
        t = self.op("Erf", [t], f"{name}.erf")
        t = self.op("Add", [t, self.scalar(1.0)], f"{name}.add")
        t = self.op("Mul", [x, t], f"{name}.mul")
        return self.op("Mul", [t, self.scalar(0.5)], f"{name}.half")

    # ---- dense layers -------------------------------------------------------------------------
    def linear(self, x: str, in_f: int, out_f: int, name: str, *, bias: bool = True, std: float = 0.02) -> str:
        """y = x @ W + b with W stored [in, out] (MatMul, then Add)."""
        w = self.param(f"{name}.weight", [in_f, out_f], std=std)
        y = self.op("MatMul", [x, w], f"{name}.matmul")
        if bias:
            y = self.op("Add", [y, self.param(f"{name}.bias", [out_f], "zeros")], f"{name}.add")
        return y

    def gemm(self, x2d: str, in_f: int, out_f: int, name: str, *, bias: bool = True, std: float = 0.02) -> str:
        """2-D fully connected layer as one Gemm, W stored [in, out]."""
        w = self.param(f"{name}.weight", [in_f, out_f], std=std)
        ins = [x2d, w] + ([self.param(f"{name}.bias", [out_f], "zeros")] if bias else [])
        return self.op("Gemm", ins, f"{name}.gemm")

    def layer_norm(self, x: str, dim: int, name: str, eps: float = 1e-5) -> str:
        """LayerNormalization over the last axis with scale and bias."""
        w = self.param(f"{name}.weight", [dim], "ones")
        b = self.param(f"{name}.bias", [dim], "zeros")
        return self.op("LayerNormalization", [x, w, b], f"{name}.layernorm", axis=-1, epsilon=eps)

    def rms_norm(self, x: str, dim: int, name: str, eps: float = 1e-6) -> str:
        """T5's scale-only RMS norm: x / sqrt(mean(x^2) + eps) * w, from primitive ops."""
        w = self.param(f"{name}.weight", [dim], "ones")
        sq = self.op("Mul", [x, x], f"{name}.square")
        ms = self.op("ReduceMean", [sq, self.ints([-1])], f"{name}.mean", keepdims=1)
        ms = self.op("Add", [ms, self.scalar(eps)], f"{name}.add_eps")
        rms = self.op("Sqrt", [ms], f"{name}.sqrt")
        y = self.op("Div", [x, rms], f"{name}.div")
        return self.op("Mul", [y, w], f"{name}.scale")

    # ---- attention ----------------------------------------------------------------------------
    def attention(self, x: str, name: str, *, hidden: int, heads: int, batch: int, seq: int,
                  kv: str | None = None, kv_seq: int | None = None, head_dim: int | None = None,
                  fused_qkv: bool = True, bias: bool = True, scale: bool = True,
                  mask: str | None = None, pos_bias: str | None = None,
                  out_name: str = "proj") -> str:
        """Multi-head attention; self-attention unless `kv` (cross-attention source) is given.

        fused_qkv: one [hidden, 3*inner] projection split in three (GPT/BERT) or separate
        q/k/v projections (T5, cross-attention). mask: bool [seq, kv_seq], True = attend.
        pos_bias: a tensor broadcastable to [batch, heads, seq, kv_seq] added to the scores.
        """
        d = head_dim or hidden // heads
        inner = heads * d
        kv_seq = kv_seq or seq
        if fused_qkv and kv is None:
            qkv = self.linear(x, hidden, 3 * inner, f"{name}.qkv", bias=bias)
            q, k, v = self.op("Split", [qkv, self.ints([inner] * 3)], f"{name}.split", n_out=3, axis=-1)
        else:
            src = x if kv is None else kv
            q = self.linear(x, hidden, inner, f"{name}.q", bias=bias)
            k = self.linear(src, hidden, inner, f"{name}.k", bias=bias)
            v = self.linear(src, hidden, inner, f"{name}.v", bias=bias)
        q = self.reshape(q, [batch, seq, heads, d], f"{name}.q_heads")
        q = self.transpose(q, [0, 2, 1, 3], f"{name}.q_t")
        k = self.reshape(k, [batch, kv_seq, heads, d], f"{name}.k_heads")
        k = self.transpose(k, [0, 2, 3, 1], f"{name}.k_t")
        v = self.reshape(v, [batch, kv_seq, heads, d], f"{name}.v_heads")
        v = self.transpose(v, [0, 2, 1, 3], f"{name}.v_t")
        s = self.op("MatMul", [q, k], f"{name}.scores")
        if scale:
            s = self.op("Mul", [s, self.scalar(1.0 / math.sqrt(d))], f"{name}.scale")
        if pos_bias is not None:
            s = self.op("Add", [s, pos_bias], f"{name}.pos_bias")
        if mask is not None:
            s = self.op("Where", [mask, s, self.scalar(NEG_INF)], f"{name}.mask")
        p = self.op("Softmax", [s], f"{name}.softmax", axis=-1)
        c = self.op("MatMul", [p, v], f"{name}.context")
        c = self.transpose(c, [0, 2, 1, 3], f"{name}.context_t")
        c = self.reshape(c, [batch, seq, inner], f"{name}.merge_heads")
        return self.linear(c, inner, hidden, f"{name}.{out_name}", bias=bias)

    def causal_mask(self, seq: int) -> str:
        """bool [seq, seq] lower-triangular mask (True = may attend), one shared constant."""
        return self.const(np.tril(np.ones((seq, seq), dtype=bool)), name=f"causal_mask.{seq}")

    # ---- convolution --------------------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int, name: str, *, stride: int = 1,
             pad: int | None = None, bias: bool = False) -> str:
        """2-D convolution, weight [cout, cin, k, k] with He init; 'same'-style padding k//2."""
        p = k // 2 if pad is None else pad
        w = self.param(f"{name}.weight", [cout, cin, k, k], "he")
        ins = [x, w] + ([self.param(f"{name}.bias", [cout], "zeros")] if bias else [])
        return self.op("Conv", ins, f"{name}.conv", kernel_shape=[k, k], strides=[stride, stride],
                       pads=[p, p, p, p])

    def conv_transpose(self, x: str, cin: int, cout: int, k: int, stride: int, name: str) -> str:
        """Transposed convolution for upsampling, weight [cin, cout, k, k], with bias."""
        w = self.param(f"{name}.weight", [cin, cout, k, k], "he", fan_in=cin * k * k)
        b = self.param(f"{name}.bias", [cout], "zeros")
        return self.op("ConvTranspose", [x, w, b], f"{name}.convtranspose", kernel_shape=[k, k],
                       strides=[stride, stride])

    def batch_norm(self, x: str, c: int, name: str, eps: float = 1e-5, scale_init: str = "ones") -> str:
        """Inference-mode BatchNormalization: scale, bias and running statistics per channel.

        scale_init="zeros" starts a residual branch at zero (Alpa / Goyal et al.), so deep
        random-weight nets begin near the identity and their initial loss is near ln(classes).
        """
        ins = [
            x,
            self.param(f"{name}.weight", [c], scale_init),
            self.param(f"{name}.bias", [c], "zeros"),
            self.param(f"{name}.running_mean", [c], "zeros"),
            self.param(f"{name}.running_var", [c], "ones"),
        ]
        return self.op("BatchNormalization", ins, f"{name}.batchnorm", epsilon=eps)

    def conv_bn(self, x: str, cin: int, cout: int, k: int, name: str, *, stride: int = 1,
                relu: bool = True, zero_init: bool = False) -> str:
        """Conv (no bias) -> BatchNorm (scale 0 if zero_init) -> optional ReLU."""
        y = self.conv(x, cin, cout, k, name, stride=stride)
        y = self.batch_norm(y, cout, f"{name}.bn", scale_init="zeros" if zero_init else "ones")
        return self.relu(y, f"{name}.relu") if relu else y

    def max_pool(self, x: str, k: int, stride: int, name: str, pad: int = 0) -> str:
        return self.op("MaxPool", [x], name, kernel_shape=[k, k], strides=[stride, stride],
                       pads=[pad, pad, pad, pad])

    # ---- heads and losses ---------------------------------------------------------------------
    def lm_loss(self, x: str, labels: str, *, batch: int, seq: int, hidden: int, vocab: int,
                weight: str, transposed: bool, bias: str | None = None, prefix: str = "lm_head",
                ignore_index: int | None = None) -> None:
        """Project hidden states to the vocabulary and finish the graph with `loss` and `logits`.

        weight: [vocab, hidden] when `transposed` (a tied embedding), else [hidden, vocab].
        Outputs: loss (scalar, mean SoftmaxCrossEntropyLoss over batch*seq), logits [B, S, V].
        """
        tokens = batch * seq
        x2d = self.reshape(x, [tokens, hidden], f"{prefix}.flatten")
        ins = [x2d, weight] + ([bias] if bias else [])
        logits2d = self.op("Gemm", ins, f"{prefix}.gemm", transB=1 if transposed else 0)
        self.classify_loss(logits2d, labels, [tokens], "labels.flatten", ignore_index)
        self.op("Reshape", [logits2d, self.ints([batch, seq, vocab])], "logits.reshape", outputs=["logits"])
        self.output("loss", TensorProto.FLOAT, [])
        self.output("logits", TensorProto.FLOAT, [batch, seq, vocab])

    def classify_loss(self, logits: str, labels: str, label_shape: Sequence[int] | None = None,
                      reshape_name: str = "labels.flatten", ignore_index: int | None = None) -> str:
        """SoftmaxCrossEntropyLoss (mean) producing the tensor `loss`; class axis is 1."""
        if label_shape is not None:
            labels = self.reshape(labels, label_shape, reshape_name)
        attrs: dict[str, object] = {"reduction": "mean"}
        if ignore_index is not None:
            attrs["ignore_index"] = ignore_index
        return self.op("SoftmaxCrossEntropyLoss", [logits, labels], "loss.softmax_cross_entropy",
                       outputs=["loss"], **attrs)
