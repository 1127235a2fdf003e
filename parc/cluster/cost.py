"""The cost formulas: alpha-beta collectives per mesh axis, and a roofline per op.

A node's time on a device is `NodeWork.seconds(device, ...)`: its work (FLOPs, bytes, type, class
and pieces, from its op rule; among other nodes, as `parc.cluster.work.graph_work` says) priced by
`compute_time`. The SPMD search, the stage search, the heterogeneous balance and the task times
of the emitted modules all price nodes through it.

Collectives use ring algorithms. For a group of n devices on a link with latency alpha and
per-device bandwidth beta (bytes/s), moving a tensor of B bytes:

    kind            steps      bytes each device sends       B is
    all_reduce      2(n-1)     2(n-1)/n B                    the tensor (same on every device)
    all_gather      n-1        (n-1)/n B                     the gathered (full) tensor
    reduce_scatter  n-1        (n-1)/n B                     the input (full) tensor
    all_to_all      n-1        (n-1)/n^2 B                   the full tensor (B/n per device)
    send_recv       1          B                             the message

and time = call + steps * alpha + volume / beta, where `call` is the link's fixed cost of one
collective or message (0 in the catalogue; measured by `parc profile` on a host whose ranks
outnumber its cores). A group of one device costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from parc.cluster.devices import DeviceSpec
from parc.cluster.links import LinkSpec
from parc.cluster.mesh import Mesh
from parc.ir.graph import Node
from parc.ops.base import node_pieces, node_work, op_class
from parc.ops.fusion import FLAT_MAX

# Latency steps of each ring collective over n devices, and the bytes each device sends as a
# fraction of B (the table above): every collective's time comes from these two.
STEPS: dict[str, Callable[[int], int]] = {
    "all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
    "all_to_all": lambda n: n - 1, "send_recv": lambda n: 1}
_VOLUME: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n**2, "send_recv": lambda n: 1.0}


# Gradient buckets: along a mesh axis where they pay (`bucket_axes`), the lowering
# (`parc.passes.lower.fuse_gradients`) concatenates the all-reduces of gradients that send at most
# BUCKET_MEMBER_BYTES per device (the ring volume, `Collective.bytes_per_device`) and run at the
# same place of a program into buckets of up to GRAD_BUCKET_BYTES (PyTorch DDP's default
# bucket_cap_mb), each run as one collective; the SPMD cost model charges each such gradient its
# share of a bucket's latency (`bucket_share`). Larger gradients run alone: from about 1 MiB a ring
# all-reduce's bandwidth term is the larger one on most links of the catalogue (25 GbE between 4
# nodes from 0.26 MiB, NVLink2 between 8 devices from about 4 MiB), and a bucket holds a copy of
# its members while it is in flight.
GRAD_BUCKET_BYTES = 25 * 2**20
BUCKET_MEMBER_BYTES = 2**20


def bucket_axes(shape: Sequence[int], links: Sequence[LinkSpec], device: DeviceSpec) -> tuple[bool, ...]:
    """Per mesh axis, whether gradient buckets pay along it: the latency a member's own all-reduce
    would pay (its ring steps' alpha and the link's handoff) against what the bucket adds for a
    member of the largest size, BUCKET_MEMBER_BYTES: a copy into the bucket and one out of it at
    the device's memory bandwidth (its reshapes are views; the Concat and the Split are one
    launch each per bucket). With the catalogue's figures: CPU ranks over shared memory no (6 us
    on 4 ranks against 21 us), with a measured handoff yes; GPUs over NVLink or PCIe and nodes
    over a network, yes."""
    copy = 2 * BUCKET_MEMBER_BYTES / (device.memory_bandwidth * device.memory_efficiency)
    return tuple(n > 1 and link.call + STEPS["all_reduce"](n) * link.latency + link.handoff > copy
                 for n, link in zip(shape, links))


def bucket_member(kind: str, bytes_per_device: float) -> bool:
    """Whether a gradient's collective along an axis where buckets pay joins a bucket: an
    all-reduce of at most BUCKET_MEMBER_BYTES (the lowering fuses exactly these)."""
    return kind == "all_reduce" and bytes_per_device <= BUCKET_MEMBER_BYTES


def bucket_share(kind: str, bytes_per_device: float) -> float:
    """The share of a collective's latency a gradient's synchronisation pays along an axis where
    buckets pay: its bytes over a bucket's when it joins one (`bucket_member`), else 1."""
    return bytes_per_device / GRAD_BUCKET_BYTES if bucket_member(kind, bytes_per_device) else 1.0


