"""The hints file: what it reads, and every mistake named by file, line and key."""

from __future__ import annotations

import logging
import textwrap

import pytest

from parc.errors import UsageError
from parc.hints import Hints, Pin, Request, Scope, load_hints, warn_once
from parc.sharding import ShardSpec

EXAMPLE = """\
default: replicate
scopes:
  - match: "h\\\\.[0-9]+\\\\.mlp\\\\."
    split: 4
  - match: "^embed"
    replicate: 8
pins:
  wte.weight: "S(0)"
  h.0.attn.qkv.weight: "S(1,64)R"
"""


def write(tmp_path, text: str, name: str = "hints.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def fails(tmp_path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as e:
        load_hints(path)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:")
    return message[len(str(path)):]


def test_reads_scopes_pins_and_default(tmp_path):
    h = load_hints(write(tmp_path, EXAMPLE))
    assert h.default == Request("replicate", None)
    assert [(s.match, s.request) for s in h.scopes] == [
        (r"h\.[0-9]+\.mlp\.", Request("split", 4)), ("^embed", Request("replicate", 8))]
    assert h.scopes[0].regex.search("h.11.mlp.fc.matmul") and not h.scopes[0].regex.search("h.1.attn.x")
    assert h.scopes[0].where.endswith("hints.yaml:3: scopes[0]")
    assert [(p.tensor, p.spec) for p in h.pins] == [
        ("wte.weight", ShardSpec("S(0)")), ("h.0.attn.qkv.weight", ShardSpec("S(1,64)R"))]
    assert h.pins[0].where.endswith("hints.yaml:8: pins.wte.weight")
    assert h.to_json()["scopes"] == [{"match": r"h\.[0-9]+\.mlp\.", "split": 4}, {"match": "^embed", "replicate": 8}]
    assert h.to_json()["default"] == {"replicate": None}


def test_default_is_auto_and_may_carry_a_count(tmp_path):
    assert load_hints(write(tmp_path, "scopes: []\n")).default is None
    assert load_hints(write(tmp_path, "default: auto\n")).default is None
    assert load_hints(write(tmp_path, "default: split\n")).default == Request("split", None)
    assert load_hints(write(tmp_path, "default: {replicate: 2}\n")).default == Request("replicate", 2)


@pytest.mark.parametrize("text, where, what", [
    ('scopes:\n  - match: "h\\\\.["\n    split: 4\n', ":2: scopes[0].match:", "invalid regular expression"),
    ("scopes:\n  - match: a\n    split: 2\n  - match: b\n    split: 2\n    replicate: 2\n",
     ":4: scopes[1]:", "not both"),
    ("scopes:\n  - match: a\n", ":2: scopes[0]:", "missing replicate: N, split: N or stage: K"),
    ("scopes:\n  - split: 2\n", ":2: scopes[0]:", "missing key 'match'"),
    ("scopes:\n  - match: a\n    stage: -1\n", ":3: scopes[0].stage:", "stage number >= 0"),
    ("scopes:\n  - match: a\n    stage: one\n", ":3: scopes[0].stage:", "stage number >= 0"),
    ("scopes:\n  - match: a\n    split: 0\n", ":3: scopes[0].split:", "positive integer"),
    ("scopes:\n  - match: a\n    replicate: -2\n", ":3: scopes[0].replicate:", "positive integer"),
    ("scopes:\n  - match: a\n    split: 2.5\n", ":3: scopes[0].split:", "positive integer"),
    ("scopes:\n  - match: a\n    split: four\n", ":3: scopes[0].split:", "'four'"),
    ("scopes:\n  - match: a\n    split: true\n", ":3: scopes[0].split:", "positive integer"),
    ("scopes:\n  - match: a\n    split: 2\n    devices: 3\n", ":4: scopes[0].devices:", "unknown key"),
    ("scopes:\n  - match: ''\n    split: 2\n", ":2: scopes[0].match:", "regular expression"),
    ("scopes:\n  - match: 7\n    split: 2\n", ":2: scopes[0].match:", "regular expression"),
    ("scopes:\n  match: a\n", ":2: scopes:", "expected a list"),
    ("pins:\n  wte.weight: \"S(0\"\n", ":2: pins.wte.weight:", "cannot parse sharding spec"),
    ("pins:\n  wte.weight: 3\n", ":2: pins.wte.weight:", "sharding spec string"),
    ("pins:\n  - wte.weight\n", ":2: pins:", "expected a mapping"),
    ("default: manual\n", ":1: default:", "expected auto, replicate, split"),
    ("default: {split: 2, replicate: 2}\n", ":1: default:", "not both"),
    ("defaults: auto\n", ":1: defaults:", "unknown key"),
    ("scopes:\n  - match: a\n    split: 2\n  - match: a\n    split: 2\n    split: 3\n",
     ":6: scopes[1].split:", "key given twice"),
    ("scopes: [\n", ":2:", "not valid YAML"),
])
def test_every_error_names_file_line_and_key(tmp_path, text, where, what):
    message = fails(tmp_path, text)
    assert message.startswith(where), message
    assert what in message, message


def test_empty_file_is_refused(tmp_path):
    assert "empty" in fails(tmp_path, "")


def test_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="cannot read"):
        load_hints(tmp_path / "absent.yaml")


def test_merged_keeps_our_pins_and_default_and_appends_scopes():
    ours = Hints((Scope("a", Request("split", 2)),), (Pin("w", ShardSpec("S(0)")),), None, source="f.yaml")
    theirs = Hints((Scope("b", Request("replicate", 2)),),
                   (Pin("w", ShardSpec("R")), Pin("x", ShardSpec("S(1)"))), Request("replicate", None), source="m.onnx")
    both = ours.merged(theirs)
    assert [s.match for s in both.scopes] == ["a", "b"]
    assert [(p.tensor, str(p.spec)) for p in both.pins] == [("w", "S(0)"), ("x", "S(1)")]
    assert both.default == Request("replicate", None) and both.source == "f.yaml+m.onnx"
    assert Hints().empty and not both.empty


def test_requests_check_themselves():
    with pytest.raises(ValueError):
        Request("shard", 2)
    with pytest.raises(ValueError):
        Request("split", 0)
    assert str(Request("split", 4)) == "split(4)" and str(Request("replicate", None)) == "replicate(all)"
    with pytest.raises(UsageError, match=r"<hints>\.match: invalid regular expression"):
        Scope("(", Request("split", 2))


def test_warn_once_logs_each_warning_once(caplog):
    seen: set[str] = set()
    with caplog.at_level(logging.WARNING, logger="parc.hints"):
        warn_once(["hints.yaml:4: scopes[0].match: 'x' matches no node"], seen)
        warn_once(["hints.yaml:4: scopes[0].match: 'x' matches no node", "other"], seen)
    assert [r.getMessage() for r in caplog.records] == ["hints.yaml:4: scopes[0].match: 'x' matches no node", "other"]


def test_stage_scopes(tmp_path):
    hints = load_hints(write(tmp_path, 'scopes:\n  - match: "^h\\\\.1"\n    stage: 1\n  - match: b\n'
                                        '    split: 2\n    stage: 0\n'))
    assert hints.scopes[0].stage == 1 and hints.scopes[0].request is None
    assert hints.scopes[1].stage == 0 and hints.scopes[1].request == Request("split", 2)
    assert hints.scopes[0].to_json() == {"match": "^h\\.1", "stage": 1}
