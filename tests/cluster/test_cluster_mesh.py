"""Mesh enumeration against hand-written lists, and properties over random clusters."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parc.cluster import DEVICES, LINKS, Cluster, LinkSpec, Mesh, Node, enumerate_meshes, parse_devices

NET = LINKS["net-100g"]


def net_share(k: int) -> LinkSpec:
    return LinkSpec(f"net-100g/{k}", 12.5e9 / k, 14e-6)


def one_port(spec: str) -> Cluster:
    """`spec`'s nodes with one 100 Gb/s port each (the SXM nodes' default is eight)."""
    cluster = parse_devices(spec, inter_link=LINKS["net-100g"])
    return Cluster(tuple(Node(n.devices, n.intra_link, 1) for n in cluster.nodes), cluster.inter_link)


def listing(cluster: Cluster) -> list[tuple[tuple[int, ...], tuple[str, ...], tuple[bool, ...]]]:
    return [(m.shape, tuple(link.name for link in m.links), m.spans_nodes) for m in enumerate_meshes(cluster)]


def test_one_node_of_8():
    nv = "nvlink2"
    assert listing(parse_devices("8xv100-32g")) == [
        ((8,), (nv,), (False,)),
        ((2, 4), (nv, nv), (False, False)),
        ((4, 2), (nv, nv), (False, False)),
        ((2, 2, 2), (nv, nv, nv), (False, False, False)),
    ]


def test_two_nodes_of_8():
    # Every layout qualifies: the inner axes (sizes multiplying to 2, 4 or 8) stay in a node.
    # An axis across nodes shares the node's one NIC among the groups that cross it at once.
    nv = "nvlink3"
    meshes = enumerate_meshes(one_port("2x8xa100-80g"))
    assert [(m.shape, tuple(link.name for link in m.links), m.spans_nodes) for m in meshes] == [
        ((16,), ("net-100g",), (True,)),
        ((2, 8), ("net-100g/8", nv), (True, False)),
        ((4, 4), ("net-100g/4", nv), (True, False)),
        ((8, 2), ("net-100g/2", nv), (True, False)),
        ((2, 2, 4), ("net-100g/8", nv, nv), (True, False, False)),
        ((2, 4, 2), ("net-100g/8", nv, nv), (True, False, False)),
        ((4, 2, 2), ("net-100g/4", nv, nv), (True, False, False)),
    ]
    assert meshes[0].links[0] == NET
    assert meshes[1].links == (net_share(8), LINKS["nvlink3"])
    assert all(m.devices == tuple(range(16)) for m in meshes)


def test_two_nodes_of_8_with_a_nic_per_gpu():
    node = Node((DEVICES["a100-80g"],) * 8, LINKS["nvlink3"], nics=8)
    meshes = enumerate_meshes(Cluster((node, node), LINKS["net-200g"]))
    assert {m.links[0].name for m in meshes} == {"net-200g"}


def test_two_nodes_of_8_with_two_nics():
    node = Node((DEVICES["a100-80g"],) * 8, LINKS["nvlink3"], nics=2)
    names = [m.links[0].name for m in enumerate_meshes(Cluster((node, node)))]
    assert names == ["net-100g", "net-100g/4", "net-100g/2", "net-100g", "net-100g/4", "net-100g/4", "net-100g/2"]


def test_sixteen_single_gpu_nodes():
    # Rhino's platform S1: every axis crosses nodes, every factorization is a layout.
    assert listing(parse_devices("16x1xv100-32g")) == [
        ((16,), ("net-100g",), (True,)),
        ((2, 8), ("net-100g", "net-100g"), (True, True)),
        ((4, 4), ("net-100g", "net-100g"), (True, True)),
        ((8, 2), ("net-100g", "net-100g"), (True, True)),
        ((2, 2, 4), ("net-100g",) * 3, (True,) * 3),
        ((2, 4, 2), ("net-100g",) * 3, (True,) * 3),
        ((4, 2, 2), ("net-100g",) * 3, (True,) * 3),
    ]


def test_six_devices_in_one_node():
    assert listing(parse_devices("6xt4")) == [
        ((6,), ("pcie3",), (False,)),
        ((2, 3), ("pcie3", "pcie3"), (False, False)),
        ((3, 2), ("pcie3", "pcie3"), (False, False)),
    ]


def test_six_devices_in_two_nodes_of_3():
    # 3x2 would put {2, 3} (nodes 0 and 1) in the same inner group as {0, 1} (node 0): refused.
    assert listing(parse_devices("2x3xt4")) == [
        ((6,), ("net-100g",), (True,)),
        ((2, 3), ("net-100g/3", "pcie3"), (True, False)),
    ]


def test_six_devices_in_three_nodes_of_2():
    # In 2x3 every group of either axis crosses nodes ({0,1,2} and {3,4,5} share node 1), so both
    # axes are priced on the network; node 1's NIC carries two groups' rings at once.
    assert listing(parse_devices("3x2xa10")) == [
        ((6,), ("net-100g",), (True,)),
        ((2, 3), ("net-100g/2", "net-100g/2"), (True, True)),
        ((3, 2), ("net-100g/2", "pcie4"), (True, False)),
    ]


def test_one_device():
    assert enumerate_meshes(parse_devices("cpu")) == [Mesh((1,), (0,), (LINKS["shm"],), (False,))]
    assert enumerate_meshes(parse_devices("h100")) == [Mesh((1,), (0,), (LINKS["nvlink4"],), (False,))]


def test_mixed_nodes_use_the_slowest_intra_link():
    assert listing(parse_devices("4xv100-32g+4xp100-16g")) == [
        ((8,), ("net-100g",), (True,)),
        ((2, 4), ("net-100g/4", "nvlink1"), (True, False)),
        ((4, 2), ("net-100g/2", "nvlink1"), (True, False)),
        ((2, 2, 2), ("net-100g/4", "nvlink1", "nvlink1"), (True, False, False)),
    ]


def test_uneven_nodes():
    # Nodes of 8 and 4: inner axes must divide both, and no axis may half-cross.
    assert [m.shape for m in enumerate_meshes(parse_devices("8xv100-32g+4xv100-32g"))] == [
        (12,), (3, 4), (6, 2), (3, 2, 2)]


def test_cpu_ranks_bottleneck_on_shared_memory():
    # One ring over 2 hosts of 4 CPU ranks: shm (10 GB/s) is slower than the network (12.5 GB/s),
    # but each step still waits for the network's latency.
    mesh = enumerate_meshes(parse_devices("2x4xcpu"))[0]
    assert mesh.links == (LinkSpec("shm+net-100g", 10e9, 14e-6),)


def test_a_ring_over_links_pays_the_largest_handoff_and_call_of_them():
    from parc.cluster.mesh import _bottleneck

    shm = LinkSpec("shm", 10e9, 1e-6, 8e-4, 3e-4)  # a calibrated host: slow to schedule
    net = LinkSpec("net", 12.5e9, 14e-6)
    assert _bottleneck([shm, net]) == LinkSpec("shm+net", 10e9, 14e-6, 8e-4, 3e-4)
    fast = LinkSpec("fast", 12.5e9, 1e-7, 0.0, 3e-4)
    assert _bottleneck([LinkSpec("slow", 1e9, 1e-6), fast]) == LinkSpec("slow", 1e9, 1e-6, 0.0, 3e-4)
    assert _bottleneck([shm, shm]) is shm
    slow_in_steps = LinkSpec("shm", 10e9, 1e-6, 8e-4, 3e-4, step_ratio=2.0)
    assert _bottleneck([slow_in_steps, net]).step_ratio == 2.0


def test_max_dims():
    cluster = parse_devices("2x8xa100-80g")
    assert [m.shape for m in enumerate_meshes(cluster, max_dims=1)] == [(16,)]
    assert len(enumerate_meshes(cluster, max_dims=4)) == 7 + 1  # adds 2x2x2x2
    with pytest.raises(ValueError, match="max_dims must be >= 1"):
        enumerate_meshes(cluster, max_dims=0)


def test_prime_count_has_only_the_flat_mesh():
    assert [m.shape for m in enumerate_meshes(parse_devices("7xcpu"))] == [(7,)]


def test_mesh_helpers():
    mesh = enumerate_meshes(one_port("2x8xa100-80g"))[1]
    assert str(mesh) == "2x8" and mesh.ndim == 2 and mesh.num_devices == 16
    assert mesh.describe() == "2x8 [net-100g/8, nvlink3]"
    assert mesh.coords(11) == (1, 3) and mesh.rank_at((1, 3)) == 11
    assert mesh.axis_groups(0) == tuple((i, i + 8) for i in range(8))
    assert mesh.axis_groups(1) == (tuple(range(8)), tuple(range(8, 16)))
    assert Mesh.from_json(mesh.to_json()) == mesh
    assert hash(mesh) == hash(Mesh.from_json(mesh.to_json()))


def test_mesh_is_canonicalised_and_checked():
    link = LINKS["pcie4"]
    mesh = Mesh([2, 2], [3, 2, 1, 0], [link, link])
    assert mesh.shape == (2, 2) and mesh.devices == (3, 2, 1, 0) and mesh.spans_nodes == (False, False)
    assert mesh.rank_at((0, 1)) == 2 and mesh.coords(0) == (1, 1)
    for shape, devices, links, message in [
        ((2, 2), (0, 1, 2), (link, link), "holds 4 devices, got 3"),
        ((2, 2), (0, 0, 1, 2), (link, link), "distinct ranks"),
        ((4,), (0, 1, 2, 3), (link, link), "one LinkSpec per axis"),
        ((), (), (), "at least one axis"),
        ((0,), (), (link,), "every size >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            Mesh(shape, devices, links)


# -- properties over random clusters ------------------------------------------------------------

node_sizes = st.one_of(
    st.tuples(st.integers(1, 6), st.integers(1, 8)).map(lambda t: [t[1]] * t[0]),  # regular
    st.lists(st.integers(1, 8), min_size=1, max_size=5),  # any
)


def cluster_of(sizes: list[int]) -> Cluster:
    return Cluster(tuple(Node((DEVICES["cpu"],) * s, LINKS["shm"]) for s in sizes), LINKS["net-400g"])


def owner(sizes: list[int]) -> list[int]:
    return [i for i, s in enumerate(sizes) for _ in range(s)]


def groups(shape: tuple[int, ...], axis: int) -> list[list[int]]:
    """Rank groups along `axis` of a row-major mesh over ranks 0..n-1, without numpy."""
    stride = math.prod(shape[axis + 1:])
    n = math.prod(shape)
    starts = [r for r in range(n) if (r // stride) % shape[axis] == 0]
    return [[s + j * stride for j in range(shape[axis])] for s in starts]


def ordered_factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(f, *rest) for f in range(2, n) if n % f == 0 for rest in ordered_factorizations(n // f, parts - 1)]


@settings(max_examples=150, deadline=None)
@given(node_sizes)
def test_enumerated_meshes_respect_nodes(sizes):
    cluster, node = cluster_of(sizes), owner(sizes)
    n = cluster.num_devices
    meshes = enumerate_meshes(cluster)
    assert meshes, sizes
    assert [(m.ndim, m.shape) for m in meshes] == sorted((m.ndim, m.shape) for m in meshes)  # stable order
    for mesh in meshes:
        assert math.prod(mesh.shape) == n and mesh.devices == tuple(range(n))
        assert n == 1 or all(s >= 2 for s in mesh.shape)
        for axis, spans in enumerate(mesh.spans_nodes):
            touched = [len({node[r] for r in g}) for g in groups(mesh.shape, axis)]
            if spans:  # crosses nodes in every group, over a link no faster than the network
                assert min(touched) > 1 and mesh.links[axis].bandwidth <= LINKS["net-400g"].bandwidth
            else:  # lies inside a node in every group, over the node's own link
                assert max(touched) == 1 and mesh.links[axis] == LINKS["shm"]
        inner = [not s for s in mesh.spans_nodes]
        assert inner == sorted(inner)  # the axes inside nodes are the innermost ones
        inner_size = math.prod(s for s, i in zip(mesh.shape, inner) if i)
        assert all(size % inner_size == 0 for size in sizes)  # ... and multiply to a divisor


@settings(max_examples=100, deadline=None)
@given(node_sizes)
def test_enumeration_is_complete(sizes):
    # Every factorization into 1..3 axes >= 2 with no axis half inside and half across nodes.
    cluster, node = cluster_of(sizes), owner(sizes)
    n = cluster.num_devices
    expected = []
    for parts in (1, 2, 3):
        for shape in (ordered_factorizations(n, parts) if n > 1 else []):
            mixed = False
            for axis in range(parts):
                touched = {len({node[r] for r in g}) > 1 for g in groups(shape, axis)}
                mixed |= len(touched) > 1
            if not mixed:
                expected.append(shape)
    assert [m.shape for m in enumerate_meshes(cluster)] == (expected or [(1,)])
