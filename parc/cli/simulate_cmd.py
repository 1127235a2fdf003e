"""`parc simulate PLAN_DIR`: replay one step of the plan's task graph (`parc.exec.stepsim`)."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("plan_dir", metavar="PLAN_DIR")
@click.option("--json", "as_json", is_flag=True, help="The simulation as one JSON object (stable keys).")
@click.option("--timeline", "timeline_ranks", type=click.IntRange(0),
              help="Ranks whose timeline --json includes (default 16).")
def simulate(plan_dir: str, as_json: bool, timeline_ranks: int | None) -> None:
    """Simulate one step of the plan in PLAN_DIR: step time, bubble, busy time per rank,
    communication exposed and hidden, the critical path and peak memory per rank."""
    from parc.exec.stepsim import simulate_plan
    from parc.plandir.simulation import TIMELINE_RANKS

    timeline_ranks = TIMELINE_RANKS if timeline_ranks is None else timeline_ranks
    sim = simulate_plan(plan_dir, keep_spans=as_json and timeline_ranks > 0)
    doc = sim.to_json(timeline_ranks)
    if as_json:
        click.echo(json.dumps(doc, sort_keys=True))
        return
    click.echo(summary(doc))


def summary(doc: dict) -> str:
    """The simulation in a few lines of text."""
    ms = 1e3
    rows = doc["ranks"]
    lines = [f"simulated step {doc['step_time_s'] * ms:.3f} ms over {len(rows)} ranks "
             f"({'one simulated rank per stage' if doc['granularity'] == 'stage' else 'every task'}): "
             f"bubble {doc['bubble_s'] * ms:.3f} ms per rank on average, communication exposed "
             f"{doc['exposed_comm_s'] * ms:.3f} ms, hidden {doc['hidden_comm_s'] * ms:.3f} ms"]
    shown = rows if len(rows) <= 16 else rows[:8] + rows[-8:]
    lines.append(f"{'rank':>6} {'stage':>5} {'busy ms':>10} {'compute':>10} {'comm':>10} {'wait':>10} {'peak MiB':>10}")
    for i, row in enumerate(shown):
        if len(rows) > 16 and i == 8:
            lines.append(f"{'...':>6}")
        peak = f"{row['peak_bytes'] / 2**20:10.1f}" if row.get("peak_bytes") is not None else f"{'-':>10}"
        lines.append(f"{row['rank']:>6} {row['stage']:>5} {row['busy_s'] * ms:10.3f} {row['compute_s'] * ms:10.3f} "
                     f"{row['comm_s'] * ms:10.3f} {row['wait_s'] * ms:10.3f} {peak}")
    path = doc["critical_path"]
    if path:
        head = " -> ".join(path[:3] + (["..."] if len(path) > 6 else []) + path[max(3, len(path) - 3):])
        lines.append(f"critical path ({len(path)} tasks): {head}")
    return "\n".join(lines)
