"""The cluster: nodes of devices joined by links, and the `--devices` spec that describes one."""

from __future__ import annotations

import bisect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from itertools import groupby

from parc.cluster.devices import DeviceSpec, lookup_device
from parc.cluster.links import DEFAULT_INTER_LINK, LINKS, LinkSpec, slowest
from parc.errors import UsageError


@dataclass(frozen=True)
class Node:
    """One machine: its devices (mixed types allowed), the link inside it, and its NIC ports."""

    devices: tuple[DeviceSpec, ...]
    intra_link: LinkSpec
    nics: int = 1  # ports of the inter-node link; the node's devices share them
    # a host whose ranks outnumber its cores (CPU ranks; `Calibration.apply`, from a calibration's
    # `cpus` and `sharing`): (a, the devices as priced when only a of them compute at once) for
    # counts a below the node's size; `devices` are priced for all of them at once
    sharing: tuple[tuple[int, tuple[DeviceSpec, ...]], ...] = ()

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        if not devices:
            raise ValueError("a node needs at least one device")
        if not all(isinstance(d, DeviceSpec) for d in devices):
            raise ValueError("node devices must be DeviceSpecs")
        if isinstance(self.nics, bool) or not isinstance(self.nics, int) or self.nics < 1:
            raise ValueError(f"a node needs at least one NIC, got {self.nics!r}")
        object.__setattr__(self, "devices", devices)

    @property
    def spec(self) -> str:
        """The node in `--devices` syntax: '8xv100-32g', or '(4xv100-32g+4xp100-16g)' if mixed."""
        runs = [f"{len(list(run))}x{name}" for name, run in groupby(d.name for d in self.devices)]
        return runs[0] if len(runs) == 1 else f"({'+'.join(runs)})"


