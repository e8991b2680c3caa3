"""Vision Transformer (Dosovitskiy et al.; HV ``models/vit.py``) with global, windowed or
convolutional MSA.

Linear patch embedding of p×p patches (p = 2 on 32×32 CIFAR, 16 on 224×224
ImageNet), a CLS token and absolute position embeddings (init N(0, 0.02²)),
``depth`` pre-norm units alternating MSA and MLP,

  x ← x + DropPath(MSA(LN(x))),   x ← x + DropPath(MLP(LN(x))),   MLP = Dense-GELU-Dense,

with stochastic-depth rate ``stochastic_depth · i / (depth − 1)`` in encoder block i,
and a head LN → Dense on the CLS token (``classifier="token"``, the reference)
or on the mean of the patch tokens (``"gap"``; no CLS token).

Layouts.  The defaults are HV's class (LayerNorm ε = 1e-5, q, k, v without bias).  timm's
``VisionTransformer`` (HV's released CIFAR-100 ViT-Ti; ``convert.TIMM_LAYOUTS["vit_ti"]``) takes
``layer_norm_epsilon=1e-6`` (every LN) and ``qkv_bias`` as its constructor's.  Everything else
computes alike: timm's conv patch embedding (kernel = stride = p) is our Dense on (row, col,
channel)-ordered patches, its position embedding covers the CLS token as ours, and its final
``norm`` over all tokens followed by taking the CLS token equals our LN on the CLS token (LN acts
per token).

Lesion studies: ``block_mask`` [2·depth] scales the residual branch of each unit
(``units()`` names them), so ``block_mask = 1 − e_i`` removes unit i at test time.
"""
from __future__ import annotations

from typing import Any, ClassVar

import flax.linen as nn
import jax.numpy as jnp

from smoothing_jax.layers.attention import (
  MultiHeadAttention,
  WindowAttention,
  dense_init,
  neighbourhood_mask,
)
from smoothing_jax.models.cnn import STEMS, check_images, drop_path

PATCH_SIZES = {"cifar": 2, "imagenet": 16}
CLASSIFIERS = ("token", "gap")


class PreNormUnit(nn.Module):
  """One pre-norm residual unit ``x + DropPath(f(LN(x)))`` of ViT, PiT and Swin: ``kind`` "msa"
  (f = the subclass's ``_attention(y, train)``) or "mlp" (f = Dense-GELU-Dense, each Dense
  followed by the subclass's ``_dropout(y, train)``, none here)."""
  kind: str
  num_heads: int = 3
  head_dim: int = 64
  mlp_dim: int = 768
  drop_path_rate: float = 0.0
  dtype: Any = jnp.float32
  layer_norm_epsilon: float = 1e-5

  @nn.compact
  def __call__(self, x, train: bool = False, keep=None):
    y = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype, name="norm")(x)
    if self.kind == "msa":
      y = self._attention(y, train)
    else:
      y = nn.gelu(nn.Dense(self.mlp_dim, kernel_init=dense_init, dtype=self.dtype, name="fc1")(y),
                  approximate=False)
      y = self._dropout(y, train)
      y = nn.Dense(x.shape[-1], kernel_init=dense_init, dtype=self.dtype, name="fc2")(y)
      y = self._dropout(y, train)
    return x + drop_path(y, self.drop_path_rate, train, keep)

  def _dropout(self, y, train: bool):
    return y


class TransformerUnit(PreNormUnit):
  """:class:`PreNormUnit` on tokens [B, N, D] with train-only dropout (MSA and MLP outputs).

  Windowed / convolutional attention treats the N tokens as a ``grid`` (h, w); neither: global.
  """
  dropout_rate: float = 0.0
  window_size: int | None = None
  kernel_size: int | None = None
  grid: tuple | None = None
  qkv_bias: bool = False

  def _dropout(self, y, train: bool):
    return nn.Dropout(self.dropout_rate, deterministic=not train)(y)

  def _attention(self, y, train: bool):
    if self.window_size:
      b, _, d = y.shape
      y = WindowAttention(self.window_size,
                          self.num_heads,
                          self.head_dim,
                          dropout_rate=self.dropout_rate,
                          dtype=self.dtype,
                          name="attention")(y.reshape(b, *self.grid, d), train)
      return y.reshape(b, -1, d)
    bias = jnp.asarray(neighbourhood_mask(*self.grid,
                                          self.kernel_size)) if self.kernel_size else None
    return MultiHeadAttention(self.num_heads,
                              self.head_dim,
                              dropout_rate=self.dropout_rate,
                              dtype=self.dtype,
                              qkv_bias=self.qkv_bias,
                              name="attention")(y, bias, train)


