"""Reading node and value names: scopes, phases, parameters, and strategies in words.

plan.json carries names, not the graph, so everything here is a rule on names and spec
strings; each rule is written where it is used and in docs/explain.md:

- scope: a node belongs to the layer its name starts with. Backward nodes
  (`<forward>.grad.<op>_N`) and optimizer nodes (`<param>.update.<op>_N`) take the scope of
  the forward node or parameter they come from. The scope is the name up to the first numeric
  component and one more (`h.0.attn.qkv.matmul` -> `h.0.attn`), else its first component
  (`lm_head.gemm` -> `lm_head`). `.` and `/` both separate components (PyTorch exports).
- phase: `.grad.` or a `grad.` prefix is backward, `.update.` is optimizer, the rest forward.
- parameter: a spec name X is a parameter when `X.new` is also a spec name (a training step
  outputs each parameter's next value under that name) and no shorter such name is a prefix
  of X; the longer ones (`X.exp_avg`, `X.exp_avg_sq`) are X's optimizer state.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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


def phase_of(name: str) -> str:
    """forward, backward or optimizer, from the name alone."""
    if ".update." in name:
        return "optimizer"
    if ".grad." in name or name.startswith("grad."):
        return "backward"
    return "forward"


def split_axes(spec: str) -> list[str]:
    """`S(0)R` -> ['S(0)', 'R']: the per-mesh-axis parts of a ShardSpec string."""
    return _AXIS.findall(spec)


def is_sharded(spec: str) -> bool:
    """Whether a spec splits the tensor on some mesh axis (partial values count as sharded)."""
    return any(a != "R" for a in split_axes(spec))


def parameters(spec_names: Iterable[str]) -> dict[str, list[str]]:
    """{parameter: [its optimizer state names]} by the `X.new` rule (module docstring)."""
    names = set(spec_names)
    candidates = sorted(n for n in names if n + ".new" in names)
    params: dict[str, list[str]] = {}
    for name in candidates:  # sorted, so a parameter comes before its `name.suffix` state
        owner = next((p for p in _prefixes(name) if p in params), None)
        if owner is None:
            params[name] = []
        else:
            params[owner].append(name)
    return params


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def axis_words(label: str, out_axis: str | None, name: str) -> str:
    """One mesh axis of a node's strategy in words.

    `label` is the rule label the axis splits (`-`: none); `out_axis` the node's output layout
    on that axis when plan.json has it. Dim 0 of forward and backward activations is taken to
    be the batch (as in the zoo and most exported models)."""
    if label == "-":
        return "replicated"
    phase = phase_of(name)
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


def strategy_words(strategy: str, name: str, specs: Mapping[str, str]) -> str:
    """A node's strategy string (`b0`, `-`, `b0xk`) in words, axis by axis."""
    labels = strategy.split("x") if strategy else ["-"]
    out = specs.get(name, specs.get(name.lower()))
    out_axes = split_axes(out) if out is not None else []
    if len(out_axes) != len(labels):
        out_axes = [None] * len(labels)  # type: ignore[list-item]
    words = [axis_words(lbl, ax, name) for lbl, ax in zip(labels, out_axes)]
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
