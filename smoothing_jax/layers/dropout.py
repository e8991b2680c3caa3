"""MC dropout that keeps sampling at evaluation time (Gal & Ghahramani 2016)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


class MCDropout(nn.Module):
  """Element-wise dropout that is stochastic in training *and* evaluation.

  As in the reference (``F.dropout(x, p)`` with its default ``training=True``):
  each element is zeroed with probability ``rate`` and survivors are scaled by
  ``1 / (1 - rate)``, regardless of ``train``; BatchNorm elsewhere still switches
  to running statistics.  Randomness comes from the ``"dropout"`` RNG stream.
  """
  rate: float

  @nn.compact
  def __call__(self, x):
    if not 0.0 <= self.rate < 1.0:
      raise ValueError(f"MCDropout rate must be in [0, 1), got {self.rate!r}.")
    if self.rate == 0.0:
      return x
    if not self.has_rng("dropout"):
      raise ValueError(
          "MCDropout needs a 'dropout' RNG even at evaluation time: call "
          "model.apply(variables, x, rngs={'dropout': key}) or use "
          "smoothing_jax.inference.mc_predict.")
    keep = jax.random.bernoulli(self.make_rng("dropout"), 1.0 - self.rate, x.shape)
    return jnp.where(keep, x / (1.0 - self.rate), jnp.zeros_like(x))
