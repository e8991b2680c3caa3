"""Pooling-based Vision Transformer (PiT; Heo et al.; HV ``models/pit.py``; timm's
``PoolingVisionTransformer``): a ViT whose token map shrinks and widens between stages.

A patch embedding (p×p conv of stride s, no padding: an h×w map of width D₁ with
h = ⌊(H − p)/s⌋ + 1), a CLS token and absolute position embeddings, then three stages
(s = 1, 2, 3; width D_s = heads_s · head_dim) of ``depths[s]`` blocks of two pre-norm units on
the tokens [B, 1 + h·w, D_s] (CLS first),

  x ← x + DropPath(MSA(LN(x))),   x ← x + DropPath(MLP(LN(x))),   MLP = Dense-GELU-Dense (×4),

with stochastic-depth rate ``stochastic_depth · k / (Σ depths − 1)`` in block k (both units
alike).  Stages 2 and 3 start with a pooling layer: the patch tokens, as an h×w map, go
through a depth-wise 3×3 conv of stride 2 and padding 1 (D_s → D_{s+1}, channel multiplier
D_{s+1} / D_s; the map becomes ⌈h/2⌉×⌈w/2⌉) and the CLS token through a Dense D_s → D_{s+1}.
Head: LN → Dense on the CLS token.

Geometry.  HV's class defaults to p = 16, s = 8 (224×224 ImageNet: 27×27, 14×14, 7×7 maps);
HV's CIFAR recipe (``configs/cifar100_vit.yaml``) sets only p = 2, so the stride stays 8:
a 4×4 map of 2×2 patches, then 2×2 and 1×1 (the embedding sees 1 pixel in 16, as HV's
``Unfold`` does).  HV's released CIFAR-100 PiT-Ti is timm's class with p = 2, s = 1 (31×31,
16×16, 8×8 maps).

Layouts.  The defaults are HV's own class: a position embedding of the 1 + h·w tokens
(``position_embedding="tokens"``, the CLS token included), q, k, v without bias, LayerNorm
ε = 1e-5.  timm's class (``convert.TIMM_LAYOUTS``) is selected by

* ``position_embedding="map"``: an h×w×D₁ embedding added to the patch map only;
* ``qkv_bias=True``;
* ``layer_norm_epsilon=1e-6`` (every LN: units and head).

Both compute the pooling and the head alike (timm's final ``norm`` on the CLS token, then
``head`` on it, is HV's LN → Dense), and both embed patches with a conv: HV's ``Unfold`` +
Linear on (channel, row, col)-ordered patches is that conv.

Lesion studies: ``block_mask`` [2·Σ depths] scales the residual branch of each unit
(``units()`` names them, MSA then MLP of each block), so ``block_mask = 1 − e_i`` removes unit i.
Feature taps (``feature_taps()``): the embedded tokens, the units (``vit.TransformerUnit``, global
MSA) and the pooling layers, all tokens [B, 1 + h·w, D] (the analyses drop the CLS token).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.layers.attention import dense_init
from smoothing_jax.models.cnn import STEMS, check_images, staged_taps, staged_units
from smoothing_jax.models.vit import TransformerUnit

PATCH_SIZES = {"cifar": 2, "imagenet": 16}
STRIDE = 8  # HV's class default for both stems (HV's CIFAR recipe does not set it)
POSITION_EMBEDDINGS = ("tokens", "map")


class Pooling(nn.Module):
  """PiT pooling ``[B, 1 + h·w, C] -> [B, 1 + ⌈h/2⌉·⌈w/2⌉, features]`` of the tokens of an
  h×w ``grid`` (CLS first): depth-wise 3×3 conv, stride 2, padding 1 (with bias; channel
  multiplier features / C) on the patch map, Dense on the CLS token."""
  features: int
  grid: tuple
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    b, _, c = tokens.shape
    patches = tokens[:, 1:].reshape(b, *self.grid, c)
    patches = nn.Conv(self.features, (3, 3),
                      strides=(2, 2),
                      padding=((1, 1), (1, 1)),
                      feature_group_count=c,
                      kernel_init=dense_init,
                      dtype=self.dtype,
                      name="conv")(patches)
    cls = nn.Dense(self.features, kernel_init=dense_init, dtype=self.dtype,
                   name="cls_dense")(tokens[:, :1])
    return jnp.concatenate([cls, patches.reshape(b, -1, self.features)], axis=1)


class PiT(nn.Module):
  """``__call__(images [B, H, W, 3], train, block_mask=None) -> logits [B, num_classes]``.

  Attributes:
    depths: blocks per stage (PiT-Ti/S (2, 6, 4)); num_heads: heads per stage (Ti (2, 4, 8),
      S (3, 6, 12)); head_dim: width of a head (Ti 32, S 48), so stage s has width
      num_heads[s] · head_dim; mlp_ratio: MLP width / stage width.
    patch_size: None = 2 for the CIFAR stem, 16 for ImageNet; stride: None = 8 (HV's class).
    stochastic_depth: the last block's DropPath rate (linear in the block index).
    position_embedding, qkv_bias, layer_norm_epsilon: the layout (module docstring); the
      defaults are HV's class, ``convert.TIMM_LAYOUTS["pit_ti"]`` timm's.
  """
  num_classes: int = 10
  depths: Sequence[int] = (2, 6, 4)
  num_heads: Sequence[int] = (2, 4, 8)
  head_dim: int = 32
  mlp_ratio: int = 4
  patch_size: int | None = None
  stride: int | None = None
  stochastic_depth: float = 0.0
  position_embedding: str = "tokens"
  qkv_bias: bool = False
  layer_norm_epsilon: float = 1e-5
  stem: str = "cifar"
  dtype: Any = jnp.float32
  dropout_rate: ClassVar[float] = 0.0  # no MC dropout: test-time predictions are deterministic

  def units(self) -> list:
    """``[(name, kind)]`` of the residual units in order; kind is "msa" or "mlp"."""
    return staged_units(self.depths)

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the embedded tokens at depth 0, the units and the pooling layers ("pool")."""
    return staged_taps(self.depths, "pool")

  def _check(self, x) -> tuple:
    """Validates the options against images ``x``; returns (patch size, stride, widths)."""
    check_images(x)
    if self.stem not in STEMS:
      raise ValueError(f"Unknown stem {self.stem!r}; choose one of {STEMS}.")
    if self.position_embedding not in POSITION_EMBEDDINGS:
      raise ValueError(f"Unknown position_embedding {self.position_embedding!r} for PiT; choose "
                       f"one of {POSITION_EMBEDDINGS}.")
    if len(self.depths) != len(self.num_heads):
      raise ValueError(f"depths {tuple(self.depths)} and num_heads {tuple(self.num_heads)} need "
                       "one entry per stage.")
    widths = [heads * self.head_dim for heads in self.num_heads]
    for stage in range(1, len(widths)):
      if widths[stage] % widths[stage - 1]:
        raise ValueError(
            f"The depth-wise pooling before stage {stage + 1} needs its width "
            f"{widths[stage]} to be a multiple of stage {stage}'s {widths[stage - 1]} "
            f"(widths num_heads · head_dim).")
    patch = self.patch_size or PATCH_SIZES[self.stem]
    stride = self.stride or STRIDE
    if min(x.shape[1:3]) < patch:
      raise ValueError(f"Image size {x.shape[1]}×{x.shape[2]} is smaller than the patch size "
                       f"{patch}.")
    return patch, stride, widths

  @nn.compact
  def __call__(self, x, train: bool = False, block_mask=None):
    patch, stride, widths = self._check(x)
    x = nn.Conv(widths[0], (patch, patch),
                strides=(stride, stride),
                padding="VALID",
                kernel_init=dense_init,
                dtype=self.dtype,
                name="embedding")(x)
    b, height, width, _ = x.shape
    position = lambda shape: self.param("pos_embedding", nn.initializers.normal(0.02),  # noqa: E731
                                        shape).astype(x.dtype)
    if self.position_embedding == "map":
      x = x + position((1, height, width, widths[0]))
    cls = self.param("cls_token", nn.initializers.normal(0.02), (1, 1, widths[0]))
    tokens = jnp.concatenate(
        [jnp.broadcast_to(cls, (b, 1, widths[0])).astype(x.dtype),
         x.reshape(b, -1, widths[0])], axis=1)
    if self.position_embedding == "tokens":
      tokens = tokens + position((1,) + tokens.shape[1:])
    self.sow("intermediates", "patch_embedding", tokens)  # depth 0 of the feature taps

    grid = (height, width)
    units = iter(enumerate(self.units()))
    num_blocks = sum(self.depths)
    block = 0
    for stage, (depth, heads) in enumerate(zip(self.depths, self.num_heads, strict=True), start=1):
      if stage > 1:
        tokens = Pooling(widths[stage - 1], grid, self.dtype, name=f"stage{stage}_pool")(tokens)
        grid = tuple(-(-n // 2) for n in grid)  # ⌊(n + 2·1 − 3) / 2⌋ + 1
      for _ in range(depth):
        rate = self.stochastic_depth * block / max(num_blocks - 1, 1)
        for _ in range(2):
          i, (name, kind) = next(units)
          tokens = TransformerUnit(kind,
                                   heads,
                                   self.head_dim,
                                   self.mlp_ratio * widths[stage - 1],
                                   drop_path_rate=rate,
                                   qkv_bias=self.qkv_bias,
                                   layer_norm_epsilon=self.layer_norm_epsilon,
                                   dtype=self.dtype,
                                   name=name)(tokens, train,
                                              None if block_mask is None else block_mask[i])
        block += 1

    pooled = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                          name="head_norm")(tokens[:, 0])
    return nn.Dense(self.num_classes, kernel_init=dense_init, dtype=self.dtype, name="head")(pooled)
