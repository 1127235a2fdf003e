#!/usr/bin/env python3
"""Export tiny random-init `transformers` models to ONNX, for cross-checking parc's importer.

Models: gpt2, bert, t5, llama, vit, resnet (the cross-checks of tests/with_torch), and bart,
neox, distilbert, convnext, swin, mistral (planned and verified end to end by
tests/with_torch/test_families_end_to_end.py, a slow test).

    python scripts/export_torch_models.py OUT_DIR [--exporter legacy|dynamo|both] [--models gpt2,bert]

Each model is wrapped so that its ONNX outputs are `loss` and `logits`, and is written as
`OUT_DIR/<model>-<exporter>.onnx` with, beside it, `<model>-<exporter>.json` (torch's parameter
count, the symbolic dims and their sample sizes, the ONNX file's opset) and `<model>.npz` (the
sample inputs) and `<model>.torch.npz` (torch's outputs on them). Needs torch, transformers and,
for the dynamo exporter, onnxscript; none of them is a dependency of parc.

For gradient cross-checks, `torch_gradients` gives torch's d loss / d parameter and
`match_parameters` says which torch parameter each ONNX initializer holds.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

LEGACY_OPSET = 17
VOCAB = 96
BATCH, SEQ, TGT = 2, 8, 6  # sample sizes; the batch and sequence dims are exported symbolic
IMAGE = 32


class LossLogits(nn.Module):
    """Calls a transformers model with keyword inputs; returns (loss, logits) as a tuple."""

    def __init__(self, model: nn.Module, input_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(**dict(zip(self.input_names, args)), return_dict=True)
        return out.loss, out.logits


@dataclass
class Spec:
    """A model to export: the module, its sample inputs, and which input axes are symbolic."""

    name: str
    module: nn.Module
    inputs: dict[str, torch.Tensor]
    axes: dict[str, dict[int, str]]  # input name -> {axis: dim name}
    logits_axes: dict[int, str]
    notes: list[str] = field(default_factory=list)

    @property
    def dims(self) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for name, axes in self.axes.items():
            for axis, dim in axes.items():
                sizes[dim] = int(self.inputs[name].shape[axis])
        return sizes


def _eager(cls, config) -> nn.Module:
    """A random-init model with the eager (plain matmul + softmax) attention."""
    config._attn_implementation = "eager"
    return cls(config).eval()


def _tokens(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=gen, dtype=torch.int64)


def _lm_labels(gen: torch.Generator, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, 0] = -100  # ignored positions exercise ignore_index
    return labels


def _padding_mask(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, -2:] = 0  # padding in the last sequence exercises the padding part of the mask
    return mask


def gpt2(gen: torch.Generator) -> Spec:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                     bos_token_id=0, eos_token_id=0)
    ids = _tokens(gen, BATCH, SEQ)
    return Spec("gpt2", _eager(GPT2LMHeadModel, cfg), {"input_ids": ids, "labels": _lm_labels(gen, ids)},
                {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}},
                {0: "batch", 1: "seq"})


def bert(gen: torch.Generator) -> Spec:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    ids = _tokens(gen, BATCH, SEQ)
    mask = _padding_mask(BATCH, SEQ)
    labels = torch.full_like(ids, -100)
    labels[:, 1::3] = ids[:, 1::3]
    axes = {0: "batch", 1: "seq"}
    return Spec("bert", _eager(BertForMaskedLM, cfg),
                {"input_ids": ids, "attention_mask": mask, "labels": labels},
                {"input_ids": axes, "attention_mask": axes, "labels": axes}, axes)


def t5(gen: torch.Generator) -> Spec:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    ids = _tokens(gen, BATCH, SEQ)
    labels = _tokens(gen, BATCH, TGT)
    labels[1, -1] = -100
    return Spec("t5", _eager(T5ForConditionalGeneration, cfg), {"input_ids": ids, "labels": labels},
                {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "tgt"}},
                {0: "batch", 1: "tgt"})


def llama(gen: torch.Generator) -> Spec:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    ids = _tokens(gen, BATCH, SEQ)
    axes = {0: "batch", 1: "seq"}
    return Spec("llama", _eager(LlamaForCausalLM, cfg),
                {"input_ids": ids, "attention_mask": _padding_mask(BATCH, SEQ), "labels": _lm_labels(gen, ids)},
                {"input_ids": axes, "attention_mask": axes, "labels": axes}, axes)


def vit(gen: torch.Generator) -> Spec:
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, num_labels=10)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    labels = torch.randint(0, 10, (BATCH,), generator=gen)
    return Spec("vit", _eager(ViTForImageClassification, cfg), {"pixel_values": pixels, "labels": labels},
                {"pixel_values": {0: "batch"}, "labels": {0: "batch"}}, {0: "batch"})


def resnet(gen: torch.Generator) -> Spec:
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=10)
    model = ResNetForImageClassification(cfg).eval()
    with torch.no_grad():  # non-trivial running statistics, so eval-mode BatchNorm is tested
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=gen)
                m.running_var.uniform_(0.5, 1.5, generator=gen)
    pixels = torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen)
    labels = torch.randint(0, 10, (BATCH,), generator=gen)
    return Spec("resnet", model, {"pixel_values": pixels, "labels": labels},
                {"pixel_values": {0: "batch"}, "labels": {0: "batch"}}, {0: "batch"})


def bart(gen: torch.Generator) -> Spec:
    """An encoder-decoder with learned positions and tied input and output embeddings."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                     max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                     decoder_start_token_id=2)
    ids = _tokens(gen, BATCH, SEQ)
    labels = _tokens(gen, BATCH, TGT)
    return Spec("bart", _eager(BartForConditionalGeneration, cfg), {"input_ids": ids, "labels": labels},
                {"input_ids": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "tgt"}},
                {0: "batch", 1: "tgt"})


