"""Config keys shared by every experiment config: infrastructure defaults, and the recipe keys
that each recipe in ``configs/`` sets (``check_recipe`` names any it left unset)."""
import copy
import difflib
import types
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import ml_collections
from absl import logging
from ml_collections.config_dict import placeholder

from smoothing_jax import methods
from smoothing_jax.models import get_model, implied_method, model_options

# Recipe keys: None in ``base_config()``; each recipe sets those its optimiser and schedule read.
RECIPE_KEYS = ("model", "input.dataset", "optimizer", "input.batch_size", "base_batch_size",
               "learning_rate", "weight_decay", "num_epochs", "warmup_epochs", "lr_schedule")
# Recipe keys read only with one choice of ``(key, value)``.
RECIPE_KEYS_OF = {
    ("optimizer", "sgd"): ("momentum", "nesterov"),
    ("lr_schedule", "multistep"): ("lr_milestones", "lr_decay"),
    ("lr_schedule", "flat_linear"): ("lr_final_ratio",),
}


def base_config() -> ml_collections.ConfigDict:
  """Every key a config has, with recipe-neutral defaults; not a runnable config by itself.

  Infrastructure keys (model options, the data settings of the ``input`` block, seed, devices,
  logging, evaluation, checkpoints) hold neutral defaults, and every optional feature (class
  balancing, gradient clipping, label smoothing, Mixup/CutMix, RandAugment) is off;
  ``init_from`` ("": off) names a workdir or torch checkpoint file whose variables training
  fine-tunes and an evaluation without checkpoints uses; every method's settings block is here
  at its defaults until ``finalize`` keeps the chosen method's.  The recipe keys
  (``RECIPE_KEYS`` and ``RECIPE_KEYS_OF``: model name, dataset, batch, optimiser and
  learning-rate schedule) are None: a recipe's ``get_config()`` sets them and ends with
  ``finalize``.
  """
  config = ml_collections.ConfigDict()
  # Model: a registry name (set by the recipe) plus module options; None means the family's
  # default (stem defaults to the dataset's geometry).
  config.model = placeholder(str)
  # Module options: ``finalize`` declares every option of ``config.model`` (None: the registry's).
  config.model_kwargs = ml_collections.ConfigDict()
  config.num_classes = -1           # -1: from the dataset
  # Start from other variables ("": off): a workdir (its latest checkpoint) or a torch checkpoint
  # file (SS / HV CNNs, HV's timm ViT / PiT / Swin; ``convert.load_torch_checkpoint``).  Training
  # fine-tunes from it (an output layer of another class count is re-initialised); evaluation
  # and analyses of a workdir without checkpoints use it.
  config.init_from = ""
  # Data: the input pipeline's settings, read as one block (``data.create_pipeline``).
  config.input = ml_collections.ConfigDict()
  # TFDS name, "npz:<dir>", "digits" or "synthetic:…" (recipe).
  config.input.dataset = placeholder(str)
  config.input.data_dir = placeholder(str)  # TFDS data_dir (None: TFDS default)
  config.input.download = True            # let TFDS download missing datasets
  # "auto": in-memory splits (npz:, digits, synthetic:, CIFAR and -C) stay on the devices and each
  # step gathers and augments its batch there; ImageNet and CamVid stream from disk by tf.data.
  # "resident" or "tfdata" forces a path.
  config.input.data_pipeline = "auto"
  config.input.batch_size = placeholder(int)  # global training batch (recipe)
  # Segmentation: random (h, w) training crop (None: whole image).
  config.input.crop_size = placeholder(tuple)
  # RandAugment of the training images after the crop and flip (num_layers 0: off; the ViT
  # recipe's).
  config.input.randaugment = ml_collections.ConfigDict({
      "num_layers": 0,
      "magnitude": 9.0,
      "magnitude_std": 0.0
  })
  # Small-data regime (HV: "ViT using 6% dataset"): train on a fixed class-balanced subset, each
  # class keeping round(fraction × its count), seeded by ``split_seed`` (in-memory splits only;
  # the number of examples used is recorded as ``model_spec.num_train_examples`` in config.json).
  config.input.train_fraction = 1.0
  # A class-balanced part of the training split held out (seeded by ``split_seed``, never trained
  # on): the examples the ``calibration`` evaluator fits its temperature on (0: none).
  config.input.holdout_fraction = 0.0
  # The seed of those two draws (-1: ``seed``).  An ensemble's members share its split; a member
  # written out as a run of its own (its ``deep_ensemble.member_seeds[m]``) records the ensemble's
  # seed here.
  config.input.split_seed = -1
  # A file prefix keeping the preprocessed evaluation images after the first evaluation ("": off;
  # ImageNet's validation JPEGs are otherwise decoded at every evaluation).
  config.input.eval_cache = ""
  # Images of a set held in memory brought to S × S as they are read (the shorter side resized
  # to S, then the centre cropped; data.sources.base.fit_to_size); 0: their own size.
  config.input.image_size = 0
  # The seed of the initialisation, the order of the training batches and the training draws.
  config.seed = 0
  config.num_devices = -1           # -1: all devices of all hosts
  config.half_precision = False     # compute in bfloat16 (parameters and statistics stay float32)
  config.prefetch_batches = 2       # tf.data: global batches put on the devices ahead of the step
  # Optimisation: the recipe sets these (and ``input.batch_size``).
  config.base_batch_size = placeholder(int)  # batch of the recipe's learning rate (linear scaling)
  config.optimizer = placeholder(str)  # "sgd" (coupled L2, the paper's CNN recipe), "adam" or
                                       # "adamw" (decoupled)
  config.learning_rate = placeholder(float)
  config.momentum = placeholder(float)       # sgd (and the iBNN optimiser)
  config.nesterov = placeholder(bool)        # sgd
  config.weight_decay = placeholder(float)
  config.num_epochs = placeholder(int)
  config.warmup_epochs = placeholder(int)
  config.lr_schedule = placeholder(str)  # "multistep", "cosine" (ViT recipe), "flat_linear" (iBNN)
  config.lr_milestones = placeholder(tuple)  # multistep: epochs of the decays
  config.lr_decay = placeholder(float)       # multistep: factor at each milestone
  config.lr_final_ratio = placeholder(float)  # flat_linear: final rate / base rate
  config.num_train_steps = -1       # -1: (warmup_epochs + num_epochs) × steps per epoch
  config.grad_clip_norm = 0.0       # clip the global gradient norm (0: off)
  config.grad_accum_steps = 1       # micro-batches per optimiser step (steps.train_step)
  # Resident data: training steps per host call, one compiled loop (0: log_every_steps on an
  # accelerator, 1 on the CPU); a call ends at every log, evaluation, checkpoint and epoch
  # boundary whatever it is.
  config.steps_per_call = 0
  config.class_balancing = "none"   # or "median_frequency" (segmentation loss weights)
  # Regularisation (the ViT recipe's; all off by default).
  config.label_smoothing = 0.0
  config.mixup_alpha = 0.0          # Mixup Beta(α, α) (on device, in the train step)
  config.cutmix_alpha = 0.0         # CutMix Beta(α, α)
  config.mixup_switch_prob = 0.5    # P(CutMix) when both are on
  # The uncertainty method (``smoothing_jax.methods.REGISTRY``; None: the one ``model`` is built
  # for), and its settings block ``config.<method>`` (``Method.settings``): a recipe may set any
  # method's block here, and ``finalize`` keeps the chosen method's alone (``declare_method``).
  # Test-time augmentation and the deep ensemble compose with every method (``methods.COMPOSED``):
  # their blocks (``tta.augmentations``, ``deep_ensemble.members``, ...) are always there.
  config.method = placeholder(str)
  for name, method in (*methods.REGISTRY.items(), *methods.COMPOSED.items()):
    if method.settings:
      config[name] = ml_collections.ConfigDict(copy.deepcopy(method.settings))
  # Logging, evaluation and checkpoints.
  config.log_every_steps = 100
  config.eval_every_epochs = 10
  config.eval_batch_size = 500
  config.ece_bins = 10
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3
  # Learning trajectory (HV Fig. 1b): every k steps (and at step 0) the parameters projected on
  # ``trajectory_dims`` fixed random Gaussian directions, and ‖θ‖², appended to
  # ``<workdir>/trajectory.npz`` (``smoothing_jax.analysis.trajectory``; 0: off).
  config.trajectory_every_steps = 0
  config.trajectory_dims = 256
  # The evaluators run after training (in the order of their names), each with its options
  # (``smoothing_jax.evaluators``: an option left out takes the default of the evaluator's
  # ``evaluate``): ``--config.evals.<name>.<option>=…`` sets one, ``--mode=<name>`` runs one on a
  # trained workdir with the options given here.
  config.evals = ml_collections.ConfigDict({"ensemble_sizes": {}})
  # MC ensemble sizes N the evaluators report (an evaluator's ``sizes`` option overrides them;
  # deterministic models use N = 1).
  config.ensemble_sizes = (1, 2, 3, 4, 5, 10, 20, 50)
  # Samples evaluated together (None: passes.default_chunk_size, 1 on CPU, 10 on GPU/TPU).
  config.eval_chunk_size = placeholder(int)
  return config


