"""The cluster model of `parc plan`: devices, links, nodes, meshes and the cost formulas.

`parse_devices('2x8xa100-80g')` or `load_cluster('cluster.yaml')` gives a Cluster;
`enumerate_meshes(cluster)` the device meshes the planner searches; `collective_time` and
`compute_time` the alpha-beta and roofline costs. docs/cluster.md describes all of it.
"""

from parc.cluster.cluster import Cluster, Node, parse_devices
from parc.cluster.clusterfile import (
    Calibration,
    load_cluster,
    load_constants,
    override_fields,
    resolve_cluster,
)
from parc.cluster.cost import (
    COLLECTIVES,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    axis_collective_time,
    collective_time,
    compute_time,
    node_floor,
    reduce_scatter_time,
    send_recv_time,
)
from parc.cluster.devices import DEVICES, DeviceSpec, lookup_device
from parc.cluster.links import LINKS, LinkSpec, lookup_link
from parc.cluster.mesh import Mesh, enumerate_meshes

__all__ = [
    "COLLECTIVES",
    "DEVICES",
    "LINKS",
    "Calibration",
    "Cluster",
    "DeviceSpec",
    "LinkSpec",
    "Mesh",
    "Node",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "axis_collective_time",
    "collective_time",
    "compute_time",
    "node_floor",
    "enumerate_meshes",
    "load_cluster",
    "load_constants",
    "lookup_device",
    "lookup_link",
    "override_fields",
    "parse_devices",
    "reduce_scatter_time",
    "resolve_cluster",
    "send_recv_time",
]
