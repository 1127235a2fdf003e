"""Device meshes: the cluster's ranks arranged as a grid whose axes have their own links.

Rhino (sections 3 and 4) organises devices as meshes, shards recursively on each mesh axis, and
"enumerates different device mesh configurations", searching each and keeping the best.
`enumerate_meshes` gives those configurations for one cluster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

import numpy as np

from parc.cluster.cluster import Cluster
from parc.cluster.links import LinkSpec, slowest


@dataclass(frozen=True)
class Mesh:
    """Ranks `devices` laid out row-major in `shape`; axis i's collectives run over `links[i]`.

    `links[i]` is the per-device bottleneck of a collective along axis i run by all its groups
    at once; `spans_nodes[i]` says whether those groups cross node boundaries.
    """

    shape: tuple[int, ...]
    devices: tuple[int, ...]
    links: tuple[LinkSpec, ...]
    spans_nodes: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        devices = tuple(int(d) for d in self.devices)
        links = tuple(self.links)
        spans = tuple(bool(s) for s in self.spans_nodes) or (False,) * len(shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"mesh shape {shape}: needs at least one axis, every size >= 1")
        if math.prod(shape) != len(devices):
            raise ValueError(f"mesh shape {shape} holds {math.prod(shape)} devices, got {len(devices)}")
        if len(set(devices)) != len(devices) or any(d < 0 for d in devices):
            raise ValueError(f"mesh devices {devices}: must be distinct ranks >= 0")
        if len(links) != len(shape) or not all(isinstance(link, LinkSpec) for link in links):
            raise ValueError(f"mesh shape {shape}: needs one LinkSpec per axis, got {len(links)}")
        if len(spans) != len(shape):
            raise ValueError(f"mesh shape {shape}: needs one spans_nodes flag per axis, got {len(spans)}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "links", links)
        object.__setattr__(self, "spans_nodes", spans)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def coords(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinates of `rank`."""
        return tuple(int(i) for i in np.unravel_index(self.devices.index(rank), self.shape))

    def rank_at(self, coords: tuple[int, ...]) -> int:
        """The rank at mesh coordinates `coords`."""
        return self.devices[int(np.ravel_multi_index(tuple(coords), self.shape))]

    def axis_groups(self, axis: int) -> tuple[tuple[int, ...], ...]:
        """The rank groups a collective along `axis` runs in, each in axis order."""
        grid = np.moveaxis(np.asarray(self.devices).reshape(self.shape), axis, -1)
        return tuple(tuple(int(r) for r in row) for row in grid.reshape(-1, self.shape[axis]))

    def __str__(self) -> str:
        return "x".join(map(str, self.shape))

    def describe(self) -> str:
        """One line: the shape and each axis's link, e.g. '2x8 [net-100g/8, nvlink3]'."""
        return f"{self} [{', '.join(map(str, self.links))}]"

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "devices": list(self.devices),
                "links": [link.to_json() for link in self.links], "spans_nodes": list(self.spans_nodes)}

    @staticmethod
    def from_json(data: Mapping) -> Mesh:
        return Mesh(tuple(data["shape"]), tuple(data["devices"]),
                    tuple(LinkSpec.from_json(link) for link in data["links"]), tuple(data["spans_nodes"]))


def enumerate_meshes(cluster: Cluster, max_dims: int = 3) -> list[Mesh]:
    """Every mesh of all the cluster's devices, in rank order, with 1..max_dims axes.

    Shapes are the ordered factorizations of the device count into factors >= 2 (one device
    gives the trivial mesh (1,)), by number of axes, then lexicographically. A shape is kept when
    no axis mixes: each axis either has all its groups inside single nodes or all of them
    crossing nodes. So the axes inside nodes are the innermost ones and their sizes multiply to a
    divisor of every node's size; the outer axes stride across nodes.
    """
    if max_dims < 1:
        raise ValueError(f"max_dims must be >= 1, got {max_dims}")
    n = cluster.num_devices
    if n == 1:
        return [Mesh((1,), (0,), (cluster.nodes[0].intra_link,), (False,))]
    node_of = np.array([cluster.node_of(r) for r in range(n)])
    meshes = []
    for dims in range(1, max_dims + 1):
        for shape in _factorizations(n, dims):
            axes = [_axis_link(cluster, node_of, shape, axis) for axis in range(dims)]
            if all(a is not None for a in axes):
                meshes.append(Mesh(shape, tuple(range(n)), tuple(a[0] for a in axes), tuple(a[1] for a in axes)))
    return meshes


