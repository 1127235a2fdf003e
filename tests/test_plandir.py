"""The plan directory's formats: program.json round trips and refusals, plan.json versions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from parc.errors import PlanFormatError
from parc.plandir import (
    PLAN_FORMATS,
    PROGRAM_FORMAT,
    Program,
    check_plan,
    load_program,
    program_path,
    rank_dir,
    write_program,
)


def _resident(name: str, kind: str, shape: list[int], local: list[int], **extra) -> dict:
    return {"name": name, "kind": kind, "spec": "S(0)" if shape != local else "R", "shape": shape,
            "local": local, "dtype": 1, "high": None, **extra}


def _program(rank: int = 1) -> Program:
    """Rank 1 of a data-parallel step on 2 devices and 2 microbatches."""
    return Program(
        rank=rank, coords=(0, rank), mesh=(2, 2), micro_batches=2,
        residents=(_resident("x", "data", [8, 4], [2, 4]),
                   _resident("w", "state", [4, 4], [4, 4], init={"mean": 0.0, "std": 0.02})),
        outputs={"loss": "loss.acc", "w.new": "w.new"},
        accumulate={"loss.acc": ["loss", "sum"], "y.acc": ["y", "concat", 0]},
        bindings={"w.new": "w"}, loss="loss")


def _staged(rank: int = 3) -> Program:
    """The same as the second stage of a pipeline on ranks 2 and 3."""
    data = _resident("x", "data", [8, 4], [8, 4])
    return replace(_program(rank), stage=1, stages=2, stage_ranks=[2, 3], data_inputs=[data], reporter=2)


@pytest.mark.parametrize("program", [_program(), _staged()], ids=["one-mesh", "pipeline-stage"])
def test_program_round_trips(tmp_path, program):
    path = write_program(tmp_path, program)
    assert path == rank_dir(tmp_path, program.rank) / "program.json" == program_path(tmp_path, program.rank)
    loaded = load_program(tmp_path, program.rank)
    assert loaded == program
    assert isinstance(loaded.coords, tuple) and isinstance(loaded.residents, tuple)
    doc = json.loads(path.read_text())
    assert doc["format"] == PROGRAM_FORMAT
    assert ("stage" in doc) == (program.stage is not None)
    write_program(tmp_path / "again", loaded)  # same program, same bytes
    assert program_path(tmp_path / "again", program.rank).read_bytes() == path.read_bytes()


def _set(key, value):
    def damage(doc):
        doc[key] = value
    return damage


@pytest.mark.parametrize("damage, needle", [
    (_set("format", "parc.program/9"), "unknown format 'parc.program/9' (this parc reads 'parc.program/1')"),
    (lambda d: d.pop("format"), "missing key 'format'"),
    (lambda d: d.pop("residents"), "missing key 'residents'"),
    (_set("micro_batches", "2"), "key 'micro_batches' should be an integer, found str"),
    (_set("micro_batches", True), "key 'micro_batches' should be an integer, found bool"),
    (_set("coords", [0, "1"]), "key 'coords' should be a list of integers"),
    (_set("loss", 3), "key 'loss' should be a string or null, found int"),
    (_set("outputs", {"loss": 1}), "key 'outputs.loss' should be a string, found int"),
    (_set("accumulate", {"y.acc": ["y", "concat"]}), "key 'accumulate.y.acc' should be [value, one of sum"),
    (lambda d: d["residents"][1].pop("spec"), "missing key 'residents[1].spec'"),
    (lambda d: d["residents"][0].__setitem__("shape", "8x4"), "key 'residents[0].shape' should be a list"),
    (lambda d: d["residents"][1]["init"].pop("std"), "missing key 'residents[1].init.std'"),
    (_set("stage", 0), "missing key 'stages'"),  # the stage keys come together
    (_set("rank", 0), "key 'rank' should be 1 (the directory's rank), found 0"),
])
def test_load_program_refuses_a_bad_program(tmp_path, damage, needle):
    path = write_program(tmp_path, _program())
    doc = json.loads(path.read_text())
    damage(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanFormatError) as e:
        load_program(tmp_path, 1)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and needle in message and "\n" not in message


@pytest.mark.parametrize("text, needle", [
    ('{"format": "parc.program/1",', "not valid JSON"),
    ("[1, 2]", "expected a JSON object, found list"),
])
def test_load_program_refuses_what_is_not_a_program(tmp_path, text, needle):
    path = program_path(tmp_path, 0)
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(PlanFormatError, match=needle) as e:
        load_program(tmp_path, 0)
    assert str(e.value).startswith(f"{path}: ")


def test_load_program_names_a_missing_file(tmp_path):
    with pytest.raises(PlanFormatError) as e:
        load_program(tmp_path, 2)
    assert str(e.value).startswith(f"{tmp_path / 'rank_2' / 'program.json'}: missing")


def test_check_plan_accepts_exactly_the_versions_parc_writes():
    """What the planners write is tested where they plan (tests/exec, tests/report); here the
    reader: each version in PLAN_FORMATS passes, the next one is refused with the file named."""
    plan = {"mesh": {"shape": [2]}, "predicted": {"step_time_s": 1.0, "compute_s": 1.0, "comm_s": 0.0,
                                                  "memory_bytes_per_device": [1, 1], "memory_budget_bytes": 2},
            "specs": {}, "strategies": {}}
    for version in PLAN_FORMATS:
        check_plan({"format_version": version, **plan})
    with pytest.raises(PlanFormatError, match=r"^p/plan.json: unknown format_version 3"):
        check_plan({"format_version": max(PLAN_FORMATS) + 1, **plan}, "p/plan.json")
