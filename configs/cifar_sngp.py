"""SNGP's CIFAR recipe (Liu et al. 2020), as uncertainty-baselines' ``baselines/cifar/sngp.py``
gives it for WRN-28-10 (``wideresnet_sngp_28_10``, the default) and, on the same settings, a
ResNet-18 (``resnet_sngp_18``):

* spectral normalisation of every conv and dense layer, norm bound 6, one power iteration per
  step (``spec_norm_bound``, ``spec_norm_iteration``); the GP output layer of 1,024 random
  features (``gp_hidden_dim``), ridge penalty 1 (``gp_cov_ridge_penalty``), the precision summed
  over each epoch (``gp_cov_discount_factor`` −1), mean-field factor 25 (``gp_mean_field_factor``;
  12.5 on CIFAR-100, as its docstring says);
* SGD-Nesterov 0.9, lr 0.05 at 128 images a step (``base_learning_rate``, scaled by batch / 128),
  batch 512 (64 × 8 cores), Keras L2 3e-4 (weight decay 2 × 3e-4 here), 250 epochs with one
  warm-up epoch, lr × 0.2 at epochs 75, 150, 200 (``lr_decay_epochs`` 60/120/160 × 250 // 200).

The WRN trains with its filter-wise dropout 0.1 after the stem and every BatchNorm-ReLU
(``dropout_rate``, Keras's training-only ``Dropout``: ``use_mc_dropout`` is False;
``model_kwargs.filter_dropout_rate``).  Two differences, stated in the docs: uncertainty-baselines
projects the GP's input to 128 dimensions by a fixed Gaussian matrix and draws orthogonal random
features (``gp_input_dim``, ``gp_random_feature_type="orf"``, its TF layer), where edward2's JAX
layer, which ours equals, takes the pooled features as they are and draws Gaussian features.

Arguments (``:<args>``): ``model`` (default ``wideresnet_sngp_28_10``), ``dataset`` (default
``cifar10``; TFDS name or ``npz:<dir>``); flags ``runlocal`` (a CPU smoke run) and
``uncertainty``.

  --config=configs/cifar_sngp.py                                   # WRN-28-10 on CIFAR-10
  --config=configs/cifar_sngp.py:resnet_sngp_18,npz:data/cifar10
  --config=configs/cifar_sngp.py --config.deep_ensemble.members=4  # an SNGP ensemble
"""
from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
  with_uncertainty_evals,
)

ARGS = {"model": "wideresnet_sngp_28_10", "dataset": "cifar10"}


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS, flags=("runlocal", "uncertainty"))
  config = base_config()
  config.model = args.model
  config.input.dataset = args.dataset
  config.method = "sngp"
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = True
  config.input.batch_size = 512
  config.base_batch_size = 128
  config.learning_rate = 0.05
  config.weight_decay = 2 * 3e-4
  config.num_epochs = 249            # + the warm-up epoch: uncertainty-baselines' 250
  config.warmup_epochs = 1
  config.lr_schedule = "multistep"
  config.lr_milestones = (74, 149, 199)  # counted after the warm-up: epochs 75, 150, 200
  config.lr_decay = 0.2
  config.sngp.mean_field_factor = 12.5 if "cifar100" in args.dataset else 25.0
  config.ece_bins = 15
  if args.runlocal:
    shrink_for_cpu(config)
  if args.uncertainty:
    with_uncertainty_evals(config, 0.1)
  return finalize(config)
