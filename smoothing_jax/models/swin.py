"""Swin Transformer (Liu et al.; HV ``models/swin.py``; timm's ``SwinTransformer``): MSA within
shifted windows of a shrinking map.

A patch embedding (p×p conv, stride p: p = 1 on 32×32 CIFAR, 4 on 224×224 ImageNet) gives a
map of width C; stage s ∈ {1, 2, 3, 4} (width C·2^(s−1)) starts with a patch merging
(2× down-sampling, except stage 1) and holds ``depths[s]`` blocks of two pre-norm units on the
NHWC map,

  x ← x + DropPath(W-MSA(LN(x))),   x ← x + DropPath(MLP(LN(x))),   MLP = Dense-GELU-Dense,

where W-MSA attends within non-overlapping w×w windows (w = 4 on CIFAR, 7 on ImageNet) with
the logit bias B of a learned relative position table, and every odd block shifts the map
cyclically by ⌊w/2⌋ first (and back after):

  SW-MSA(x) = roll(W-MSA(roll(x, −⌊w/2⌋); B + M), +⌊w/2⌋),

M = −∞ between tokens of one shifted window that are not neighbours in the image (one side
wrapped around).  Head: global average pool, LN, Dense.  Stochastic depth is linear in the
block index (``stochastic_depth · k / (Σ depths − 1)``, both units of block k alike).

Layouts.  The defaults are HV's own class: patch embedding conv without LN, patch merging
= 2×2 conv of stride 2 (with bias), one (2w−1)² relative position table per block shared by
the heads, LN after pooling, shift in every odd block.  HV's released CIFAR-100 Swin-Ti is
instead timm's class (``convert.TIMM_LAYOUTS``), selected by the fields

* ``patch_norm=True``: LN after the patch embedding;
* ``merge="linear_concat"``: patch merging = concat of the 2×2 neighbours (timm's order
  x[0,0], x[1,0], x[0,1], x[1,1]) → LN(4C) → Dense(4C → 2C) without bias;
* ``bias_table="per_head"``: a (2w−1)² × heads table per block;
* ``final_norm="tokens"``: LN on every token before pooling (timm's ``norm``);
* ``fit_window=True``: a stage whose map is not larger than the window uses one window of the
  whole map and no shift (timm's ``always_partition=False``).

Unlike HV's ``WindowAttention``, whose left/right mask (``mask[-n1 - 1::n1]``) reaches the
last column of windows only when a stage has ≤ 2 windows per side, M masks every window of
the last column (and row), as the Swin paper and timm do.  HV builds ``depths[s] // 2`` pairs
of blocks; ours builds ``depths[s]`` blocks (the same for the even depths of all sizes).

Lesion studies: ``block_mask`` [2·Σ depths] scales the residual branch of each unit
(``units()`` names them, MSA then MLP of each block), so ``block_mask = 1 − e_i`` removes unit i.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from smoothing_jax.layers.attention import (
  MultiHeadAttention,
  dense_init,
  relative_position_index,
  window_merge,
  window_partition,
)
from smoothing_jax.models.cnn import STEMS, check_images, conv, staged_taps, staged_units
from smoothing_jax.models.vit import PreNormUnit

PATCH_SIZES = {"cifar": 1, "imagenet": 4}
WINDOW_SIZES = {"cifar": 4, "imagenet": 7}
MERGES = ("conv", "linear_concat")
BIAS_TABLES = ("shared", "per_head")
FINAL_NORMS = ("pooled", "tokens")


def shifted_window_mask(height: int, width: int, window_size: int, shift: int) -> np.ndarray:
  """``[num_windows, w², w²]`` logit bias of SW-MSA on a map rolled by −``shift``: 0 between
  tokens of one window that are neighbours in the image, −∞ between tokens on either side of
  the wrap-around.

  Row r of the rolled map holds image row (r + shift) mod H, so it wrapped iff
  r + shift ≥ H; two tokens are neighbours iff they wrapped alike in rows and in columns.
  Windows in :func:`~smoothing_jax.layers.attention.window_partition` order (row-major).
  """
  rows = (np.arange(height) + shift) // height
  cols = (np.arange(width) + shift) // width
  region = (2 * rows[:, None] + cols[None, :]).astype(np.float32)[None, :, :, None]
  region = window_partition(region, window_size)[..., 0]                  # [nW, w²]
  return np.where(region[:, :, None] == region[:, None, :], 0.0, -np.inf).astype(np.float32)


class SwinUnit(PreNormUnit):
  """:class:`~smoothing_jax.models.vit.PreNormUnit` on an NHWC map ``[B, H, W, C]`` whose MSA
  attends within w×w windows, shifted by ``shift`` when > 0."""
  window_size: int = 4
  shift: int = 0
  bias_table: str = "shared"

  def _attention(self, x, train: bool):
    b, h, w, _ = x.shape
    p, s = self.window_size, self.shift
    per_head = (self.num_heads,) if self.bias_table == "per_head" else ()
    table = self.param("relative_position", nn.initializers.normal(0.02),
                       (2 * p - 1, 2 * p - 1) + per_head)
    index = relative_position_index(p)
    bias = table[index[..., 0], index[..., 1]]                    # [w², w²] or [w², w², heads]
    if per_head:
      bias = jnp.moveaxis(bias, -1, 0)                            # [heads, w², w²]
    if s:
      mask = jnp.asarray(shifted_window_mask(h, w, p, s))[:, None]   # [nW, 1, w², w²]
      bias = jnp.tile(bias + mask, (b, 1, 1, 1))                  # windows are (batch, window)
      x = jnp.roll(x, (-s, -s), axis=(1, 2))
    out = MultiHeadAttention(self.num_heads, self.head_dim, dtype=self.dtype,
                             name="attention")(window_partition(x, p), bias, train)
    out = window_merge(out, b, h, w, p)
    return jnp.roll(out, (s, s), axis=(1, 2)) if s else out


class PatchMerging(nn.Module):
  """2× down-sampling ``[B, H, W, C] -> [B, H/2, W/2, features]``: HV's 2×2 conv of stride 2
  (``merge="conv"``) or timm's concat of the 2×2 neighbours → LN → Dense without bias
  (``"linear_concat"``)."""
  features: int
  merge: str = "conv"
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    if self.merge == "conv":
      return conv(self.features, 2, 2, bias=True, dtype=self.dtype, name="reduction")(x)
    b, h, w, c = x.shape
    # Concatenation order (column offset, row offset, channel), as timm's permute(0, 1, 3, 4, 2, 5).
    x = x.reshape(b, h // 2, 2, w // 2, 2, c).transpose(0, 1, 3, 4, 2, 5).reshape(
        b, h // 2, w // 2, 4 * c)
    x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="norm")(x)
    return nn.Dense(self.features, use_bias=False, kernel_init=dense_init, dtype=self.dtype,
                    name="reduction")(x)


class Swin(nn.Module):
  """``__call__(images [B, H, W, 3], train, block_mask=None) -> logits [B, num_classes]``.

  Attributes:
    embed_dim: width of stage 1 (stage s: embed_dim · 2^(s−1)); Swin-T/S 96.
    depths: blocks per stage (Swin-T (2, 2, 6, 2), Swin-S (2, 2, 18, 2)); num_heads: heads per
      stage (3, 6, 12, 24); head_dim: width of a head (32); mlp_ratio: MLP width / stage width.
    patch_size: None = 1 for the CIFAR stem, 4 for ImageNet.
    window_size: None = 4 for the CIFAR stem, 7 for ImageNet.
    stochastic_depth: the last block's DropPath rate (linear in the block index).
    patch_norm, merge, bias_table, final_norm, fit_window: the layout (module docstring);
      the defaults are HV's class, ``convert.TIMM_LAYOUTS["swin_t"]`` timm's.
  """
  num_classes: int = 10
  embed_dim: int = 96
  depths: Sequence[int] = (2, 2, 6, 2)
  num_heads: Sequence[int] = (3, 6, 12, 24)
  head_dim: int = 32
  mlp_ratio: int = 4
  patch_size: int | None = None
  window_size: int | None = None
  stochastic_depth: float = 0.0
  patch_norm: bool = False
  merge: str = "conv"
  bias_table: str = "shared"
  final_norm: str = "pooled"
  fit_window: bool = False
  stem: str = "cifar"
  dtype: Any = jnp.float32
  dropout_rate: ClassVar[float] = 0.0  # no MC dropout: test-time predictions are deterministic

  def units(self) -> list:
    """``[(name, kind)]`` of the residual units in order; kind is "msa" or "mlp"."""
    return staged_units(self.depths)

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the embedded map at depth 0, the units and the patch mergings ("merge")."""
    return staged_taps(self.depths, "merge")

  def _check(self, x) -> int:
    check_images(x)
    for field, value, choices in (("stem", self.stem, STEMS), ("merge", self.merge, MERGES),
                                  ("bias_table", self.bias_table, BIAS_TABLES),
                                  ("final_norm", self.final_norm, FINAL_NORMS)):
      if value not in choices:
        raise ValueError(f"Unknown {field} {value!r} for Swin; choose one of {choices}.")
    if len(self.depths) != len(self.num_heads):
      raise ValueError(f"depths {tuple(self.depths)} and num_heads {tuple(self.num_heads)} need "
                       "one entry per stage.")
    p = self.patch_size or PATCH_SIZES[self.stem]
    if x.shape[1] % p or x.shape[2] % p:
      raise ValueError(
          f"Image size {x.shape[1]}×{x.shape[2]} is not divisible by the patch size {p}.")
    return p

  def _window_and_shift(self, stage: int, height: int, width: int, block: int) -> tuple:
    """``(window, shift)`` of a block on a ``height``×``width`` map (odd blocks shift)."""
    window = self.window_size or WINDOW_SIZES[self.stem]
    if self.fit_window and min(height, width) <= window:
      if height != width:
        raise ValueError(f"fit_window needs a square map where the window covers it; stage "
                         f"{stage} is {height}×{width}.")
      return height, 0
    if height % window or width % window:
      raise ValueError(
          f"window_size {window} does not divide the {height}×{width} map of stage {stage}; "
          f"choose a divisor (4 on 32×32 CIFAR inputs with patch 1, 7 on 224×224 ImageNet "
          f"inputs with patch 4).")
    return window, window // 2 if block % 2 else 0

  @nn.compact
  def __call__(self, x, train: bool = False, block_mask=None):
    p = self._check(x)
    x = conv(self.embed_dim, p, p, bias=True, dtype=self.dtype, name="embedding")(x)
    if self.patch_norm:
      x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="embedding_norm")(x)
    self.sow("intermediates", "patch_embedding", x)  # depth 0 of the feature taps
    units = iter(enumerate(self.units()))
    num_blocks = sum(self.depths)
    block = 0
    for stage, (depth, heads) in enumerate(zip(self.depths, self.num_heads, strict=True), start=1):
      width = self.embed_dim * 2 ** (stage - 1)
      if stage > 1:
        if x.shape[1] % 2 or x.shape[2] % 2:
          raise ValueError(f"Patch merging before stage {stage} needs an even map, got "
                           f"{x.shape[1]}×{x.shape[2]}.")
        x = PatchMerging(width, self.merge, self.dtype, name=f"stage{stage}_merge")(x)
      for j in range(depth):
        window, shift = self._window_and_shift(stage, x.shape[1], x.shape[2], j)
        rate = self.stochastic_depth * block / max(num_blocks - 1, 1)
        for _ in range(2):
          i, (name, kind) = next(units)
          x = SwinUnit(kind,
                       heads,
                       self.head_dim,
                       self.mlp_ratio * width,
                       drop_path_rate=rate,
                       dtype=self.dtype,
                       window_size=window,
                       shift=shift,
                       bias_table=self.bias_table,
                       name=name)(x, train, None if block_mask is None else block_mask[i])
        block += 1

    norm = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="head_norm")
    pooled = (jnp.mean(norm(x), axis=(1, 2)) if self.final_norm == "tokens" else
              norm(jnp.mean(x, axis=(1, 2))))
    return nn.Dense(self.num_classes, kernel_init=dense_init, dtype=self.dtype, name="head")(pooled)
