"""A deterministic network: one pass is its predictive (N = 1), trained on the cross-entropy
(``<family>_dnn[_smoothing]_<depth>``, the ViTs, and every model without a stochastic layer)."""
from __future__ import annotations

import dataclasses

from smoothing_jax.methods.base import Method


@dataclasses.dataclass(frozen=True)
class Deterministic(Method):
  """One pass, p(y | x) = softmax(f(x)); every :class:`~smoothing_jax.methods.base.Method`
  default."""
  name = "deterministic"

