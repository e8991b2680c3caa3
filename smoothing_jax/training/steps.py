"""The train state and the compiled steps: ``create_train_state``, ``train_step`` (gradient
accumulation in one ``lax.scan``), ``eval_step``, and ``compile_steps``, which jits them over the
mesh (batch sharded on ``data``, state replicated and donated; BatchNorm statistics over the
*global* batch, XLA inserting the cross-device reductions).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging
from flax.training import train_state
from jax.sharding import Mesh

from smoothing_jax.inference import batch_ensemble_predict, mc_predict, sample_rngs
from smoothing_jax.metrics import UncertaintyMetrics, label_mask
from smoothing_jax.models import is_batch_ensemble
from smoothing_jax.parallel import sharded_eval_step, shardings
from smoothing_jax.training.losses import supervised_loss
from smoothing_jax.training.optim import create_optimizer


class TrainState(train_state.TrainState):
  batch_stats: Any


def variables_of(state: TrainState) -> dict:
  """``{"params", "batch_stats"}`` of a train state (what inference and checkpoints' readers
  use)."""
  return {"params": state.params, "batch_stats": state.batch_stats}


def create_train_state(config, model, rng, image_shape, schedule) -> TrainState:
  """Initialise parameters and BatchNorm statistics; attach the optimizer.

  One compiled call: outside ``jit`` the optimizer state would be created leaf by leaf, each
  new leaf shape an eager operation compiled (and kept) on its own.
  """
  tx = create_optimizer(config, schedule, model)
  return jax.jit(functools.partial(init_train_state, model, tx, image_shape))(rng)


def init_train_state(model, tx, image_shape, rng) -> TrainState:
  """The train state of ``model`` initialised from ``rng`` (pure: under ``jit``, or ``vmap`` over
  keys for the members of an ensemble)."""
  variables = model.init({"params": rng, **sample_rngs(rng)}, jnp.zeros((1,) + tuple(image_shape)))
  return TrainState.create(apply_fn=model.apply, params=variables["params"],
                           batch_stats=variables.get("batch_stats", {}), tx=tx)


def split_micro_batches(batch, num_micro_batches: int):
  """``[B, ...]`` leaves → ``[num_micro_batches, B / num_micro_batches, ...]``, micro-batch j
  holding rows j, j + k, j + 2k, ... (k = ``num_micro_batches``): each device's contiguous block
  of a data-sharded batch then holds an equal part of every micro-batch."""
  def split(x):
    if x.shape[0] % num_micro_batches:
      raise ValueError(f"A batch of {x.shape[0]} does not split into {num_micro_batches} "
                       "micro-batches (config.grad_accum_steps must divide "
                       "config.input.batch_size).")
    x = x.reshape((x.shape[0] // num_micro_batches, num_micro_batches) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def train_step(schedule, loss_fn, state: TrainState, batch, dropout_rng, grad_accum_steps: int = 1):
  """One optimiser step on a (global) batch of ``loss_fn`` (``losses.make_loss``); the dropout /
  noise key is ``fold_in(dropout_rng, step)``.  Metrics: loss, accuracy (void masked),
  learning rate and the loss's own (e.g. the ELBO's NLL and KL).

  ``grad_accum_steps`` = k > 1 splits the batch into k micro-batches
  (:func:`split_micro_batches`, key ``fold_in(key, j)`` for micro-batch j) and applies the mean
  of their gradients and losses in one update, inside one ``lax.scan``: a batch that does not
  fit in memory runs at 1/k of it.  The update equals the full batch's for a loss that is a mean
  over equal-size micro-batches; BatchNorm statistics (and their running averages, updated once
  per micro-batch) then come from micro-batches, and per-pixel losses are averaged per
  micro-batch.
  """
  rng = jax.random.fold_in(dropout_rng, state.step)

  def micro_step(batch_stats, micro_batch, key):
    (loss, aux), grads = jax.value_and_grad(
        lambda params: loss_fn(params, batch_stats, micro_batch, key, state.step),
        has_aux=True)(state.params)
    counted = label_mask(aux["labels"], aux["logits"].shape[-1])
    correct = (jnp.argmax(aux["logits"], -1) == aux["labels"]) * counted
    totals = {"loss": loss, "correct": jnp.sum(correct), "counted": jnp.sum(counted),
              **aux["metrics"]}
    return aux["batch_stats"], grads, totals

  if grad_accum_steps == 1:
    batch_stats, grads, totals = micro_step(state.batch_stats, batch, rng)
  else:
    def accumulate(carry, inputs):
      batch_stats, grad_sum, total_sum = carry
      j, micro_batch = inputs
      batch_stats, grads, totals = micro_step(batch_stats, micro_batch, jax.random.fold_in(rng, j))
      return (batch_stats, jax.tree.map(jnp.add, grad_sum, grads),
              jax.tree.map(jnp.add, total_sum, totals)), None

    micro_batches = split_micro_batches(batch, grad_accum_steps)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    _, grad_shape, total_shape = jax.eval_shape(micro_step, state.batch_stats, first, rng)
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    (batch_stats, grads, totals), _ = jax.lax.scan(
        accumulate, (state.batch_stats, zeros(grad_shape), zeros(total_shape)),
        (jnp.arange(grad_accum_steps), micro_batches))
    grads = jax.tree.map(lambda g: g / grad_accum_steps, grads)
    counts = {"correct": totals["correct"], "counted": totals["counted"]}
    totals = {**jax.tree.map(lambda t: t / grad_accum_steps, totals), **counts}
  new_state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  correct, counted = totals.pop("correct"), totals.pop("counted")
  return new_state, {
      **totals,
      "accuracy": correct / jnp.maximum(counted, 1.0),
      "learning_rate": schedule(state.step),
  }


def eval_step(model, num_samples: int, num_bins: int, variables, batch, rng) -> UncertaintyMetrics:
  """Metrics of the N-sample predictive on one padded, masked batch (per pixel, void masked,
  for segmentation); a BatchEnsemble's: its M members."""
  if is_batch_ensemble(model):
    pred = batch_ensemble_predict(model, variables, batch["image"], rng=rng)
  else:
    pred = mc_predict(model, variables, batch["image"], num_samples=num_samples, rng=rng)
  return UncertaintyMetrics.from_model_output(pred.mean_probs,
                                              batch["label"],
                                              batch["mask"],
                                              num_bins=num_bins)


