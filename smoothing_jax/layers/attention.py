"""Multi-head self-attention (MSA): global, windowed with a relative position bias, and
convolutional.

HV ("How do vision transformers work?") treats MSA as a trainable, data-specific
smoothing: each output token is a convex combination of value tokens,

  MSA(x) = concat_h softmax(q_h k_hᵀ / √d + B) v_h · W_out + b_out,
  q, k, v = x W_{q,k,v} (no bias),

with softmax rows summing to 1.  ``B`` is an additive logit bias shared by the
heads: a learned relative position bias inside non-overlapping windows
(AlterNet's ``LocalAttention``) or a −∞ mask outside a k×k neighbourhood
(the slides' convolutional "local MSA").  Attention weights are sown as the
intermediate ``"attention"`` ([B, heads, N, N]) so they can be inspected.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

# Reference ``nn.Linear``: U(±1/√fan_in) weights; ViT code initialises embeddings N(0, 0.02²).
dense_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


class MultiHeadAttention(nn.Module):
  """Self-attention over tokens ``x [B, N, C] -> [B, N, out_features or C]``.

  Attributes:
    num_heads, head_dim: heads h and per-head width d (inner width h·d).
    out_features: output channels (None: C).
    dropout_rate: train-only dropout on the output projection.
    qkv_bias: a bias on q, k, v (timm's ``qkv_bias=True``, e.g. its PiT); HV's MSAs have none.
  """
  num_heads: int
  head_dim: int = 64
  out_features: int | None = None
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32
  qkv_bias: bool = False

  @nn.compact
  def __call__(self, x, bias=None, train: bool = False):
    """``bias``: additive attention logits broadcastable to [B, heads, N, N] (e.g. [N, N])."""
    qkv = nn.DenseGeneral((3, self.num_heads, self.head_dim),
                          use_bias=self.qkv_bias,
                          kernel_init=dense_init,
                          dtype=self.dtype,
                          name="qkv")(x)  # [B, N, 3, h, d]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    logits = jnp.einsum("bihd,bjhd->bhij", q, k).astype(jnp.float32) * self.head_dim ** -0.5
    if bias is not None:
      logits = logits + bias
    attention = nn.softmax(logits, axis=-1)
    self.sow("intermediates", "attention", attention)
    out = jnp.einsum("bhij,bjhd->bihd", attention.astype(v.dtype), v)
    out = nn.DenseGeneral(self.out_features or x.shape[-1], axis=(-2, -1), kernel_init=dense_init,
                          dtype=self.dtype, name="out")(out)
    return nn.Dropout(self.dropout_rate, deterministic=not train)(out)


def relative_position_index(window_size: int) -> np.ndarray:
  """``[w², w², 2]`` table indices of the offset (Δrow, Δcol) + w − 1 from query i to key j
  (row-major)."""
  coords = np.stack(np.meshgrid(np.arange(window_size), np.arange(window_size), indexing="ij"),
                    -1).reshape(-1, 2)
  return coords[None, :, :] - coords[:, None, :] + window_size - 1


def neighbourhood_mask(height: int, width: int, kernel_size: int) -> np.ndarray:
  """``[HW, HW]`` logit bias: 0 where key j lies in the k×k neighbourhood of query i, −∞
  elsewhere.

  The neighbourhood is |Δrow|, |Δcol| ≤ k // 2 (k odd: centred on the query), so
  ``kernel_size >= 2·max(H, W) − 1`` is global attention.
  """
  coords = np.stack(np.meshgrid(np.arange(height), np.arange(width), indexing="ij"),
                    -1).reshape(-1, 2)
  offsets = np.abs(coords[None, :, :] - coords[:, None, :])
  inside = np.all(offsets <= kernel_size // 2, axis=-1)
  return np.where(inside, 0.0, -np.inf).astype(np.float32)


def window_partition(x, window_size: int):
  """``[B, H, W, C] -> [B·(H/w)·(W/w), w², C]`` non-overlapping windows, row-major."""
  b, h, w, c = x.shape
  x = x.reshape(b, h // window_size, window_size, w // window_size, window_size, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(-1, window_size * window_size, c)


def window_merge(windows, batch: int, height: int, width: int, window_size: int):
  """Inverse of :func:`window_partition`."""
  c = windows.shape[-1]
  x = windows.reshape(batch, height // window_size, width // window_size, window_size, window_size,
                      c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, height, width, c)


class WindowAttention(nn.Module):
  """MSA within non-overlapping w×w windows of an NHWC map, plus a learned relative position bias.

  HV ``LocalAttention``: one (2w−1)×(2w−1) bias table shared by the heads, init
  N(0, 0.02²).  ``window_size`` must divide H and W; a window covering the whole
  map is global attention (plus the bias).  ``[B, H, W, C] -> [B, H, W, out_features]``.
  """
  window_size: int
  num_heads: int
  head_dim: int = 64
  out_features: int | None = None
  dropout_rate: float = 0.0
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool = False):
    b, h, w, _ = x.shape
    p = self.window_size
    if p < 1 or h % p or w % p:
      raise ValueError(f"window_size {p} does not divide the {h}×{w} feature map; choose a "
                       f"divisor (AlterNet: 4 on 32×32 CIFAR inputs, 7 on 224×224 ImageNet "
                       f"inputs).")
    table = self.param("relative_position", nn.initializers.normal(0.02), (2 * p - 1, 2 * p - 1))
    index = relative_position_index(p)
    bias = table[index[..., 0], index[..., 1]]
    out = MultiHeadAttention(self.num_heads,
                             self.head_dim,
                             self.out_features,
                             self.dropout_rate,
                             self.dtype,
                             name="attention")(window_partition(x, p), bias, train)
    return window_merge(out, b, h, w, p)
