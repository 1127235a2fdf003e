"""Gradient rules, registered by op type (one module per op family)."""

from parc.autodiff.rules.base import GRADS, NON_DIFFERENTIABLE, grad  # noqa: F401
from parc.autodiff.rules import core  # noqa: F401  (registration)
