"""Sharding specs: how a tensor is laid out over a device mesh (Rhino 4.1, Whale 3.3.1).

A `ShardSpec` holds one `AxisSpec` per mesh axis:

=================  ==========================================================================
``R``              replicated: every device of the axis holds the whole tensor
``S(d)``           split on tensor dim ``d`` into ``n`` contiguous equal pieces
``S(d,s)``         strided split (Rhino's ``(dim, stride)``): the dim, of extent ``E``, is viewed
                   as ``(E/(s*n), n, s)`` and device ``c`` holds ``[:, c, :]``: ``E/(s*n)``
                   chunks of ``s`` consecutive elements. ``s = E/n`` is ``S(d)``.
``S(d,[e0,...])``  uneven contiguous split: device ``c`` holds ``e_c`` consecutive elements
                   (Whale's hardware-aware balancing); the ``e_c`` sum to ``E``
``P(op)``          partial: the tensor is the ``op`` (sum, max, min) of the devices' values
=================  ==========================================================================

Mesh axes nest in order, axis 0 outermost: axis ``k`` acts on what axes ``0..k-1`` left each
device, so ``E`` above is the dim's *level extent* (its extent after the earlier axes) and two
axes splitting one dim are a nested split (``S(0)S(0)`` on a 2x4 mesh cuts dim 0 in 2, then
each half in 4). A spec alone does not know the tensor: `ShardSpec.check` validates it against
a shape and mesh, and `ShardSpec.canonical` also rewrites what the shape makes redundant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from parc.errors import ParcError

PARTIAL_OPS = ("sum", "max", "min")


class ShardSpecError(ParcError, ValueError):
    """A sharding spec is malformed, or does not fit a tensor shape and device mesh."""


def _int(value: Any, what: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ShardSpecError(f"{what} must be an int >= {low}, got {value!r}")
    return int(value)


@dataclass(frozen=True, repr=False)
class Replicated:
    """Every device of the mesh axis holds the whole (level) tensor."""

    def __str__(self) -> str:
        return "R"

    __repr__ = __str__

    def to_json(self) -> dict[str, Any]:
        return {"kind": "R"}


@dataclass(frozen=True, repr=False)
class Split:
    """Split on tensor dim `dim`: contiguous, strided (`stride`) or uneven (`sizes`)."""

    dim: int
    stride: int | None = None
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", _int(self.dim, "S(dim): dim", 0))
        if self.stride is not None:
            object.__setattr__(self, "stride", _int(self.stride, f"S({self.dim}, stride): stride", 1))
        if self.sizes is not None:
            sizes = tuple(_int(e, f"S({self.dim}, sizes): a size", 0) for e in self.sizes)
            if not sizes:
                raise ShardSpecError(f"S({self.dim}, sizes=()): an uneven split needs one size per device")
            object.__setattr__(self, "sizes", sizes)
        if self.stride is not None and self.sizes is not None:
            raise ShardSpecError(f"S({self.dim}, stride={self.stride}, sizes={list(self.sizes)}): "
                                 f"a split is strided or uneven, not both")

    @property
    def is_even(self) -> bool:
        """Contiguous equal pieces (not strided, not uneven)."""
        return self.stride is None and self.sizes is None

    def __str__(self) -> str:
        if self.sizes is not None:
            return f"S({self.dim},[{','.join(map(str, self.sizes))}])"
        return f"S({self.dim},{self.stride})" if self.stride is not None else f"S({self.dim})"

    __repr__ = __str__

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": "S", "dim": self.dim}
        if self.stride is not None:
            out["stride"] = self.stride
        if self.sizes is not None:
            out["sizes"] = list(self.sizes)
        return out


@dataclass(frozen=True, repr=False)
class Partial:
    """Partial values: the tensor is the `op` reduction of the devices' values."""

    op: str = "sum"

    def __post_init__(self) -> None:
        if self.op not in PARTIAL_OPS:
            raise ShardSpecError(f"P({self.op}): partial op must be one of {', '.join(PARTIAL_OPS)}")

    def __str__(self) -> str:
        return f"P({self.op})"

    __repr__ = __str__

    def to_json(self) -> dict[str, Any]:
        return {"kind": "P", "op": self.op}


AxisSpec = Replicated | Split | Partial
R = Replicated()
S = Split
P = Partial