def missing_recipe_keys(config: ml_collections.ConfigDict) -> list:
  """The recipe keys ``config`` reads with its optimiser and schedule but leaves None."""
  keys = list(RECIPE_KEYS)
  for (key, value), needed in RECIPE_KEYS_OF.items():
    if config[key] == value:
      keys.extend(needed)
  return [key for key in keys if config[key] is None]


def check_recipe(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns ``config``; raises ValueError naming every recipe key it left unset (None)."""
  missing = missing_recipe_keys(config)
  if missing:
    raise ValueError(f"The recipe leaves {', '.join(missing)} unset: a config's get_config() "
                     "sets every recipe key of smoothing_jax.experiment.config_base (RECIPE_KEYS, "
                     "and RECIPE_KEYS_OF for its optimizer and lr_schedule).")
  return config


def declare_model_options(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Add every module option of ``config.model`` (``models.model_options``) missing from
  ``config.model_kwargs`` as None, so ``--config.model_kwargs.<option>=…`` can set any of them;
  an unknown model name adds nothing (training reports it)."""
  try:
    options = model_options(config.model)
  except ValueError:
    return config
  for key, kind in options.items():
    if key not in config.model_kwargs:
      config.model_kwargs[key] = placeholder(kind)
  return config


def chosen_method(model: str, model_kwargs, method: str | None) -> str | None:
  """The method a config of ``model`` (with the set ``model_kwargs``) trains: ``method``, or the
  one the model is built for (``models.implied_method``); None for a model that cannot be
  built (training names the problem)."""
  if method:
    return method
  try:
    built = get_model(model, 2, **{k: v for k, v in dict(model_kwargs or {}).items()
                                   if v is not None})
  except (ValueError, TypeError):
    return None
  return implied_method(built)


def blocks_of_others(chosen: str | None) -> list:
  """The settings blocks of the registered methods other than ``chosen`` (a config drops them)."""
  return [name for name, method in methods.REGISTRY.items()
          if method.settings and name != chosen]


def declare_method(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """``config`` holding the settings block of its method alone (:func:`chosen_method`): the
  other methods' blocks dropped, the chosen one's added at its defaults where missing (an info
  line says so), so that ``--config.<method>.<key>=…`` sets only the chosen method's keys; a
  method name not registered is left for ``methods.resolve`` to refuse."""
  chosen = chosen_method(config.model, config.model_kwargs, config.method)
  with config.unlocked():
    for name in blocks_of_others(chosen):
      if name in config:
        del config[name]
    method = methods.REGISTRY.get(chosen)
    if method is not None and method.settings and chosen not in config:
      logging.info("Method %s: its settings (config.%s) at their defaults.", chosen, chosen)
      config[chosen] = ml_collections.ConfigDict(copy.deepcopy(method.settings))
  return config


def with_method(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """A copy of ``config`` training method ``name`` (``--config.method=<name>``), holding that
  method's settings block instead of the previous one's (:func:`declare_method`), which keeps
  the values the previous block set for the keys both methods take (a recipe's SWAG schedule
  stays when ``swa`` replaces ``swag``; an info line names them); ValueError (one line) for a
  name not in ``methods.REGISTRY``, with the closest."""
  if name not in methods.REGISTRY:
    close = difflib.get_close_matches(name, methods.REGISTRY, n=1)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"--config.method={name}: unknown method. {hint}Methods: "
                     f"{', '.join(methods.REGISTRY)}.")
  previous = chosen_method(config.model, config.model_kwargs, config.method)
  kept = {}
  if previous in config and previous != name:
    kept = {k: v for k, v in config[previous].items()
            if k in methods.REGISTRY[name].settings and v is not None}
  config = copy.deepcopy(config)
  with config.unlocked():
    config.method = name
  config = declare_method(config)
  if kept:
    logging.info("Method %s: keeping %s of config.%s.", name,
                 ", ".join(f"{k}={v!r}" for k, v in kept.items()), previous)
    with config.unlocked():
      config[name].update(kept)
  return config


def with_model(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  """A copy of ``config`` for model ``name`` (``--config.model=<name>``): its ``model_kwargs``
  are that model's options (:func:`declare_model_options`), keeping the values ``config`` set for
  options ``name`` also takes (a recipe's narrow ``width`` stays narrow) and dropping the others,
  which an info line names; ValueError for an unknown name (with the closest ones)."""
  options = model_options(name)
  set_values = {k: v for k, v in config.model_kwargs.items() if v is not None}
  dropped = {k: v for k, v in set_values.items() if k not in options}
  if dropped:
    logging.info("Model %s takes no option %s of %s: dropped from model_kwargs.", name,
                 ", ".join(f"{k}={v!r}" for k, v in dropped.items()), config.model)
  config = copy.deepcopy(config)
  with config.unlocked():
    config.model = name
    config.model_kwargs = ml_collections.ConfigDict(
        {k: v for k, v in set_values.items() if k in options})
    declare_model_options(config)
  return declare_method(config)


def finalize(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The end of every ``get_config()``: ``check_recipe``, declare the model's options, keep the
  settings block of the chosen method alone (:func:`declare_method`), then lock (the CLI sets
  existing keys only)."""
  declare_method(declare_model_options(check_recipe(config))).lock()
  return config


def shrink_for_cpu(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The ``runlocal`` variant: a narrow model and a few steps, for CPU smoke runs."""
  config.model_kwargs.width = 8
  config.input.batch_size = 32
  config.num_train_steps = 20
  config.log_every_steps = 5
  config.eval_every_epochs = 1000
  config.checkpoint_every_steps = 10
  config.eval_batch_size = 256
  config.ensemble_sizes = (1, 2, 5)
  return config


def with_uncertainty_evals(config: ml_collections.ConfigDict,
                           holdout_fraction: float = 0.1) -> ml_collections.ConfigDict:
  """The preset of the ``uncertainty`` config flag: after training, the ensemble sizes, then OOD
  detection, temperature scaling (fitted on ``holdout_fraction`` of the training split, held out
  of training) and selective prediction.  The ``ood`` evaluator's ``datasets``: dataset names
  (TFDS, "npz:<dir>", ...) and "corruptions" (every corruption of the dataset at severity 5);
  empty: the standard pairs (CIFAR-10: SVHN and CIFAR-100; CIFAR-100: SVHN and CIFAR-10)."""
  config.evals = ml_collections.ConfigDict({
      "ensemble_sizes": {}, "ood": {"datasets": ()}, "calibration": {}, "selective": {}})
  config.input.holdout_fraction = holdout_fraction
  return config


def parse_config_arg(arg: str, positional: Mapping[str, Any],
                     flags: Sequence[str] = ("runlocal",)) -> types.SimpleNamespace:
  """Parses the ``<args>`` of ``--config=configs/<file>.py:<args>`` (``get_config``'s argument).

  ``arg`` is comma-separated: values of the ``positional`` arguments in order, then ``name=value``
  pairs for them, and bare ``flags`` anywhere (values may hold ':' and '/', not ',').
  ``positional`` maps each name to its default, which a missing argument takes and whose type
  converts the value.  Returns the arguments and the flags (True when given) as attributes.
  Raises ValueError naming the bad argument and listing the accepted ones.
  """
  def fail(item: str, reason: str) -> NoReturn:
    listed = ", ".join(f"{name} (default {default!r})" for name, default in positional.items())
    accepted = (f"positional arguments {listed} (in this order, or as name=value)" if positional
                else "no positional arguments")
    raise ValueError(f"Bad config argument {item!r} in {arg!r}: {reason}. Accepted: {accepted}; "
                     f"flags {', '.join(flags) or '(none)'}.")

  values, given, raised, keyword = dict(positional), [], set(), False
  names = list(positional)
  for item in arg.split(",") if arg else ():
    if item in flags:
      raised.add(item)
      continue
    name, eq, value = item.partition("=")
    if eq and name.isidentifier():
      keyword = True
      if name not in positional:
        fail(item, f"unknown name {name!r}")
    else:
      name, value = names[len(given)] if len(given) < len(names) else None, item
      close = difflib.get_close_matches(item, flags, n=1, cutoff=0.8)
      if close:
        fail(item, f"unknown flag (did you mean {close[0]!r}?)")
      if keyword:
        fail(item, "a positional argument after name=value")
      if name is None:
        fail(item, f"too many positional arguments (at most {len(names)})")
    if not value:
      fail(item, "empty value")
    if name in given:
      fail(item, f"{name} given twice")
    given.append(name)
    kind = type(positional[name])
    try:
      values[name] = kind(value)
    except ValueError:
      fail(item, f"{name} must be {kind.__name__}")
  return types.SimpleNamespace(**values, **{flag: flag in raised for flag in flags})