@dataclass(frozen=True)
class Cluster:
    """Nodes in rank order (node 0 holds ranks 0..len-1, and so on) and the link between nodes."""

    nodes: tuple[Node, ...]
    inter_link: LinkSpec = LINKS[DEFAULT_INTER_LINK]

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        object.__setattr__(self, "nodes", nodes)

    @cached_property
    def devices(self) -> tuple[DeviceSpec, ...]:
        """Every device, flat, in rank order."""
        return tuple(d for node in self.nodes for d in node.devices)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def node_sizes(self) -> tuple[int, ...]:
        return tuple(len(node.devices) for node in self.nodes)

    @cached_property
    def _node_starts(self) -> tuple[int, ...]:
        starts, total = [], 0
        for size in self.node_sizes:
            starts.append(total)
            total += size
        return tuple(starts)

    def node_of(self, rank: int) -> int:
        """Index of the node that holds `rank`."""
        if not 0 <= rank < self.num_devices:
            raise ValueError(f"rank {rank} out of range for {self.num_devices} devices")
        return bisect.bisect_right(self._node_starts, rank) - 1

    def shared_devices(self, rank: int) -> tuple[tuple[int, DeviceSpec], ...]:
        """Device `rank` as priced when only a of its host's ranks compute at once: (a, spec)
        for each count of its node's `sharing` (empty where the node's ranks fit its cores)."""
        k = self.node_of(rank)
        return tuple((a, devices[rank - self._node_starts[k]]) for a, devices in self.nodes[k].sharing)

    @property
    def memory_bytes(self) -> tuple[int, ...]:
        """Memory capacity of each device, in rank order."""
        return tuple(d.memory_bytes for d in self.devices)

    @property
    def min_memory(self) -> int:
        return min(self.memory_bytes)

    def peak_flops(self, dtype: object) -> tuple[float, ...]:
        """Peak FLOP/s of each device for `dtype`, in rank order (Whale's load-balancing input)."""
        return tuple(d.peak(dtype) for d in self.devices)

    @property
    def is_homogeneous(self) -> bool:
        """True when every device is the same DeviceSpec (node sizes may still differ)."""
        return len(set(self.devices)) == 1

    @property
    def is_regular(self) -> bool:
        """True when every node has the same number of devices."""
        return len(set(self.node_sizes)) == 1

    @property
    def device_types(self) -> tuple[DeviceSpec, ...]:
        """The distinct device specs, in order of first appearance."""
        return tuple(dict.fromkeys(self.devices))

    def without_slower(self, times: Mapping[str, float]) -> list[tuple[Cluster, tuple[int, ...]]]:
        """The clusters that leave the slower device types idle, fastest first: for each time but
        the slowest in `times` (seconds per device type name, for the work at hand), the whole
        nodes whose devices all take at most that long (a node is kept or left whole: its ranks
        are one host's), with the kept nodes' indices. Empty for one device type."""
        levels = sorted({times[d.name] for d in self.devices})
        # a link between nodes that is the default of these nodes' types is the kept nodes' own
        # default (the A100 nodes of a cluster with V100s have their 200 Gb/s ports alone)
        defaulted = self.inter_link == default_inter_link(self.nodes)
        out = []
        for level in levels[:-1]:
            kept = tuple(i for i, node in enumerate(self.nodes) if all(times[d.name] <= level for d in node.devices))
            if kept and len(kept) < len(self.nodes) and all(kept != k for _, k in out):
                nodes = tuple(self.nodes[i] for i in kept)
                out.append((Cluster(nodes, default_inter_link(nodes) if defaulted else self.inter_link), kept))
        return out

    @property
    def spec(self) -> str:
        """The devices in `--devices` syntax (links and NICs are not part of it)."""
        groups = []
        for node_spec, run in groupby(node.spec for node in self.nodes):
            count = len(list(run))
            groups.append(node_spec if count == 1 else f"{count}x{node_spec}")
        return "+".join(groups)

    def __str__(self) -> str:
        devices, nodes = _plural(self.num_devices, "device"), _plural(len(self.nodes), "node")
        return f"{self.spec} ({devices} in {nodes}, inter-node {self.inter_link})"

    def links_text(self) -> str:
        """The links in words, as `plan` and `explain` print them: 'nvlink3 inside, 8 x net-200g
        per node across' ('across' only with several nodes; the ports only where more than one)."""
        text = f"{', '.join(sorted({n.intra_link.name for n in self.nodes}))} inside"
        if len(self.nodes) > 1:
            ports = sorted({n.nics for n in self.nodes})
            link = self.inter_link.name
            if ports == [1]:
                text += f", {link} across"
            elif len(ports) == 1:
                text += f", {ports[0]} x {link} per node across"
            else:  # nodes of several port counts
                text += f", {link} across ({' or '.join(map(str, ports))} ports a node)"
        return text

    def to_json(self) -> dict:
        return {
            "device_types": {d.name: d.to_json() for d in self.device_types},
            "nodes": [{"devices": [d.name for d in node.devices], "intra_link": node.intra_link.to_json(),
                       "nics": node.nics,
                       **({"sharing": [[a, [d.to_json() for d in devices]] for a, devices in node.sharing]}
                          if node.sharing else {})} for node in self.nodes],
            "inter_link": self.inter_link.to_json(),
        }

    @staticmethod
    def from_json(data: Mapping) -> Cluster:
        types = {name: DeviceSpec.from_json(spec) for name, spec in data["device_types"].items()}
        nodes = tuple(Node(tuple(types[name] for name in node["devices"]), LinkSpec.from_json(node["intra_link"]),
                           node["nics"], tuple((int(a), tuple(DeviceSpec.from_json(d) for d in devices))
                                               for a, devices in node.get("sharing", ())))
                      for node in data["nodes"])
        return Cluster(nodes, LinkSpec.from_json(data["inter_link"]))


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


# The server each SXM GPU ships in: its ports to the other nodes (the compute fabric; storage
# and management ports not counted), one catalogue link each. A node of these GPUs written in
# `--devices` or a cluster file gets them unless told otherwise; other types (PCIe cards, the
# V100 and P100 of Whale's clusters, CPUs) one DEFAULT_INTER_LINK port.
#   a100-40g, a100-80g: NVIDIA DGX A100 User Guide (2020-2023), "8 x single-port ConnectX-6
#     (HDR InfiniBand 200 Gb/s)" for the compute network; the HGX A100 servers cloud providers
#     built on the same board carry the same 8 x 200 Gb/s.
#   h100-80g, h200-141g: NVIDIA DGX H100/H200 User Guide (2022-2024), "8 x single-port
#     ConnectX-7 (NDR InfiniBand 400 Gb/s)" in four OSFP cages for the compute network.
SHIPPED_PORTS: dict[str, tuple[str, int]] = {
    "a100-40g": ("net-200g", 8), "a100-80g": ("net-200g", 8),
    "h100-80g": ("net-400g", 8), "h200-141g": ("net-400g", 8),
}


