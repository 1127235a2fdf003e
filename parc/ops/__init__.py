"""Op rules: sharding rules and costs per ONNX op type."""

from parc.ops import elementwise  # noqa: F401  (registers rules)
from parc.ops.base import RULES, OpRule, ShardingRule, get_rule, sharding_rule

__all__ = ["RULES", "OpRule", "ShardingRule", "get_rule", "sharding_rule"]
