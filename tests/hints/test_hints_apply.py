"""Hints as pins on a real cost model (a gpt-tiny SGD training step on 4 A100s), solved."""

from __future__ import annotations

import math
import textwrap
from collections import Counter

import numpy as np
import onnx
import pytest

from parc.autodiff import OptimizerConfig, make_training_step
from parc.cluster import enumerate_meshes, parse_devices
from parc.errors import UsageError
from parc.hints import (
    AnnotationError,
    Hints,
    IneligibleMeshError,
    Pin,
    check_mesh,
    encode,
    load_hints,
    param_names,
    read_annotations,
    scope_names,
    write_sharded_model,
)
from parc.ir import load, save
from parc.models import build_model
from parc.passes.spmd.costs import build
from parc.passes.spmd.pins import hint_pins
from parc.passes.spmd.strategies import PARTIAL
from parc.sharding import Replicated, ShardSpec, Split, reshard
from parc.solver import solve

CLUSTER = parse_devices("4xa100-80g")


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    graph = load(build_model("gpt-tiny", tmp_path_factory.mktemp("m") / "gpt.onnx", {"batch": "8"}))
    make_training_step(graph, OptimizerConfig("sgd"))
    return graph


@pytest.fixture(scope="module")
def flat(step):
    mesh = enumerate_meshes(CLUSTER)[0]
    assert mesh.shape == (4,)
    return build(step, mesh, CLUSTER)


@pytest.fixture(scope="module")
def square(step):
    mesh = enumerate_meshes(CLUSTER)[1]
    assert mesh.shape == (2, 2)
    return build(step, mesh, CLUSTER)


@pytest.fixture
def hints(tmp_path):
    def make(text: str) -> Hints:
        path = tmp_path / "hints.yaml"
        path.write_text(textwrap.dedent(text))
        return load_hints(path)
    return make


def chosen(model, pins):
    """The solved strategy of every node, by name (pins applied)."""
    solution = solve(model.problem.restricted(pins), "O3")
    x = solution.choice
    nodes = {n.name: model.strategies[pos][x[model.node_index(pos)]] for pos, n in enumerate(model.graph.nodes)}
    sources = {v.name: model.source_specs[k][x[k]] for k, v in enumerate(model.sources)}
    return nodes, sources, solution


def param_inputs(model, node):
    params = param_names(model.graph)
    sources = {id(v) for v in model.sources}
    return [i for i, v in enumerate(node.inputs) if v is not None and id(v) in sources and v.name in params]


def pieces(spec, mesh_shape):
    return math.prod(m for a, m in zip(spec, mesh_shape) if isinstance(a, Split))


def node(model, name):
    return next((pos, n) for pos, n in enumerate(model.graph.nodes) if n.name == name)


def test_backward_and_optimizer_nodes_take_their_forward_nodes_scope(step):
    names = dict(zip((n.name for n in step.nodes), scope_names(step)))
    assert names["h.0.mlp.fc.matmul"] == "h.0.mlp.fc.matmul"
    assert names["h.0.mlp.fc.matmul.grad.Gemm_0"] == "h.0.mlp.fc.matmul"  # the weight's gradient
    assert names["h.0.mlp.fc.weight.update.Sub_0"] == "h.0.mlp.fc.matmul"  # the parameter's first reader
    assert names["wte.weight.update.Sub_0"] == "wte.gather"  # tied: the embedding reads it first
    assert "h.0.mlp.fc.weight" in param_names(step)


def test_split_4_on_an_mlp_shards_its_weights(flat, hints):
    h = hints(r"""
        scopes:
          - match: "h\\.0\\.mlp\\."
            split: 4
    """)
    pins, warnings = hint_pins(flat, h)
    assert warnings == []
    nodes, sources, _ = chosen(flat, pins)
    for name, weight in (("h.0.mlp.fc.matmul", "h.0.mlp.fc.weight"), ("h.0.mlp.proj.matmul", "h.0.mlp.proj.weight")):
        _, n = node(flat, name)
        s = nodes[name]
        assert pieces(s.inputs[1], (4,)) == 4, (name, s)  # the weight is split four ways
        assert str(s) in ("n", "k") and pieces(sources[weight], (4,)) == 4
    # every parameter reader of the scope (forward, backward, optimizer) obeys; the others are free
    names = dict(zip((n.name for n in flat.graph.nodes), scope_names(flat.graph)))
    constrained = 0
    for pos, n in enumerate(flat.graph.nodes):
        inputs = param_inputs(flat, n)
        if inputs and names[n.name].startswith("h.0.mlp."):
            constrained += 1
            assert flat.node_index(pos) in pins
            assert any(pieces(nodes[n.name].inputs[i], (4,)) == 4 for i in inputs), n.name
        elif not names[n.name].startswith("h.0.mlp."):
            assert flat.node_index(pos) not in pins
    assert constrained >= 10