# Servers usable as a node in `--devices` (`64xdgx-a100`: 64 of them), by name: (devices per node,
# device type), parsed as NODESxCOUNTxTYPE, so their links are their devices' defaults (the
# intra-node link `DeviceSpec.default_link`, the ports SHIPPED_PORTS).
#   dgx-a100: NVIDIA DGX A100 User Guide and datasheet (80GB model): 8 x A100 80GB SXM4 on six
#     NVSwitches, 600 GB/s NVLink per GPU (nvlink3), 8 x HDR.
#   dgx-h100: NVIDIA DGX H100 User Guide and datasheet: 8 x H100 SXM5 on four NVSwitches, 900 GB/s
#     NVLink 4 per GPU (nvlink4), 8 x NDR.
NODE_TYPES: dict[str, tuple[int, str]] = {"dgx-a100": (8, "a100-80g"), "dgx-h100": (8, "h100-80g")}


def _node_type(name: str) -> tuple[str, int, str] | None:
    """(name, devices, device type) of the node type spelled `name`, or None."""
    key = name.strip().lower().replace("_", "-")
    return (key, *NODE_TYPES[key]) if key in NODE_TYPES else None


def _ports(device: DeviceSpec) -> tuple[str, int]:
    """The link and count of the ports a node of `device` has by default (SHIPPED_PORTS)."""
    return SHIPPED_PORTS.get(device.name, (DEFAULT_INTER_LINK, 1))


def default_nics(devices: tuple[DeviceSpec, ...]) -> int:
    """The ports a node of `devices` has by default: the fewest of its types'."""
    return min(_ports(d)[1] for d in devices)


def default_inter_link(nodes: tuple[Node, ...] | list[Node]) -> LinkSpec:
    """The link between nodes by default: the slowest port of the nodes' device types."""
    return slowest(LINKS[_ports(d)[0]] for n in nodes for d in n.devices)


def default_intra_link(devices: tuple[DeviceSpec, ...], where: str) -> LinkSpec:
    """The link a node of `devices` has by default: the slowest default link of its device types."""
    names = dict.fromkeys(d.default_link for d in devices)
    unknown = [n for n in names if n not in LINKS]
    if unknown:
        raise UsageError(f"{where}: device default link '{unknown[0]}' is not in the catalogue "
                         f"(known: {', '.join(sorted(LINKS))})")
    return slowest(LINKS[n] for n in names)


MAX_COUNT = 65536  # a bound on every count and on the device total, so a typo cannot hang parc
_GRAMMAR = ("the form is [NODESx]COUNTxTYPE joined by '+' (a mixed node in parentheses), e.g. 8xv100-32g, "
            "2x8xa100-80g, 4xv100-32g+4xp100-16g or cpu, or NODESx a node type (dgx-a100, dgx-h100)")
_TERM = re.compile(r"^(?:(\d+)\s*x\s*)?(?:(\d+)\s*x\s*)?(.*)$", re.IGNORECASE)
_GROUP = re.compile(r"^(?:(\d+)\s*x\s*)?\((.*)\)$", re.IGNORECASE | re.DOTALL)


