"""The train state and the compiled steps: ``create_train_state``, ``train_step`` (gradient
accumulation in one ``lax.scan``), ``eval_step``, and ``compile_steps``, which jits them over the
mesh (batch sharded on ``data``, state replicated and donated; BatchNorm statistics over the
*global* batch, XLA inserting the cross-device reductions).
"""
from __future__ import annotations

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
from absl import logging
from flax.training import train_state
from jax.sharding import Mesh

from smoothing_jax.methods import Method, as_method
from smoothing_jax.methods.base import Clock
from smoothing_jax.methods.losses import supervised_loss
from smoothing_jax.metrics import label_mask
from smoothing_jax.parallel import sharded_eval_step, shardings
from smoothing_jax.passes import sample_rngs
from smoothing_jax.training.optim import create_optimizer


class TrainState(train_state.TrainState):
  """Parameters, optimizer state and step (flax's), BatchNorm statistics, and the collections
  the run's method keeps of its own (``Method.init_state``: ``{name: pytree}``, e.g. SWAG's
  moments; ``{}`` for most methods)."""
  batch_stats: Any
  method_state: Any = flax.struct.field(default_factory=dict)


def variables_of(state: TrainState) -> dict:
  """``{"params", "batch_stats", **method_state}`` of a train state: what the predictive,
  inference and checkpoints' readers take (``model.apply`` reads the first two)."""
  return {"params": state.params, "batch_stats": state.batch_stats, **state.method_state}


def create_train_state(config, model, rng, image_shape, schedule) -> TrainState:
  """Initialise parameters and BatchNorm statistics of one network (``model``: a Flax module or
  its method); attach the optimizer of its method (``optim.create_optimizer``).

  One compiled call: outside ``jit`` the optimizer state would be created leaf by leaf, each
  new leaf shape an eager operation compiled (and kept) on its own.
  """
  return jax.jit(state_initializer(config, as_method(model, config), image_shape, schedule))(rng)


def state_initializer(config, method: Method, image_shape, schedule):
  """``init_one(key) -> TrainState`` of one network of ``method`` with its optimizer (what
  ``Method.init_train_state`` initialises, once or for each member)."""
  tx = create_optimizer(config, schedule, method)
  return functools.partial(init_train_state, method.model, tx, image_shape,
                           method.per_member.init_state)


def init_train_state(model, tx, image_shape, init_method_state, rng) -> TrainState:
  """The train state of ``model`` initialised from ``rng``, with the method's collections
  ``init_method_state(variables)`` (pure: under ``jit``, or ``vmap`` over keys for the members of
  an ensemble)."""
  variables = model.init({"params": rng, **sample_rngs(rng)}, jnp.zeros((1,) + tuple(image_shape)))
  state = TrainState.create(apply_fn=model.apply, params=variables["params"],
                            batch_stats=variables.get("batch_stats", {}), tx=tx,
                            method_state=init_method_state(
                                {"params": variables["params"],
                                 "batch_stats": variables.get("batch_stats", {})}))
  # A strong int32 step, as a restored checkpoint's: TrainState.create's Python 0 is weakly typed,
  # and a resumed run would compile its train step again for the other type.
  return state.replace(step=jnp.asarray(0, jnp.int32))


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


