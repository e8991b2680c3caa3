"""The cross-entropy every method's objective builds on (``Method.loss``): void pixels masked,
class-weighted for segmentation, or against soft targets (label smoothing, Mixup, CutMix).

Segmentation models (per-pixel logits) train on the pixel-wise cross-entropy with void pixels
masked and, with ``class_balancing="median_frequency"``, class weights (paper Appendix A.2).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from smoothing_jax.data.mixup import Mixing, mix_batch
from smoothing_jax.metrics import label_mask
from smoothing_jax.models import is_segmentation_model
from smoothing_jax.passes import sample_rngs


def training_mixing(config, model) -> Mixing | None:
  """Label smoothing / Mixup / CutMix of the training loss (None when all are off)."""
  if not (config.label_smoothing or config.mixup_alpha or config.cutmix_alpha):
    return None
  if is_segmentation_model(model):
    raise ValueError(
        "label_smoothing / mixup_alpha / cutmix_alpha are for classification, not "
        "segmentation models."
    )
  return Mixing(model.num_classes, config.label_smoothing, config.mixup_alpha, config.cutmix_alpha,
                config.mixup_switch_prob).check()


def class_weights(config, model, pipeline) -> np.ndarray | None:
  """Per-class loss weights ``[C]``: ``config.class_balancing`` "median_frequency"
  (segmentation) or "none"."""
  if config.class_balancing == "none":
    return None
  if config.class_balancing != "median_frequency":
    raise ValueError(
        f"Unknown class_balancing {config.class_balancing!r}; choose 'none' or 'median_frequency'.")
  weights = pipeline.class_weights(model.num_classes)
  logging.info("Median-frequency class weights: %s", np.array2string(weights, precision=4))
  return weights


def cross_entropy(logits, labels, class_weights=None):
  """Softmax cross-entropy of ``logits [..., C]`` against integer ``labels [...]``.

  Positions whose label lies outside ``[0, C)`` (void pixels) do not count.  Without
  ``class_weights`` it is the mean over the counted positions; with weights ``w [C]``
  it is Σ w_y CE / Σ w_y (PyTorch ``CrossEntropyLoss(weight=w)``).
  """
  weights = label_mask(labels, logits.shape[-1])
  labels = jnp.where(weights > 0, labels, 0)
  if class_weights is not None:
    weights = weights * jnp.asarray(class_weights, jnp.float32)[labels]
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  return jnp.sum(weights * losses) / jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)


def supervised_loss(model, mixing: Mixing | None = None, class_weights=None,
                    tile: Callable = lambda *arrays: arrays):
  """``loss_fn(params, batch_stats, batch, rng, step) -> (loss, aux)`` of the cross-entropy:
  :func:`cross_entropy` (per pixel for segmentation, void masked, ``class_weights`` if given),
  or against soft targets (label smoothing, Mixup / CutMix drawn from ``fold_in(rng, 2)``).

  ``tile(images, targets, labels)`` makes the method's training batch of the (mixed) batch
  (``Method.tile``: a BatchEnsemble's repeats it for its members)."""
  weights = None if class_weights is None else jnp.asarray(class_weights, jnp.float32)
  if mixing is None:
    def inputs(batch, rng):
      return batch["image"], batch["label"]

    def criterion(logits, labels):
      return cross_entropy(logits, labels, weights)
  else:
    def inputs(batch, rng):
      return mix_batch(jax.random.fold_in(rng, 2), batch["image"], batch["label"], mixing)

    def criterion(logits, targets):
      return optax.softmax_cross_entropy(logits.astype(jnp.float32), targets).mean()

  def loss_fn(params, batch_stats, batch, rng, step):
    images, targets = inputs(batch, rng)
    labels = batch["label"]
    images, targets, labels = tile(images, targets, labels)
    logits, updates = model.apply({
        "params": params,
        "batch_stats": batch_stats
    },
                                  images,
                                  train=True,
                                  mutable=["batch_stats"],
                                  rngs=sample_rngs(rng))
    return criterion(logits, targets), {"logits": logits, "labels": labels, "metrics": {},
                                        "batch_stats": updates.get("batch_stats", {})}
  return loss_fn
