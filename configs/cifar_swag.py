"""SWAG's CIFAR recipe (Maddox et al. 2019), as wjmaddox/swa_gaussian's
``experiments/train/README.md`` gives its runs of ``run_swag.py``: 300 epochs of SGD (momentum
0.9, batch 128), the models collected once per epoch after epoch 161 (``swag.start_fraction``
161/300, so a shorter run collects over the same share of it), rank K = 20 (``--cov_mat``:
low-rank plus diagonal), samples at scale 0.5, on ``run_swag.py``'s schedule: the initial rate
to 50% of the collection's start, linear down to the SWA rate at 90%, then constant.

========================  =========  ======  ==========  ============================
model                     lr_init    wd      swa_lr      its README's run
========================  =========  ======  ==========  ============================
``wideresnet_dnn_28_10``  0.1        5e-4    0.05        WideResNet28x10
``preresnet_dnn_*``       0.1        3e-4    0.05 / 0.01 PreResNet164 (CIFAR-100 / -10)
``vgg_dnn_16``            0.05       5e-4    0.01        VGG16
========================  =========  ======  ==========  ============================

Our PreResNets stop at depth 152 (``preresnet_dnn_152``), not 164.  The SGD baseline of the same
runs (``--config.method=deterministic``) keeps the schedule's shape: the recipe's
``lr_schedule`` is ``flat_linear`` to 0.01 × the rate, ``run_swag.py``'s without ``--swa``.

Arguments (``:<args>``): ``model`` (default ``wideresnet_dnn_28_10``), ``dataset`` (default
``cifar10``; TFDS name or ``npz:<dir>``); flags ``runlocal`` (a CPU smoke run) and
``uncertainty`` (OOD detection, recalibration and selective prediction after training).

  --config=configs/cifar_swag.py                                  # SWAG, WRN-28-10, CIFAR-10
  --config=configs/cifar_swag.py:vgg_dnn_16,cifar100
  --config=configs/cifar_swag.py --config.method=swa              # SWA on the same run
  --config=configs/cifar_swag.py --config.deep_ensemble.members=4  # MultiSWAG
"""
from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
  with_uncertainty_evals,
)

ARGS = {"model": "wideresnet_dnn_28_10", "dataset": "cifar10"}


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS, flags=("runlocal", "uncertainty"))
  config = base_config()
  config.model = args.model
  config.input.dataset = args.dataset
  config.method = "swag"
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = False
  config.input.batch_size = 128
  config.base_batch_size = 128
  config.learning_rate = 0.1
  config.weight_decay = 5e-4
  config.num_epochs = 300
  config.warmup_epochs = 0
  config.lr_schedule = "flat_linear"  # the SGD baseline's; SWAG's own schedule replaces it
  config.lr_final_ratio = 0.01
  config.swag.start_fraction = 161 / 300
  config.swag.collect_every_epochs = 1
  config.swag.lr_ratio = 0.05 / 0.1
  config.swag.lr_schedule = "maddox"
  config.swag.rank = 20
  config.swag.scale = 0.5
  config.swag.covariance = "low_rank"
  config.ensemble_sizes = (1, 2, 5, 10, 20, 30)  # the paper's 30 samples
  if args.model.startswith("vgg_"):
    config.learning_rate = 0.05
    config.swag.lr_ratio = 0.01 / 0.05
  if args.model.startswith("preresnet_"):
    config.weight_decay = 3e-4
    config.swag.lr_ratio = (0.05 if args.dataset == "cifar100" else 0.01) / 0.1
  if args.runlocal:
    shrink_for_cpu(config)
    config.input.train_fraction = 0.01  # 500 images: 15 steps an epoch of 32
    config.num_train_steps = 60         # 4 epochs: 2 models collected, at the ends of 3 and 4
  if args.uncertainty:
    with_uncertainty_evals(config)
  return finalize(config)