def train_batch_sharding(config, mesh: Mesh):
  """How training batches lie on ``mesh``: sharded on ``data`` when each micro-batch
  (``batch_size / grad_accum_steps``) divides over the devices; otherwise (one process only)
  replicated, every device computing whole micro-batches, with a warning."""
  k, batch_size = config.grad_accum_steps, config.input.batch_size
  if not isinstance(k, int) or k < 1 or batch_size % k:
    raise ValueError(f"grad_accum_steps must be a positive integer that divides batch_size "
                     f"{batch_size}, got {k!r}.")
  replicated, data_sharding = shardings(mesh)
  micro = batch_size // k
  if micro % mesh.size == 0:
    return data_sharding
  if jax.process_count() > 1:
    raise ValueError(f"Micro-batches of {micro} (batch_size {batch_size} / "
                     f"grad_accum_steps {k}) do not divide over the {mesh.size} devices of a "
                     "multi-process run.")
  logging.warning("Micro-batches of %d (batch_size %d / grad_accum_steps %d) do not divide over "
                  "%d devices: every device computes whole micro-batches (no data parallelism).",
                  micro, batch_size, k, mesh.size)
  return replicated


def compile_steps(model, schedule, mesh: Mesh, num_bins: int, loss_fn=None,
                  grad_accum_steps: int = 1, batch_sharding=None, pipeline=None):
  """``(train_step, eval_step)`` jitted over ``mesh``: the training batch on ``batch_sharding``
  (default: sharded on ``data``), state replicated and donated.  ``loss_fn``
  (``losses.make_loss``) defaults to the plain cross-entropy.

  ``train_step(state, batch, rng)``; for a device-resident ``pipeline``
  (:class:`~smoothing_jax.data.resident.ResidentPipeline`) ``train_step(state, arrays, order,
  rng)``, which gathers and augments the batch of ``state.step`` inside the same compiled step.
  """
  replicated, data_sharding = shardings(mesh)
  batch_sharding = batch_sharding or data_sharding
  loss_fn = loss_fn or supervised_loss(model)
  step = functools.partial(train_step, schedule, loss_fn, grad_accum_steps=grad_accum_steps)
  if pipeline is not None and pipeline.resident:
    def resident_step(state, arrays, order, rng):
      return step(state, pipeline.train_batch(arrays, order, state.step, batch_sharding), rng)
    compiled_train_step = jax.jit(resident_step, in_shardings=(replicated,) * 4,
                                  out_shardings=(replicated, replicated), donate_argnums=(0,))
  else:
    compiled_train_step = jax.jit(step, in_shardings=(replicated, batch_sharding, replicated),
                                  out_shardings=(replicated, replicated), donate_argnums=(0,))
  return compiled_train_step, sharded_eval_step(eval_step, mesh, model, 1, num_bins)