class ViT(nn.Module):
  """``__call__(images [B, H, W, 3], train, block_mask=None) -> logits [B, num_classes]``.

  Attributes:
    hidden_dim, depth, num_heads, head_dim, mlp_dim: ViT-Ti 192/12/3/64/768.
    patch_size: None = 2 for the CIFAR stem, 16 for ImageNet.
    classifier: "token" (CLS → LN → Dense) or "gap" (mean of tokens → LN → Dense).
    dropout_rate_train: train-only dropout in MSA/MLP outputs; embedding_dropout_rate after the
      embedding.
    stochastic_depth: the last block's DropPath rate (linear in depth).
    window_size: MSA within non-overlapping windows of the token grid (with a
      relative position bias); kernel_size: MSA within a k×k neighbourhood.
      Both need ``classifier="gap"``; None = global MSA.
    qkv_bias: a bias on q, k, v (global or k×k MSA); layer_norm_epsilon: ε of every LayerNorm.
      The defaults are HV's class, ``convert.TIMM_LAYOUTS["vit_ti"]`` timm's (module docstring).
  """
  num_classes: int = 10
  hidden_dim: int = 192
  depth: int = 12
  num_heads: int = 3
  head_dim: int = 64
  mlp_dim: int = 768
  patch_size: int | None = None
  classifier: str = "token"
  dropout_rate_train: float = 0.0      # HV models/vit.py: dropout=0.0, emb_dropout=0.0
  embedding_dropout_rate: float = 0.0
  stochastic_depth: float = 0.0
  window_size: int | None = None
  kernel_size: int | None = None
  stem: str = "cifar"
  dtype: Any = jnp.float32
  qkv_bias: bool = False
  layer_norm_epsilon: float = 1e-5
  dropout_rate: ClassVar[float] = 0.0  # no MC dropout: test-time predictions are deterministic

  def units(self) -> list:
    """``[(name, kind)]`` of the residual units in order; kind is "msa" or "mlp"."""
    return [(f"block{i}_{kind}", kind) for i in range(self.depth) for kind in ("msa", "mlp")]

  def feature_taps(self) -> list:
    """``[(name, kind)]`` of the feature-map taps in order (:mod:`smoothing_jax.analysis.features`):
    the embedded tokens at depth 0, then the units."""
    return [("patch_embedding", "embedding")] + self.units()

  def _check(self, x):
    check_images(x)
    if self.stem not in STEMS:
      raise ValueError(f"Unknown stem {self.stem!r}; choose one of {STEMS}.")
    if self.classifier not in CLASSIFIERS:
      raise ValueError(
          f"Unknown classifier {self.classifier!r} for ViT; choose one of {CLASSIFIERS}.")
    if self.window_size and self.kernel_size:
      raise ValueError("Give window_size or kernel_size (local MSA), not both.")
    if (self.window_size or self.kernel_size) and self.classifier != "gap":
      raise ValueError(
          "Local MSA (window_size / kernel_size) needs classifier='gap' (a CLS token has no "
          "position)."
      )
    if self.window_size and self.qkv_bias:
      raise ValueError("qkv_bias is for global or k×k MSA (kernel_size), not windowed MSA.")
    p = self.patch_size or PATCH_SIZES[self.stem]
    if x.shape[1] % p or x.shape[2] % p:
      raise ValueError(
          f"Image size {x.shape[1]}×{x.shape[2]} is not divisible by the patch size {p}.")
    return p

  @nn.compact
  def __call__(self, x, train: bool = False, block_mask=None):
    p = self._check(x)
    b = x.shape[0]
    grid = (x.shape[1] // p, x.shape[2] // p)
    # Patches flattened as (row, col, channel), as the reference's (p1 p2 c) rearrange.
    patches = x.reshape(b, grid[0], p, grid[1], p, x.shape[-1]).transpose(0, 1, 3, 2, 4, 5)
    tokens = nn.Dense(self.hidden_dim, kernel_init=dense_init, dtype=self.dtype, name="embedding")(
        patches.reshape(b, grid[0] * grid[1], -1))
    if self.classifier == "token":
      cls = self.param("cls_token", nn.initializers.normal(0.02), (1, 1, self.hidden_dim))
      tokens = jnp.concatenate(
          [jnp.broadcast_to(cls, (b, 1, self.hidden_dim)).astype(tokens.dtype), tokens], 1)
    tokens = tokens + self.param("pos_embedding", nn.initializers.normal(0.02),
                                 (1,) + tokens.shape[1:])
    tokens = nn.Dropout(self.embedding_dropout_rate, deterministic=not train)(tokens)
    # Depth 0 of the feature taps: what the first unit sees (HV's ``PatchEmbed``).
    self.sow("intermediates", "patch_embedding", tokens)

    for i, (name, kind) in enumerate(self.units()):
      rate = self.stochastic_depth * (i // 2) / max(self.depth - 1, 1)
      tokens = TransformerUnit(kind,
                               self.num_heads,
                               self.head_dim,
                               self.mlp_dim,
                               drop_path_rate=rate,
                               dtype=self.dtype,
                               layer_norm_epsilon=self.layer_norm_epsilon,
                               dropout_rate=self.dropout_rate_train,
                               window_size=self.window_size,
                               kernel_size=self.kernel_size,
                               grid=grid,
                               qkv_bias=self.qkv_bias,
                               name=name)(tokens, train,
                                          None if block_mask is None else block_mask[i])

    pooled = tokens[:, 0] if self.classifier == "token" else jnp.mean(tokens, axis=1)
    pooled = nn.LayerNorm(epsilon=self.layer_norm_epsilon, dtype=self.dtype,
                          name="head_norm")(pooled)
    return nn.Dense(self.num_classes, kernel_init=dense_init, dtype=self.dtype, name="head")(pooled)

