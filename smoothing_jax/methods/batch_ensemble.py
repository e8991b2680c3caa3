"""BatchEnsemble (Wen et al. 2020): M members sharing slow weights W, each with rank-1 fast
weights, W_m = W ⊙ r_m s_mᵀ (``resnet_batchensemble_18``, ``wideresnet_batchensemble_28_10``;
the layers are :mod:`smoothing_jax.layers.batch_ensemble`).

* Predictive: the M members in one pass over the batch repeated M times
  (:func:`batch_ensemble_log_probs`), averaged in probability space as
  uncertainty-baselines does; N counts members (the first N of M).
* Training: the batch repeated M times, row b·M + m example b under member m (uncertainty-
  baselines tiles it M times: the same rows, and BatchNorm sees the same statistics), so the loss
  is the mean over members of each member's loss.
* Optimiser: the fast weights and the members' biases learn at the rate ×
  ``config.batch_ensemble.fast_weight_lr_multiplier``; weight decay skips the fast weights, which
  take ``config.batch_ensemble.fast_weight_decay`` instead.
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from smoothing_jax.layers.batch_ensemble import fast_weight_mask
from smoothing_jax.methods.base import Method
from smoothing_jax.methods.fixed_members import FixedMembers
from smoothing_jax.passes import log_probs, mean_probs, pass_outputs, repeat_for_members


@functools.partial(jax.jit, static_argnames=("model",))
def batch_ensemble_log_probs(model: nn.Module, variables, images, rng=None):
  """``[M, B, ..., C]`` log-probabilities of a BatchEnsemble's M members, all in one pass over
  the batch repeated M times (:func:`repeat_for_members`)."""
  m = model.ensemble_size
  out = log_probs(model, variables, repeat_for_members(images, m), rng)   # [B·M, ..., C]
  return jnp.swapaxes(out.reshape((images.shape[0], m) + out.shape[1:]), 0, 1)


@dataclasses.dataclass(frozen=True)
class BatchEnsemble(FixedMembers):
  """The M = ``model.ensemble_size`` members of one network of fast weights."""
  name = "batch_ensemble"
  members_attribute = "ensemble_size"
  # uncertainty-baselines' CIFAR settings: the fast weights (and the members' biases) learn at the
  # multiplied rate; weight decay skips the fast weights unless fast_weight_decay says otherwise.
  settings = {"fast_weight_lr_multiplier": 0.5, "fast_weight_decay": 0.0}


  def sample_log_probs(self, variables, images, rng):
    return batch_ensemble_log_probs(self.model, variables, images, rng)

  def sample_outputs(self, variables, images, rng):
    m = self.num_draws
    # One pass over row b·M + m = example b under member m (repeat_for_members); per draw, the
    # rows of member m come from images[m].
    rows = (jnp.swapaxes(images, 0, 1).reshape((-1,) + images.shape[2:]) if images.ndim == 5
            else repeat_for_members(images, m))
    out = pass_outputs(self.model, variables, rows, rng)
    return jax.tree.map(lambda x: jnp.swapaxes(x.reshape((-1, m) + x.shape[1:]), 0, 1), out)

  def frame_probs(self, variables, frame, rng):
    """The members' mean: all M members in one pass over the repeated frame."""
    return mean_probs(self.sample_log_probs(variables, frame, rng))

  def one_network(self, batch_size: int) -> dict:
    return {"components": jnp.zeros(batch_size, jnp.int32)}  # member 0's network

  def check(self, config) -> BatchEnsemble:
    if config.optimizer == "adamw":
      raise ValueError("optimizer 'adamw' decays every parameter; a BatchEnsemble trains with "
                       "'sgd' or 'adam' (coupled decay that skips its fast weights).")
    return self

  def as_member(self, config=None) -> Method:
    model = f" {config.model!r}" if config is not None else ""
    raise ValueError(f"Model{model} is a BatchEnsemble of {self.num_draws} members already; "
                     "train it with deep_ensemble.members=1.")

  def tile(self, *arrays) -> tuple:
    return tuple(repeat_for_members(x, self.num_draws) for x in arrays)

  def weight_decay(self, config) -> optax.GradientTransformation:
    def slow(params):
      return jax.tree.map(lambda fast: not fast, fast_weight_mask(params))
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=slow),
        optax.add_decayed_weights(self.settings_in(config).fast_weight_decay,
                                  mask=fast_weight_mask))

  def update_scaling(self, config) -> optax.GradientTransformation:
    """The fast weights' and member biases' updates × ``fast_weight_lr_multiplier``: with SGD
    that equals uncertainty-baselines' scaling of their gradients (decay included) before the
    optimiser; after the optimiser it holds for Adam too, which would undo a gradient scale."""
    return optax.masked(optax.scale(self.settings_in(config).fast_weight_lr_multiplier),
                        lambda params: fast_weight_mask(params, with_bias=True))
