"""`--devices` specs: every form of the grammar, every error, and the Cluster built from them."""

from __future__ import annotations

import pytest

from parc.cluster import DEVICES, LINKS, Cluster, Node, parse_devices, resolve_cluster
from parc.errors import UsageError


def layout(cluster: Cluster) -> list[tuple[int, str, str]]:
    """(devices, types, intra link) per node."""
    return [(len(n.devices), "+".join(dict.fromkeys(d.name for d in n.devices)), n.intra_link.name)
            for n in cluster.nodes]


@pytest.mark.parametrize("spec, nodes", [
    ("8xv100-32g", [(8, "v100-32g", "nvlink2")]),
    ("2x8xa100-80g", [(8, "a100-80g", "nvlink3")] * 2),
    ("v100-32g", [(1, "v100-32g", "nvlink2")]),
    ("16x1xv100-32g", [(1, "v100-32g", "nvlink2")] * 16),
    ("4xv100-32g+4xp100-16g", [(4, "v100-32g", "nvlink2"), (4, "p100-16g", "nvlink1")]),
    ("8xv100-32g+2x4xt4", [(8, "v100-32g", "nvlink2"), (4, "t4-16g", "pcie3"), (4, "t4-16g", "pcie3")]),
    ("(4xv100-32g+4xp100-16g)", [(8, "v100-32g+p100-16g", "nvlink1")]),
    ("2x(4xv100-32g+4xp100-16g)", [(8, "v100-32g+p100-16g", "nvlink1")] * 2),
    ("(2xa10+t4)", [(3, "a10-24g+t4-16g", "pcie3")]),
    ("cpu", [(1, "cpu", "shm")]),
    ("4xcpu", [(4, "cpu", "shm")]),
    ("2x4xcpu", [(4, "cpu", "shm")] * 2),
    ("8xH100", [(8, "h100-80g", "nvlink4")]),
    ("8xh200", [(8, "h200-141g", "nvlink4")]),
    ("4xa10", [(4, "a10-24g", "pcie4")]),
    (" 2 X 8 X A100-80GB ", [(8, "a100-80g", "nvlink3")] * 2),
    ("4xv100-32g + 4xp100-16g", [(4, "v100-32g", "nvlink2"), (4, "p100-16g", "nvlink1")]),
])
def test_spec_forms(spec, nodes):
    cluster = parse_devices(spec)
    assert layout(cluster) == nodes
    # the ports the SXM servers ship with (`SHIPPED_PORTS`), else one 100 Gb/s port
    link, nics = {"a100-80g": ("net-200g", 8), "h100-80g": ("net-400g", 8),
                  "h200-141g": ("net-400g", 8)}.get(nodes[0][1], ("net-100g", 1))
    assert cluster.inter_link == LINKS[link]
    assert all(node.nics == nics for node in cluster.nodes)


@pytest.mark.parametrize("spec, canonical", [
    ("8xv100-32g", "8xv100-32g"), ("2x8xa100-80g", "2x8xa100-80g"), ("cpu", "1xcpu"),
    ("16x1xv100-32g", "16x1xv100-32g"), ("4xv100-32g+4xp100-16g", "4xv100-32g+4xp100-16g"),
    ("8xv100-32g+8xv100-32g", "2x8xv100-32g"), ("2x(4xv100-32g+4xp100-16g)", "2x(4xv100-32g+4xp100-16g)"),
    ("(t4+t4+a10)", "(2xt4-16g+1xa10-24g)"),
])
def test_spec_round_trips(spec, canonical):
    cluster = parse_devices(spec)
    assert cluster.spec == canonical
    assert parse_devices(canonical) == cluster


@pytest.mark.parametrize("spec, message", [
    ("0xv100-32g", "--devices '0xv100-32g': counts must be between 1 and 65536, got 0"),
    ("2x0xv100-32g", "counts must be between 1 and 65536, got 0"),
    ("100000xcpu", "counts must be between 1 and 65536, got 100000"),
    ("65536x65536xcpu", "4294967296 devices; parc plans for at most 65536"),
    ("65536xcpu+cpu", "65537 devices; parc plans for at most 65536"),
    ("8x", "--devices '8x': expected a device type after '8x'"),
    ("2x8x", "expected a device type after '2x8x'"),
    ("", "--devices '': empty device group"),
    ("8xv100-32g+", "empty device group"),
    ("+8xv100-32g", "empty device group"),
    ("8xv100", "--devices '8xv100': device type 'v100' is ambiguous: say which of v100-16g, v100-32g"),
    ("8xa100", "device type 'a100' is ambiguous: say which of a100-40g, a100-80g"),
    ("8xrtx4090", "--devices '8xrtx4090': unknown device type 'rtx4090' (known: a10-24g, a100-40g, "),
    ("2x3x4xv100-32g", "'2x3x4xv100-32g' has more than two counts"),
    ("(8xv100-32g", "unbalanced parentheses"),
    ("8xv100-32g)", "unbalanced parentheses"),
    ("2x(2x4xv100-32g)", "'2x4xv100-32g' gives a node count inside a node"),
    ("((8xv100-32g))", "parentheses do not nest"),
    ("2x(8xv100-32g)x2", "parentheses must hold a whole node, as in [NODESx](COUNTxTYPE+...), not "),
    ("()", "empty device group"),
])
def test_spec_errors(spec, message):
    with pytest.raises(UsageError) as info:
        parse_devices(spec)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert text.startswith(f"--devices '{spec}': ")


