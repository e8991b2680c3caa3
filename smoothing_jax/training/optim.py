"""Learning-rate schedules and optimisers of the recipes (``config.lr_schedule``,
``config.optimizer``).

Weight decay is the reference's (PyTorch SGD's) coupled L2: ``wd · w`` is added to the gradient
before momentum (``optax.add_decayed_weights``), i.e. the gradient of ``wd/2 · ‖w‖²`` in the loss,
on every parameter but a BNN-VI model's mean-field kernels (their KL regularises them) and a
BatchEnsemble's fast weights (``config.batch_ensemble.fast_weight_decay`` instead).  Keras's
``l2(λ)`` regulariser (uncertainty-baselines) is ``λ · ‖w‖²``: weight decay ``2λ`` here.
"""
from __future__ import annotations

import jax
import optax

from smoothing_jax.layers.batch_ensemble import fast_weight_mask
from smoothing_jax.methods import bnnvi, ibnn
from smoothing_jax.models import is_batch_ensemble, is_ibnn, is_mean_field


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
  lr = config.learning_rate * config.input.batch_size / config.base_batch_size
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


def weight_decay(config, model) -> optax.GradientTransformation:
  """The coupled weight decay of ``config.weight_decay`` on the parameters it applies to."""
  if is_mean_field(model):
    return optax.add_decayed_weights(config.weight_decay, mask=bnnvi.decay_mask)
  if is_batch_ensemble(model):
    def slow(params):
      return jax.tree.map(lambda fast: not fast, fast_weight_mask(params))
    return optax.chain(
        optax.add_decayed_weights(config.weight_decay, mask=slow),
        optax.add_decayed_weights(config.batch_ensemble.fast_weight_decay, mask=fast_weight_mask))
  return optax.add_decayed_weights(config.weight_decay)


def regularised(config, model, tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` after :func:`weight_decay`; for a BatchEnsemble, the fast weights' and member biases'
  updates then scaled by ``fast_weight_lr_multiplier``: their learning rate × the multiplier.
  With SGD that equals uncertainty-baselines' scaling of their gradients (decay included) before
  the optimiser; after the optimiser it holds for Adam too, which would undo a gradient scale."""
  if not is_batch_ensemble(model):
    return optax.chain(weight_decay(config, model), tx)
  fast_rate = optax.masked(optax.scale(config.batch_ensemble.fast_weight_lr_multiplier),
                           lambda params: fast_weight_mask(params, with_bias=True))
  return optax.chain(weight_decay(config, model), tx, fast_rate)


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
    if is_mean_field(model) or is_batch_ensemble(model):
      raise ValueError("optimizer 'adamw' decays every parameter; BNN-VI and BatchEnsemble models "
                       "train with 'sgd' or 'adam' (coupled decay that skips their variational "
                       "or fast weights).")
    tx = optax.adamw(schedule, weight_decay=config.weight_decay)
  elif config.optimizer == "adam":
    tx = regularised(config, model, optax.adam(schedule))
  elif config.optimizer == "sgd":
    tx = regularised(config, model,
                     optax.sgd(schedule, momentum=config.momentum, nesterov=config.nesterov))
  else:
    raise ValueError(f"Unknown optimizer {config.optimizer!r}; choose 'sgd', 'adam' or 'adamw'.")
  if config.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
  return tx


