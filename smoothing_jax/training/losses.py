"""The training objective a config and model call for (``make_loss``): the cross-entropy
(void pixels masked, class-weighted for segmentation), against soft targets (label smoothing,
Mixup, CutMix), the iBNN negative ELBO, or the BNN-VI one.  A BatchEnsemble's members each see
the whole batch (the batch repeated M times).

Segmentation models (per-pixel logits) train on the pixel-wise cross-entropy with void pixels
masked and, with ``class_balancing="median_frequency"``, class weights (paper Appendix A.2).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from smoothing_jax.data.mixup import Mixing, mix_batch
from smoothing_jax.inference import repeat_for_members, sample_rngs
from smoothing_jax.methods import bnnvi, ibnn
from smoothing_jax.metrics import label_mask
from smoothing_jax.models import is_batch_ensemble, is_ibnn, is_mean_field, is_segmentation_model


def training_mixing(config, model) -> Mixing | None:
  """Label smoothing / Mixup / CutMix of the training loss (None when all are off)."""
  if not (config.label_smoothing or config.mixup_alpha or config.cutmix_alpha):
    return None
  if is_ibnn(model):
    raise ValueError(
        "label_smoothing / mixup_alpha / cutmix_alpha are not supported with the iBNN ELBO.")
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


def ibnn_objective(config, model, num_train: int, steps_per_epoch: int) -> ibnn.Objective:
  """The iBNN ELBO settings of ``config.ibnn`` for a node-noise model."""
  return ibnn.Objective(model.num_components, config.ibnn.num_train_samples, config.ibnn.prior_mean,
                        config.ibnn.prior_std, num_train, steps_per_epoch,
                        config.ibnn.kl_anneal_epochs).check()


def bnnvi_objective(config, num_train: int, steps_per_epoch: int) -> bnnvi.Objective:
  """The BNN-VI ELBO settings of ``config.bnnvi`` for a mean-field model."""
  return bnnvi.Objective(config.bnnvi.prior_std, config.bnnvi.prior_mean, num_train,
                         steps_per_epoch, config.bnnvi.kl_anneal_epochs).check()


def supervised_loss(model, mixing: Mixing | None = None, class_weights=None):
  """``loss_fn(params, batch_stats, batch, rng, step) -> (loss, aux)`` of the cross-entropy:
  :func:`cross_entropy` (per pixel for segmentation, void masked, ``class_weights`` if given),
  or against soft targets (label smoothing, Mixup / CutMix drawn from ``fold_in(rng, 2)``).

  A BatchEnsemble of M members trains on the batch repeated M times, row b·M + m example b
  under member m (uncertainty-baselines tiles it M times; the rows are the same, and BatchNorm
  sees the same statistics), so the loss is the mean over members of each member's loss."""
  members = model.ensemble_size if is_batch_ensemble(model) else 0
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
    if members:
      images, targets, labels = (repeat_for_members(x, members) for x in (images, targets, labels))
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


def make_loss(config, model, *, num_train: int, steps_per_epoch: int, class_weights=None):
  """The training objective that ``config`` and ``model`` call for, as a ``loss_fn`` for
  :func:`train_step`: the negative ELBO for iBNN models
  (:func:`smoothing_jax.methods.ibnn.elbo_loss`) and for BNN-VI models (:func:`supervised_loss` +
  β·KL/N, :mod:`smoothing_jax.methods.bnnvi`), their NLL, KL and β joining the metrics; otherwise
  :func:`supervised_loss`."""
  if is_mean_field(model):
    objective = bnnvi_objective(config, num_train, steps_per_epoch)
    nll_fn = supervised_loss(model, training_mixing(config, model), class_weights)

    def elbo_fn(params, batch_stats, batch, rng, step):
      nll, aux = nll_fn(params, batch_stats, batch, rng, step)
      loss, metrics = bnnvi.elbo_terms(params, objective, nll, step)
      return loss, {**aux, "metrics": metrics}
    return elbo_fn
  if not is_ibnn(model):
    return supervised_loss(model, training_mixing(config, model), class_weights)
  training_mixing(config, model)  # rejects label smoothing / Mixup / CutMix with the ELBO
  objective = ibnn_objective(config, model, num_train, steps_per_epoch)

  def loss_fn(params, batch_stats, batch, rng, step):
    loss, aux = ibnn.elbo_loss(model, objective, params, batch_stats, batch["image"],
                               batch["label"], rng, step)
    metrics = {k: aux.pop(k) for k in ("nll", "kl", "kl_weight")}
    return loss, {**aux, "metrics": metrics}
  return loss_fn


