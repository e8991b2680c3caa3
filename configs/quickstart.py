"""The README's main job: a few CPU minutes of smoothing + MC dropout, then evaluation.

Default: ``resnet_mcdo_smoothing_18`` at width 16 on scikit-learn's bundled
handwritten digits (1,797 real 8×8 images upsampled to 32×32; no network), then
an ensemble-size table and a reliability diagram.  The same recipe runs on
CIFAR-10 with ``--config.input.dataset=cifar10`` (TFDS) or ``--config.input.dataset=npz:<dir>``.
The CIFAR CNN recipe, shortened: SGD (momentum 0.9, no Nesterov), lr 0.1 at batch 128 (scaled
linearly to batch 64), weight decay 5e-4, 12 epochs after 1 warm-up epoch, lr × 0.2 at epochs 6/9.

Arguments (``:<args>``, parsed by ``smoothing_jax.experiment.config_base.parse_config_arg``): no
positional ones; flag ``runlocal``: a 10-step smoke run of a narrower model.
"""
from smoothing_jax.experiment.config_base import base_config, finalize, parse_config_arg

ARGS = {}  # no positional arguments


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS)
  config = base_config()
  config.model = "resnet_mcdo_smoothing_18"
  config.model_kwargs.width = 16
  config.input.dataset = "digits"
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = False
  config.input.batch_size = 64
  config.base_batch_size = 128
  config.learning_rate = 0.1
  config.weight_decay = 5e-4
  config.num_epochs = 12
  config.warmup_epochs = 1
  config.lr_schedule = "multistep"
  config.lr_milestones = (6, 9)
  config.lr_decay = 0.2
  config.log_every_steps = 20
  config.eval_every_epochs = 4
  config.checkpoint_every_steps = 100
  config.eval_batch_size = 500
  config.ensemble_sizes = (1, 2, 5, 10)
  if args.runlocal:
    config.num_train_steps = 10
    config.model_kwargs.width = 8
    config.ensemble_sizes = (1, 2)
  return finalize(config)
