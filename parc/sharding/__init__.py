"""Sharding specs and resharding (Rhino 4.1, Whale 3.2.3 and 3.3): see docs/sharding.md.

`ShardSpec` says how a tensor lies on a device mesh, one `AxisSpec` (R, S, P) per mesh axis;
`layout` says what each device holds; `labels` derives specs from op-rule labels; `reshard`
lists the collectives between two specs; `simulate` runs them on NumPy shards.
"""

from parc.sharding.labels import axis_spec_for_label, shard_spec_for_labels, split_label
from parc.sharding.layout import assemble, devices, local_shape, positions, shard_index, split
from parc.sharding.reshard import COMM_KINDS, LOCAL_KINDS, Collective, reshard, reshard_bytes, step_kind
from parc.sharding.simulator import simulate
from parc.sharding.spec import (
                                PARTIAL_OPS,
                                AxisSpec,
                                P,
                                Partial,
                                R,
                                Replicated,
                                S,
                                ShardSpec,
                                ShardSpecError,
                                Split,
                                axis_from_json,
                                parse_axes,
)

__all__ = [
    "COMM_KINDS", "LOCAL_KINDS", "PARTIAL_OPS", "AxisSpec", "Collective", "P", "Partial", "R",
    "Replicated", "S", "ShardSpec", "ShardSpecError", "Split", "assemble", "axis_from_json",
    "axis_spec_for_label", "devices", "local_shape", "parse_axes", "positions", "reshard",
    "reshard_bytes", "shard_index", "shard_spec_for_labels", "simulate", "split", "split_label",
    "step_kind",
]
