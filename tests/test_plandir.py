"""The plan directory's formats: program.json round trips and refusals, plan.json versions."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parc.errors import PlanFormatError
from parc.plandir import (
    PLAN_FORMAT,
    PROGRAM_FORMAT,
    Plan,
    Program,
    check_plan,
    load_plan,
    load_program,
    program_path,
    rank_dir,
    write_plan,
    write_program,
)
from parc.plandir.plan import (
    ROLES,
    Baseline,
    MeshLayout,
    ModelRef,
    ParameterRole,
    Prediction,
    Schedule,
    Stage,
    StepRoles,
    Tensor,
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


def _plan_doc(version=PLAN_FORMAT) -> dict:
    from parc.cluster import parse_devices

    return {"format_version": version, "cluster": parse_devices("2xa100-80g").to_json(), "mesh": {"shape": [2]},
            "stages": [{"id": 0, "devices": [0, 1], "mesh": [2], "device_types": ["a100-80g"], "nodes": 0,
                        "step_time_s": 1.0, "memory_bytes_per_device": 1, "parameters": 0}],
            "schedule": {"kind": "1f1b", "micro_batches": 1},
            "predicted": {"step_time_s": 1.0, "compute_s": 1.0, "comm_s": 0.0, "memory_bytes_per_device": [1, 1],
                          "memory_budget_bytes": 2},
            "specs": {}, "strategies": {}}


def test_check_plan_accepts_exactly_the_format_parc_writes():
    """What the planners write is tested where they plan (every write checks that it reads back);
    here the reader: the current format passes, an older one says to plan again, a newer one is
    unknown, each with the file named."""
    check_plan(_plan_doc())
    for old in (1, 2):
        with pytest.raises(PlanFormatError, match=rf"^p/plan.json: a plan of format {old}, written by an older "
                                                  r"parc: plan the model again"):
            check_plan(_plan_doc(old), "p/plan.json")
    with pytest.raises(PlanFormatError, match=rf"^p/plan.json: unknown format_version {PLAN_FORMAT + 1}"):
        check_plan(_plan_doc(PLAN_FORMAT + 1), "p/plan.json")


@pytest.mark.parametrize("damage, needle", [
    (lambda d: d.pop("stages"), "missing key 'stages'"),
    (lambda d: d.update(stages=[]), "at least one stage"),
    (lambda d: d["stages"][0].pop("devices"), "missing key 'stages[0].devices'"),
    (lambda d: d["stages"][0].update(nodes="7"), "key 'stages[0].nodes' should be an integer"),
    (lambda d: d["schedule"].update(micro_batches=1.5), "key 'schedule.micro_batches' should be an integer"),
    (lambda d: d["cluster"].update(nodes=[{"devices": ["nope"]}]), "malformed plan"),
], ids=["no-stages", "empty-stages", "stage-devices", "stage-nodes", "micro-batches", "cluster"])
def test_a_damaged_plan_is_one_line(damage, needle):
    doc = _plan_doc()
    damage(doc)
    with pytest.raises(PlanFormatError, match="^p/plan.json: .*" + re.escape(needle)):
        Plan.from_json(doc, "p/plan.json")


_names = st.text("abcdefgh.", min_size=1, max_size=8)
_floats = st.floats(0, 1e6, allow_nan=False)


@st.composite
def _plans(draw) -> Plan:
    """Random plans: one stage or a pipeline, with roles, baselines and records."""
    from parc.cluster import parse_devices

    count = draw(st.sampled_from([1, 2, 4]))
    cluster = parse_devices(draw(st.sampled_from(["4xa100-80g", "2x2xv100-32g", "2xv100-32g+2xp100-16g"])))
    per = 4 // count
    specs = draw(st.dictionaries(_names, st.sampled_from(["R", "S(0)", "S(1)R", "P(sum)"]), max_size=5))
    stages = tuple(Stage(k, range(k * per, (k + 1) * per), (per,), ["a100-80g"], draw(st.integers(0, 99)),
                         draw(_floats), draw(_floats), draw(st.integers(0, 10**9)), specs,
                         *([draw(_floats) for _ in range(5)] if count > 1 else []),
                         solver={"status": "optimal", "gap": draw(_floats)}) for k in range(count))
    params = draw(st.dictionaries(_names, st.builds(ParameterRole, st.none() | _names, st.none() | _names,
                                                    st.dictionaries(_names, _names, max_size=2)), max_size=3))
    return Plan(
        cluster=cluster, mesh=MeshLayout((count, per) if count > 1 else (4,), ({"name": "nvlink3"},),
                                         (False,), None if count > 1 else tuple(range(4)), count > 1),
        stages=stages, schedule=Schedule("1f1b", draw(st.integers(1, 8)), ({"micro_batches": 2},)),
        specs=specs, strategies=draw(st.dictionaries(_names, st.sampled_from(["-", "b0", "b0xk"]), max_size=4)),
        phases=draw(st.dictionaries(_names, st.sampled_from(["backward", "optimizer"]), max_size=3)),
        predicted=Prediction(draw(_floats), draw(_floats), draw(_floats), [draw(_floats)] * 4, draw(_floats),
                             draw(_floats)),
        baselines=draw(st.dictionaries(st.sampled_from(["data-parallel", "zero-3"]),
                                       st.builds(Baseline, st.none() | _floats, st.booleans(), st.none() | _floats,
                                                 st.just({"gap": 0.0})), max_size=2)),
        tensors=draw(st.dictionaries(_names, st.builds(Tensor, st.lists(st.integers(1, 64), max_size=3).map(tuple),
                                                       st.just("float"), st.integers(0, 10**6),
                                                       st.sampled_from(ROLES)), max_size=4)),
        step=draw(st.none() | st.builds(StepRoles, st.none() | _names, st.lists(_names, max_size=2).map(tuple),
                                        st.just(params), st.none() | st.just({"name": "adamw"}))),
        solver={"level": "O3", "meshes": [{"shape": [4], "feasible": True}]},
        communication=({"value": "x", "collectives": [{"kind": "all_reduce", "axis": 0}]},),
        micro=draw(st.none() | st.just({"count": 2})),
        model=draw(st.none() | st.builds(ModelRef, _names, st.just("ab" * 32))))


@given(_plans())
def test_plans_read_back_as_written(tmp_path_factory, plan):
    """from_json(to_json(p)) == p through a file, for random plans (every plan the suite writes is
    checked the same way by write_plan)."""
    d = tmp_path_factory.mktemp("p")
    write_plan(d, plan)
    assert load_plan(d) == plan
