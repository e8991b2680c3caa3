"""Packed-Ensembles (Laurent et al., ICLR 2023): M members of width α·C/M packed side by side in
one network of grouped convolutions (``resnet_packed_18``, the module
:mod:`smoothing_jax.models.packed`, TorchUncertainty's ``packed_resnet``).

* Predictive: the M members in one pass over the batch (not repeated), the model's logits
  ``[B·M, C]`` (row b·M + m: example b under member m), averaged in probability space; N counts
  members (the first N of M).
* Training: the cross-entropy of every member on every example, i.e. the labels repeated M times
  (TorchUncertainty's ``RepeatTarget``); the images are not repeated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from smoothing_jax.methods.base import Method
from smoothing_jax.methods.fixed_members import FixedMembers
from smoothing_jax.passes import log_probs, mean_probs, sample_rngs


def _members_first(x, m: int):
  """``[B·M, ...]`` (row b·M + m) → ``[M, B, ...]``."""
  return jnp.swapaxes(x.reshape((-1, m) + x.shape[1:]), 0, 1)


@dataclasses.dataclass(frozen=True)
class PackedEnsemble(FixedMembers):
  """The M = ``model.num_estimators`` members of one packed network."""
  name = "packed_ensemble"
  members_attribute = "num_estimators"


  def sample_log_probs(self, variables, images, rng):
    return _members_first(log_probs(self.model, variables, images, rng), self.num_draws)

  def _outputs(self, variables, images, rng) -> dict:
    m = self.num_draws
    rngs = None if rng is None else sample_rngs(rng)
    logits, state = self.model.apply(variables, images, train=False, rngs=rngs,
                                     mutable=["intermediates"])
    (features,) = state["intermediates"]["features"]            # [B, M·D], member-major
    features = features.reshape(features.shape[0], m, -1)
    return {"logits": _members_first(logits.astype(jnp.float32), m),
            "features": jnp.swapaxes(features, 0, 1).astype(jnp.float32)}

  def sample_outputs(self, variables, images, rng):
    if images.ndim == 4:
      return self._outputs(variables, images, rng)
    # Member m on images[m]: the pass on each, member m's outputs of pass m.
    out = jax.vmap(lambda x: self._outputs(variables, x, rng))(images)   # [M (images), M, ...]
    return jax.tree.map(lambda x: x[jnp.arange(self.num_draws), jnp.arange(self.num_draws)], out)

  def frame_probs(self, variables, frame, rng):
    """The members' mean: all M members in one pass over the frame."""
    return mean_probs(self.sample_log_probs(variables, frame, rng))

  def as_member(self, config=None) -> Method:
    model = f" {config.model!r}" if config is not None else ""
    raise ValueError(f"Model{model} is a Packed-Ensemble of {self.num_draws} members already; "
                     "train it with deep_ensemble.members=1.")

  def tile(self, images, *arrays) -> tuple:
    """The images as they are (every member sees the whole batch in one pass), the targets and
    labels repeated M times, row b·M + m for member m (the model's output rows)."""
    return (images,) + tuple(jnp.repeat(x, self.num_draws, axis=0) for x in arrays)
