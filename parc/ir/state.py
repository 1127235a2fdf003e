"""A training step's metadata: its `parc.state` record (the one reader and writer) and each
node's phase (`phase`).

`parc grad` (parc/autodiff/step.py) writes it; everything else reads it through `step_state`:
which output feeds which input on the next step (`bindings`), the trained parameters and their
gradients, the optimizer (its `to_json`), the loss output, the step counter input and, for a
mixed-precision step, what its products compute in and its loss scale (`parc.autodiff.precision`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

STATE_KEY = "parc.state"
PHASE = "parc.phase"  # node metadata: which part of the step a node belongs to
FORWARD_OF = "parc.forward"  # a backward node's metadata: the forward node it differentiates
PARAM_OF = "parc.param"  # an optimizer node's metadata: the parameter it updates
FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"


def phase(node) -> str:
    """A node's part of a training step (forward when untagged: a plain model is all forward)."""
    return node.meta.get(PHASE, FORWARD)


def is_gradient_sync(v, consumer) -> bool:
    """Whether value v read by node `consumer` is a gradient handed to the optimizer (a backward
    value an optimizer node reads): its synchronisation may be fused into a gradient bucket."""
    return phase(consumer) == OPTIMIZER and v.producer is not None and phase(v.producer) == BACKWARD


@dataclass(frozen=True)
class StepState:
    """The record of a training step (see the module docstring)."""

    bindings: Mapping[str, str] = field(default_factory=dict)  # output -> input it feeds next step
    params: tuple[str, ...] = ()
    grads: Mapping[str, str] = field(default_factory=dict)  # parameter -> its gradient value
    optimizer: Mapping[str, Any] | None = None
    loss: str | None = None
    step: str | None = None  # the step counter input, if the optimizer has one
    precision: Mapping[str, Any] = field(default_factory=dict)  # {"compute": "bf16", "loss_scale": 1.0}; {} for fp32

    def to_json(self) -> str:
        return json.dumps({"bindings": dict(self.bindings), "params": list(self.params), "grads": dict(self.grads),
                           "optimizer": self.optimizer, "loss": self.loss, "step": self.step,
                           **({"precision": dict(self.precision)} if self.precision else {})}, sort_keys=True)

    def replace(self, **changes: Any) -> StepState:
        return replace(self, **changes)


def step_state(metadata: Mapping[str, str]) -> StepState | None:
    """The record in a graph's metadata (`graph.metadata`, or an ONNX model's metadata_props as a
    dict), or None when it is not a training step."""
    text = metadata.get(STATE_KEY)
    if not text:
        return None
    rec = json.loads(text)
    return StepState(dict(rec.get("bindings", {})), tuple(rec.get("params", ())), dict(rec.get("grads", {})),
                     rec.get("optimizer"), rec.get("loss"), rec.get("step"), dict(rec.get("precision", {})))


def bindings(metadata: Mapping[str, str]) -> dict[str, str]:
    """Training step output -> the input it feeds next step (empty for other programs)."""
    state = step_state(metadata)
    return dict(state.bindings) if state is not None else {}


def write_step_state(metadata: dict[str, str], state: StepState) -> None:
    metadata[STATE_KEY] = state.to_json()