def neox(gen: torch.Generator) -> Spec:
    """GPT-NeoX: rotary embeddings on half of each head, parallel attention and MLP."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, rotary_pct=0.5, bos_token_id=0,
                        eos_token_id=0)
    ids = _tokens(gen, BATCH, SEQ)
    axes = {0: "batch", 1: "seq"}
    return Spec("neox", _eager(GPTNeoXForCausalLM, cfg), {"input_ids": ids, "labels": _lm_labels(gen, ids)},
                {"input_ids": axes, "labels": axes}, axes)


def distilbert(gen: torch.Generator) -> Spec:
    """A sequence classifier: the loss over one label per sequence, padding masked."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    cfg = DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                           max_position_embeddings=64, num_labels=3)
    ids = _tokens(gen, BATCH, SEQ)
    axes = {0: "batch", 1: "seq"}
    labels = torch.randint(0, 3, (BATCH,), generator=gen)
    return Spec("distilbert", _eager(DistilBertForSequenceClassification, cfg),
                {"input_ids": ids, "attention_mask": _padding_mask(BATCH, SEQ), "labels": labels},
                {"input_ids": axes, "attention_mask": axes, "labels": {0: "batch"}}, {0: "batch"})


def _images(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 3, IMAGE, IMAGE, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


def convnext(gen: torch.Generator) -> Spec:
    """Depthwise 7x7 convolutions, channels-last LayerNorm, layer scale."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], patch_size=4,
                         num_labels=10)
    pixels, labels = _images(gen)
    return Spec("convnext", ConvNextForImageClassification(cfg).eval(), {"pixel_values": pixels, "labels": labels},
                {"pixel_values": {0: "batch"}, "labels": {0: "batch"}}, {0: "batch"})


def swin(gen: torch.Generator) -> Spec:
    """Window attention over shifted windows (a roll, a window partition, a relative bias)."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 1], num_heads=[2, 4],
                     window_size=4, num_labels=10)
    pixels, labels = _images(gen)
    return Spec("swin", _eager(SwinForImageClassification, cfg), {"pixel_values": pixels, "labels": labels},
                {"pixel_values": {0: "batch"}, "labels": {0: "batch"}}, {0: "batch"})


