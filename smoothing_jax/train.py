"""Data-parallel training and evaluation loop (in the style of the Flax ImageNet example).

``train_and_evaluate(config, workdir)`` reads top to bottom: build the input
pipeline and model, ``create_train_state``, restore the latest checkpoint, then
loop ``train_step`` with periodic logging, evaluation (``eval_step``) and
checkpoints.  Data parallelism is ``jax.jit`` over a 1-D ``Mesh`` with axis
``data``: the batch is sharded over all devices (and hosts), parameters and
optimizer state are replicated, and BatchNorm statistics are computed over the
*global* batch (XLA inserts the cross-device reductions).

Weight decay is the reference's (PyTorch SGD's) coupled L2: ``wd · w`` is added
to the gradient before momentum (``optax.add_decayed_weights``), i.e. the
gradient of ``wd/2 · ‖w‖²`` in the loss, on every parameter.

Segmentation models (per-pixel logits) train on the pixel-wise cross-entropy
with void pixels masked and, with ``class_balancing="median_frequency"``,
class weights (paper Appendix A.2).
"""
from __future__ import annotations

import functools
import signal
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging
from flax.training import train_state
from jax.sharding import Mesh

from smoothing_jax import ibnn
from smoothing_jax.analysis.trajectory import TrajectoryRecorder
from smoothing_jax import workdir as workdir_lib
from smoothing_jax.data import NUM_CLASSES, create_pipeline
from smoothing_jax.data.mixup import Mixing, mix_batch
from smoothing_jax.inference import mc_predict, sample_rngs
from smoothing_jax.metrics import UncertaintyMetrics, label_mask
from smoothing_jax.models import is_ibnn, is_segmentation_model
from smoothing_jax.parallel import (create_mesh, eval_batch_size, evaluate_batches,
                                    prefetch_to_devices, shardings)
from smoothing_jax.writers import MetricWriter, ProgressReporter


class TrainState(train_state.TrainState):
  batch_stats: Any


def model_spec(config, pipeline, model_options: Optional[dict] = None) -> dict:
  """What rebuilds the model without the dataset (recorded in ``config.json``): classes
  (``config.num_classes`` > 0 overrides the dataset's), stem geometry and image shape; also the
  number of training examples used (``num_train_examples``: the ``train_fraction`` subset), and
  the model options a timm ``init_from`` needs (``model_options``, where any: given, or read from
  the ``init_from`` file)."""
  if config.num_classes <= 0 and pipeline.is_segmentation and pipeline.spec.base not in NUM_CLASSES:
    raise ValueError(
        f"Set --config.num_classes for the segmentation dataset {config.dataset!r}: label maps "
        "mark void pixels with values outside [0, num_classes), so the classes cannot be inferred.")
  num_classes = config.num_classes if config.num_classes > 0 else (
      NUM_CLASSES.get(pipeline.spec.base) or pipeline.spec.num_classes
      or int(pipeline.train_labels.max()) + 1)
  spec = {"num_classes": int(num_classes), "stem": pipeline.spec.geometry,
          "image_shape": [int(d) for d in pipeline.image_shape],
          "num_train_examples": int(pipeline.num_train)}
  if model_options is None:
    model_options = workdir_lib.init_from_model_options(config)
  return {**spec, "model_options": model_options} if model_options else spec


def _recorded_model_options(workdir, config) -> Optional[dict]:
  """The model options a run with checkpoints recorded (the layout of a timm ``init_from``), so
  that resuming it reads no ``init_from`` file; None for a new run."""
  if not (workdir_lib.has_checkpoint(workdir) and workdir_lib.has_run(workdir)):
    return None
  return workdir_lib.read_config(workdir)[1].get("model_options", {})


def create_model(config, pipeline, spec: Optional[dict] = None):
  """``config.model`` for ``pipeline``'s classes and geometry (``spec``, default
  :func:`model_spec`); a clear error when a segmentation model meets one label per image, or a
  classifier label maps."""
  model = workdir_lib.build_model(config, spec or model_spec(config, pipeline))
  if is_segmentation_model(model) != pipeline.is_segmentation:
    kind = ("label maps (segmentation)"
            if pipeline.is_segmentation else "one label per image (classification)")
    raise ValueError(
        f"Model {config.model!r} does not fit dataset {config.dataset!r}, which has {kind}; "
        "use a unet_* model for segmentation and a classifier otherwise.")
  return model