def ring_time(kind: str, link: LinkSpec, n: int, bytes_per_device: float, latency_share: float = 1.0) -> float:
    """((call + steps(n) * alpha) * latency_share + bytes_per_device / beta) * step_ratio, with the
    link's alpha and beta for `kind` (`LinkSpec.figures`) and, for a collective, its `step_ratio`
    (1 but in a calibration from `parc profile`, which fits it on collectives: a point-to-point
    message keeps its figures, as the traced receives did): a collective whose per-device volume
    is already known (`parc.sharding.reshard` gives it, exact for uneven splits).
    `latency_share` < 1: the collective is fused with others (gradient buckets) and pays that
    share of one collective's latency."""
    latency, bandwidth = link.figures(kind)
    ratio = 1.0 if kind == "send_recv" else link.step_ratio
    return ratio * ((link.call + STEPS[kind](n) * latency) * latency_share + bytes_per_device / bandwidth)


def _ring(kind: str, link: LinkSpec, n: int, nbytes: float) -> float:
    if n <= 1 and kind != "send_recv":
        return 0.0
    return ring_time(kind, link, n, _VOLUME[kind](n) * nbytes)


def all_reduce_time(link: LinkSpec, n: int, nbytes: float) -> float:
    """Ring all-reduce of a B-byte tensor held by each of n devices."""
    return _ring("all_reduce", link, n, nbytes)


def all_gather_time(link: LinkSpec, n: int, nbytes: float) -> float:
    """Ring all-gather into a B-byte tensor (each device holds B/n)."""
    return _ring("all_gather", link, n, nbytes)


def reduce_scatter_time(link: LinkSpec, n: int, nbytes: float) -> float:
    """Ring reduce-scatter of a B-byte tensor (each device ends with B/n)."""
    return _ring("reduce_scatter", link, n, nbytes)


def all_to_all_time(link: LinkSpec, n: int, nbytes: float) -> float:
    """All-to-all of a B-byte tensor split over n devices: each sends (n-1)/n of its B/n."""
    return _ring("all_to_all", link, n, nbytes)


def send_recv_time(link: LinkSpec, n: int, nbytes: float) -> float:
    """One point-to-point message of B bytes (n is ignored: a pair)."""
    return _ring("send_recv", link, n, nbytes)


COLLECTIVES: dict[str, Callable[[LinkSpec, int, float], float]] = {
    "all_reduce": all_reduce_time,
    "all_gather": all_gather_time,
    "reduce_scatter": reduce_scatter_time,
    "all_to_all": all_to_all_time,
    "send_recv": send_recv_time,
}


def collective_time(kind: str, link: LinkSpec, n: int, nbytes: float) -> float:
    """Seconds for collective `kind` (a COLLECTIVES key) over n devices moving B = nbytes."""
    try:
        formula = COLLECTIVES[kind]
    except KeyError:
        raise ValueError(f"unknown collective '{kind}' (known: {', '.join(COLLECTIVES)})") from None
    if n < 1 or nbytes < 0:
        raise ValueError(f"{kind}: need n >= 1 and nbytes >= 0, got n={n}, nbytes={nbytes}")
    return formula(link, n, nbytes)


def axis_collective_time(mesh: Mesh, axis: int, kind: str, nbytes: float) -> float:
    """Seconds for collective `kind` along mesh axis `axis` (all its groups at once)."""
    return collective_time(kind, mesh.links[axis], mesh.shape[axis], nbytes)