def mistral(gen: torch.Generator) -> Spec:
    """One key/value head for four queries, a sliding window, tied embeddings."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64, sliding_window=4,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True)
    ids = _tokens(gen, BATCH, SEQ)
    axes = {0: "batch", 1: "seq"}
    return Spec("mistral", _eager(MistralForCausalLM, cfg), {"input_ids": ids, "labels": _lm_labels(gen, ids)},
                {"input_ids": axes, "labels": axes}, axes)


MODELS: dict[str, Callable[[torch.Generator], Spec]] = {
    "gpt2": gpt2, "bert": bert, "t5": t5, "llama": llama, "vit": vit, "resnet": resnet,
    "bart": bart, "neox": neox, "distilbert": distilbert, "convnext": convnext, "swin": swin, "mistral": mistral}


def build(name: str, seed: int = 0) -> Spec:
    """The model `name` with seeded random weights and sample inputs."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = MODELS[name](gen)
    _perturb(spec.module, gen)
    return spec


def _perturb(module: nn.Module, gen: torch.Generator) -> None:
    """Add noise to every parameter: freshly initialised LayerNorm weights (all ones) and biases
    (all zeros) are equal, and both exporters merge equal initializers into one, which would
    hide parameters from a count and make the numerical checks blind to mixed-up weights."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def sample_inputs(spec: Spec, dims: dict[str, int], seed: int = 1) -> dict[str, torch.Tensor]:
    """Inputs like the spec's samples but with the symbolic dims resized to `dims`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in spec.inputs.items():
        shape = list(t.shape)
        for axis, dim in spec.axes.get(name, {}).items():
            shape[axis] = dims[dim]
        if name == "attention_mask":
            out[name] = _padding_mask(*shape)
        elif t.is_floating_point():
            out[name] = torch.randn(shape, generator=gen)
        else:
            out[name] = torch.randint(0, int(t.max()) + 1, shape, generator=gen, dtype=t.dtype)
            if name == "labels" and len(shape) == 2:
                out[name][:, 0] = -100
    return out


def run_torch(spec: Spec, inputs: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """Torch's (loss, logits) on `inputs`."""
    with torch.no_grad():
        loss, logits = LossLogits(spec.module, list(spec.inputs))(*inputs.values())
    return loss.numpy(), logits.numpy()


def torch_parameters(module: nn.Module) -> int:
    """Parameter count with tied weights counted once (`parameters()` deduplicates)."""
    return sum(p.numel() for p in module.parameters())


def parameter_differences(module: nn.Module) -> list[dict]:
    """How the exported file's parameter count differs from torch's, and why; each item has the
    difference (`delta`, file minus torch) and the `reason`. Both exporters, on these models:

    - a tied input/output embedding is one torch parameter, but the exporters constant-fold the
      LM head's Transpose of it into a second initializer (the transposed copy);
    - eval-mode BatchNorm is folded into the Conv before it: its weight and bias (2C) go and
      the Conv gains a bias (C), so the file has C fewer parameters per BatchNorm.
    """
    diffs = []
    get_in, get_out = getattr(module, "get_input_embeddings", None), getattr(module, "get_output_embeddings", None)
    if get_in is not None and get_out is not None and get_out() is not None:
        w = get_in().weight
        if get_out().weight is w:
            diffs.append({"delta": w.numel(), "reason": f"tied embedding {tuple(w.shape)}: the exporter "
                          "constant-folds the LM head's transposed copy into a second initializer"})
    for name, m in module.named_modules():
        if isinstance(m, nn.BatchNorm2d) and m.affine:
            diffs.append({"delta": -m.num_features, "reason": f"{name}: eval-mode BatchNorm folded into "
                          "the Conv before it (weight and bias replaced by a Conv bias)"})
    return diffs


def torch_gradients(spec: Spec, inputs: dict[str, torch.Tensor] | None = None) -> dict[str, np.ndarray]:
    """d loss / d p for every parameter, by the `LossLogits` names (`model.` + the module's own),
    on the sample inputs or `inputs`. The models are in eval mode, so dropout is off, as in the
    exported graph; a parameter the loss does not use gets zeros."""
    wrapper = LossLogits(spec.module, list(spec.inputs))
    assert not spec.module.training, "dropout must be off: the exported graph has none"
    params = dict(wrapper.named_parameters())  # tied weights once, under their first name
    loss, _ = wrapper(*(inputs or spec.inputs).values())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)).detach().numpy()
            for (n, p), g in zip(params.items(), grads)}


