"""plan.json's `simulation` section: what the simulator writes and `parc explain` draws.

`simulation.timeline` maps a rank to its spans `[start_s, end_s, kind]`; a span's kind is what
the rank does in it. The simulator keeps the timelines of at most `TIMELINE_RANKS` ranks (the
first rank of each stage first), so a plan of thousands of ranks stays a small file.
"""

from __future__ import annotations

COMPUTE, COMM, WAIT = "compute", "comm", "wait"  # span kinds: computing, held by a transfer, idle
SPAN_KINDS = (COMPUTE, COMM, WAIT)
TIMELINE_RANKS = 16  # ranks whose timeline the simulation keeps