def test_cluster_queries_mixed():
    cluster = parse_devices("4xv100-32g+4xp100-16g")
    assert cluster.num_devices == 8
    assert cluster.node_sizes == (4, 4)
    assert [cluster.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.name for d in cluster.devices] == ["v100-32g"] * 4 + ["p100-16g"] * 4
    assert cluster.memory_bytes == (32 * 2**30,) * 4 + (16 * 2**30,) * 4
    assert cluster.min_memory == 16 * 2**30
    assert cluster.peak_flops("float16") == (125e12,) * 4 + (21.2e12,) * 4
    assert not cluster.is_homogeneous and cluster.is_regular
    assert cluster.device_types == (DEVICES["v100-32g"], DEVICES["p100-16g"])
    assert str(cluster) == "4xv100-32g+4xp100-16g (8 devices in 2 nodes, inter-node net-100g)"


def test_cluster_queries_homogeneous_irregular():
    cluster = parse_devices("8xa100-80g+4xa100-80g")
    assert cluster.is_homogeneous and not cluster.is_regular
    assert cluster.node_of(7) == 0 and cluster.node_of(8) == 1 and cluster.node_of(11) == 1
    for bad in (-1, 12):
        with pytest.raises(ValueError, match="out of range"):
            cluster.node_of(bad)
    assert str(parse_devices("cpu")) == "1xcpu (1 device in 1 node, inter-node net-100g)"


def test_cluster_is_hashable_and_json_round_trips():
    a, b = parse_devices("2x8xa100-80g"), parse_devices("2x8xA100-80GB")
    assert a == b and hash(a) == hash(b)
    mixed = parse_devices("2x(4xv100-32g+4xp100-16g)+cpu")
    assert Cluster.from_json(mixed.to_json()) == mixed


def test_descriptors_reject_bad_values():
    with pytest.raises(ValueError, match="at least one device"):
        Node((), LINKS["pcie4"])
    with pytest.raises(ValueError, match="at least one NIC"):
        Node((DEVICES["cpu"],), LINKS["shm"], nics=0)
    with pytest.raises(ValueError, match="at least one node"):
        Cluster(())


def test_resolve_cluster_needs_exactly_one_source(tmp_path):
    assert resolve_cluster("8xv100-32g", None) == parse_devices("8xv100-32g")
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [{gpus: 8xv100-32g}]\n")
    assert resolve_cluster(None, str(path)) == parse_devices("8xv100-32g")
    for devices, cluster in ((None, None), ("8xv100-32g", str(path))):
        with pytest.raises(UsageError, match="^give exactly one of --devices SPEC and --cluster FILE$"):
            resolve_cluster(devices, cluster)


@pytest.mark.parametrize("spec, subsets", [
    ("8xv100-32g", []),  # one type: nothing to leave idle
    ("2x8xa100-80g", []),
    ("4xv100-32g+4xp100-16g", [("4xv100-32g", (0,))]),
    ("4xp100-16g+4xv100-32g", [("4xv100-32g", (1,))]),  # the fast node need not come first
    # three speeds: V100 alone, then V100 with P100 (the T4s idle)
    ("8xv100-32g+2x4xt4+4xp100-16g", [("8xv100-32g", (0,)), ("8xv100-32g+4xp100-16g", (0, 3))]),
    ("(4xv100-32g+4xp100-16g)", []),  # one mixed node: a node is kept or left whole
    ("(2xv100-32g+2xp100-16g)+4xv100-32g", [("4xv100-32g", (1,))]),
])
def test_the_clusters_that_leave_slower_devices_idle(spec, subsets):
    cluster = parse_devices(spec)
    found = cluster.without_slower({d.name: 1 / d.peak("float32") for d in cluster.devices})
    assert [(c.spec, kept) for c, kept in found] == subsets
    for c, kept in found:
        assert c.nodes == tuple(cluster.nodes[i] for i in kept) and c.inter_link == cluster.inter_link


