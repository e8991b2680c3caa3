"""CIFAR recipe of the paper (Appendix A) for any registered CNN.

Arguments (``:<args>``, parsed by ``smoothing_jax.experiment.config_base.parse_config_arg``):
``model`` (default ``resnet_mcdo_smoothing_18``), ``dataset`` (default ``cifar10``; TFDS name or
``npz:<dir>``), positionally or as ``name=value``; flag ``runlocal``: a CPU smoke run; flag
``uncertainty``: after training also OOD detection (CIFAR-10: SVHN and CIFAR-100, CIFAR-100:
SVHN and CIFAR-10), temperature scaling on 10% of the training set held out, and selective
prediction (``config_base.with_uncertainty_evals``).

  --config=configs/cifar_resnet.py  # resnet_mcdo_smoothing_18, cifar10
  --config=configs/cifar_resnet.py:resnet_mcdo_smoothing_18,cifar100
  --config=configs/cifar_resnet.py:model=vgg_dnn_16,dataset=cifar100
  --config=configs/cifar_resnet.py:vgg_dnn_smoothing_16,cifar10,runlocal   # CPU smoke run
  --config=configs/cifar_resnet.py:resnet_mcdo_18,cifar10,uncertainty      # + OOD, recalibration
  --config=configs/cifar_resnet.py:wideresnet_batchensemble_28_10,cifar10  # BatchEnsemble
  --config=configs/cifar_resnet.py:wideresnet_bnnvi_28_10,cifar10  # uncertainty-baselines' VI
  --config=configs/cifar_resnet.py:wideresnet_mimo_28_10,cifar10   # MIMO
  --config=configs/cifar_resnet.py:resnet_packed_18,cifar10  # Packed-Ensembles (TorchUncertainty)

SGD (momentum 0.9, no Nesterov), lr 0.1 at batch 128, weight decay 5e-4,
200 epochs after 1 linear warm-up epoch, lr × 0.2 at epochs 60/130/160 (the
paper's text; the reference code uses 60/120/160), random crop + flip.

BatchEnsemble models (``resnet_batchensemble_18``, ``wideresnet_batchensemble_28_10``) take
uncertainty-baselines' CIFAR BatchEnsemble settings instead (``baselines/cifar/batchensemble.py``):
SGD-Nesterov 0.9, lr 0.1 at 128 new images a step (each repeated for the M members), 250 epochs
with 1 warm-up epoch, lr × 0.2 at epochs 100/200/225, Keras L2 3e-4 on all but the fast weights
(weight decay 6e-4 here: L2 λ·‖w‖² is decay 2λ), the fast weights and member biases at half the
rate, fast weights initialised N(1, 0.5²) (``random_sign_init`` −0.5).

MIMO models (``resnet_mimo_18``, ``wideresnet_mimo_28_10``: M = 3) take uncertainty-baselines'
CIFAR MIMO settings (``baselines/cifar/mimo.py`` with the flags of ``baselines/cifar/utils.py``,
commit 163351d4): SGD-Nesterov 0.9, lr 0.1 at 128 new images a step (``per_core_batch_size`` 64 ×
``num_cores`` 8 // ``batch_repetitions`` 4; ``base_learning_rate`` 0.1 × 128 / 128), each
repeated 4 times (``mimo.batch_repetitions``) with input repetition probability 0
(``mimo.input_repetition_probability``), 250 epochs with 1 warm-up epoch, lr × 0.2 at epochs
100/200/225 (``lr_decay_epochs`` 80/160/180 × 250 // 200), Keras L2 3e-4 on every kernel, bias and
BatchNorm parameter (weight decay 6e-4 here).
The Packed-Ensembles ResNet-18 (``resnet_packed_18``: M = 4, α = 2, γ = 2) takes
TorchUncertainty's CIFAR-10 recipe instead (``experiments/classification/cifar10/configs/resnet18/
packed.yaml``): SGD 0.9 (no Nesterov), lr 0.05 at batch 128, weight decay 5e-4, 75 epochs without
warm-up, lr × 0.1 at epochs 25 and 50.

The variational WRN-28-10 (``wideresnet_bnnvi_28_10``: UB's layout, 72,940,426 parameters) takes
uncertainty-baselines' VI recipe instead (``baselines/cifar/variational_inference.py`` with the
flags of ``baselines/cifar/utils.py``, commit 163351d4): SGD-Nesterov 0.9
(``one_minus_momentum`` 0.1), lr 0.1 at 128 (``base_learning_rate``) at batch 512
(``per_core_batch_size`` 64 × ``num_cores`` 8), 250 epochs with 1 warm-up epoch, lr × 0.2 at
epochs 75/150/200 (``lr_decay_epochs`` 60/120/160 × 250 // 200), Keras L2 4e-4 on BatchNorm and
biases only (weight decay 8e-4 here; BNN-VI never decays the posterior), β linear per step over
200 epochs (``kl_annealing_epochs``; ``bnnvi.kl_anneal_per_step``), prior std 0.1 and σ₀ 1e-3
(the BNN-VI defaults), training on 95% of the training split (``train_proportion``; the other 5%
held out, ``input.holdout_fraction``), ECE with 15 bins (``num_bins``).  One difference: UB divides
the KL by the whole training split's 50,000 (``dataset_size=ds_info.splits['train']``), ours by
the 47,500 examples trained on.
"""
from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
  with_uncertainty_evals,
)

