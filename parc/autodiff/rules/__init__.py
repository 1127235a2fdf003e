"""Gradient rules, registered by op type (one module per op family)."""

from parc.autodiff.rules import conv, core, einsum, elementwise, index, loss, norm, reduce, resize, shape  # noqa: F401  (registration)
from parc.autodiff.rules.base import GRADS, NON_DIFFERENTIABLE, grad  # noqa: F401
