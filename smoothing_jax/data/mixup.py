"""Mixup / CutMix with label smoothing, on device inside the jitted train step (timm ``Mixup``,
mode "batch").

One λ per batch; the partner of example i is example B−1−i (the batch reversed).
With probability ``switch_prob`` the batch uses CutMix (λ ~ Beta(α_c, α_c), a box
of side √(1−λ)·(H, W) centred uniformly and clipped to the image, λ corrected to
the uncovered area), otherwise Mixup (λ ~ Beta(α_m, α_m), x̃ = λx + (1−λ)x_rev).
Targets: ỹ = λ·s(y) + (1−λ)·s(y_rev) with smoothed one-hots
s(y) = (1 − ε)·onehot(y) + ε/C.  Everything is a function of the key, so a
resumed run mixes exactly as an uninterrupted one.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Mixing(NamedTuple):
  """Soft-target settings of the training loss (all zero: plain one-hot cross-entropy)."""
  num_classes: int
  label_smoothing: float = 0.0
  mixup_alpha: float = 0.0
  cutmix_alpha: float = 0.0
  switch_prob: float = 0.5

  def check(self) -> Mixing:
    if not 0.0 <= self.label_smoothing < 1.0:
      raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}.")
    if self.mixup_alpha < 0 or self.cutmix_alpha < 0:
      raise ValueError(
          f"mixup_alpha and cutmix_alpha must be >= 0, got {self.mixup_alpha}, {self.cutmix_alpha}."
      )
    if not 0.0 <= self.switch_prob <= 1.0:
      raise ValueError(f"switch_prob must be in [0, 1], got {self.switch_prob}.")
    return self


def smooth_one_hot(labels, num_classes: int, smoothing: float):
  """``[B] -> [B, C]``: 1 − ε + ε/C on the label, ε/C elsewhere."""
  off = smoothing / num_classes
  return jax.nn.one_hot(labels, num_classes) * (1.0 - smoothing) + off


def cutmix_box(rng, lam, height: int, width: int):
  """``(top, bottom, left, right)`` of the CutMix box for mixing ratio ``lam``
  (timm ``rand_bbox``)."""
  ratio = jnp.sqrt(1.0 - lam)
  cut_h, cut_w = (height * ratio).astype(jnp.int32), (width * ratio).astype(jnp.int32)
  ky, kx = jax.random.split(rng)
  cy = jax.random.randint(ky, (), 0, height)
  cx = jax.random.randint(kx, (), 0, width)
  return (jnp.clip(cy - cut_h // 2, 0, height), jnp.clip(cy + cut_h // 2, 0, height),
          jnp.clip(cx - cut_w // 2, 0, width), jnp.clip(cx + cut_w // 2, 0, width))


def mix(images, targets, lam, box=None):
  """Mix each example with its partner in the reversed batch; ``box`` given: paste it (CutMix).

  Returns ``(images, targets, λ)`` with λ the kept fraction (box area corrected).
  """
  partner_images, partner_targets = images[::-1], targets[::-1]
  if box is None:
    mixed = lam * images + (1.0 - lam) * partner_images
  else:
    top, bottom, left, right = box
    rows = jnp.arange(images.shape[1])[:, None]
    cols = jnp.arange(images.shape[2])[None, :]
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    mixed = jnp.where(inside[None, :, :, None], partner_images, images)
    lam = 1.0 - jnp.mean(inside.astype(jnp.float32))
  return mixed, lam * targets + (1.0 - lam) * partner_targets, lam


def mix_batch(rng, images, labels, mixing: Mixing):
  """``(images, soft targets [B, C])`` of one training batch under ``mixing``."""
  targets = smooth_one_hot(labels, mixing.num_classes, mixing.label_smoothing)
  if mixing.mixup_alpha <= 0 and mixing.cutmix_alpha <= 0:
    return images, targets
  k_switch, k_mixup, k_cutmix, k_box = jax.random.split(rng, 4)

  def with_mixup(_):
    lam = jax.random.beta(k_mixup, mixing.mixup_alpha, mixing.mixup_alpha)
    return mix(images, targets, lam)[:2]

  def with_cutmix(_):
    lam = jax.random.beta(k_cutmix, mixing.cutmix_alpha, mixing.cutmix_alpha)
    return mix(images, targets, lam, cutmix_box(k_box, lam, images.shape[1], images.shape[2]))[:2]

  if mixing.mixup_alpha <= 0:
    return with_cutmix(None)
  if mixing.cutmix_alpha <= 0:
    return with_mixup(None)
  return jax.lax.cond(
      jax.random.uniform(k_switch) < mixing.switch_prob, with_cutmix, with_mixup, None)
