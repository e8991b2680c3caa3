"""Post-hoc recalibration by temperature scaling (Guo et al. 2017), for single models and
ensembles.

Every sample's logits are divided by one temperature T > 0 before the softmax, and the
prediction is the mean over the N samples (MC dropout, ensemble members, iBNN draws):

    p_T(y | x) = 1/N Σᵢ softmax(zᵢ(x) / T)_y

T is fitted to minimise the NLL of that mean prediction on held-out examples.  Log-probabilities
serve as logits: log softmax(z) differs from z by a constant per example, which dividing by T
and the softmax ignore.  The NLL is computed in float64 on the host and minimised over log T by
bounded Brent search (``scipy.optimize.minimize_scalar``), T in [0.05, 20] by default.
"""
from __future__ import annotations

import numpy as np
from scipy import optimize, special

DEFAULT_BOUNDS = (0.05, 20.0)


def tempered_log_mean_probs(sample_log_probs, temperature: float) -> np.ndarray:
  """``log p_T`` ``[B, C]`` (float64) of per-sample log-probabilities ``[N, B, C]``."""
  scaled = np.asarray(sample_log_probs, np.float64) / temperature
  scaled = scaled - special.logsumexp(scaled, axis=-1, keepdims=True)
  return special.logsumexp(scaled, axis=0) - np.log(scaled.shape[0])


def tempered_nll(sample_log_probs, labels, temperature: float) -> float:
  """Mean −log p_T(y | x) over the examples (labels ``[B]``)."""
  log_probs = tempered_log_mean_probs(sample_log_probs, temperature)
  return float(-np.mean(log_probs[np.arange(len(labels)), np.asarray(labels)]))


def fit_temperature(sample_log_probs, labels, bounds=DEFAULT_BOUNDS, tol: float = 1e-5) -> float:
  """The T in ``bounds`` minimising :func:`tempered_nll` on ``(sample_log_probs [N, B, C],
  labels [B])`` (search over log T to within ``tol``)."""
  if len(labels) == 0:
    raise ValueError("Temperature scaling needs held-out examples; got none.")
  low, high = np.log(bounds[0]), np.log(bounds[1])
  result = optimize.minimize_scalar(
      lambda log_t: tempered_nll(sample_log_probs, labels, float(np.exp(log_t))),
      bounds=(low, high), method="bounded", options={"xatol": tol})
  return float(np.exp(result.x))