def create_learning_rate_schedule(config, steps_per_epoch: int) -> optax.Schedule:
  """The base rate, scaled linearly with ``batch_size / base_batch_size``, on
  ``config.lr_schedule``:

  * ``"multistep"``: linear warm-up from 0 for ``warmup_epochs``, then × ``lr_decay`` at
    each milestone epoch (counted after the warm-up: the reference's extra warm-up epoch);
  * ``"flat_linear"`` (iBNN reference): flat for the first 50% of training, linear
    down to ``lr_final_ratio`` × the rate at 90%, then flat (per step);
  * ``"cosine"`` (ViT recipe): linear warm-up from 0 for ``warmup_epochs``, then
    cosine annealing to 0 over ``num_epochs`` (per step).
  """
  lr = config.learning_rate * config.batch_size / config.base_batch_size
  warmup_steps = int(config.warmup_epochs * steps_per_epoch)
  if config.lr_schedule == "cosine":
    decay_steps = int(config.num_epochs * steps_per_epoch)
    if warmup_steps == 0:
      return optax.cosine_decay_schedule(lr, decay_steps)
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, warmup_steps + decay_steps,
                                              0.0)
  if config.lr_schedule == "flat_linear":
    total = (config.warmup_epochs + config.num_epochs) * steps_per_epoch
    return optax.piecewise_interpolate_schedule(
        "linear", lr, {int(0.5 * total): 1.0, int(0.9 * total): config.lr_final_ratio})
  if config.lr_schedule != "multistep":
    raise ValueError(
        f"Unknown lr_schedule {config.lr_schedule!r}; choose 'multistep', 'cosine' or "
        "'flat_linear'."
    )
  main = optax.piecewise_constant_schedule(
      lr, {int(m * steps_per_epoch): config.lr_decay for m in config.lr_milestones})
  if warmup_steps == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup_steps), main], [warmup_steps])


def create_optimizer(config, schedule, model=None) -> optax.GradientTransformation:
  """``config.optimizer``: "sgd" with coupled (PyTorch ``SGD``) weight decay, "adam" (PyTorch
  ``Adam``: β 0.9/0.999, coupled weight decay) or "adamw" (PyTorch ``AdamW``: decay lr·wd·w
  decoupled from the moments); iBNN models get the two-learning-rate optimizer.
  ``grad_clip_norm`` > 0 clips the global gradient norm first.
  """
  if is_ibnn(model):
    tx = ibnn.create_optimizer(schedule, config.ibnn.variational_lr, config.weight_decay,
                               config.momentum, config.ibnn.freeze_deterministic)
  elif config.optimizer == "adamw":
    tx = optax.adamw(schedule, weight_decay=config.weight_decay)
  elif config.optimizer == "adam":
    tx = optax.chain(optax.add_decayed_weights(config.weight_decay), optax.adam(schedule))
  elif config.optimizer == "sgd":
    tx = optax.chain(optax.add_decayed_weights(config.weight_decay),
                     optax.sgd(schedule, momentum=config.momentum, nesterov=config.nesterov))
  else:
    raise ValueError(f"Unknown optimizer {config.optimizer!r}; choose 'sgd', 'adam' or 'adamw'.")
  if config.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
  return tx


def training_mixing(config, model) -> Optional[Mixing]:
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


def class_weights(config, model, pipeline) -> Optional[np.ndarray]:
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


def supervised_loss(model, mixing: Optional[Mixing] = None, class_weights=None):
  """``loss_fn(params, batch_stats, batch, rng, step) -> (loss, aux)`` of the cross-entropy:
  :func:`cross_entropy` (per pixel for segmentation, void masked, ``class_weights`` if given),
  or against soft targets (label smoothing, Mixup / CutMix drawn from ``fold_in(rng, 2)``)."""
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
    logits, updates = model.apply({
        "params": params,
        "batch_stats": batch_stats
    },
                                  images,
                                  train=True,
                                  mutable=["batch_stats"],
                                  rngs=sample_rngs(rng))
    return criterion(logits, targets), {"logits": logits, "labels": batch["label"], "metrics": {},
                                        "batch_stats": updates.get("batch_stats", {})}
  return loss_fn


def make_loss(config, model, *, num_train: int, steps_per_epoch: int, class_weights=None):
  """The training objective that ``config`` and ``model`` call for, as a ``loss_fn`` for
  :func:`train_step`: the negative ELBO for iBNN models (:func:`smoothing_jax.ibnn.elbo_loss`;
  its NLL, KL and β join the metrics), otherwise :func:`supervised_loss`."""
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


