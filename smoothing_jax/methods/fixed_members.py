"""What BatchEnsemble, MIMO and Packed-Ensembles share: M members inside one network, fixed when
it is built.  Not a method of its own (not registered): their base."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

from smoothing_jax.methods.base import Method
from smoothing_jax.models import is_stochastic


@dataclasses.dataclass(frozen=True)
class FixedMembers(Method):
  """N is the first N of the network's M members (``members_attribute`` of the model names M),
  and every N ≤ M is reported; dropout inside the network makes the draws stochastic."""
  members_attribute: ClassVar[str]

  @property
  def stochastic(self) -> bool:
    return is_stochastic(self.model)

  @property
  def num_draws(self) -> int:
    return getattr(self.model, self.members_attribute)

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    return self, tuple(range(1, self.num_draws + 1))