@dataclass(frozen=True)
class NodeWork:
    """What one node asks of a device: FLOPs, bytes moved, the type it computes in, its op class
    and its pieces (`parc.ops`: `node_work`, `op_class`, `node_pieces`), and of its bytes, those
    the caches do not hold (`cold`: `parc.cluster.work.far_bytes`, priced at the device's cold
    rate on top of its roofline). Alone, a node is `NodeWork.of(node)`; among the nodes of a
    module or a graph, `parc.cluster.work.graph_work` says what each asks."""

    flops: float
    nbytes: float
    dtype: Any
    op_class: str = ""
    pieces: float = 0.0
    cold: float = 0.0
    alone: bool = True  # a kernel of its own; False: part of one, whose launch another node pays
    # part of a kernel the engine runs only on arrays of fewer than FLAT_MAX elements (a softmax
    # row with its trees): `flat`, the kernel's elements whole, and `unfused`, what the node asks
    # where a device's part is too large for it (`parc.cluster.work.graph_work`, the search's view)
    flat: int = 0
    unfused: NodeWork | None = None

    @classmethod
    def of(cls, node: Node) -> NodeWork:
        flops, nbytes, dtype = node_work(node)
        return cls(flops, nbytes, dtype, op_class(node), node_pieces(node))

    def seconds(self, device: DeviceSpec, share: float = 1.0, split: int = 1, queued: bool = False) -> float:
        """`compute_time` of the part of the work one device does: `share` of it, divided `split`
        ways (a strategy's even split; an uneven one gives each device its share)."""
        if self.unfused is not None and self.flat * share / split >= FLAT_MAX:
            return self.unfused.seconds(device, share, split, queued)
        t = compute_time(self.flops * share / split, self.nbytes * share / split, device, self.dtype,
                         self.op_class, queued=queued, pieces=self.pieces * share / split, floor=self.alone)
        return t + device.step_ratio * device.cold_cost() * self.cold * share / split if self.cold else t

    def floor(self, device: DeviceSpec) -> float:
        """What the node costs on `device` however little of its work it does (`node_floor`;
        nothing for part of a kernel)."""
        return node_floor(self.flops, self.nbytes, device, self.op_class) if self.alone else 0.0


def compute_time(flops: float, nbytes: float, device: DeviceSpec, dtype: object = "float32",
                 op_class: str = "", queued: bool = False, pieces: float = 0.0, floor: bool = True) -> float:
    """Roofline time of one op: the slower of compute and memory traffic, plus the launch floor.
    `queued` (a module's nodes in a row, as the task times price them): on a GPU
    (`DeviceSpec.gpu`) the longer of the two instead, since kernels queue while the host launches
    the next. The search prices nodes apart, the floor added (where kernels are shorter than
    their launch, as in small models, the sum keeps a split worth its share of the kernel).

    max(flops / (peak[dtype] * efficiency), bytes / (memory_bandwidth * memory_fraction))
    + pieces * piece_cost + launch_floor + the class's floor (`node_floor`), where efficiency,
    memory_fraction, piece_cost and the floor are the device's for the op's class
    (`parc.ops.op_class`), else its compute_efficiency, memory_efficiency, node_piece and
    node_floor, and `pieces` is `parc.ops.node_pieces` (a Transpose's short runs, a Softmax's
    rows). Queued on a GPU, the node costs the longest of its roofline (with its pieces) and its
    launch, and no class floor. `dtype` is a DType or a name ('float32', 'tf32', 'bf16', ...); a
    dtype the device lists no peak for runs at its float32 peak. The whole is multiplied by the
    device's `step_ratio` (1 but in a calibration from `parc profile`). `floor=False` (part of a
    kernel another node launches): no launch and no class floor.
    """
    if flops < 0 or nbytes < 0:
        raise ValueError(f"compute_time: need flops >= 0 and bytes >= 0, got {flops}, {nbytes}")
    compute = flops / (device.peak(dtype) * device.efficiency(op_class))
    memory = nbytes / (device.memory_bandwidth * device.memory_fraction(op_class))
    walk = pieces * device.piece_cost(op_class) if pieces else 0.0
    if queued and device.gpu:
        return device.step_ratio * max(compute + walk, memory + walk, device.launch_floor if floor else 0.0)
    return device.step_ratio * (max(compute, memory) + walk + (node_floor(flops, nbytes, device, op_class) if floor else 0.0))


def node_floor(flops: float, nbytes: float, device: DeviceSpec, op_class: str = "") -> float:
    """What one node costs however little of its work a device does: the launch floor, and the
    class's floor (`DeviceSpec.class_floor`) where the node has work (FLOPs or traffic)."""
    return device.launch_floor + (device.class_floor(op_class) if flops > 0 or nbytes > 0 else 0.0)
