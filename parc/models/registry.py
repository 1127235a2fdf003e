"""The model zoo's catalogue: what `parc models list` shows and `parc models build` builds."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType

from parc.errors import UsageError
from parc.models import bert, gpt, moe, resnet, t5, unet, vgg
from parc.models.builder import data_path_for
from parc.models.config import Config, ConfigProblem, check_common, parse_value
from parc.models.layers import ModelBuilder

# Family modules in listing order. Each has MODELS [(name, description, params, defaults)],
# build(builder, cfg), validate(cfg), and FAMILY (or a per-model family via FAMILIES).
_MODULES: tuple[ModuleType, ...] = (gpt, moe, bert, t5, vgg, resnet, unet)


@dataclass(frozen=True)
class ModelInfo:
    """One buildable model: its name, family, a one-line description, the paper's parameter
    count (None for the tiny test variants) and its default configuration (read-only)."""

    name: str
    family: str
    description: str
    params_paper: int | None
    defaults: Mapping[str, object] = field(hash=False)


@dataclass(frozen=True)
class _Entry:
    info: ModelInfo
    build: Callable[[ModelBuilder, Config], None]
    validate: Callable[[Config], None]


def _entries() -> dict[str, _Entry]:
    entries: dict[str, _Entry] = {}
    for module in _MODULES:
        families = getattr(module, "FAMILIES", {})
        for name, description, params, defaults in module.MODELS:
            family = families.get(name, getattr(module, "FAMILY", ""))
            info = ModelInfo(name, family, description, params, MappingProxyType(dict(defaults)))
            entries[name] = _Entry(info, module.build, module.validate)
    return entries


_ENTRIES = _entries()


def list_models() -> list[ModelInfo]:
    """Every model in a stable order (family by family, named configs before the tiny one)."""
    return [e.info for e in _ENTRIES.values()]


def _lookup(name: str) -> _Entry:
    entry = _ENTRIES.get(name.strip().lower())
    if entry is None:
        raise UsageError(f"unknown model {name!r}; valid models: {', '.join(_ENTRIES)}")
    return entry


def resolve_config(name: str, overrides: Mapping[str, object] | None = None) -> Config:
    """The model's defaults with `overrides` (strings from --set) converted and validated."""
    entry = _lookup(name)
    defaults = entry.info.defaults
    cfg: Config = dict(defaults)
    try:
        for key, text in (overrides or {}).items():
            if key not in defaults:
                raise UsageError(
                    f"model {entry.info.name!r} has no config key {key!r}; valid keys: {', '.join(defaults)}"
                )
            cfg[key] = parse_value(key, text, defaults[key])
        check_common(cfg)
        entry.validate(cfg)
    except ConfigProblem as e:
        raise UsageError(f"model {entry.info.name!r}: {e}") from None
    return cfg


def build_model(name: str, out: str | Path, overrides: Mapping[str, object] | None = None) -> Path:
    """Write model `name` (with `overrides` from --set) to `out`; returns the path written.

    Sparse builds also write `out` + ".data" (recreated as one sparse hole). Nothing else on
    disk is touched, apart from creating missing parent directories of `out`.
    """
    entry = _lookup(name)
    cfg = resolve_config(entry.info.name, overrides)
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"output {str(out)!r} is a directory; give a file name such as model.onnx")
    out.parent.mkdir(parents=True, exist_ok=True)
    b = ModelBuilder(entry.info.name, weights=cfg["weights"], seed=cfg["seed"],
                     data_location=data_path_for(out).name)
    entry.build(b, cfg)
    metadata = {"parc.model": entry.info.name, "parc.config": json.dumps(cfg, sort_keys=True)}
    model = b.model(metadata, doc=f"{entry.info.name}: {entry.info.description}")
    b.save(model, out)
    return out
