"""The SVG charts of `parc explain --format html`: each chart as XML, the merge that keeps a long
timeline small, escaping, the page on real plans, and the page in a headless browser."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from helpers import parc

from parc.errors import PlanFormatError
from parc.plandir import Plan, load_plan
from parc.report import charts, explain, figures, render
from parc.report.charts import (
    MERGE_FRACTION,
    MemoryRow,
    StageBox,
    TimeBar,
    TimelineRow,
    baselines_svg,
    memory_svg,
    merge_spans,
    stages_svg,
    timeline_svg,
)

NO_TIMELINE = "no simulated timeline in this plan (re-plan with this parc)"  # the note, word for word


def svg_tree(svg: str) -> ET.Element:
    root = ET.fromstring(svg)  # raises on anything that is not well-formed XML
    assert _tag(root) == "svg"
    return root


def _tag(el: ET.Element) -> str:
    return el.tag.rsplit("}", 1)[-1]


def elements(root: ET.Element, tag: str) -> list[ET.Element]:
    return [el for el in root.iter() if _tag(el) == tag]


def texts(root: ET.Element) -> list[str]:
    return ["".join(t for t in el.itertext()) for el in elements(root, "text")]


def simulation(ranks: int, spans: int, step_s: float, seed: int = 0, key=str) -> dict:
    """plan.json's `simulation` for a made-up step: per rank `spans` back-to-back spans of random
    length and kind (a later rank waits first, like a pipeline's bubble)."""
    rng = random.Random(seed)
    timeline, totals = {}, []
    for r in range(ranks):
        lengths = [rng.expovariate(1.0) for _ in range(spans)]
        scale, t, row = step_s / sum(lengths), 0.0, []
        used = dict.fromkeys(("compute", "comm", "wait"), 0.0)
        for i, d in enumerate(lengths):
            kind = "wait" if t < 0.05 * step_s * r else rng.choices(["compute", "comm", "wait"], [0.7, 0.2, 0.1])[0]
            row.append([t, t + d * scale, kind, f"r{r}.task{i}"])
            used[kind] += d * scale
            t += d * scale
        timeline[key(r)] = row
        totals.append({"rank": r, "busy_s": used["compute"] + used["comm"], "compute_s": used["compute"],
                       "comm_s": used["comm"], "wait_s": used["wait"], "peak_bytes": 2**20 * (r + 1)})
    return {"step_time_s": step_s, "bubble_s": 0.1 * step_s, "exposed_comm_s": 0.05 * step_s,
            "hidden_comm_s": 0.02 * step_s, "ranks": totals, "timeline": timeline,
            "critical_path": [f"task{i}" for i in range(12)]}


# -- timeline -------------------------------------------------------------------------------------

def test_merge_spans_joins_close_spans_of_one_kind_only():
    tol = 0.01
    bars = merge_spans([(0.0, 0.1, "compute", "a"), (0.105, 0.2, "compute", "b"),  # 0.005 apart: merged
                        (0.1, 0.105, "wait", "w"),  # another kind: its own bar, not merged
                        (0.3, 0.4, "compute", "c"),  # 0.1 apart: its own bar, keeps its label
                        (0.35, 0.5, "comm", "x"), (0.45, 0.6, "comm", "y")], tol)  # overlapping: merged
    got = [(b.start_s, b.end_s, b.kind, b.label, b.spans) for b in bars]
    assert got == [(0.0, 0.2, "compute", None, 2), (0.1, 0.105, "wait", "w", 1), (0.3, 0.4, "compute", "c", 1),
                   (0.35, 0.6, "comm", None, 2)]


def test_timeline_draws_a_row_per_rank_and_tooltips_single_spans():
    rows = [TimelineRow("rank 0", [(0.0, 0.004, "compute", "fwd"), (0.004, 0.005, "wait", "idle"),
                                   (0.001, 0.002, "comm", "all_reduce")], note="busy 4 ms"),
            TimelineRow("rank 1", [(0.0, 0.001, "wait", "bubble"), (0.001, 0.005, "compute", "bwd")])]
    root = svg_tree(timeline_svg(rows, 0.005))
    labels = texts(root)
    assert "rank 0" in "".join(labels) and "rank 1" in "".join(labels)
    assert {"compute", "communication", "waiting (bubble)"} <= set(labels)  # the legend
    assert any(t.endswith(" ms") for t in labels)  # the x axis in ms
    bars = [r for g in elements(root, "g") for r in g if _tag(r) == "rect"]
    assert len(bars) == 5
    tips = ["".join(t.itertext()) for r in bars for t in r if _tag(t) == "title"]
    assert len(tips) == 5 and any(t.startswith("all_reduce (communication): start 1.000 ms") for t in tips)


def test_timeline_labels_are_escaped():
    rows = [TimelineRow("rank <&>", [(0.0, 1.0, "compute", 'op "<&>"')], note="a<b & c>d")]
    root = svg_tree(timeline_svg(rows, 1.0))
    assert "a<b & c>drank <&>" in texts(root)  # the label with its tooltip
    tips = ["".join(t.itertext()) for t in elements(root, "title")]
    assert any(t.startswith('op "<&>" (compute)') for t in tips)


def test_merged_timeline_of_16_ranks_by_5000_spans_stays_small():
    sim = simulation(16, 5000, 0.01)
    rows = [TimelineRow(f"rank {k}", spans) for k, spans in sim["timeline"].items()]
    svg = timeline_svg(rows, 0.01)
    assert len(svg) < 2_000_000, len(svg)
    root = svg_tree(svg)
    drawn = sum(1 for g in elements(root, "g") for r in g if _tag(r) == "rect")
    assert drawn < 16 * 5000 / 2  # most spans were merged


def test_a_kind_has_at_most_one_bar_per_merge_window():
    rng = random.Random(1)
    tol = MERGE_FRACTION * 1.0
    for length in (1e-5, 1e-4):  # short spans scattered over a 1 s step, any gaps
        spans = [(t, t + length, "comm", f"t{k}") for k, t in enumerate(rng.uniform(0, 1) for _ in range(20_000))]
        bars = merge_spans(spans, tol)
        assert len(bars) <= 1 / MERGE_FRACTION + 1
        assert all(b.start_s - a.end_s >= tol for a, b in zip(bars, bars[1:]))
    spans = [(k * 3 * tol, k * 3 * tol + tol, "compute", f"t{k}") for k in range(100)]  # 2 windows apart
    assert [b.label for b in merge_spans(spans, tol)] == [f"t{k}" for k in range(100)]  # each kept, with its tooltip


# -- memory, baselines, stages --------------------------------------------------------------------

def test_memory_draws_a_bar_per_row_stacked_by_part_with_budgets():
    rows = [MemoryRow("devices 0-1 (a100)", {"parameters": 2e9, "optimizer": 4e9, "activations": 1e9}, 8e9),
            MemoryRow("device 2 <&>", {"parameters": 1e9, "optimizer": 2e9, "activations": 9e9}, 8e9)]
    root = svg_tree(memory_svg(rows))
    parts = [r for r in elements(root, "rect") if r.get("height") == "16"]
    assert len(parts) == 6  # 3 parts stacked on 2 rows
    assert len([line for line in elements(root, "line") if line.get("stroke") == charts.PALETTE.budget]) == 2
    words = texts(root)
    assert "device 2 <&>" in words
    assert any("over budget" in t for t in words) and sum("over budget" in t for t in words) == 1
    assert {"parameters", "optimizer", "activations", "budget"} <= set(words)


def test_baselines_hatch_what_does_not_fit():
    rows = [TimeBar("plan", 0.010, True, plan=True), TimeBar("data-parallel", 0.012, True),
            TimeBar("zero-3 <&>", 0.011, False), TimeBar("megatron-tp2", None, False)]
    root = svg_tree(baselines_svg(rows))
    bars = [r for r in elements(root, "rect") if r.get("height") == "16"]
    assert len(bars) == 4
    assert [b.get("fill") == "url(#parc-hatch)" for b in bars] == [False, False, True, True]
    words = texts(root)
    assert "zero-3 <&>" in words
    assert sum("does not fit" in t for t in words) == 3  # two bars and the legend
    assert any(t.startswith("12.000 ms (1.200x the plan)") for t in words)
    assert any(t.startswith("not priced") for t in words)


def test_stages_draw_boxes_arrows_and_capped_device_grids():
    boxes = [StageBox("stage <0>", ["devices 0-3"], (2, 2), [0, 1, 2, 3], ["a100"] * 2 + ["v100"] * 2),
             StageBox("stage 1", ["devices 4-103"], (100,), list(range(4, 104)))]
    root = svg_tree(stages_svg(boxes))
    squares = [r for r in elements(root, "rect") if any(_tag(t) == "title" for t in r)]
    assert len(squares) == 4 + charts.GRID_SQUARES
    assert "+36 more" in texts(root) and "stage <0>" in texts(root)
    assert len([p for p in elements(root, "path") if p.get("marker-end")]) == 1  # one arrow between two stages
    assert {"a100", "v100"} <= set(texts(root))  # mixed types: a legend
    boxes = [StageBox(f"stage {k}", [], (2,), [2 * k, 2 * k + 1]) for k in range(6)]  # wraps after 4
    root = svg_tree(stages_svg(boxes))
    assert len([p for p in elements(root, "path") if p.get("marker-end")]) == 5


# -- the page -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """A gpt-tiny SGD step (batch 4) planned on 4 A100s: one 1-D mesh, and 2 pipeline stages."""
    root = tmp_path_factory.mktemp("charts")
    res = parc("models", "build", "gpt-tiny", "--set", "batch=4", "-o", str(root / "g.onnx"))
    assert res.returncode == 0, res.stderr
    res = parc("grad", str(root / "g.onnx"), "--optimizer", "sgd", "--lr", "0.05", "-o", str(root / "step.onnx"))
    assert res.returncode == 0, res.stderr
    out = {}
    for name, how in (("spmd", ["--pipeline", "off", "--mesh-dims", "1"]), ("pipeline", ["--pipeline", "2"])):
        res = parc("plan", str(root / "step.onnx"), "--devices", "4xa100-80g", "--jobs", "1", *how, "-o", str(root / name))
        assert res.returncode == 0, res.stderr
        out[name] = root / name
    return out


class Nesting(HTMLParser):
    """Checks that every element closes in order (void elements and `<x/>` need no end tag)."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.counts: Counter[str] = Counter()

    def handle_starttag(self, tag, attrs):
        self.counts[tag] += 1
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.counts[tag] += 1

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]}")
        else:
            self.stack.pop()


def nesting(page: str) -> Nesting:
    n = Nesting()
    n.feed(page)
    n.close()
    assert not n.errors, n.errors[:5]
    assert n.stack == [], n.stack
    return n


@pytest.mark.parametrize("name, mesh_section", [("spmd", "Summary"), ("pipeline", "Pipeline")])
def test_page_of_a_real_plan_has_its_charts(plans, name, mesh_section):
    page = render(explain(load_plan(plans[name])), "html")
    n = nesting(page)
    assert n.counts["svg"] == 4 and n.counts["figure"] == 4 and n.counts["figcaption"] == 4
    assert NO_TIMELINE not in page and 'aria-label="timeline of one simulated step"' in page  # plan writes a simulation
    assert "<script" not in page and "src=" not in page and "<link" not in page
    for table in ("<th>scope</th>", "<th>consumer</th>"):  # the strategy and top-edges tables stay
        assert table in page
    section = page[page.index(f"<h2>{mesh_section}</h2>"):]
    assert section.index('aria-label="pipeline stages and their device meshes"') < section.index("</section>")
    assert "No breakdown into parameters, gradients, optimizer state and activations" in page
    for svg in page.split("<svg")[1:]:
        svg_tree("<svg" + svg[:svg.index("</svg>") + 6])


def load_doc(plan_dir: Path) -> dict:
    """A written plan's plan.json, as a document to edit."""
    return json.loads((Path(plan_dir) / "plan.json").read_text())


def explain_doc(doc: dict, where: str = "plan.json"):
    return explain(Plan.from_json(doc, where), where)


def test_page_with_a_simulation_draws_the_timeline(plans, tmp_path):
    plan = load_doc(plans["pipeline"])
    ranks = len(plan["predicted"]["memory_bytes_per_device"])
    plan["simulation"] = simulation(ranks, 300, plan["predicted"]["step_time_s"])
    shutil.copytree(plans["pipeline"], tmp_path / "sim")
    (tmp_path / "sim" / "plan.json").write_text(json.dumps(plan))
    report = explain(load_plan(tmp_path / "sim"))
    assert report.simulation is not None and len(report.simulation.timeline) == ranks
    assert report.simulation.ranks[1].peak_bytes == 2 * 2**20
    page = render(report, "html")
    n = nesting(page)
    assert n.counts["svg"] == 4 and NO_TIMELINE not in page
    sim = page[page.index("<h2>Simulated step</h2>"):]
    assert "rank 0 (stage 0)" in sim and f"rank {ranks - 1} (stage 1)" in sim
    assert sim.index("<figure>") < sim.index("<th>peak memory</th>") < sim.index("</section>")
    assert page.index("<h2>Summary</h2>") < page.index("<h2>Simulated step</h2>") < page.index("<h2>Pipeline</h2>")
    assert json.loads(render(report, "json"))["simulation"]["step_time_s"] == plan["simulation"]["step_time_s"]


def test_escaped_names_keep_the_page_well_formed(plans):
    plan = load_doc(plans["spmd"])
    plan["simulation"] = simulation(2, 50, plan["predicted"]["step_time_s"], key=lambda r: f"<&>{r}")
    plan["baselines"]["<b>&</b>"] = {"step_time_s": None, "feasible": False, "memory_bytes_per_device": None}
    page = render(explain_doc(plan), "html")
    nesting(page)
    assert "rank &lt;&amp;&gt;0" in page and "&lt;b&gt;&amp;&lt;/b&gt;" in page


def test_mixed_budgets_give_a_bar_per_device_group(plans):
    plan = load_doc(plans["spmd"])
    pred = plan["predicted"]
    pred["devices"] = ["v100-32g", "v100-32g", "p100-16g", "p100-16g"]
    pred["memory_budget_bytes_per_device"] = [32 * 2**30] * 2 + [16 * 2**30] * 2
    pred["memory_bytes_per_device"] = [2**30] * 4
    root = svg_tree(figures.memory_figure(explain_doc(plan)).split("<figcaption>")[0].removeprefix("<figure>"))
    assert [t for t in texts(root) if t.startswith("device")] == ["devices 0-1 (v100-32g)", "devices 2-3 (p100-16g)"]
    assert "1.00 GiB of 32.00 GiB (3.1%)" in texts(root)


@pytest.mark.parametrize("bad, key", [
    ({"timeline": {"0": [[0.0, 1.0, "idle", "x"]]}}, "simulation.timeline.0[0][2]"),
    ({"timeline": {"0": [[0.0, 1.0, "compute"]]}}, "simulation.timeline.0[0]"),
    ({"ranks": [{"rank": 0, "busy_s": "1"}]}, "simulation.ranks[0].busy_s"),
    ({"step_time_s": None}, "simulation.step_time_s"),
])
def test_a_bad_simulation_is_one_line_naming_the_key(plans, bad, key):
    plan = load_doc(plans["spmd"])
    plan["simulation"] = {**simulation(1, 3, 0.01), **copy.deepcopy(bad)}
    with pytest.raises(PlanFormatError, match=key.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        explain_doc(plan, "p/plan.json")


# -- in a browser ---------------------------------------------------------------------------------

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def test_page_renders_in_a_headless_browser(plans, tmp_path):
    browser = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if browser is None:
        pytest.skip(f"no chromium on PATH: none of {', '.join(BROWSERS)} (Debian: apt-get install chromium)")
    plan = load_doc(plans["pipeline"])
    plan["simulation"] = simulation(4, 2000, plan["predicted"]["step_time_s"])
    page = tmp_path / "report.html"
    page.write_text(render(explain_doc(plan), "html"))
    args = [browser, "--headless", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}", *(["--no-sandbox"] if os.geteuid() == 0 else [])]
    dom = subprocess.run([*args, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert dom.stdout.count("<svg") == 4 and dom.stdout.count("<figure>") == 4
    assert "<h2>Simulated step</h2>" in dom.stdout and "<title>" in dom.stdout
    shot = tmp_path / "report.png"
    res = subprocess.run([*args, "--window-size=1100,1600", f"--screenshot={shot}", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
