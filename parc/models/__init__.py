"""Model zoo: generators for forward + loss ONNX models of the Rhino and Whale benchmarks.

`list_models()` names every model; `build_model(name, out, overrides)` writes one, where
`overrides` are `--set KEY=VALUE` strings. Named configurations default to sparse weights
(external data that is all holes); the `-tiny` variants get seeded random weights inline.
"""

from parc.models.builder import count_params
from parc.models.registry import ModelInfo, build_model, list_models, resolve_config

__all__ = ["ModelInfo", "build_model", "count_params", "list_models", "resolve_config"]