def parse_devices(spec: str, where: str | None = None, extra: Mapping[str, DeviceSpec] | None = None,
                  inter_link: LinkSpec | None = None) -> Cluster:
    """Parse a `--devices` spec into a Cluster with default links.

    `8xv100-32g` is one node of 8; `2x8xa100-80g` two nodes of 8; `+` starts another node, so
    `4xv100-32g+4xp100-16g` is two nodes (as in Whale's V100/P100 experiments); a node holding
    mixed types is written in parentheses: `(4xv100-32g+4xp100-16g)`, `2x(4xv100-32g+4xp100-16g)`.
    `extra` holds custom device types (from a cluster file) by name.
    """
    where = where or f"--devices '{spec}'"
    nodes: list[Node] = []
    for group in _split_top(spec, where):
        match = _GROUP.match(group)
        if match:
            count = _count(match.group(1), where)
            devices = parse_node_devices(match.group(2), where, extra)
        elif "(" in group or ")" in group:
            raise UsageError(f"{where}: parentheses must hold a whole node, as in [NODESx](COUNTxTYPE+...), "
                             f"not '{group}'")
        else:
            first, second, name = _TERM.match(group).groups()
            kind = _node_type(name)
            if kind is not None:  # a server type: NODESxdgx-a100 is NODESxCOUNTxTYPE
                if second is not None:
                    raise UsageError(f"{where}: '{group}': {kind[0]} is a whole node of {kind[1]} {kind[2]}; "
                                     f"write NODESx{kind[0]}")
                first, second, name = first or "1", str(kind[1]), kind[2]
            count = _count(first, where) if second is not None else 1
            devices = (_device(name, where, extra, group),) * _count(second if second is not None else first, where)
        node = Node(devices, default_intra_link(devices, where), default_nics(devices))
        nodes.extend([node] * count)
        check_size(nodes, where)
    return Cluster(tuple(nodes), inter_link or default_inter_link(nodes))


def check_size(nodes: list[Node], where: str) -> None:
    """Refuse more than MAX_COUNT devices in all (a typo such as 65536x65536xcpu)."""
    total = sum(len(node.devices) for node in nodes)
    if total > MAX_COUNT:
        raise UsageError(f"{where}: {total} devices; parc plans for at most {MAX_COUNT}")


def parse_node_devices(text: str, where: str, extra: Mapping[str, DeviceSpec] | None = None
                       ) -> tuple[DeviceSpec, ...]:
    """The devices of one node written `COUNTxTYPE(+COUNTxTYPE)*` (no node counts)."""
    devices: list[DeviceSpec] = []
    for term in _split_top(text, where):
        if "(" in term or ")" in term:
            raise UsageError(f"{where}: parentheses do not nest ('{term}'); {_GRAMMAR}")
        first, second, name = _TERM.match(term).groups()
        if second is not None:
            raise UsageError(f"{where}: '{term}' gives a node count inside a node; write COUNTxTYPE")
        devices.extend([_device(name, where, extra, term)] * _count(first, where))
    return tuple(devices)


def _split_top(text: str, where: str) -> list[str]:
    """Split on '+' outside parentheses; every part must be non-empty."""
    parts, depth, current = [], 0, []
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            raise UsageError(f"{where}: unbalanced parentheses; {_GRAMMAR}")
        if ch == "+" and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    parts.append("".join(current).strip())
    if depth != 0:
        raise UsageError(f"{where}: unbalanced parentheses; {_GRAMMAR}")
    if not all(parts):
        raise UsageError(f"{where}: empty device group; {_GRAMMAR}")
    return parts


def _count(text: str | None, where: str) -> int:
    if text is None:
        return 1
    value = int(text)
    if not 1 <= value <= MAX_COUNT:
        raise UsageError(f"{where}: counts must be between 1 and {MAX_COUNT}, got {value}")
    return value


def _device(name: str, where: str, extra: Mapping[str, DeviceSpec] | None, term: str) -> DeviceSpec:
    name = name.strip()
    if not name:
        raise UsageError(f"{where}: expected a device type after '{term}'; {_GRAMMAR}")
    kind = _node_type(name)
    if kind is not None:  # reached inside a node's parentheses (or a cluster file's gpus)
        raise UsageError(f"{where}: '{term}': {kind[0]} is a whole node of {kind[1]} {kind[2]}, not a device "
                         f"of one; write NODESx{kind[0]} outside parentheses, or {kind[1]}x{kind[2]}")
    if re.match(r"^\d+\s*x", name, re.IGNORECASE):
        raise UsageError(f"{where}: '{term}' has more than two counts; {_GRAMMAR}")
    return lookup_device(name, where, extra)

