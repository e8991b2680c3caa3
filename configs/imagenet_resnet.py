"""ImageNet recipe of the paper (Appendix A):
``--config=configs/imagenet_resnet.py:resnet_mcdo_smoothing_50``.

Arguments (``:<args>``, parsed by ``smoothing_jax.experiment.config_base.parse_config_arg``):
``model`` (default ``resnet_mcdo_smoothing_50``), ``dataset`` (default ``imagenet2012``),
positionally or as ``name=value``; flag ``runlocal``: a CPU smoke run.

SGD momentum 0.9, lr 0.1 at batch 256 (scaled linearly with the global batch),
weight decay 1e-4, 90 epochs after 1 warm-up epoch, lr × 0.1 at epochs 30/60/80,
random-resized crop 224 + flip; evaluation resize 256 / centre crop 224.
"""
from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
)

ARGS = {"model": "resnet_mcdo_smoothing_50", "dataset": "imagenet2012"}  # positional, with defaults


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS)
  config = base_config()
  config.model = args.model
  config.input.dataset = args.dataset
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = False
  config.input.batch_size = 256
  config.base_batch_size = 256
  config.learning_rate = 0.1
  config.weight_decay = 1e-4
  config.num_epochs = 90
  config.warmup_epochs = 1
  config.lr_schedule = "multistep"
  config.lr_milestones = (30, 60, 80)
  config.lr_decay = 0.1
  config.eval_every_epochs = 5
  config.checkpoint_every_steps = 5000
  config.eval_batch_size = 250
  if args.runlocal:
    shrink_for_cpu(config)
    config.input.batch_size = 8
    config.eval_batch_size = 16
  return finalize(config)
