"""Perturbation consistency on CIFAR-10-P style sequences (paper App. E, Eqs. 37–39).

A sequence S = {x_1, …, x_{M+1}} is a short video of one image under a growing
perturbation.  With f(x) = p(y|x, D) the (ensemble-averaged) predictive and
g(x) = argmax f(x):

* consistency  = 1/M Σ_i 1[g(x_i) = g(x_{i+1})]                         (Eq. 37)
* CEC          = −1/M Σ_i f(x_i) · log f(x_{i+1})                        (Eq. 38)
* relative confidence = p(y_true | x) / max_y p(y | x)                   (Eq. 39)

The reference code's CEC differs from Eq. 38: it takes the mean over classes
(÷C) of p_{t+1}·log p_t.  ``cross_entropy_consistency(..., variant="reference")``
reproduces it; the default follows the paper.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from smoothing_jax.metrics import TemporalConsistency
from smoothing_jax.temporal import translate_sequences  # noqa: F401  (CIFAR-10-P's translate)

CIFAR10_P_TYPES = ("gaussian_noise", "shot_noise", "motion_blur", "zoom_blur", "spatter",
                   "brightness", "translate", "rotate", "tilt", "scale")
_EPS = 1e-12


def load_cifar10_p(data_dir: str, perturbation: str) -> np.ndarray:
  """Load ``<data_dir>/<perturbation>.npy`` of CIFAR-10-P as uint8 ``[N, T, 32, 32, 3]``."""
  if perturbation not in CIFAR10_P_TYPES:
    raise ValueError(
        f"Unknown CIFAR-10-P perturbation {perturbation!r}; known: {', '.join(CIFAR10_P_TYPES)}.")
  path = os.path.join(data_dir, f"{perturbation}.npy")
  if not os.path.exists(path):
    raise FileNotFoundError(f"CIFAR-10-P file {path} not found; use translate_sequences() to make "
                            "translated sequences from test images instead.")
  videos = np.load(path, mmap_mode="r")
  if videos.ndim != 5 or videos.shape[-1] != 3:
    raise ValueError(f"{path} should hold videos [N, T, H, W, 3], got shape {videos.shape}.")
  return videos


def consistency(probs: np.ndarray) -> float:
  """Eq. 37 from sequence predictions ``[N, T, C]``: mean agreement of consecutive argmaxes."""
  return TemporalConsistency.from_sequence(_check_sequence(probs)).compute()["consistency"]


def cross_entropy_consistency(probs: np.ndarray, variant: str = "paper") -> float:
  """Eq. 38 from ``[N, T, C]``: −mean_{n,t} f(x_t)·log f(x_{t+1}) ("paper"), or the reference's
  −mean_{n,t} mean_c p_{t+1,c} log p_{t,c} ("reference")."""
  probs = _check_sequence(probs).astype(np.float64)
  log_p = np.log(np.maximum(probs, _EPS))
  if variant == "paper":
    return float(-np.mean(np.sum(probs[:, :-1] * log_p[:, 1:], -1)))
  if variant == "reference":
    return float(-np.mean(np.mean(probs[:, 1:] * log_p[:, :-1], -1)))
  raise ValueError(f"Unknown CEC variant {variant!r}; use 'paper' or 'reference'.")


def relative_confidence(probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """Eq. 39: p(y_true|x) / max_y p(y|x) for predictions ``[..., C]`` and labels ``[...]``; 1 iff
  correct."""
  probs = np.asarray(probs, np.float64)
  labels = np.asarray(labels)
  if probs.shape[:-1] != labels.shape:
    raise ValueError(f"probs {probs.shape} and labels {labels.shape} disagree.")
  true = np.take_along_axis(probs, labels[..., None], -1)[..., 0]
  return true / probs.max(-1)


def sequence_predictions(predict: Callable,
                         videos: np.ndarray,
                         batch_size: int = 256) -> np.ndarray:
  """Predictions ``[N, T, C]`` of ``predict(frames [B,H,W,C]) -> probs [B,C]`` on videos
  ``[N,T,H,W,C]``."""
  n, t = videos.shape[:2]
  frames = np.asarray(videos).reshape(n * t, *videos.shape[2:])
  probs = [np.asarray(predict(frames[i:i + batch_size])) for i in range(0, len(frames), batch_size)]
  return np.concatenate(probs).reshape(n, t, -1)


def perturbation_metrics(probs: np.ndarray, labels: np.ndarray | None = None) -> dict:
  """Consistency, CEC (paper and reference variants) and, given labels ``[N]``, mean relative
  confidence."""
  metrics = {"consistency": consistency(probs), "cec": cross_entropy_consistency(probs),
             "cec_reference": cross_entropy_consistency(probs, "reference")}
  if labels is not None:
    labels = np.broadcast_to(np.asarray(labels)[:, None], probs.shape[:2])
    metrics["relative_confidence"] = float(relative_confidence(probs, labels).mean())
  return metrics


def _check_sequence(probs) -> np.ndarray:
  probs = np.asarray(probs)
  if probs.ndim != 3 or probs.shape[1] < 2:
    raise ValueError(f"Sequence predictions must be [N, T>=2, C], got shape {probs.shape}.")
  return probs