ARGS = {"model": "resnet_mcdo_smoothing_18", "dataset": "cifar10"}  # positional, with defaults


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS, flags=("runlocal", "uncertainty"))
  config = base_config()
  config.model = args.model
  config.input.dataset = args.dataset
  config.optimizer = "sgd"
  config.momentum = 0.9
  config.nesterov = False
  config.input.batch_size = 128
  config.base_batch_size = 128
  config.learning_rate = 0.1
  config.weight_decay = 5e-4
  config.num_epochs = 200
  config.warmup_epochs = 1
  config.lr_schedule = "multistep"
  config.lr_milestones = (60, 130, 160)
  config.lr_decay = 0.2
  if "_batchensemble_" in args.model:
    config.nesterov = True
    config.weight_decay = 2 * 3e-4
    config.num_epochs = 249            # + the warm-up epoch: uncertainty-baselines' 250
    config.lr_milestones = (99, 199, 224)  # counted after the warm-up: epochs 100, 200, 225
    config.batch_ensemble.fast_weight_lr_multiplier = 0.5
    config.batch_ensemble.fast_weight_decay = 0.0
  if "_mimo_" in args.model:           # uncertainty-baselines' baselines/cifar/mimo.py
    config.nesterov = True
    config.weight_decay = 2 * 3e-4
    config.num_epochs = 249            # + the warm-up epoch: uncertainty-baselines' 250
    config.lr_milestones = (99, 199, 224)  # counted after the warm-up: epochs 100, 200, 225
    config.mimo.batch_repetitions = 4
    config.mimo.input_repetition_probability = 0.0
  if "_packed_" in args.model:  # TorchUncertainty's Packed-Ensembles ResNet-18 recipe
    config.lr_milestones = (25, 50)
    config.learning_rate = 0.05
    config.num_epochs = 75
    config.warmup_epochs = 0
    config.lr_decay = 0.1
  if args.model.startswith("wideresnet_bnnvi_"):  # uncertainty-baselines' VI recipe
    config.nesterov = True
    config.input.batch_size = 512
    config.weight_decay = 2 * 4e-4
    config.num_epochs = 249            # + the warm-up epoch: uncertainty-baselines' 250
    config.lr_milestones = (74, 149, 199)  # counted after the warm-up: epochs 75, 150, 200
    config.input.holdout_fraction = 0.05
    config.bnnvi.kl_anneal_epochs = 200
    config.bnnvi.kl_anneal_per_step = True
    config.ece_bins = 15
  if args.runlocal:
    shrink_for_cpu(config)
  if args.uncertainty:  # the recipe's held-out split where it has one (UB VI's 5%), else 10%
    with_uncertainty_evals(config, config.input.holdout_fraction or 0.1)
  return finalize(config)
