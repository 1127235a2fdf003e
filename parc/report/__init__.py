"""`parc explain`: what a plan chose, why, and what it costs, read from the plan directory alone.

`load_plan(dir)` reads plan.json as a `Plan` (`parc.plandir`, re-exported here), `explain(plan)` turns it
into a `Report` of facts (a pure function), and `render(report, fmt)` writes it as text,
Markdown, HTML or JSON. Nothing here imports the planner.
"""

from parc.plandir import PLAN_FILE, PLAN_FORMAT, check_plan, load_plan, plan_path
from parc.report.build import explain
from parc.report.facts import REPORT_FORMAT, Report
from parc.report.render import FORMATS, print_text, render

__all__ = ["FORMATS", "PLAN_FILE", "PLAN_FORMAT", "REPORT_FORMAT", "Report", "check_plan", "explain",
           "load_plan", "plan_path", "print_text", "render"]
