"""Links: the bandwidth and latency between devices, and the built-in catalogue of common links."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from parc.errors import UsageError

GB = 1e9
Gbit = 1e9 / 8  # bytes/s in one Gb/s
KINDS = ("reduce_scatter", "all_gather", "all_to_all")  # the collectives a link may give figures of their own


@dataclass(frozen=True)
class LinkSpec:
    """A link as the alpha-beta model sees it.

    `bandwidth` is bytes/s per direction available to one device (a device sends and receives
    at this rate at once); `latency` is the seconds one step of a collective costs (alpha).
    """

    name: str
    bandwidth: float  # bytes/s, per direction, per device
    latency: float  # seconds per message / collective step
    # seconds the first collective or message after compute costs more than one in a burst: the
    # wait until every member runs again. 0 on dedicated devices; large on a host whose ranks
    # outnumber its cores (`parc profile` measures it)
    handoff: float = 0.0
    # seconds every collective or message costs once, beside its steps' latency: a call's fixed
    # cost. 0 in the catalogue; on a host whose ranks outnumber its cores a collective waits for
    # its members to be scheduled, about the same time whatever their number (`parc profile`)
    call: float = 0.0
    # (kind, latency, bandwidth) of collective kinds that run at figures of their own, where an
    # implementation's kinds are not the same ring (MPICH on a shared-memory host: a
    # reduce-scatter between 2 ranks takes no less than an all-reduce, not half its time:
    # docs/cluster.md; `parc profile` measures them); every other kind at `latency` and `bandwidth`
    kinds: tuple[tuple[str, float, float], ...] = ()
    # what a collective inside a training step takes against the figures above, which bursts of
    # collectives on one buffer measure: 1 in the catalogue; `parc profile` traces its reference
    # tensor-parallel step (on CPU ranks well above 1: each collective runs between modules that
    # left the caches to their own tensors; benchmarks/LOG.md, 2026-11-28, seventh session)
    step_ratio: float = 1.0

    def __post_init__(self) -> None:
        name = str(self.name).strip().lower()
        if not name:
            raise ValueError("a link needs a name")
        rows = self.kinds.items() if isinstance(self.kinds, Mapping) else self.kinds
        kinds = []
        for row in rows:
            kind, (latency, bandwidth) = (row[0], row[1]) if len(row) == 2 else (row[0], row[1:])
            if kind not in KINDS:
                raise ValueError(f"link {name}: collective kind {kind!r} has no figures of its own "
                                 f"(known: {', '.join(KINDS)})")
            if not (isinstance(latency, int | float) and latency >= 0 and isinstance(bandwidth, int | float)
                    and bandwidth > 0):
                raise ValueError(f"link {name}: {kind} needs latency >= 0 and bandwidth > 0, "
                                 f"got {latency!r}, {bandwidth!r}")
            kinds.append((str(kind), float(latency), float(bandwidth)))
        object.__setattr__(self, "kinds", tuple(sorted(kinds)))
        for field in ("bandwidth", "latency", "handoff", "call", "step_ratio"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"link {name}: {field} must be a number, got {value!r}")
            positive = field in ("bandwidth", "step_ratio")
            if not (value > 0 if positive else value >= 0):
                raise ValueError(f"link {name}: {field} must be {'> 0' if positive else '>= 0'}, got {value}")
            object.__setattr__(self, field, float(value))
        object.__setattr__(self, "name", name)

    def figures(self, kind: str) -> tuple[float, float]:
        """(latency, bandwidth) a collective of `kind` runs at on this link."""
        for k, latency, bandwidth in self.kinds:
            if k == kind:
                return latency, bandwidth
        return self.latency, self.bandwidth

    def slower_than(self, other: LinkSpec) -> bool:
        """True when this link is the bottleneck of the two: lower bandwidth, then higher latency."""
        return (self.bandwidth, -self.latency) < (other.bandwidth, -other.latency)

    def to_json(self) -> dict:
        return {"name": self.name, "bandwidth": self.bandwidth, "latency": self.latency,
                **({"handoff": self.handoff} if self.handoff else {}), **({"call": self.call} if self.call else {}),
                **({"kinds": {k: [lat, bw] for k, lat, bw in self.kinds}} if self.kinds else {}),
                **({"step_ratio": self.step_ratio} if self.step_ratio != 1.0 else {})}

    @staticmethod
    def from_json(data: Mapping) -> LinkSpec:
        return LinkSpec(**data)

    def __str__(self) -> str:
        return self.name


def slowest(links: Iterable[LinkSpec]) -> LinkSpec:
    """The bottleneck among `links` (see LinkSpec.slower_than); ties keep the first."""
    result: LinkSpec | None = None
    for link in links:
        if result is None or link.slower_than(result):
            result = link
    if result is None:
        raise ValueError("slowest() of no links")
    return result


# Bandwidths are the datasheet's bidirectional per-GPU figure halved (per direction):
#   nvlink1: P100 SXM2, 4 links, 160 GB/s bidirectional (Tesla P100 datasheet).
#   nvlink2: V100 SXM2, 6 links, 300 GB/s (V100 datasheet).
#   nvlink3: A100 SXM, 12 links, 600 GB/s (A100 datasheet).
#   nvlink4: H100/H200 SXM, 18 links, 900 GB/s (H100 and H200 datasheets).
#   pcie3/4/5: x16 slots, 32/64/128 GB/s bidirectional (T4, A10 and H100 PCIe datasheets).
#   net-*: the line rate of one NIC port (Ethernet, RoCE or InfiniBand alike: the model cannot
#          tell them apart), Gb/s / 8.
# Latencies are not datasheet figures: they are NCCL's own per-step estimates for the ring
# algorithm with the Simple protocol (hwLat in NCCL's src/graph/tuning.cc: NVLink 3.4 us, PCIe
# 5.7 us, network 14 us). shm (CPU ranks on one host exchanging through shared memory under MPI)
# is an estimate: ~10 GB/s per rank pair for large messages, ~1 us per message.
_CATALOGUE = (
    LinkSpec("nvlink1", 80 * GB, 3.4e-6),
    LinkSpec("nvlink2", 150 * GB, 3.4e-6),
    LinkSpec("nvlink3", 300 * GB, 3.4e-6),
    LinkSpec("nvlink4", 450 * GB, 3.4e-6),
    LinkSpec("pcie3", 16 * GB, 5.7e-6),
    LinkSpec("pcie4", 32 * GB, 5.7e-6),
    LinkSpec("pcie5", 64 * GB, 5.7e-6),
    LinkSpec("net-25g", 25 * Gbit, 14e-6),
    LinkSpec("net-50g", 50 * Gbit, 14e-6),
    LinkSpec("net-100g", 100 * Gbit, 14e-6),
    LinkSpec("net-200g", 200 * Gbit, 14e-6),
    LinkSpec("net-400g", 400 * Gbit, 14e-6),
    LinkSpec("shm", 10 * GB, 1e-6),
)

LINKS: dict[str, LinkSpec] = {link.name: link for link in _CATALOGUE}

LINK_ALIASES = {
    "loopback": "shm", "shared-memory": "shm",
    "pcie-3": "pcie3", "pcie-4": "pcie4", "pcie-5": "pcie5",
    "pcie3x16": "pcie3", "pcie4x16": "pcie4", "pcie5x16": "pcie5",
    **{f"{rate}gbe": f"net-{rate}g" for rate in (25, 50, 100, 200, 400)},
    **{f"{rate}g": f"net-{rate}g" for rate in (25, 50, 100, 200, 400)},
    **{f"roce-{rate}g": f"net-{rate}g" for rate in (25, 50, 100, 200, 400)},
    **{f"ib-{rate}g": f"net-{rate}g" for rate in (100, 200, 400)},
    "edr": "net-100g", "ib-edr": "net-100g", "hdr": "net-200g", "ib-hdr": "net-200g",
    "ndr": "net-400g", "ib-ndr": "net-400g",
}

DEFAULT_INTER_LINK = "net-100g"


def lookup_link(name: str, where: str) -> LinkSpec:
    """The catalogue link called `name` (case-insensitive, aliases allowed)."""
    key = name.strip().lower().replace("_", "-")
    key = LINK_ALIASES.get(key, key)
    if key not in LINKS:
        raise UsageError(f"{where}: unknown link '{name}' (known: {', '.join(sorted(LINKS))}; "
                         f"or give {{bandwidth_gbs: ..., latency_us: ...}})")
    return LINKS[key]
