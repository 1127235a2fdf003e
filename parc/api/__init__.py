"""parc as a library: plan a model on a cluster, simulate the plan, verify it (docs/python-api.md).

    import parc
    planned = parc.plan("step.onnx", "2x8xa100-80g", parc.PlanOptions(micro_batches=4))
    planned.write("plan/")
    parc.simulate("plan/").step_time_s
    parc.verify("plan/").ok

The command line (`parc plan`, `parc simulate`, `parc verify`) is a thin layer over these.
"""

from parc.api.checking import Verification, simulate, verify
from parc.api.options import PlanOptions
from parc.api.planning import Planned, plan

__all__ = ["PlanOptions", "Planned", "Verification", "plan", "simulate", "verify"]
