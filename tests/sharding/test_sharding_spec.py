"""ShardSpec: notation, JSON, canonical forms and the errors that quote the broken rule."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from shard_strategies import meshes, shapes, specs

from parc.errors import ParcError
from parc.sharding import P, Partial, R, Replicated, S, ShardSpec, ShardSpecError, Split, axis_from_json

props = settings(max_examples=60, deadline=None)


@pytest.mark.parametrize("text, axes", [
    ("R", (R,)),
    ("S(0)R", (S(0), R)),
    ("S(1,64)P(sum)", (S(1, 64), P("sum"))),
    ("S(0,[3,5])P(max)", (S(0, sizes=(3, 5)), P("max"))),
    ("RS(2)P(min)", (R, S(2), P("min"))),
])
def test_print_and_parse(text, axes):
    spec = ShardSpec(axes)
    assert str(spec) == text
    assert ShardSpec(text) == ShardSpec.parse(text) == spec
    assert repr(spec) == f"ShardSpec('{text}')"


def test_parse_is_liberal_in_spaces_and_keywords():
    assert ShardSpec(" S( 1 , stride = 64 ) P( sum ) ") == ShardSpec("S(1,64)P(sum)")
    assert ShardSpec("S(0, sizes=[3, 5]) R") == ShardSpec("S(0,[3,5])R")
    assert ShardSpec(("S(0)", "R")) == ShardSpec("S(0)R")


@pytest.mark.parametrize("text, rule", [
    ("", "needs one axis spec"),
    ("Q", "cannot parse sharding spec 'Q' at position 0"),
    ("S(0)X", "at position 4"),
    ("S(-1)", "dim must be an int >= 0"),
    ("S(0,0)", "stride must be an int >= 1"),
    ("P(prod)", "partial op must be one of sum, max, min"),
    ("P(mean)", "partial op must be one of"),
])
def test_malformed_specs(text, rule):
    with pytest.raises(ShardSpecError, match=rule.replace("(", r"\(").replace(")", r"\)")):
        ShardSpec(text)


def test_strided_uneven_is_rejected():
    with pytest.raises(ShardSpecError, match=r"S\(0, stride=2, sizes=\[1, 3\]\): a split is strided or uneven"):
        S(0, 2, sizes=(1, 3))


def test_errors_are_parc_errors_and_value_errors():
    with pytest.raises(ParcError):
        ShardSpec("P(avg)")
    with pytest.raises(ValueError):
        ShardSpec("P(avg)")


def test_immutable_and_hashable():
    spec = ShardSpec("S(0)R")
    with pytest.raises(AttributeError):
        spec.axes = (R, R)  # type: ignore[misc]
    assert {spec: 1}[ShardSpec((S(0), R))] == 1
    assert hash(S(0, sizes=[1, 2])) == hash(S(0, sizes=(1, 2)))
    assert isinstance(R, Replicated) and isinstance(S(0), Split) and isinstance(P(), Partial)


@props
@given(st.data())
def test_json_round_trip(data):
    shape, mesh = data.draw(shapes()), data.draw(meshes(3))
    spec = data.draw(specs(shape, mesh))
    text = json.dumps(spec.to_json())
    assert ShardSpec.from_json(json.loads(text)) == spec
    assert ShardSpec(str(spec)) == spec


@pytest.mark.parametrize("obj, rule", [
    ({"kind": "S"}, "dim must be an int"),
    ({"kind": "S", "dim": 0, "stride": 2, "extra": 1}, "unknown keys"),
    ({"kind": "X"}, "not an axis spec"),
    ({"kind": "S", "dim": 0, "sizes": 3}, "sizes must be a list"),
])
def test_json_errors(obj, rule):
    with pytest.raises(ShardSpecError, match=rule):
        axis_from_json(obj)
    with pytest.raises(ShardSpecError, match="list of axis specs"):
        ShardSpec.from_json({"axes": []})


@pytest.mark.parametrize("spec, shape, mesh, rule", [
    ("S(0)", (6,), (4,), r"sharding spec S\(0\) on mesh \(4,\) for shape \(6,\): mesh axis 0 \(4 devices\) "
                         r"splits dim 0 of extent 6 by S\(0\): 6 is not divisible by 4; an uneven split "
                         r"needs explicit sizes"),
    ("S(0)S(0)", (6,), (2, 2), r"mesh axis 1 \(2 devices\) splits dim 0 of extent 3 \(what mesh axes \[0\] "
                               r"left of it: a nested split"),
    ("S(0,4)", (12,), (2,), r"12 is not a multiple of stride\*devices = 4\*2 = 8"),
    ("S(2)", (4, 4), (2,), r"mesh axis 0 splits dim 2, but the tensor has rank 2"),
    ("S(0)R", (4,), (2,), r"2 axis specs for a 1-axis mesh"),
    ("S(0,[1,2])", (4,), (2,), r"the sizes sum to 3, not 4"),
    ("S(0,[1,2,1])", (4,), (2,), r"3 sizes given for 2 devices"),
    ("S(0,[1,3])S(0)", (4,), (2, 2), r"splits dim 0 of extent 1 \(what mesh axes \[0\]"),
])
def test_check_quotes_spec_mesh_and_rule(spec, shape, mesh, rule):
    with pytest.raises(ShardSpecError, match=rule):
        ShardSpec(spec).check(shape, mesh)


def test_uneven_nested_split_checks_every_piece():
    ShardSpec("S(0,[2,4])S(0)").check((6,), (2, 2))  # pieces 2 and 4 both halve
    with pytest.raises(ShardSpecError, match="extent 3"):
        ShardSpec("S(0,[3,3])S(0)").check((6,), (2, 2))


@pytest.mark.parametrize("spec, shape, mesh, want", [
    ("S(0,6)", (12,), (2,), "S(0)"),                 # stride E/n is the contiguous split
    ("S(0,3)", (12,), (2,), "S(0,3)"),
    ("S(0,[3,3])", (6,), (2,), "S(0)"),              # equal sizes are the even split
    ("S(0)P(sum)", (6,), (2, 1), "S(0)R"),           # a size-1 mesh axis holds everything
    ("S(1)S(1,2)", (2, 8), (2, 2), "S(1)S(1)"),      # strides are relative to the level extent
    ("S(1)S(1,2)", (2, 16), (2, 2), "S(1)S(1,2)"),
])
def test_canonical(spec, shape, mesh, want):
    assert ShardSpec(spec).canonical(shape, mesh) == ShardSpec(want)


@props
@given(st.data())
def test_canonical_is_idempotent(data):
    shape, mesh = data.draw(shapes()), data.draw(meshes(3))
    spec = data.draw(specs(shape, mesh)).canonical(shape, mesh)
    assert spec.canonical(shape, mesh) == spec
