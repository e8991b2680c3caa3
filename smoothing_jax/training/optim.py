"""Learning-rate schedules and optimisers of the recipes (``config.lr_schedule``,
``config.optimizer``).

Weight decay is the reference's (PyTorch SGD's) coupled L2: ``wd · w`` is added to the gradient
before momentum (``optax.add_decayed_weights``), i.e. the gradient of ``wd/2 · ‖w‖²`` in the loss,
on the parameters the run's method says (``Method.weight_decay``: all of them, but a BNN-VI
model's mean-field kernels, whose KL regularises them, and a BatchEnsemble's fast weights).
Keras's ``l2(λ)`` regulariser (uncertainty-baselines) is ``λ · ‖w‖²``: weight decay ``2λ`` here.
"""
from __future__ import annotations

import optax

from smoothing_jax.methods import Method, as_method
from smoothing_jax.methods.deterministic import Deterministic


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


def create_optimizer(config, schedule, method: Method | None = None
                     ) -> optax.GradientTransformation:
  """``config.optimizer``: "sgd" with coupled (PyTorch ``SGD``) weight decay, "adam" (PyTorch
  ``Adam``: β 0.9/0.999, coupled weight decay) or "adamw" (PyTorch ``AdamW``: decay lr·wd·w
  decoupled from the moments), with the run's ``method``'s rules (a Flax module: its method;
  None: one network): its weight decay and update scaling, or its own optimiser (iBNN's two
  learning rates).  ``grad_clip_norm`` > 0 clips the global gradient norm first.
  """
  method = Deterministic(None) if method is None else as_method(method, config)
  tx = method.optimizer(config, schedule)
  if tx is None and config.optimizer == "adamw":
    tx = optax.adamw(schedule, weight_decay=config.weight_decay)
  elif tx is None and config.optimizer in ("adam", "sgd"):
    base = optax.adam(schedule) if config.optimizer == "adam" else optax.sgd(
        schedule, momentum=config.momentum, nesterov=config.nesterov)
    scaling = method.update_scaling(config)  # (none: the state of 0.1.0's checkpoints)
    tx = optax.chain(method.weight_decay(config), base, *([scaling] if scaling else []))
  elif tx is None:
    raise ValueError(f"Unknown optimizer {config.optimizer!r}; choose 'sgd', 'adam' or 'adamw'.")
  if config.grad_clip_norm > 0:
    tx = optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), tx)
  return tx
