"""How the report spells numbers: bytes, seconds, ratios, percentages and a text bar."""

from __future__ import annotations

_BYTES = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def fmt_bytes(n: float | None) -> str:
    """Binary units with two decimals (`1.50 GiB`); `-` when unknown."""
    if n is None:
        return "-"
    for unit, scale in _BYTES:
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: float | None) -> str:
    """Seconds in the unit that keeps three to four significant digits (`4.358 ms`)."""
    if s is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(s) >= scale:
            return f"{s / scale:.3f} {unit}"
    return f"{s * 1e9:.1f} ns" if s else "0 s"


def fmt_pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal."""
    return "-" if x is None else f"{100 * x:.1f}%"


def fmt_gap(x: float | None) -> str:
    """A solver's relative gap: two significant digits, so 0.00022 reads 0.022%, not 0.0%."""
    if x is None:
        return "-"
    return "0%" if x == 0 else f"{100 * x:.2g}%"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}x"


def fmt_shape(shape: tuple[int, ...] | list[int]) -> str:
    """A mesh shape as `(2,)` / `(2, 2)`, like the planner prints it."""
    return str(tuple(shape))


def fmt_groups(groups: list[list[int]] | None, limit: int = 4) -> str:
    """Device groups as `{0-3} {4-7}` or `{0,4} {1,5}`, the first `limit` of them; `-` unknown."""
    if not groups:
        return "-"

    def one(g: list[int]) -> str:
        run = len(g) > 2 and g == list(range(g[0], g[0] + len(g)))
        return "{" + (f"{g[0]}-{g[-1]}" if run else ",".join(map(str, g))) + "}"

    more = f" ... ({len(groups)} groups)" if len(groups) > limit else ""
    return " ".join(one(g) for g in groups[:limit]) + more


def bar(fraction: float, width: int = 30) -> str:
    """`[#######.......]`: a plain-text bar that renders the same in every format."""
    filled = max(0, min(width, round(fraction * width)))
    return "[" + "#" * filled + "." * (width - filled) + "]"