def train_step(schedule, loss_fn, state: TrainState, batch, dropout_rng, grad_accum_steps: int = 1,
               method: Method | None = None, steps_per_epoch: int = 1, num_steps: int = 0):
  """One optimiser step on a (global) batch of ``loss_fn`` (``Method.loss``); the dropout /
  noise key is ``fold_in(dropout_rng, step)``.  Metrics: loss, accuracy (void masked),
  learning rate and the loss's own (e.g. the ELBO's NLL and KL).  Then ``method``'s hook
  (one network's: ``Method.after_step``) updates its collections, knowing the step, the epoch
  and the run's length (``Clock``: ``steps_per_epoch`` of the training split, ``num_steps``).

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
  if method is not None:
    clock = Clock.after(new_state.step, steps_per_epoch, num_steps)
    network = {"params": new_state.params, "batch_stats": new_state.batch_stats}
    new_state = new_state.replace(method_state=method.after_step(new_state.method_state,
                                                                 network, clock))
  correct, counted = totals.pop("correct"), totals.pop("counted")
  return new_state, {
      **totals,
      "accuracy": correct / jnp.maximum(counted, 1.0),
      "learning_rate": schedule(state.step),
  }


def eval_step(method: Method, num_bins: int, variables, batch, rng) -> dict:
  """``{tag suffix: UncertaintyMetrics}`` of ``method``'s predictive on one padded, masked batch
  (per pixel, void masked, for segmentation; ``Method.eval_metrics``)."""
  return method.eval_metrics(variables, batch, rng, num_bins)


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


def steps_in_one_call(one_step, steps_per_call: int, state, arrays, orders, rngs, count):
  """``count`` (≤ ``steps_per_call``, traced: one program serves every count) steps of
  ``one_step(state, arrays, orders, rngs) -> (state, metrics)`` in one ``fori_loop`` (the step
  alone where ``steps_per_call`` is 1): the state
  after them, their metrics stacked ``[steps_per_call, ...]`` (rows from ``count`` on are zeros),
  and the index of the first step whose loss is not finite (``count``: none), one reduction on
  the device instead of a read per step."""
  metrics_shape = jax.eval_shape(one_step, state, arrays, orders, rngs)[1]
  stacked = jax.tree.map(lambda s: jnp.zeros((steps_per_call,) + s.shape, s.dtype),
                         metrics_shape)

  def body(i, carry):
    state, stacked = carry
    state, metrics = one_step(state, arrays, orders, rngs)
    return state, jax.tree.map(lambda all_, one: jax.lax.dynamic_update_index_in_dim(
        all_, one, i, 0), stacked, metrics)

  if steps_per_call == 1:  # the step itself: XLA:CPU runs a step inside a loop 4-5x slower
    state, metrics = one_step(state, arrays, orders, rngs)
    stacked = jax.tree.map(lambda x: x[None], metrics)
  else:
    state, stacked = jax.lax.fori_loop(0, count, body, (state, stacked))
  losses = stacked["loss"].reshape(steps_per_call, -1)
  bad = ~jnp.all(jnp.isfinite(losses), axis=1) & (jnp.arange(steps_per_call) < count)
  return state, stacked, jnp.where(jnp.any(bad), jnp.argmax(bad), count)


def compile_steps(method, schedule, mesh: Mesh, num_bins: int, loss_fn=None,
                  grad_accum_steps: int = 1, batch_sharding=None, pipeline=None,
                  pipelines=None, num_steps: int = 0, steps_per_call: int = 1):
  """``(train_step, eval_step)`` of ``method`` (a Flax module: its method) jitted over ``mesh``:
  the training batches on ``batch_sharding`` (default: sharded on ``data``), state replicated
  and donated.  ``loss_fn`` (``Method.loss``) defaults to the plain cross-entropy.

  ``pipelines`` (default ``[pipeline]``): those the train state learns from
  (``Method.train_pipelines``; a deep ensemble's members each their own).  ``train_step(state,
  batch, rng)`` with one pipeline, ``train_step(state, batches, rngs)`` with a tuple, one batch
  per pipeline; for a device-resident ``pipeline``
  (:class:`~smoothing_jax.data.resident.ResidentPipeline`) ``train_step(state, arrays, order,
  rng, count) -> (state, metrics [steps_per_call, ...], first non-finite step)`` (or a tuple of
  orders): ``count`` ≤ ``steps_per_call`` steps of one epoch in one call
  (:func:`steps_in_one_call`), each gathering and augmenting the batch of ``state.step``
  inside the compiled loop (``Method.train_step`` runs the step on each member).
  ``eval_step(variables, batch, rng)`` gives the metrics of the method's training evaluation
  (``Method.for_training_eval``).  ``num_steps``: the run's length, which the method's hooks
  may read (``Method.after_step``).
  """
  method = as_method(method)
  replicated, data_sharding = shardings(mesh)
  batch_sharding = batch_sharding or data_sharding
  pipelines = pipelines or [pipeline]
  shared = len(pipelines) == 1
  loss_fn = loss_fn or supervised_loss(method.model, tile=method.tile)
  steps_per_epoch = pipelines[0].steps_per_epoch if pipelines[0] is not None else 1
  step = functools.partial(train_step, schedule, loss_fn, grad_accum_steps=grad_accum_steps,
                           method=method.per_member, steps_per_epoch=steps_per_epoch,
                           num_steps=num_steps)
  # One pipeline: its batch (order); several: a tuple, one per pipeline.
  pick = (lambda inputs, m: inputs) if shared else (lambda inputs, m: inputs[m])  # noqa: E731
  if pipeline is not None and pipeline.resident:
    def resident_step(state, arrays, orders, rngs):
      member_batch = lambda m: pipelines[m].train_batch(  # noqa: E731
          arrays, pick(orders, m), state.step, batch_sharding)
      return method.train_step(step, state, member_batch, rngs, shared=shared)
    compiled_train_step = jax.jit(
        functools.partial(steps_in_one_call, resident_step, steps_per_call),
        in_shardings=(replicated,) * 5, out_shardings=(replicated,) * 3, donate_argnums=(0,))
  else:
    def streamed_step(state, batches, rngs):
      return method.train_step(step, state, lambda m: pick(batches, m), rngs, shared=shared)
    compiled_train_step = jax.jit(streamed_step,
                                  in_shardings=(replicated, batch_sharding, replicated),
                                  out_shardings=(replicated, replicated), donate_argnums=(0,))
  return compiled_train_step, training_eval_step(method, mesh, num_bins)


def training_eval_step(method: Method, mesh: Mesh, num_bins: int):
  """The compiled step of the training's periodic evaluation, ``(variables, batch, rng) ->
  {tag suffix: UncertaintyMetrics}``: :func:`eval_step` of ``method.for_training_eval()`` (the
  predictive with one draw where it samples; every member of an ensemble)."""
  return sharded_eval_step(eval_step, mesh, method.for_training_eval(), num_bins)

