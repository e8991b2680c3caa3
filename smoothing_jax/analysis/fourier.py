"""Fourier analysis of feature maps (how-do-vits-work semantics; issues #4, #21, #39 there).

For NHWC maps: ``log(|FFT2(x)| + 1e-6)`` over (H, W) for every sample and
channel, centred (DC in the middle), averaged over batch and channels.  The
Δlog-amplitude is that map along the half diagonal, from the DC term (frequency
0) to the corner (frequency π), minus its DC value: Δ(f) = log A(f) − log A(0).
The "high-frequency" summary is Δ at 1.0π, the last point.
"""
from __future__ import annotations

import jax.numpy as jnp


def log_amplitude(feature_maps):
  """Centred mean log-amplitude ``[H, W]`` of NHWC ``feature_maps``."""
  x = jnp.asarray(feature_maps)
  if x.ndim != 4:
    raise ValueError(
        f"feature_maps must be NHWC [batch, height, width, channels], got shape {x.shape}.")
  amplitude = jnp.log(jnp.abs(jnp.fft.fft2(x.astype(jnp.float32), axes=(1, 2))) + 1e-6)
  return jnp.fft.fftshift(jnp.mean(amplitude, axis=(0, 3)), axes=(0, 1))


def delta_log_amplitude(feature_maps):
  """Δlog-amplitude curve ``[ceil(H/2)]`` from frequency 0 to π of square NHWC maps."""
  x = jnp.asarray(feature_maps)
  if x.ndim != 4 or x.shape[1] != x.shape[2]:
    raise ValueError(
        f"feature_maps must be square NHWC maps [batch, size, size, channels], got shape {x.shape}."
    )
  centred = log_amplitude(x)
  half = x.shape[1] // 2
  curve = jnp.diagonal(centred)[half:]
  return curve - curve[0]
