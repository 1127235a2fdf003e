"""Model configurations: defaults shared by every family and `--set KEY=VALUE` parsing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from parc.models.builder import WEIGHT_MODES

Config = dict[str, Any]


class ConfigProblem(Exception):
    """A configuration value a family cannot build; the registry turns it into a UsageError."""


def common_defaults(batch: int, weights: str, seed: int = 0) -> Config:
    """Fields every model has: batch size, weight storage (random|sparse) and the random seed."""
    return {"batch": batch, "weights": weights, "seed": seed}


def check(cond: bool, message: str) -> None:
    """Raise ConfigProblem(message) unless `cond` holds."""
    if not cond:
        raise ConfigProblem(message)


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(key: str, text: object, default: object) -> object:
    """Convert `text` (a --set value) to the type of `default`; raise ConfigProblem if it cannot."""
    if not isinstance(text, str):
        if isinstance(text, type(default)) and not (isinstance(text, bool) and not isinstance(default, bool)):
            return tuple(text) if isinstance(default, tuple) else text
        text = str(text)
    raw = text.strip()
    try:
        if isinstance(default, bool):
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError
        if isinstance(default, int):
            try:
                return int(raw, 10)
            except ValueError:
                as_float = float(raw)  # allow 1e6
                if not as_float.is_integer():
                    raise
                return int(as_float)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, tuple):
            return tuple(int(part) for part in raw.split(",") if part.strip())
        return raw
    except ValueError:
        kind = "comma-separated list of ints" if isinstance(default, tuple) else type(default).__name__
        raise ConfigProblem(f"{key}={text!r} is not a valid {kind} (default {default!r})") from None


def check_common(cfg: Mapping[str, Any]) -> None:
    """Checks that apply to every family: positive integer sizes and a known weights mode."""
    check(cfg["weights"] in WEIGHT_MODES, f"weights={cfg['weights']!r} must be one of {', '.join(WEIGHT_MODES)}")
    for key, value in cfg.items():
        if key == "seed":
            check(value >= 0, "seed must be >= 0")
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            check(value > 0, f"{key}={value} must be a positive integer")
        elif isinstance(value, tuple):
            check(len(value) > 0 and all(v > 0 for v in value), f"{key}={value} must be positive integers")
