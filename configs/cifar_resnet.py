"""CIFAR recipe of the paper (Appendix A) for any registered CNN.

Arguments (``:<args>``, parsed by ``smoothing_jax.config_base.parse_config_arg``): ``model``
(default ``resnet_mcdo_smoothing_18``), ``dataset`` (default ``cifar10``; TFDS name or
``npz:<dir>``), positionally or as ``name=value``; flag ``runlocal``: a CPU smoke run; flag
``uncertainty``: after training also OOD detection (CIFAR-10: SVHN and CIFAR-100, CIFAR-100:
SVHN and CIFAR-10), temperature scaling on 10% of the training set held out, and selective
prediction (``config_base.with_uncertainty_evals``).

  --config=configs/cifar_resnet.py  # resnet_mcdo_smoothing_18, cifar10
  --config=configs/cifar_resnet.py:resnet_mcdo_smoothing_18,cifar100
  --config=configs/cifar_resnet.py:model=vgg_dnn_16,dataset=cifar100
  --config=configs/cifar_resnet.py:vgg_dnn_smoothing_16,cifar10,runlocal   # CPU smoke run
  --config=configs/cifar_resnet.py:resnet_mcdo_18,cifar10,uncertainty      # + OOD, recalibration

SGD (momentum 0.9, no Nesterov), lr 0.1 at batch 128, weight decay 5e-4,
200 epochs after 1 linear warm-up epoch, lr × 0.2 at epochs 60/130/160 (the
paper's text; the reference code uses 60/120/160), random crop + flip.
"""
from smoothing_jax.config_base import (base_config, finalize, parse_config_arg, shrink_for_cpu,
                                       with_uncertainty_evals)

ARGS = {"model": "resnet_mcdo_smoothing_18", "dataset": "cifar10"}  # positional, with defaults


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS, flags=("runlocal", "uncertainty"))
  config = base_config()
  config.model = args.model
  config.dataset = args.dataset
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = False
  config.batch_size = 128
  config.base_batch_size = 128
  config.learning_rate = 0.1
  config.weight_decay = 5e-4
  config.num_epochs = 200
  config.warmup_epochs = 1
  config.lr_schedule = "multistep"
  config.lr_milestones = (60, 130, 160)
  config.lr_decay = 0.2
  if args.runlocal:
    shrink_for_cpu(config)
  if args.uncertainty:
    with_uncertainty_evals(config)
  return finalize(config)