def create_train_state(config, model, rng, image_shape, schedule) -> TrainState:
  """Initialise parameters and BatchNorm statistics; attach the optimizer.

  One compiled call: outside ``jit`` the optimizer state would be created leaf by leaf, each
  new leaf shape an eager operation compiled (and kept) on its own.
  """
  tx = create_optimizer(config, schedule, model)

  def init(rng):
    variables = model.init({"params": rng, **sample_rngs(rng)},
                           jnp.zeros((1,) + tuple(image_shape)))
    return TrainState.create(apply_fn=model.apply, params=variables["params"],
                             batch_stats=variables.get("batch_stats", {}), tx=tx)
  return jax.jit(init)(rng)


def initialize_from(config, model, state: TrainState, spec: dict) -> TrainState:
  """``state`` (fresh) starting from other variables: ``config.init_from`` (fine-tuning;
  ``workdir.init_from_variables``: an output layer of another class count stays fresh), or for
  iBNN models the deterministic weights of ``config.ibnn.pretrained_workdir``
  (``ibnn.load_deterministic``; the posterior stays fresh).  ``spec``: :func:`model_spec`."""
  if config.init_from and is_ibnn(model) and config.ibnn.pretrained_workdir:
    raise ValueError("Set config.init_from or config.ibnn.pretrained_workdir, not both.")
  if config.init_from:
    variables = workdir_lib.init_from_variables(config, spec, _variables(state),
                                                new_classifier=True)
  else:
    _, det_step, det = workdir_lib.load_checkpoint(config.ibnn.pretrained_workdir)
    variables = {k: ibnn.load_deterministic(v, det[k]) for k, v in _variables(state).items()}
    logging.info("Deterministic weights from step %d of %s", det_step,
                 config.ibnn.pretrained_workdir)
  return state.replace(params=variables["params"], batch_stats=variables["batch_stats"])


