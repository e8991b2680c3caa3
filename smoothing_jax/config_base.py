"""Infrastructure defaults shared by every experiment config (the recipes live in ``configs/``)."""
import difflib
import types
from typing import Any, Mapping, NoReturn, Sequence

import ml_collections
from ml_collections.config_dict import placeholder


def base_config() -> ml_collections.ConfigDict:
  """Keys every config has; an experiment's ``get_config()`` fills in its recipe and locks it."""
  config = ml_collections.ConfigDict()
  # Model: a registry name plus module options; None means the family's default
  # (stem defaults to the dataset's geometry).
  config.model = "resnet_mcdo_smoothing_18"
  config.model_kwargs = ml_collections.ConfigDict({
      "prob": placeholder(str),
      "temperature": placeholder(float),
      "blur_size": placeholder(int),
      "blur_same": placeholder(bool),
      "pad_mode": placeholder(str),
      "classifier": placeholder(str),
      "width": placeholder(int),
      "stochastic_depth": placeholder(float),
      "num_components": placeholder(int),
      "noise_init_std": placeholder(float),
      "batch_norm": placeholder(bool)
  })
  config.num_classes = -1           # -1: from the dataset
  # Data.
  config.dataset = "cifar10"
  config.data_dir = placeholder(str)  # TFDS data_dir (None: TFDS default)
  config.download = True            # let TFDS download missing datasets
  config.seed = 0
  config.num_devices = -1           # -1: all devices of all hosts
  config.crop_size = placeholder(
      tuple)  # segmentation: random (h, w) training crop (None: whole image)
  # Optimisation (recipe values are set by each config).
  config.batch_size = 128           # global batch
  config.base_batch_size = 128      # batch of the recipe's learning rate (linear scaling)
  config.optimizer = "sgd"          # "sgd" (coupled L2, the paper's CNN recipe), "adam" or
                                    # "adamw" (decoupled)
  config.learning_rate = 0.1
  config.momentum = 0.9
  config.nesterov = False
  config.weight_decay = 5e-4
  config.num_epochs = 200
  config.warmup_epochs = 1
  config.lr_schedule = "multistep"  # or "cosine" (ViT recipe), "flat_linear" (iBNN)
  config.lr_milestones = (60, 130, 160)
  config.lr_decay = 0.2
  config.lr_final_ratio = 0.01      # flat_linear: final rate / base rate
  config.num_train_steps = -1       # -1: (warmup_epochs + num_epochs) × steps per epoch
  config.grad_clip_norm = 0.0       # clip the global gradient norm (0: off)
  config.class_balancing = "none"   # or "median_frequency" (segmentation loss weights)
  # Regularisation of the ViT recipe (all off by default).
  config.label_smoothing = 0.0
  config.mixup_alpha = 0.0          # Mixup Beta(α, α) (on device, in the train step)
  config.cutmix_alpha = 0.0         # CutMix Beta(α, α)
  config.mixup_switch_prob = 0.5    # P(CutMix) when both are on
  config.randaugment = ml_collections.ConfigDict({
      "num_layers": 0,
      "magnitude": 9.0,
      "magnitude_std": 0.0
  })
  # iBNN (models with node noise, e.g. vgg_ibnn_16): ELBO and posterior optimiser.
  config.ibnn = ml_collections.ConfigDict({
      "num_train_samples": 2,  # S: repeats of each example per step (Algorithm 1)
      "prior_mean": 1.0,
      "prior_std": 0.1,  # s of N(1, s²): 0.1 WRN, 0.3 VGG
      "kl_anneal_epochs": 200,  # β: 0 → 1 linearly per epoch
      "variational_lr": 2.4,  # constant, no weight decay
      "eval_samples": 5,  # S at evaluation: K×S predictions
      "freeze_deterministic": False,  # train only the posterior (with pretrained_workdir)
      "pretrained_workdir":
          placeholder(str),  # initialise W from a deterministic run of the same architecture
  })
  # Logging, evaluation and checkpoints.
  config.log_every_steps = 100
  config.eval_every_epochs = 10
  config.eval_batch_size = 500
  config.ece_bins = 10
  config.checkpoint_every_steps = 1000
  config.keep_checkpoints = 3
  # Final evaluation: MC ensemble sizes (deterministic models use N = 1).
  config.ensemble_sizes = (1, 2, 3, 4, 5, 10, 20, 50)
  config.eval_chunk_size = 10       # samples evaluated together (bounds memory)
  return config


def shrink_for_cpu(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The ``runlocal`` variant: a narrow model and a few steps, for CPU smoke runs."""
  config.model_kwargs.width = 8
  config.batch_size = 32
  config.num_train_steps = 20
  config.log_every_steps = 5
  config.eval_every_epochs = 1000
  config.checkpoint_every_steps = 10
  config.eval_batch_size = 256
  config.ensemble_sizes = (1, 2, 5)
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
