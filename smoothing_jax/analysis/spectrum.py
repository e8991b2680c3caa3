"""Hessian max-eigenvalue spectrum (paper Appendix A.3, Algorithm 1; HV slides).

For each training mini-batch (as augmented for training), the top-k eigenvalues
of the Hessian of the training objective NLL + (weight_decay / 2)·‖θ‖² — the
coupled L2 the optimiser uses — with BatchNorm in inference mode and a fixed
dropout key, so each batch defines a fixed symmetric operator.  Eigenvalues of
all batches are pooled into a histogram; the slides' criteria are the mean of
the positive max eigenvalues and the proportion of negative ones.
"""
from __future__ import annotations

import functools
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.tree_util import Partial

from smoothing_jax.analysis.hessian import min_eigenvalue, top_eigenvalues
from smoothing_jax.inference import sample_rngs


def training_loss(model, weight_decay, batch_stats, dropout_key, images, labels, params):
  """NLL + (weight_decay/2)·‖θ‖² of one batch, BatchNorm with running statistics, fixed
  dropout key."""
  logits = model.apply({"params": params, "batch_stats": batch_stats}, images, train=False,
                       rngs=sample_rngs(dropout_key))
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
  return nll + 0.5 * weight_decay * optax.tree_utils.tree_l2_norm(params, squared=True)


def max_eigenvalue_spectrum(model,
                            variables,
                            batches: Iterable[dict],
                            *,
                            k: int = 5,
                            weight_decay: float = 5e-4,
                            max_iters: int = 100,
                            tol: float = 1e-3,
                            rng: Optional[jax.Array] = None,
                            negative: bool = False) -> dict:
  """Top-``k`` (largest-magnitude) eigenvalues for every batch ``{"image", "label"}``; one compiled
  power iteration for all.

  Returns ``{"eigenvalues": [num_batches, k], "max_eigenvalues": [num_batches], **summary}``;
  ``negative=True`` adds ``"min_eigenvalues"`` [num_batches], the most negative eigenvalue of
  each batch (power iteration on H − |λ₁|·I), for the negative side of HV's spectra.  That
  iteration converges at the rate (|λ₁| + λ_min)/(|λ₁| + λ_2nd-smallest), slowly when
  |λ_min| ≪ λ₁; unconverged, it returns an upper bound (a Rayleigh quotient) of λ_min.
  """
  rng = jax.random.key(0) if rng is None else rng
  rows, lowest = [], []
  static_loss = functools.partial(training_loss, model, weight_decay)  # one function: compiled once
  for i, batch in enumerate(batches):
    dropout_key, power_key = jax.random.split(jax.random.fold_in(rng, i))
    loss_fn = Partial(static_loss, variables.get("batch_stats", {}), dropout_key,
                      jnp.asarray(batch["image"]), jnp.asarray(batch["label"]))
    rows.append(
        np.asarray(top_eigenvalues(loss_fn, variables["params"], k, max_iters, tol, power_key)[0]))
    if negative:
      lowest.append(
          float(
              min_eigenvalue(loss_fn,
                             variables["params"],
                             max_iters,
                             tol,
                             jax.random.fold_in(power_key, 1),
                             top=float(rows[-1][0]))[0]))
  eigenvalues = np.stack(rows)
  out = {
      "eigenvalues": eigenvalues,
      "max_eigenvalues": eigenvalues[:, 0],
      **spectrum_summary(eigenvalues)
  }
  if negative:
    out.update(min_eigenvalues=np.asarray(lowest), mean_min_eigenvalue=float(np.mean(lowest)))
  return out


def spectrum_summary(eigenvalues) -> dict:
  """Mean of the positive max eigenvalues and the proportion of negative eigenvalues (pooled)."""
  eigenvalues = np.asarray(eigenvalues)
  top = eigenvalues[:, 0] if eigenvalues.ndim == 2 else eigenvalues
  positive = top[top > 0]
  return {"mean_positive_max_eigenvalue": float(positive.mean()) if positive.size else float("nan"),
          "negative_fraction": float(np.mean(eigenvalues < 0))}
