"""Reading node and value names: scopes, and strategies in words.

plan.json records each node's phase and each value's role; a node's layer is not recorded, so
the scope is a rule on names (written here and in docs/explain.md):

- scope: a node belongs to the layer its name starts with. Backward nodes
  (`<forward>.grad.<op>_N`) and optimizer nodes (`<param>.update.<op>_N`) take the scope of
  the forward node or parameter they come from. The scope is the name up to the first numeric
  component and one more (`h.0.attn.qkv.matmul` -> `h.0.attn`), else its first component
  (`lm_head.gemm` -> `lm_head`). `.` and `/` both separate components (PyTorch exports).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_SEP = re.compile(r"[./]")
_AXIS = re.compile(r"R|[SP]\([^()]*\)")
_DIGITS = re.compile(r"(\d+)$")
_CONTRACTIONS = ("matmul", "gemm", "einsum", "conv")


def origin(name: str) -> str:
    """The forward node or parameter a backward or optimizer node was made for."""
    for marker in (".grad.", ".update."):
        if marker in name:
            return name.split(marker, 1)[0]
    return name


def scope_of(name: str) -> str:
    """The layer a node belongs to (module docstring)."""
    parts = [p for p in _SEP.split(origin(name)) if p]
    if not parts:
        return "(unnamed)"
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 2] if i + 2 < len(parts) else parts[: i + 1])
    return parts[0] if len(parts) > 1 else "(top level)"


def split_axes(spec: str) -> list[str]:
    """`S(0)R` -> ['S(0)', 'R']: the per-mesh-axis parts of a ShardSpec string."""
    return _AXIS.findall(spec)


def is_sharded(spec: str) -> bool:
    """Whether a spec splits the tensor on some mesh axis (partial values count as sharded)."""
    return any(a != "R" for a in split_axes(spec))


def axis_words(label: str, out_axis: str | None, name: str, phase: str = "forward") -> str:
    """One mesh axis of a node's strategy in words.

    `label` is the rule label the axis splits (`-`: none); `out_axis` the node's output layout
    on that axis when plan.json has it. Dim 0 of forward and backward activations is taken to
    be the batch (as in the zoo and most exported models). `phase`: the node's (plan.json's
    `phases`)."""
    if label == "-":
        return "replicated"
    if out_axis is not None and out_axis.startswith("P("):
        return f"partial {out_axis[2:-1]} ({label})"
    dim = _split_dim(out_axis, label)
    if phase == "optimizer":
        return f"sharded update (dim {dim})" if dim is not None else f"sharded update ({label})"
    if label == "k" and _op_hint(name) in _CONTRACTIONS:
        return "partial sum (k)"
    if dim == 0 or label == "b0":
        return "data parallel (batch split)"
    if label == "n" and _op_hint(name) in _CONTRACTIONS:
        return "column-split (n)"
    if label == "m" and _op_hint(name) in _CONTRACTIONS:
        return "row-split (m)"
    return f"dim {dim} split" if dim is not None else f"split ({label})"


def strategy_words(strategy: str, name: str, specs: Mapping[str, str], phase: str = "forward") -> str:
    """A node's strategy string (`b0`, `-`, `b0xk`) in words, axis by axis."""
    labels = strategy.split("x") if strategy else ["-"]
    out = specs.get(name, specs.get(name.lower()))
    out_axes = split_axes(out) if out is not None else []
    if len(out_axes) != len(labels):
        out_axes = [None] * len(labels)  # type: ignore[list-item]
    words = [axis_words(lbl, ax, name, phase) for lbl, ax in zip(labels, out_axes)]
    if all(w == "replicated" for w in words):
        return "replicated"
    if len(words) == 1:
        return f"{words[0]} on axis 0"
    return ", ".join(f"{w} on axis {k}" for k, w in enumerate(words) if w != "replicated")


def spec_words(spec: str) -> str:
    """A source tensor's layout in words: `S(0)R` -> `dim 0 split on axis 0`."""
    parts = []
    for k, a in enumerate(split_axes(spec)):
        if a.startswith("S("):
            dim = a[2:-1].split(",")[0]
            parts.append(f"dim {dim} split on axis {k}")
        elif a.startswith("P("):
            parts.append(f"partial {a[2:-1]} on axis {k}")
    return ", ".join(parts) or "replicated"


def _split_dim(out_axis: str | None, label: str) -> int | None:
    if out_axis is not None and out_axis.startswith("S("):
        return int(out_axis[2:-1].split(",")[0])
    m = _DIGITS.search(label)
    return int(m.group(1)) if m and label[0] in "dr" else None


def _op_hint(name: str) -> str:
    """The op a node name ends in (`h.0.attn.qkv.matmul`, `x.grad.MatMul_1` -> `matmul`)."""
    last = _SEP.split(name)[-1].lower()
    return re.sub(r"_\d+$", "", last)
