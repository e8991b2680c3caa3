"""The predictive of a model in one call, for code that holds a model and its variables but no
run: each function is the :class:`~smoothing_jax.methods.base.Method` of that kind, called once
(``Method.predict``), so it gives what training, ``Run.predict`` and every evaluator give.

``mc_predict``: MC dropout's N passes, pass ``i`` with dropout key ``split(rng, N)[i]``;
``ensemble_predict``: a deep ensemble over the leading axis of stacked variables
(``stack_variables``); ``batch_ensemble_predict``: a BatchEnsemble's M members in one pass.  All
average in probability space, p̄(y|x) = (1/N) Σ_n softmax(f_n(x)), and return a ``Prediction``.
One network's pass is :func:`smoothing_jax.passes.log_probs`.
"""
from __future__ import annotations

import flax.linen as nn
import jax

from smoothing_jax.methods import as_method
from smoothing_jax.methods.batch_ensemble import BatchEnsemble
from smoothing_jax.methods.deep_ensemble import DeepEnsemble
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.passes import Prediction, log_probs, stack_variables

# The public forms of the passes' types and helpers a caller of these functions needs.
__all__ = ["Prediction", "batch_ensemble_predict", "ensemble_predict", "log_probs", "mc_predict",
           "stack_variables"]


def mc_predict(model: nn.Module, variables, images, *, num_samples: int, rng,
               chunk_size: int | None = None) -> Prediction:
  """N stochastic forward passes (MC dropout) in one jitted call (``methods.MCDropout``).

  Args:
    model: a registered model (any ``flax.linen`` module called as ``apply(v, x, train=...)``).
    variables: ``{"params": ..., "batch_stats": ...}``.
    images: ``[B, H, W, 3]`` float images.
    num_samples: N ≥ 1.  Deterministic models give N identical samples.
    rng: PRNG key; sample ``i`` uses ``jax.random.split(rng, N)[i]`` as its dropout key.
    chunk_size: evaluate this many samples at once (one vmap; ``lax.map`` over the
      chunks, which also bounds memory for large N); None: ``passes.default_chunk_size``
      for this backend, so the call is never slower than a loop of single passes.

  Returns:
    ``Prediction(sample_probs [N, B, C], mean_probs [B, C])``.
  """
  if not isinstance(num_samples, int) or num_samples < 1:
    raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}.")
  if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
    raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}.")
  method = MCDropout(model, num_samples=num_samples, chunk_size=chunk_size)
  return method.predict(variables, images, rng=rng)


def ensemble_predict(model: nn.Module, stacked_variables, images, *, rng=None) -> Prediction:
  """Deep ensemble (``methods.DeepEnsemble`` of the model's own method): one jitted call over the
  leading axis of ``stacked_variables`` (vmapped in chunks of ``passes.default_chunk_size``
  members).

  ``rng`` gives member ``m`` the dropout key ``split(rng, M)[m]``; MC dropout
  members need it, deterministic members don't.  Returns ``Prediction([M, B, C], [B, C])``.
  """
  members = stacked_variables_size(stacked_variables)
  method = DeepEnsemble.wrap(as_method(model), size=members)
  return method.predict(stacked_variables, images, rng=rng)


def stacked_variables_size(stacked_variables) -> int:
  """M, the leading axis of members' stacked variables (:func:`stack_variables`)."""
  leaves = jax.tree.leaves(stacked_variables)
  if not leaves or leaves[0].ndim == 0:
    raise ValueError("ensemble_predict takes members' variables stacked along a leading axis "
                     "(inference.stack_variables).")
  return leaves[0].shape[0]


def batch_ensemble_predict(model: nn.Module, variables, images, *, rng=None) -> Prediction:
  """BatchEnsemble (``methods.BatchEnsemble``): the M members' predictions in one jitted pass
  over the batch repeated M times.  ``rng`` seeds MC dropout where the model has it.

  Returns ``Prediction(sample_probs [M, B, C], mean_probs [B, C])`` (uncertainty-baselines
  averages the members' probabilities too).
  """
  if BatchEnsemble.refuses(model):
    raise ValueError("batch_ensemble_predict needs a BatchEnsemble model (ensemble_size >= 1), "
                     "e.g. get_model('resnet_batchensemble_18', 10).")
  return BatchEnsemble(model).predict(variables, images, rng=rng)