def axis_from_json(obj: Any) -> AxisSpec:
    """Inverse of `AxisSpec.to_json`."""
    if not isinstance(obj, dict) or obj.get("kind") not in ("R", "S", "P"):
        raise ShardSpecError(f"not an axis spec: {obj!r} (expected {{'kind': 'R'|'S'|'P', ...}})")
    allowed = {"R": {"kind"}, "S": {"kind", "dim", "stride", "sizes"}, "P": {"kind", "op"}}[obj["kind"]]
    if set(obj) - allowed:
        raise ShardSpecError(f"axis spec {obj!r}: unknown keys {sorted(set(obj) - allowed)}")
    if obj["kind"] == "R":
        return R
    if obj["kind"] == "P":
        return Partial(obj.get("op", "sum"))
    sizes = obj.get("sizes")
    if sizes is not None and not isinstance(sizes, list):
        raise ShardSpecError(f"axis spec {obj!r}: sizes must be a list")
    return Split(obj.get("dim"), obj.get("stride"), tuple(sizes) if sizes is not None else None)


# -- parsing ------------------------------------------------------------------------------------

_AXIS = re.compile(r"""\s*(?:
    (?P<r>R)
  | P\(\s*(?P<op>[a-z]+)\s*\)
  | S\(\s*(?P<dim>-?\d+)\s*
      (?:,\s*(?:(?:stride\s*=\s*)?(?P<stride>-?\d+)
              |(?:sizes\s*=\s*)?\[(?P<sizes>[\s\d,]*)\]))?\s*\)
)\s*""", re.VERBOSE)


def parse_axes(text: str) -> tuple[AxisSpec, ...]:
    """Parse the compact notation, e.g. ``"S(0)R"``, ``"S(1,64)P(sum)"``, ``"S(0,[3,5])"``."""
    axes: list[AxisSpec] = []
    pos = 0
    while pos < len(text):
        m = _AXIS.match(text, pos)
        if m is None or m.end() == pos:
            raise ShardSpecError(f"cannot parse sharding spec {text!r} at position {pos}: expected R, "
                                 f"S(dim), S(dim,stride), S(dim,[sizes]) or P(sum|max|min)")
        pos = m.end()
        if m["r"]:
            axes.append(R)
        elif m["op"]:
            axes.append(Partial(m["op"]))
        else:
            sizes = m["sizes"]
            axes.append(Split(int(m["dim"]), int(m["stride"]) if m["stride"] else None,
                              tuple(int(e) for e in sizes.split(",") if e.strip())
                              if sizes is not None else None))
    return tuple(axes)


# -- the spec -----------------------------------------------------------------------------------

