"""Op rules: each ONNX op's sharding rule and FLOP count, registered by op type.

Importing the package registers every family; an op without an entry in `RULES` is planned
replicate-only.
"""

from parc.ops import conv, elementwise, index, matmul, norm, reduce, shape  # noqa: F401  (registration)
from parc.ops.base import (
    RULES,
    OpRule,
    RuleBuilder,
    ShardingRule,
    get_rule,
    node_pieces,
    node_work,
    op_class,
    sharding_rule,
)
from parc.ops.verify import verify

__all__ = ["RULES", "OpRule", "RuleBuilder", "ShardingRule", "get_rule", "node_pieces", "node_work", "op_class", "sharding_rule", "verify"]