def test_replicate_4_everywhere_is_data_parallel(flat, hints):
    pins, warnings = hint_pins(flat, hints("""
        scopes:
          - match: "."
            replicate: 4
    """))
    assert warnings == []
    nodes, sources, _ = chosen(flat, pins)
    labels = Counter()
    for n in flat.graph.nodes:
        inputs = param_inputs(flat, n)
        if not inputs:
            continue
        s = nodes[n.name]
        assert all(isinstance(a, Replicated) for i in inputs for a in s.inputs[i]), n.name
        if n.meta["parc.phase"] == "forward":
            assert s.split == 4, n.name
            if n.op_type == "MatMul":
                labels[str(s)] += 1
    assert labels.most_common(1)[0][0] == "b0"  # the batch: data parallelism
    # an update cannot divide its work with its parameter replicated: it runs on every replica
    assert nodes["h.0.mlp.fc.weight.update.Sub_0"].split == 1
    assert all(str(sources[p]) == "R" for p in param_names(flat.graph))


def test_default_requests_cover_the_nodes_no_scope_matches(flat, hints):
    pins, _ = hint_pins(flat, hints(r"""
        default: replicate
        scopes:
          - match: "^h\\.0\\.mlp\\."
            split: 4
    """))
    inside, _ = node(flat, "h.0.mlp.fc.matmul")
    outside, _ = node(flat, "h.1.mlp.fc.matmul")
    assert {str(flat.strategies[inside][j]) for j in pins[flat.node_index(inside)]} == {"k", "n"}
    assert {str(flat.strategies[outside][j]) for j in pins[flat.node_index(outside)]} == {"b0", "m"}
    softmax, _ = node(flat, "h.1.attn.softmax")
    assert flat.node_index(softmax) not in pins  # no parameter: left to the search


def test_a_count_no_mesh_axes_multiply_to_makes_the_mesh_ineligible(flat, square, hints):
    three = hints("scopes:\n  - match: mlp\n    split: 3\n")
    with pytest.raises(IneligibleMeshError, match=r"split\(3\)"):
        check_mesh(flat.graph, three, (2, 2))  # before building a cost model
    for model in (flat, square):
        with pytest.raises(IneligibleMeshError, match=r"hints.yaml:2: scopes\[0\]: split\(3\) needs mesh axes"):
            hint_pins(model, three)
    two = hints("scopes:\n  - match: mlp\n    split: 2\n")
    with pytest.raises(IneligibleMeshError, match=r"mesh 4 offers \[1, 4\]") as e:
        hint_pins(flat, two)
    assert e.value.mesh_shape == (4,)
    pins, _ = hint_pins(square, two)
    pos, n = node(square, "h.0.mlp.fc.matmul")
    allowed = [square.strategies[pos][j] for j in pins[square.node_index(pos)]]
    assert allowed and all(pieces(s.inputs[1], (2, 2)) == 2 for s in allowed)
    with pytest.raises(IneligibleMeshError, match=r"hints.yaml:1: default: replicate\(8\) needs mesh axes"):
        hint_pins(square, hints("default: {replicate: 8}\n"))


def test_replicate_2_on_a_2x2_mesh_divides_the_work_two_ways(square, hints):
    pins, _ = hint_pins(square, hints("scopes:\n  - match: '.'\n    replicate: 2\n"))
    pos, n = node(square, "h.0.mlp.fc.matmul")
    allowed = [square.strategies[pos][j] for j in pins[square.node_index(pos)]]
    assert allowed and all(s.split == 2 and str(s.inputs[1]) == "RR" for s in allowed)


def test_nodes_that_cannot_obey_are_left_free_with_a_warning(flat, hints):
    pins, warnings = hint_pins(flat, hints(r"""
        scopes:
          - match: "^h\\.0\\.ln_1\\."
            split: 4
    """))
    pos, _ = node(flat, "h.0.ln_1.layernorm")  # LayerNormalization cannot split its weight
    assert flat.node_index(pos) not in pins
    assert len(warnings) == 1
    assert "hints.yaml:3: scopes[0]: split(4): on mesh 4 no strategy of h.0.ln_1.layernorm" in warnings[0]
    assert warnings[0].endswith("obeys it; left to the search")


def test_a_regex_that_matches_no_node_is_a_warning_naming_its_line(flat, hints):
    pins, warnings = hint_pins(flat, hints("""
        scopes:
          - match: "^h\\\\.0\\\\.mlp"
            split: 4
          - match: "^decoder"
            replicate: 4
    """))
    assert pins and len(warnings) == 1
    assert warnings[0].endswith("hints.yaml:5: scopes[1].match: '^decoder' matches no node (scope ignored)")