def padding_rows(spec: Spec) -> dict[str, int]:
    """Embedding weights with a `padding_idx`, by `LossLogits` name: torch gives their padding
    row no gradient, but the exported graph reads it with a plain Gather, which knows nothing
    of that (so the row's gradient differs by design where the inputs hold the padding id)."""
    wrapper = LossLogits(spec.module, list(spec.inputs))
    names = {id(p): n for n, p in wrapper.named_parameters()}
    return {names[id(m.weight)]: int(m.padding_idx) for m in wrapper.modules()
            if isinstance(m, nn.Embedding) and m.padding_idx is not None}


def match_parameters(spec: Spec, arrays: dict[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
    """Which torch parameter each ONNX initializer in `arrays` holds: name -> (torch name,
    transposed). Matched by value, since the exporters rename what they constant-fold:

    - a Linear weight folded into its MatMul's transposed operand becomes `onnx::MatMul_N`
      (legacy) or `val_N` (dynamo), holding the weight transposed;
    - a tied input/output embedding is one torch parameter but two initializers: the embedding
      as is (legacy: under torch's name; dynamo: maybe under the LM head's alias) and the LM
      head's transposed copy. Both map to the one torch parameter.

    `_perturb` made every parameter distinct, so a value match is unambiguous. Initializers that
    hold no torch parameter (buffers, folded constants) are left out.
    """
    params = {n: p.detach().numpy() for n, p in LossLogits(spec.module, list(spec.inputs)).named_parameters()}
    by_shape: dict[tuple[int, ...], list[tuple[str, np.ndarray, bool]]] = {}
    for n, p in params.items():
        by_shape.setdefault(p.shape, []).append((n, p, False))
        if p.ndim == 2 and not np.array_equal(p, p.T):  # a symmetric one matches once
            by_shape.setdefault(p.T.shape, []).append((n, p.T, True))
    found = {}
    for name, a in arrays.items():
        hits = [(n, t) for n, p, t in by_shape.get(a.shape, []) if a.dtype == p.dtype and np.array_equal(a, p)]
        if len(hits) > 1:
            raise ValueError(f"initializer {name} equals several torch parameters: {hits}")
        if hits:
            found[name] = hits[0]
    return found


def float_buffers(module: nn.Module) -> dict[str, int]:
    """Float buffers (BatchNorm statistics, rotary frequencies): not parameters, though they may
    be ONNX initializers read like weights (the dynamo exporter marks them BUFFER)."""
    return {n: b.numel() for n, b in module.named_buffers() if b.is_floating_point() and b.dim() >= 1}


def export(spec: Spec, exporter: str, out_dir: Path) -> dict:
    """Write `<name>-<exporter>.onnx` and its JSON; return the JSON's content."""
    wrapper = LossLogits(spec.module, list(spec.inputs)).eval()
    args = tuple(spec.inputs.values())
    path = out_dir / f"{spec.name}-{exporter}.onnx"
    start = time.perf_counter()
    dynamic = True
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            dynamic_axes = {**spec.axes, "logits": spec.logits_axes}
            torch.onnx.export(wrapper, args, str(path), dynamo=False, opset_version=LEGACY_OPSET,
                              input_names=list(spec.inputs), output_names=["loss", "logits"],
                              dynamic_axes=dynamic_axes)
        else:
            dynamic = _export_dynamo(spec, wrapper, args, path)
    seconds = time.perf_counter() - start
    model = onnx.load(str(path), load_external_data=False)
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    info = {
        "model": spec.name,
        "exporter": exporter,
        "onnx": path.name,
        "opset": opset,
        "onnx_nodes": len(model.graph.node),
        "export_seconds": round(seconds, 2),
        "torch_parameters": torch_parameters(spec.module),
        "torch_float_buffers": float_buffers(spec.module),
        "parameter_differences": parameter_differences(spec.module),
        "dims": spec.dims if dynamic else {},
        "sample_dims": spec.dims,
        "dynamic": dynamic,
        "inputs": f"{spec.name}.npz",
        "torch_outputs": f"{spec.name}.torch.npz",
        "torch_loss": float(np.load(out_dir / f"{spec.name}.torch.npz")["loss"]),
        "notes": spec.notes,
    }
    (out_dir / f"{spec.name}-{exporter}.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _export_dynamo(spec: Spec, wrapper: nn.Module, args: tuple, path: Path) -> bool:
    """Export with dynamic batch/sequence dims; fall back to static shapes if that fails.
    Returns whether the export is dynamic."""
    dims = {name: torch.export.Dim(name, min=1, max=1024) for name in spec.dims}
    shapes = tuple({axis: dims[d] for axis, d in spec.axes[n].items()} for n in spec.inputs)
    try:
        torch.onnx.export(wrapper, args, str(path), dynamo=True, dynamic_shapes=(shapes,),
                          input_names=list(spec.inputs), output_names=["loss", "logits"],
                          external_data=False, verbose=False)
        return True
    except Exception as e:  # torch.export raises many types for unsupported dynamism
        spec.notes.append(f"dynamic dynamo export failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); exported with static shapes")
    torch.onnx.export(wrapper, args, str(path), dynamo=True, input_names=list(spec.inputs),
                      output_names=["loss", "logits"], external_data=False, verbose=False)
    return False


def save_samples(spec: Spec, out_dir: Path) -> None:
    """`<name>.npz` (inputs) and `<name>.torch.npz` (torch's loss and logits on them)."""
    np.savez(out_dir / f"{spec.name}.npz", **{k: v.numpy() for k, v in spec.inputs.items()})
    loss, logits = run_torch(spec, spec.inputs)
    np.savez(out_dir / f"{spec.name}.torch.npz", loss=loss, logits=logits)


def export_all(out_dir: Path, models: list[str], exporters: list[str]) -> dict[str, dict | str]:
    """Export every (model, exporter); a failure is recorded as its message, not raised."""
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict | str] = {}
    for name in models:
        spec = build(name)
        save_samples(spec, out_dir)
        for exporter in exporters:
            key = f"{name}-{exporter}"
            try:
                results[key] = export(spec, exporter, out_dir)
            except Exception as e:  # report and go on with the other models
                results[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                (out_dir / f"{key}.error.txt").write_text(traceback.format_exc())
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--exporter", choices=["legacy", "dynamo", "both"], default="both")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        p.error(f"unknown model {bad[0]!r} (known: {', '.join(MODELS)})")
    exporters = ["legacy", "dynamo"] if a.exporter == "both" else [a.exporter]
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # "torchvision is not installed"
    results = export_all(a.out_dir, models, exporters)
    failed = 0
    for key, r in results.items():
        if isinstance(r, str):
            failed += 1
            print(f"{key:16s} FAILED {r}")
        else:
            print(f"{key:16s} opset {r['opset']:2d}  {r['onnx_nodes']:5d} nodes  dims {r['dims']}  "
                  f"{r['torch_parameters']} params  {r['export_seconds']:.1f}s"
                  + (f"  ({'; '.join(r['notes'])})" if r["notes"] else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