def test_the_work_at_hand_ranks_the_devices():
    """The caller's times per type rank the devices (`parc plan` passes the step's own time on
    each), not the catalogue's peaks: reverse them and the other node is kept."""
    cluster = parse_devices("4xp100-16g+4xt4")
    assert [kept for _, kept in cluster.without_slower({"p100-16g": 1.0, "t4-16g": 2.3})] == [(0,)]
    assert [kept for _, kept in cluster.without_slower({"p100-16g": 2.0, "t4-16g": 1.0})] == [(1,)]
    assert cluster.without_slower({"p100-16g": 1.0, "t4-16g": 1.0}) == []  # equally fast: nothing to idle


def test_sxm_nodes_get_the_ports_they_ship_with():
    """A node of A100s has the DGX A100's 8 HDR ports (200 Gb/s), a node of H100s or H200s the
    DGX H100's 8 NDR ports (400 Gb/s); other types one 100 Gb/s port; a node mixing types the
    fewest ports of its types, and the cluster the slowest port among its nodes."""
    a100 = parse_devices("2x8xa100-80g")
    assert [n.nics for n in a100.nodes] == [8, 8] and a100.inter_link == LINKS["net-200g"]
    h100 = parse_devices("2x8xh100")
    assert [n.nics for n in h100.nodes] == [8, 8] and h100.inter_link == LINKS["net-400g"]
    v100 = parse_devices("2x8xv100-32g")
    assert [n.nics for n in v100.nodes] == [1, 1] and v100.inter_link == LINKS["net-100g"]
    mixed = parse_devices("(4xa100-80g+4xv100-32g)+8xh100")
    assert [n.nics for n in mixed.nodes] == [1, 8] and mixed.inter_link == LINKS["net-100g"]
    given = parse_devices("2x8xa100-80g", inter_link=LINKS["net-25g"])
    assert given.inter_link == LINKS["net-25g"]
    assert a100.links_text() == "nvlink3 inside, 8 x net-200g per node across"
    assert v100.links_text() == "nvlink2 inside, net-100g across"
    assert parse_devices("8xa100-80g").links_text() == "nvlink3 inside"
    # 2x8: the 8 groups that cross the nodes at once each have a port of their own
    from parc.cluster import enumerate_meshes
    assert enumerate_meshes(a100)[1].describe() == "2x8 [net-200g, nvlink3]"


def test_dgx_node_types():
    """`NODESxdgx-a100` is NODES DGX A100 servers: 8 A100-80GB on NVSwitch, 8 HDR ports each."""
    dgx = parse_devices("64xdgx-a100")
    assert dgx.num_devices == 512 and len(dgx.nodes) == 64
    assert dgx == parse_devices("64x8xa100-80g")
    node = dgx.nodes[0]
    assert node.devices == (DEVICES["a100-80g"],) * 8 and node.intra_link == LINKS["nvlink3"] and node.nics == 8
    h = parse_devices("dgx-h100+DGX-H100")
    assert len(h.nodes) == 2 and h.inter_link == LINKS["net-400g"] and h.nodes[0].intra_link == LINKS["nvlink4"]
    with pytest.raises(UsageError, match=r"dgx-a100 is a whole node of 8 a100-80g; write NODESxdgx-a100"):
        parse_devices("2x4xdgx-a100")


def test_node_types_and_port_counts_in_mixed_clusters():
    """Leaving V100 nodes idle gives the A100 nodes their own 200 Gb/s ports (the cluster's
    default link was the V100s' 100 Gb/s); nodes of several port counts say so in words; a node
    type inside parentheses is refused by name; `dgx_a100` is `dgx-a100`."""
    mixed = parse_devices("2xdgx-a100+2x8xv100-32g")
    assert mixed.inter_link == LINKS["net-100g"]
    times = {"a100-80g": 1.0, "v100-32g": 3.0}
    (alone, kept), = mixed.without_slower(times)
    assert kept == (0, 1) and alone == parse_devices(alone.spec) and alone.inter_link == LINKS["net-200g"]
    given = parse_devices("2xdgx-a100+2x8xv100-32g", inter_link=LINKS["net-25g"])
    assert given.without_slower(times)[0][0].inter_link == LINKS["net-25g"]  # a link given stays
    assert parse_devices("dgx-a100+8xv100-32g").links_text() == \
        "nvlink2, nvlink3 inside, net-100g across (1 or 8 ports a node)"
    assert parse_devices("2xdgx_a100") == parse_devices("2xdgx-a100")
    for spec in ("(dgx-a100)", "2x(4xa100-80g+dgx-a100)"):
        with pytest.raises(UsageError, match=r"dgx-a100 is a whole node of 8 a100-80g, not a device of one"):
            parse_devices(spec)