def test_pins_fix_a_source_layout_and_a_producers_strategies(flat, hints):
    pins, _ = hint_pins(flat, hints("""
        pins:
          wte.weight: "S(0)"
          h.0.mlp.fc.matmul: "S(2)"
          h.0.mlp.proj.matmul: "P(sum)"
    """))
    k = next(k for k, v in enumerate(flat.sources) if v.name == "wte.weight")
    assert [str(flat.source_specs[k][j]) for j in pins[k]] == ["S(0)"]
    nodes, sources, _ = chosen(flat, pins)
    assert str(sources["wte.weight"]) == "S(0)"
    # P(sum) out of the second matmul: row-parallel, or a partial sum passed through
    assert str(nodes["h.0.mlp.fc.matmul"]) == "n" and str(nodes["h.0.mlp.proj.matmul"]) in ("k", "+")


def test_pins_match_after_canonicalisation(flat):
    # S(1,64) over 4 devices of a (64, 256) weight is the contiguous S(1)
    pins, _ = hint_pins(flat, Hints(pins=(Pin("h.0.mlp.fc.weight", ShardSpec("S(1,64)")),)))
    k = next(k for k, v in enumerate(flat.sources) if v.name == "h.0.mlp.fc.weight")
    assert {str(flat.source_specs[k][j].canonical((64, 256), (4,))) for j in pins[k]} == {"S(1)"}


def test_pin_errors(flat, square, hints):
    with pytest.raises(UsageError, match=r"hints.yaml:3: pins.wte.weihgt: no tensor named 'wte.weihgt' in the "
                                         r"graph \(did you mean 'wte.weight'\?\)"):
        hint_pins(flat, hints("\npins:\n  wte.weihgt: S(0)\n"))
    odd = next(v for v in flat.sources if v.shape and v.shape[0] % 4 and v.shape[0] > 1)
    with pytest.raises(UsageError, match=rf"pins.{odd.name}: {odd.name} pinned to S\(0\): mesh 4 cannot divide "
                                         rf"a pinned dim of shape") as e:
        hint_pins(flat, Hints(pins=(Pin(odd.name, ShardSpec("S(0)"), f"hints.yaml:2: pins.{odd.name}"),)))
    assert isinstance(e.value, IneligibleMeshError)  # the search may skip this mesh and try others
    with pytest.raises(IneligibleMeshError, match="1 axis specs for the 2-axis mesh 2x2"):
        hint_pins(square, hints("pins:\n  wte.weight: S(0)\n"))
    with pytest.raises(IneligibleMeshError, match="for mesh 2x2, not 4"):
        hint_pins(flat, Hints(pins=(Pin("wte.weight", ShardSpec("S(0)"), mesh=(2, 2)),)))
    with pytest.raises(IneligibleMeshError, match="no strategy on mesh 4 lays it out so"):
        hint_pins(flat, hints("pins:\n  h.0.ln_1.layernorm: S(2)\n"))  # LayerNorm keeps its last dim
    _, warnings = hint_pins(flat, Hints(pins=(Pin("folded", ShardSpec("R"), "m.onnx: node x", required=False),)))
    assert warnings == ["m.onnx: node x: no tensor named 'folded' in the graph (pin ignored)"]


def test_a_pin_overrides_a_scope_it_contradicts(flat, hints):
    pins, warnings = hint_pins(flat, hints(r"""
        scopes:
          - match: "^h\\.0\\.mlp\\.fc\\.matmul$"
            split: 4
        pins:
          h.0.mlp.fc.matmul: "S(0)"
    """))
    pos, _ = node(flat, "h.0.mlp.fc.matmul")
    assert [str(flat.strategies[pos][j]) for j in pins[flat.node_index(pos)]] == ["b0"]
    assert any("the pin overrides the scope request on h.0.mlp.fc.matmul's producer" in w for w in warnings)


# -- Whale's bridge (3.2.3): resharding between scopes is the edge cost ---------------------------

_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1, "reduce_scatter": lambda n: n - 1,
          "all_to_all": lambda n: n - 1}


def alpha_beta(src, dst, v, mesh) -> float:
    """The bridge's time from `parc.sharding.reshard`'s collectives, priced on the mesh links."""
    total = 0.0
    for c in reshard(src, dst, v.shape, v.dtype.itemsize, mesh.shape):
        if not c.is_local:
            link = mesh.links[c.axis]
            total += _STEPS[c.kind](c.n) * link.latency + c.bytes_per_device / link.bandwidth
    return total


def edge_cost(model, u, v) -> np.ndarray:
    p = model.problem
    e = next(e for e, (a, b) in enumerate(p.edges.tolist()) if (a, b) == (u, v))
    return p.comm[e]


