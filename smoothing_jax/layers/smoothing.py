"""Spatial smoothing layers: ``Smooth = Blur ∘ Prob`` (Park & Kim, "Blurs behave like ensembles",
Sec. 2).

All layers take NHWC feature maps.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

# Binomial filters: k ⊗ k / ‖k‖₁² (paper Eq. 4 and Appendix C).
BLUR_FILTERS = {1: (1.0,), 2: (1.0, 1.0), 3: (1.0, 2.0, 1.0), 5: (1.0, 4.0, 6.0, 4.0, 1.0)}
PROB_KINDS = ("tanh", "relu6", "scale", None)
# τ of each kind when none is given: tanh τ = 10 (SS TanhBlurBlock), scale τ = 5 (SS
# ScalingBlurBlock, paper Appendix B.1).
DEFAULT_TEMPERATURE = {"tanh": 10.0, "scale": 5.0}
PAD_MODES = {"constant": "constant", "zero": "constant", "reflect": "reflect",
             "replicate": "edge", "circular": "wrap"}


def blur_kernel(kernel_size: int) -> np.ndarray:
  """The normalised 2-D kernel ``k ⊗ k / ‖k‖₁²`` as a ``(size, size)`` array."""
  if kernel_size not in BLUR_FILTERS:
    raise ValueError(
        f"Unsupported blur size {kernel_size!r}; choose one of {sorted(BLUR_FILTERS)}.")
  k = np.asarray(BLUR_FILTERS[kernel_size], np.float32)
  kernel = np.outer(k, k)
  return kernel / kernel.sum()


def blur_padding(kernel_size: int, same: bool, pad_mode: str = "constant"):
  """Spatial (before, after) padding used by the reference implementation.

  Size 2 with zero padding and ``same=False`` is PyTorch's
  ``AvgPool2d(kernel_size=2, stride=1, padding=1)``: one zero on every side, so
  an ``H``-pixel map becomes ``H + 1`` pixels.  Every other case pads
  ``floor((n-1)/2)`` before and ``ceil((n-1)/2)`` after (size preserving).
  """
  if kernel_size == 2 and not same and PAD_MODES[pad_mode] == "constant":
    return (1, 1)
  return ((kernel_size - 1) // 2, math.ceil((kernel_size - 1) / 2))


class Prob(nn.Module):
  """Element-wise "probabilistic" squashing before the blur.

  kinds:
    ``"tanh"``  — ``ReLU(τ·tanh(x/τ))`` (the reference's TanhBlurBlock, τ = 10);
    ``"relu6"`` — ``ReLU(min(x, 6))`` (the reference's ReLuBlurBlock, ``clamp(x, 0, 6)``);
    ``"scale"`` — ``x/τ`` (τ = 5: the reference's ScalingBlurBlock, paper Appendix B.1, which
    keeps the sign: after a pre-activation stage, negative inputs stay negative);
    ``None``    — identity.

  ``temperature`` None takes the kind's default (:data:`DEFAULT_TEMPERATURE`).
  """
  kind: str | None = "tanh"
  temperature: float | None = None

  def setup(self):
    if self.kind not in PROB_KINDS:
      raise ValueError(f"Unknown Prob kind {self.kind!r}; choose one of {PROB_KINDS}.")
    if self.kind in DEFAULT_TEMPERATURE and not self.tau > 0:
      raise ValueError(f"Prob temperature must be > 0, got {self.temperature!r}.")

  @property
  def tau(self) -> float:
    """The temperature in use: ``temperature``, or the kind's default."""
    return DEFAULT_TEMPERATURE.get(self.kind, 1.0) if self.temperature is None else self.temperature

  def __call__(self, x):
    if self.kind == "tanh":
      return nn.relu(self.tau * jnp.tanh(x / self.tau))
    if self.kind == "relu6":
      return jnp.clip(x, 0.0, 6.0)
    if self.kind == "scale":
      return x / self.tau
    return x


class Blur(nn.Module):
  """Fixed depth-wise blur with kernel ``k ⊗ k / ‖k‖₁²`` (no trainable parameters).

  Input ``[B, H, W, C]``.  Output ``[B, H+1, W+1, C]`` for the default
  ``kernel_size=2, same=False`` (reference semantics, zeros counted in the
  average) and ``[B, H, W, C]`` otherwise.  ``pad_mode`` is one of
  ``constant`` (zeros), ``reflect``, ``replicate`` or ``circular``.
  """
  kernel_size: int = 2
  same: bool = False
  pad_mode: str = "constant"

  def setup(self):
    blur_kernel(self.kernel_size)  # validates the size
    if self.pad_mode not in PAD_MODES:
      raise ValueError(
          f"Unknown blur pad_mode {self.pad_mode!r}; choose one of {sorted(PAD_MODES)}.")

  def __call__(self, x):
    if x.ndim != 4:
      raise ValueError(f"Blur expects NHWC feature maps, got shape {x.shape}.")
    if self.kernel_size == 1:
      return x
    before, after = blur_padding(self.kernel_size, self.same, self.pad_mode)
    x = jnp.pad(x, ((0, 0), (before, after), (before, after), (0, 0)),
                mode=PAD_MODES[self.pad_mode])
    # The kernel is separable, k ⊗ k / ‖k‖₁²: weighted sums of shifted views along H,
    # then W.
    # (Cheaper than a grouped convolution, and XLA fuses it with the surrounding element-wise ops.)
    taps = np.asarray(BLUR_FILTERS[self.kernel_size]) / np.sum(BLUR_FILTERS[self.kernel_size])
    n = self.kernel_size
    h, w = x.shape[1] - n + 1, x.shape[2] - n + 1
    x = sum(float(t) * x[:, i:i + h] for i, t in enumerate(taps))
    return sum(float(t) * x[:, :, j:j + w] for j, t in enumerate(taps))


class Smooth(nn.Module):
  """Spatial smoothing ``Blur ∘ Prob`` (the reference's TanhBlurBlock; ``prob="scale"``:
  ScalingBlurBlock).  ``temperature`` None: the Prob kind's default."""
  prob: str | None = "tanh"
  temperature: float | None = None
  blur_size: int = 2
  same: bool = False
  pad_mode: str = "constant"

  @nn.compact
  def __call__(self, x):
    x = Prob(self.prob, self.temperature, name="prob")(x)
    return Blur(self.blur_size, self.same, self.pad_mode, name="blur")(x)