def split_micro_batches(batch, num_micro_batches: int):
  """``[B, ...]`` leaves → ``[num_micro_batches, B / num_micro_batches, ...]``, micro-batch j
  holding rows j, j + k, j + 2k, ... (k = ``num_micro_batches``): each device's contiguous block
  of a data-sharded batch then holds an equal part of every micro-batch."""
  def split(x):
    if x.shape[0] % num_micro_batches:
      raise ValueError(f"A batch of {x.shape[0]} does not split into {num_micro_batches} "
                       "micro-batches (config.grad_accum_steps must divide config.batch_size).")
    x = x.reshape((x.shape[0] // num_micro_batches, num_micro_batches) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1)
  return jax.tree.map(split, batch)


def train_step(schedule, loss_fn, state: TrainState, batch, dropout_rng, grad_accum_steps: int = 1):
  """One optimiser step on a (global) batch of ``loss_fn`` (:func:`make_loss`); the dropout /
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
  for segmentation)."""
  pred = mc_predict(model, variables, batch["image"], num_samples=num_samples, rng=rng)
  return UncertaintyMetrics.from_model_output(pred.mean_probs,
                                              batch["label"],
                                              batch["mask"],
                                              num_bins=num_bins)


def train_batch_sharding(config, mesh: Mesh):
  """How training batches lie on ``mesh``: sharded on ``data`` when each micro-batch
  (``batch_size / grad_accum_steps``) divides over the devices; otherwise (one process only)
  replicated, every device computing whole micro-batches, with a warning."""
  k = config.grad_accum_steps
  if not isinstance(k, int) or k < 1 or config.batch_size % k:
    raise ValueError(f"grad_accum_steps must be a positive integer that divides batch_size "
                     f"{config.batch_size}, got {k!r}.")
  replicated, data_sharding = shardings(mesh)
  micro = config.batch_size // k
  if micro % mesh.size == 0:
    return data_sharding
  if jax.process_count() > 1:
    raise ValueError(f"Micro-batches of {micro} (batch_size {config.batch_size} / "
                     f"grad_accum_steps {k}) do not divide over the {mesh.size} devices of a "
                     "multi-process run.")
  logging.warning("Micro-batches of %d (batch_size %d / grad_accum_steps %d) do not divide over "
                  "%d devices: every device computes whole micro-batches (no data parallelism).",
                  micro, config.batch_size, k, mesh.size)
  return replicated


def compile_steps(model, schedule, mesh: Mesh, num_bins: int, loss_fn=None,
                  grad_accum_steps: int = 1, batch_sharding=None, pipeline=None):
  """``(train_step, eval_step)`` jitted over ``mesh``: the training batch on ``batch_sharding``
  (default: sharded on ``data``), state replicated and donated.  ``loss_fn``
  (:func:`make_loss`) defaults to the plain cross-entropy.

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
    p_train_step = jax.jit(resident_step, in_shardings=(replicated,) * 4,
                           out_shardings=(replicated, replicated), donate_argnums=(0,))
  else:
    p_train_step = jax.jit(step, in_shardings=(replicated, batch_sharding, replicated),
                           out_shardings=(replicated, replicated), donate_argnums=(0,))
  p_eval_step = jax.jit(functools.partial(eval_step, model, 1, num_bins),
                        in_shardings=(replicated, data_sharding, replicated),
                        out_shardings=replicated)
  return p_train_step, p_eval_step


def _variables(state: TrainState) -> dict:
  return {"params": state.params, "batch_stats": state.batch_stats}


class Preempted(SystemExit):
  """Raised after the checkpoint that a SIGTERM asked for has been written."""


class _Preemption:
  """Turns SIGTERM into a flag the loop checks between steps (checkpoint, then exit)."""

  def __init__(self):
    self.requested = False
    self._previous = None

  def __enter__(self):
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread
      self._previous = None
    return self

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint before exiting.")
    self.requested = True

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)

  def agreed(self, step: int, every: int) -> bool:
    """Whether to stop after ``step``.  One process: its own flag.  Several: any process's flag,
    compared by an all-gather every ``every`` steps; every process runs the same steps, so all
    stop (and save) at the same one, whichever received the SIGTERM."""
    if jax.process_count() == 1:
      return self.requested
    if step % every:
      return False
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))


@jax.jit
def _all_finite(state: TrainState):
  return jnp.all(
      jnp.stack(
          [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((state.params, state.batch_stats))]))


def _check_finite(pending: list, last_good_step: int, checkpoint_dir: str):
  """Raise ``FloatingPointError`` naming the first step whose loss is not finite."""
  for step, loss in pending:
    loss = float(loss)
    if not np.isfinite(loss):
      raise FloatingPointError(
          f"Non-finite training loss ({loss}) at step {step}. Training stopped; the last good "
          f"checkpoint (step {last_good_step}) is kept in {checkpoint_dir}.")
  pending.clear()


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       stop_after_steps: Optional[int] = None) -> TrainState:
  """Train ``config.model`` on ``config.dataset``, writing checkpoints and metrics to ``workdir``.

  Resumes from the latest intact checkpoint in ``workdir/checkpoints`` onto this run's
  devices, whatever device count wrote it (``workdir.restore_latest``; newer steps that fail
  to restore are renamed by ``workdir.set_aside_newer_steps``, not deleted).  ``stop_after_steps``
  ends this run early (after a checkpoint), as a preemption would.
  """
  workdir_lib.workdir_path(workdir).mkdir(parents=True, exist_ok=True)
  writer = MetricWriter(  # other processes log only
      str(workdir_lib.workdir_path(workdir)) if jax.process_index() == 0 else None)
  mesh = create_mesh(config.num_devices)
  replicated, data_sharding = shardings(mesh)
  batch_sharding = train_batch_sharding(config, mesh)

  randaugment = config.randaugment
  pipeline = create_pipeline(
      config.dataset, config.batch_size, config.seed, config.data_dir, config.download,
      (randaugment.num_layers, randaugment.magnitude, randaugment.magnitude_std), config.crop_size,
      config.eval_cache, config.train_fraction, config.data_pipeline, mesh)
  spec = model_spec(config, pipeline, _recorded_model_options(workdir, config))
  model = create_model(config, pipeline, spec)
  steps_per_epoch = pipeline.steps_per_epoch
  if steps_per_epoch == 0:
    raise ValueError(
        f"batch_size {config.batch_size} is larger than the training set ({pipeline.num_train}).")
  num_steps = config.num_train_steps if config.num_train_steps > 0 else int(
      (config.warmup_epochs + config.num_epochs) * steps_per_epoch)
  schedule = create_learning_rate_schedule(config, steps_per_epoch)
  trajectory = TrajectoryRecorder.for_run(config, workdir, num_steps)

  init_rng, dropout_rng, eval_rng = jax.random.split(jax.random.key(config.seed), 3)
  state = jax.device_put(
      create_train_state(config, model, init_rng, pipeline.image_shape, schedule), replicated)

  checkpoint_dir = workdir_lib.checkpoint_dir(workdir)
  manager = workdir_lib.checkpoint_manager(workdir, max_to_keep=config.keep_checkpoints)
  loss_fn = make_loss(config, model, num_train=pipeline.num_train, steps_per_epoch=steps_per_epoch,
                      class_weights=class_weights(config, model, pipeline))
  try:  # onto this run's mesh, whatever device count wrote the checkpoint
    resumed = workdir_lib.restore_latest(manager, workdir_lib.abstract_tree(state, replicated))
    if resumed is not None:
      workdir_lib.set_aside_newer_steps(manager, resumed[0])
  except BaseException:
    manager.close()
    raise
  if resumed is not None:
    state = resumed[1]
    logging.info("Resumed from step %d of %s", int(state.step), checkpoint_dir)
  elif config.init_from or (is_ibnn(model) and config.ibnn.pretrained_workdir):
    state = jax.device_put(initialize_from(config, model, state, spec), replicated)
  start_step = int(state.step)
  trajectory.start(start_step, state.params)
  if jax.process_index() == 0:
    workdir_lib.write_config(workdir, config, spec)

  p_train_step, p_eval_step = compile_steps(model, schedule, mesh, config.ece_bins, loss_fn,
                                            config.grad_accum_steps, batch_sharding, pipeline)

  report_progress = ProgressReporter(num_steps, writer)
  eval_every = max(1, int(config.eval_every_epochs * steps_per_epoch))
  stop_at = num_steps if stop_after_steps is None else min(num_steps, start_step + stop_after_steps)
  train_metrics, pending_losses = [], []
  last_good, preempted = start_step, False
  logging.info("Training %s on %s: %d steps (%d per epoch), global batch %d on %d devices.",
               config.model, config.dataset, num_steps, steps_per_epoch, config.batch_size,
               mesh.size)

  if pipeline.resident:  # the step takes its batch from the arrays on the devices
    batches = None
    step_inputs = lambda step: (pipeline.arrays,  # noqa: E731
                                pipeline.device_order((step - 1) // steps_per_epoch))
  else:  # the next global batches are assembled on the devices while the current step runs
    batches = prefetch_to_devices(pipeline.train_iterator(start_step), batch_sharding,
                                  config.prefetch_batches)
    step_inputs = lambda step: (next(batches),)  # noqa: E731
  try:
    with _Preemption() as preemption:
      for step in range(start_step + 1, stop_at + 1):
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
          state, metrics = p_train_step(state, *step_inputs(step), dropout_rng)
        trajectory.observe(step, state.params)
        train_metrics.append(metrics)
        pending_losses.append((step, metrics["loss"]))

        # Read once: the save and the exit below must agree (and, multi-host, every process).
        preempted = preemption.agreed(step, config.log_every_steps)
        is_last = step == stop_at or preempted
        if step % config.log_every_steps == 0 or is_last:
          _check_finite(pending_losses, last_good, checkpoint_dir)
          summary = {f"train_{k}": float(v) for k, v in jax.tree.map(
              lambda *xs: np.mean(np.stack(xs)), *jax.device_get(train_metrics)).items()}
          writer.write_scalars(step, summary)
          train_metrics = []
        report_progress(step)  # after the summary, which waits for the step: honest steps/s
        if step % eval_every == 0 or step == num_steps:
          with report_progress.timed("eval"):
            eval_batches = pipeline.eval_batches(eval_batch_size(config, mesh))
            results = evaluate_batches(p_eval_step, _variables(state), eval_batches, data_sharding,
                                       eval_rng).compute()
          writer.write_scalars(step, {
              f"eval_{k}": v for k, v in results.items() if k in ("nll", "acc", "ece")
          })
        if step % config.checkpoint_every_steps == 0 or is_last:
          _check_finite(pending_losses, last_good, checkpoint_dir)
          if not bool(_all_finite(state)):
            raise FloatingPointError(
                f"Non-finite parameters after step {step}. Training stopped; the last good "
                f"checkpoint (step {last_good}) is kept in {checkpoint_dir}.")
          trajectory.write()  # before the checkpoint: a restored step always has its rows
          manager.save(step, args=ocp.args.StandardSave(state))
          last_good = step
        writer.flush()
        if preempted:
          break
  finally:
    if batches is not None:
      batches.close()
    manager.wait_until_finished()  # commits any checkpoint still being written
    manager.close()
    writer.close()
  if preempted:
    raise Preempted(f"Stopped at step {step} after SIGTERM (checkpoint saved in {checkpoint_dir}); "
                    "rerun the same command to resume.")
  return state
