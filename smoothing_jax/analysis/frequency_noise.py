"""Frequency-based random noise (paper Fig. 6c): x + F⁻¹(F(δ) ⊙ M_f).

δ is Gaussian noise; M_f keeps the 2-D frequencies whose L∞ radius (in units of
π, as the reference's square-annulus ``FreqAttack`` mask) lies in a band of
width ``width`` around ``f``.  The mask is symmetric under k → −k, so the
band-limited noise is real.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def frequency_band_mask(size: int, center: float, width: float = 0.1) -> np.ndarray:
  """``[size, size]`` 0/1 mask (unshifted FFT layout) of frequencies with L∞ radius in
  [f − w/2, f + w/2)."""
  k = np.abs(np.fft.fftfreq(size) * 2.0)  # |frequency| in units of π
  radius = np.maximum(k[:, None], k[None, :])
  return ((radius >= center - width / 2) & (radius < center + width / 2)).astype(np.float32)


def band_limited_noise(rng, shape, center: float, width: float = 0.1, std: float = 1.0):
  """Gaussian noise of ``shape`` NHWC restricted to the frequency band around ``center``
  (real-valued)."""
  if shape[1] != shape[2]:
    raise ValueError(f"Frequency noise needs square images, got shape {shape}.")
  delta = std * jax.random.normal(rng, shape)
  mask = jnp.asarray(frequency_band_mask(shape[1], center, width))[None, :, :, None]
  return jnp.real(jnp.fft.ifft2(jnp.fft.fft2(delta, axes=(1, 2)) * mask, axes=(1, 2)))


def accuracy_vs_frequency(predict: Callable,
                          images,
                          labels,
                          frequencies: Sequence[float],
                          *,
                          std: float = 0.1,
                          width: float = 0.1,
                          rng=None) -> np.ndarray:
  """Accuracy of ``predict(images) -> probs`` on ``images + band-limited noise`` for each
  frequency."""
  rng = jax.random.key(0) if rng is None else rng
  accuracies = []
  for i, f in enumerate(frequencies):
    noisy = images + band_limited_noise(jax.random.fold_in(rng, i), images.shape, f, width, std)
    accuracies.append(float(jnp.mean(jnp.argmax(predict(noisy), -1) == labels)))
  return np.asarray(accuracies)