def test_a_split_to_replicate_bridge_costs_the_reshard_and_same_dim_is_free(flat):
    """fc.matmul (split scope, output S(2)) feeds fc.add: gathering to R costs what reshard says;
    when the next scope partitions the same dim, the gather and the split cancel (free)."""
    pu, producer = node(flat, "h.0.mlp.fc.matmul")
    pv, _ = node(flat, "h.0.mlp.fc.add")
    value = producer.outputs[0]
    comm = edge_cost(flat, flat.node_index(pu), flat.node_index(pv))
    ju = next(j for j, s in enumerate(flat.strategies[pu]) if str(s.outputs[0]) == "S(2)")
    to_r = next(j for j, s in enumerate(flat.strategies[pv]) if str(s.inputs[0]) == "R")
    to_same = next(j for j, s in enumerate(flat.strategies[pv]) if str(s.inputs[0]) == "S(2)")
    bridge = alpha_beta(ShardSpec("S(2)"), ShardSpec("R"), value, flat.mesh)
    assert [c.kind for c in reshard("S(2)", "R", value.shape, 4, (4,))] == ["all_gather"]
    assert bridge > 0 and comm[ju, to_r] == pytest.approx(bridge)
    assert reshard("S(2)", "S(2)", value.shape, 4, (4,)) == [] and comm[ju, to_same] == 0.0


def test_a_solved_hybrid_plan_pays_exactly_its_bridges(flat, hints):
    """split(4) on the MLP of block 0, replicate(4) elsewhere: every edge the plan crosses costs
    the reshard of the chosen layouts, and the plan's cost is compute plus those bridges."""
    h = hints(r"""
        default: replicate
        scopes:
          - match: "^h\\.0\\.mlp\\."
            split: 4
    """)
    pins, _ = hint_pins(flat, h)
    _, _, solution = chosen(flat, pins)
    x, p, g = solution.choice, flat.problem, flat.graph
    n_src = len(flat.sources)
    layout = {id(v): flat.source_specs[k][x[k]] for k, v in enumerate(flat.sources)}
    for pos, n in enumerate(g.nodes):
        for v, spec in zip(n.outputs, flat.strategies[pos][x[flat.node_index(pos)]].outputs):
            layout[id(v)] = spec
    names = scope_names(g)
    crossings = 0
    for (u, v), comm in zip(p.edges.tolist(), p.comm):
        if u < n_src or v < n_src:
            continue
        producer, consumer = g.nodes[u - n_src], g.nodes[v - n_src]
        if names[u - n_src].startswith("h.0.mlp.") == names[v - n_src].startswith("h.0.mlp."):
            continue
        strategy = flat.strategies[v - n_src][x[v]]
        want = sum(alpha_beta(layout[id(val)], strategy.inputs[i], val, flat.mesh)
                   for i, val in enumerate(consumer.inputs) if val is not None and val.producer is producer)
        assert comm[x[u], x[v]] == pytest.approx(want, abs=1e-15)
        crossings += want > 0
    assert crossings > 0
    total = sum(p.comp[i][x[i]] for i in range(p.n)) + sum(c[x[u], x[v]] for (u, v), c in zip(p.edges.tolist(), p.comm))
    assert solution.cost == pytest.approx(total)


# -- a plan written as ONNX annotations and read back --------------------------------------------

@pytest.mark.parametrize("which", ["flat", "square"])
def test_a_plans_layouts_round_trip_through_the_onnx_annotations(which, step, request, tmp_path):
    """Every value laid out by some strategy (the widest split of each node, so partial and
    strided layouts occur too): what ONNX can express reads back as the canonical spec."""
    model = request.getfixturevalue(which)
    shape = model.mesh.shape
    specs = {v.name: str(s[-1]) for v, s in zip(model.sources, model.source_specs)}
    values = {v.name: v for v in model.sources}
    for n, strategies in zip(model.graph.nodes, model.strategies):
        widest = [s for s in strategies if PARTIAL not in s.labels][-1]
        for v, spec in zip(n.outputs, widest.outputs):
            specs[v.name] = str(spec)
            values[v.name] = v
    save(model.graph, tmp_path / "step.onnx")
    shapes = {v.name: v.shape for v in model.graph.values() if v.shape is not None}
    out = write_sharded_model(tmp_path / "step.onnx", specs, shape, tmp_path / "model.sharded.onnx", shapes=shapes)
    onnx.checker.check_model(str(out))
    back = {p.tensor: p.spec for p in read_annotations(out).pins}
    expressible = {}
    for name, text in specs.items():
        v = values[name]
        try:
            encode(name, ShardSpec(text), shape, v.shape)
        except AnnotationError:
            continue
        expressible[name] = ShardSpec(text).canonical(v.shape, shape)
    assert len(expressible) > 0.8 * len(specs)
    assert {k: back[k] for k in expressible if k in back} == expressible
    assert set(expressible) <= set(back)