def _factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Ordered tuples of `parts` factors >= 2 whose product is n, in lexicographic order."""
    if parts == 1:
        return [(n,)] if n >= 2 else []
    return [(f, *rest) for f in range(2, n + 1) if n % f == 0 for rest in _factorizations(n // f, parts - 1)]


def _axis_link(cluster: Cluster, node_of: np.ndarray, shape: tuple[int, ...], axis: int
               ) -> tuple[LinkSpec, bool] | None:
    """The bottleneck link of `axis` and whether it spans nodes; None when the axis mixes."""
    ranks = np.arange(len(node_of)).reshape(shape)
    groups = np.moveaxis(ranks, axis, -1).reshape(-1, shape[axis])
    nodes = node_of[groups]  # node of each member, one row per group
    touched = 1 + (np.diff(np.sort(nodes, axis=1), axis=1) != 0).sum(axis=1)
    if (touched == 1).all():
        return slowest(cluster.nodes[i].intra_link for i in np.unique(nodes)), False
    if (touched == 1).any():
        return None
    # Every group crosses nodes. In a ring, each group passes once in and once out of each node it
    # touches, so a node's NIC ports carry one stream per group touching it; the intra-node hops
    # of groups with several members in a node run alongside.
    num_nodes = len(cluster.nodes)
    pairs, members = np.unique(np.arange(len(nodes))[:, None] * num_nodes + nodes, return_counts=True)
    streams = np.bincount(pairs % num_nodes, minlength=num_nodes)  # groups touching each node
    crowded = np.unique(pairs[members > 1] % num_nodes)  # nodes where a group has several members
    shares = sorted({(int(k), node.nics) for k, node in zip(streams, cluster.nodes) if k})
    candidates = [shared_link(cluster.inter_link, k, nics) for k, nics in shares]
    candidates += [cluster.nodes[int(i)].intra_link for i in crowded]
    return _bottleneck(candidates), True


def shared_link(link: LinkSpec, streams: int, nics: int) -> LinkSpec:
    """`link` as seen by one of `streams` concurrent streams over `nics` ports."""
    share = Fraction(min(streams, nics), streams)
    if share == 1:
        return link
    suffix = f"/{share.denominator}" if share.numerator == 1 else f"*{share}"
    return replace(link, name=f"{link.name}{suffix}", bandwidth=link.bandwidth * float(share),
                   kinds=tuple((k, lat, bw * float(share)) for k, lat, bw in link.kinds))


def _bottleneck(links: list[LinkSpec]) -> LinkSpec:
    """Lowest bandwidth, and the highest latency, handoff, call cost and step ratio of all: hops
    of one step run in parallel. Collective kinds with figures of their own keep the slowest
    link's."""
    low = slowest(links)
    worst = max(links, key=lambda link: link.latency)
    handoff, call = max(link.handoff for link in links), max(link.call for link in links)
    ratio = max(link.step_ratio for link in links)
    if worst.latency <= low.latency and (handoff, call, ratio) == (low.handoff, low.call, low.step_ratio):
        return low
    name = low.name if worst.latency <= low.latency else f"{low.name}+{worst.name}"
    return LinkSpec(name, low.bandwidth, max(worst.latency, low.latency), handoff, call, low.kinds, ratio)
