"""Post-hoc recalibration by temperature scaling (Guo et al. 2017), for single models and
ensembles, with the temperature in either of the two places the field puts it (``placement``):

* ``"members"``: every sample's logits are divided by T before the softmax, then the N samples
  (MC dropout, ensemble members, iBNN draws) are averaged:
  p_T(y | x) = 1/N Σᵢ softmax(zᵢ(x) / T)_y;
* ``"ensemble"`` (Ashukha et al. 2020, "Pitfalls of in-domain uncertainty estimation", their
  ``apply_t``): the average is tempered, p_T(y | x) = softmax(log p̄(x) / T)_y with
  p̄ = 1/N Σᵢ softmax(zᵢ).

The two agree for N = 1.  T is fitted to minimise the NLL of p_T on held-out examples.
Log-probabilities serve as logits: log softmax(z) differs from z by a constant per example,
which dividing by T and the softmax ignore.  The NLL is computed in float64 on the host and
minimised over log T by bounded Brent search (``scipy.optimize.minimize_scalar``), T in
[0.05, 20] by default.
"""
from __future__ import annotations

import numpy as np
from scipy import optimize, special

DEFAULT_BOUNDS = (0.05, 20.0)
PLACEMENTS = ("members", "ensemble")


def tempered_log_mean_probs(sample_log_probs, temperature: float,
                            placement: str = "members") -> np.ndarray:
  """``log p_T`` ``[B, C]`` (float64) of per-sample log-probabilities ``[N, B, C]``, T placed
  as ``placement`` says (``PLACEMENTS``; see the module docstring)."""
  log_probs = np.asarray(sample_log_probs, np.float64)
  if placement == "members":
    scaled = log_probs / temperature
    scaled = scaled - special.logsumexp(scaled, axis=-1, keepdims=True)
    return special.logsumexp(scaled, axis=0) - np.log(scaled.shape[0])
  if placement == "ensemble":
    scaled = (special.logsumexp(log_probs, axis=0) - np.log(log_probs.shape[0])) / temperature
    return scaled - special.logsumexp(scaled, axis=-1, keepdims=True)
  raise ValueError(f"Unknown temperature placement {placement!r}; choose one of {PLACEMENTS}.")


def tempered_nll(sample_log_probs, labels, temperature: float, placement: str = "members") -> float:
  """Mean −log p_T(y | x) over the examples (labels ``[B]``)."""
  log_probs = tempered_log_mean_probs(sample_log_probs, temperature, placement)
  return float(-np.mean(log_probs[np.arange(len(labels)), np.asarray(labels)]))


def fit_temperature(sample_log_probs, labels, bounds=DEFAULT_BOUNDS, tol: float = 1e-5,
                    placement: str = "members") -> float:
  """The T in ``bounds`` minimising :func:`tempered_nll` on ``(sample_log_probs [N, B, C],
  labels [B])`` with T placed as ``placement`` says (search over log T to within ``tol``)."""
  if len(labels) == 0:
    raise ValueError("Temperature scaling needs held-out examples; got none.")
  if placement not in PLACEMENTS:
    raise ValueError(f"Unknown temperature placement {placement!r}; choose one of {PLACEMENTS}.")
  low, high = np.log(bounds[0]), np.log(bounds[1])
  result = optimize.minimize_scalar(
      lambda log_t: tempered_nll(sample_log_probs, labels, float(np.exp(log_t)), placement),
      bounds=(low, high), method="bounded", options={"xatol": tol})
  return float(np.exp(result.x))