@dataclass(frozen=True, repr=False)
class ShardSpec:
    """One AxisSpec per mesh axis; immutable and hashable.

    ``ShardSpec("S(0)R")`` parses the compact notation; ``ShardSpec((S(0), R))`` takes axis
    specs (or their strings). Canonical without a shape: the axes are AxisSpec values; with a
    shape, `canonical` also drops strides and sizes that describe a contiguous even split and
    turns splits and partials on size-1 mesh axes into R.
    """

    axes: tuple[AxisSpec, ...]

    def __post_init__(self) -> None:
        axes = self.axes
        if isinstance(axes, ShardSpec):
            axes = axes.axes
        if isinstance(axes, str):
            axes = parse_axes(axes)
        else:
            axes = tuple(a if isinstance(a, Replicated | Split | Partial) else _one_axis(a) for a in axes)
        if not axes:
            raise ShardSpecError("a sharding spec needs one axis spec per mesh axis, got none")
        object.__setattr__(self, "axes", axes)

    def __hash__(self) -> int:
        # kept once computed: the planner hashes specs millions of times (reshard plans, caches);
        # not pickled, since string hashes differ between processes
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self.axes)
            object.__setattr__(self, "_hash", h)
        return h

    def __getstate__(self) -> dict:
        return {"axes": self.axes}

    def __setstate__(self, state: dict) -> None:
        object.__setattr__(self, "axes", state["axes"])

    def __str__(self) -> str:
        return "".join(map(str, self.axes))

    def __repr__(self) -> str:
        return f"ShardSpec({str(self)!r})"

    def __len__(self) -> int:
        return len(self.axes)

    def __iter__(self):
        return iter(self.axes)

    def __getitem__(self, k: int) -> AxisSpec:
        return self.axes[k]

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        return cls(parse_axes(text))

    @classmethod
    def replicated(cls, mesh_axes: int) -> ShardSpec:
        return cls((R,) * mesh_axes)

    def replace(self, axis: int, spec: AxisSpec) -> ShardSpec:
        """This spec with mesh axis `axis` laid out as `spec`."""
        return ShardSpec(self.axes[:axis] + (spec,) + self.axes[axis + 1:])

    @property
    def is_partial(self) -> bool:
        return any(isinstance(a, Partial) for a in self.axes)

    def to_json(self) -> list[dict[str, Any]]:
        return [a.to_json() for a in self.axes]

    @classmethod
    def from_json(cls, obj: Any) -> ShardSpec:
        if not isinstance(obj, list):
            raise ShardSpecError(f"a sharding spec in JSON is a list of axis specs, got {obj!r}")
        return cls(tuple(axis_from_json(a) for a in obj))

    def check(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> None:
        """Raise ShardSpecError unless this spec lays out a `shape` tensor on `mesh_shape`."""
        level_extents(self, shape, mesh_shape)

    def canonical(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> ShardSpec:
        """The unique spelling of this layout for `shape` on `mesh_shape` (checked).

        S(d, E/n) and S(d, [E/n]*n) become S(d); S and P on a size-1 mesh axis become R.
        """
        levels = level_extents(self, shape, mesh_shape)
        axes: list[AxisSpec] = []
        for ax, n, extents in zip(self.axes, mesh_shape, levels):
            if n == 1 and not isinstance(ax, Replicated):
                ax = R
            elif isinstance(ax, Split) and ax.stride is not None and all(ax.stride * n == e for e in extents):
                ax = Split(ax.dim)
            elif isinstance(ax, Split) and ax.sizes is not None and len(set(ax.sizes)) == 1:
                ax = Split(ax.dim)
            axes.append(ax)
        return ShardSpec(tuple(axes))


def _one_axis(a: Any) -> AxisSpec:
    if isinstance(a, str):
        parsed = parse_axes(a)
        if len(parsed) == 1:
            return parsed[0]
    raise ShardSpecError(f"not an axis spec: {a!r} (expected R, S(...), P(...) or one such string)")


def as_spec(spec: ShardSpec | str) -> ShardSpec:
    return spec if isinstance(spec, ShardSpec) else ShardSpec(spec)


class _Broken(Exception):
    """Internal: which rule a split breaks (wrapped into ShardSpecError with the context)."""


def pieces(extent: int, ax: Split, n: int) -> list[int]:
    """Per-device extents of a dim of level extent `extent` split by `ax` over `n` devices."""
    if ax.sizes is not None:
        if len(ax.sizes) != n:
            raise _Broken(f"{len(ax.sizes)} sizes given for {n} devices")
        if sum(ax.sizes) != extent:
            raise _Broken(f"the sizes sum to {sum(ax.sizes)}, not {extent}")
        return list(ax.sizes)
    if ax.stride is None:
        if extent % n:
            raise _Broken(f"{extent} is not divisible by {n}; an uneven split needs explicit sizes, "
                          f"e.g. S({ax.dim},[...])")
        return [extent // n] * n
    if extent % (ax.stride * n):
        raise _Broken(f"{extent} is not a multiple of stride*devices = {ax.stride}*{n} = {ax.stride * n}")
    return [extent // n] * n


def level_extents(spec: ShardSpec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> list[set[int]]:
    """Check `spec` against `shape` and `mesh_shape`; per mesh axis, the level extents it splits.

    The set for axis k holds every extent (over devices of the earlier axes) of the dim that
    axis k splits, before axis k; empty for R and P axes.
    """
    shape, mesh_shape = tuple(shape), tuple(mesh_shape)
    where = f"sharding spec {spec} on mesh {mesh_shape} for shape {shape}"
    if len(spec.axes) != len(mesh_shape):
        raise ShardSpecError(f"{where}: {len(spec.axes)} axis specs for a {len(mesh_shape)}-axis mesh; "
                             f"give one per mesh axis")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in mesh_shape):
        raise ShardSpecError(f"{where}: mesh axis sizes must be ints >= 1")
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in shape):
        raise ShardSpecError(f"{where}: tensor extents must be ints >= 0")
    current = [{e} for e in shape]
    splitters: dict[int, list[int]] = {}
    out: list[set[int]] = []
    for k, (ax, n) in enumerate(zip(spec.axes, mesh_shape)):
        if not isinstance(ax, Split):
            out.append(set())
            continue
        d = ax.dim
        if d >= len(shape):
            raise ShardSpecError(f"{where}: mesh axis {k} splits dim {d}, but the tensor has rank {len(shape)}")
        new: set[int] = set()
        for extent in sorted(current[d]):
            try:
                new.update(pieces(extent, ax, n))
            except _Broken as e:
                earlier = splitters.get(d)
                nested = (f" (what mesh axes {earlier} left of it: a nested split cuts each of their "
                          f"pieces)" if earlier else "")
                raise ShardSpecError(f"{where}: mesh axis {k} ({n} devices) splits dim {d} of extent "
                                     f"{extent}{nested} by {ax}: {e}") from None
        out.append(set(current[d]))
        current[d] = new
        splitters.setdefault(d, []).append(k)
    return out
