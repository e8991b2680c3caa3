"""Adversarial robustness against the MC-averaged prediction (HV ``ops/adversarial.py`` semantics).

The attack loss is the NLL of the ensemble prediction, −log p̄(y|x) with
p̄ = mean_n softmax(f_n(x)), over ``num_samples`` fixed dropout keys.  ε is in
pixel space [0, 1]; ``normalize`` maps pixels to the model's input, and
adversarial images are clipped to [0, 1] (unlike the reference, which clips
normalised inputs).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from smoothing_jax.inference import log_mean_probs, member_log_probs


def ensemble_nll(model, variables, keys, normalize: Callable, pixels, labels):
  """Mean −log p̄(y | x) of pixel images ``[B,H,W,3]`` under the MC ensemble given by
  ``keys`` (a BatchEnsemble's: all its members for each key)."""
  samples = jax.vmap(lambda key: member_log_probs(model, variables, normalize(pixels), key))(keys)
  log_mean = log_mean_probs(samples.reshape((-1,) + samples.shape[2:]))
  return -jnp.mean(jnp.take_along_axis(log_mean, labels[:, None], axis=1))


def fgsm(loss_fn: Callable, pixels, labels, eps: float):
  """x + ε·sign(∇ₓ L(x, y)), clipped to [0, 1]; ``loss_fn(pixels, labels) -> scalar``."""
  grad = jax.grad(loss_fn)(pixels, labels)
  return jnp.clip(pixels + eps * jnp.sign(grad), 0.0, 1.0)


def pgd(loss_fn: Callable, pixels, labels, eps: float, step_size: float = 2 / 255, steps: int = 10,
        rng=None):
  """L∞ projected gradient ascent (Madry et al.) with an optional uniform random start in the
  ε-ball."""
  x = pixels
  if rng is not None:
    x = jnp.clip(x + jax.random.uniform(rng, x.shape, x.dtype, -eps, eps), 0.0, 1.0)
  grad_fn = jax.grad(loss_fn)

  def step(x, _):
    x = x + step_size * jnp.sign(grad_fn(x, labels))
    return jnp.clip(jnp.clip(x, pixels - eps, pixels + eps), 0.0, 1.0), None
  return jax.lax.scan(step, x, None, length=steps)[0]
