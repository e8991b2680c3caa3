"""The iBNN paper's comparison on CIFAR (Trinh et al., Table 2, Algorithm 1, Figs. 5–7): a DNN,
MC dropout, BNN-VI and iBNN with K components, VGG-16 or WRN-28-10, under one protocol.

Arguments (``:<args>``, parsed by ``smoothing_jax.experiment.config_base.parse_config_arg``):
``model`` (default ``vgg_ibnn_16``; any of ``METHODS``' models), ``dataset`` (default ``cifar10``;
``cifar100``, or ``npz:<dir>`` with the CIFAR-10 setting), ``num_components`` K of an iBNN
(default ``4``), positionally or as ``name=value``; flag ``runlocal``: a CPU smoke run.

  --config=configs/cifar_ibnn.py:vgg_dnn_16,cifar10           # SGD
  --config=configs/cifar_ibnn.py:vgg_mcdo_16,cifar10          # MC dropout
  --config=configs/cifar_ibnn.py:vgg_bayesian_16,cifar10      # BNN-VI (the iBNN repository's)
  --config=configs/cifar_ibnn.py:vgg_bnnvi_16,cifar10         # BNN-VI (uncertainty-baselines')
  --config=configs/cifar_ibnn.py:vgg_ibnn_16,cifar10,4        # iBNN-4
  --config=configs/cifar_ibnn.py:wideresnet_ibnn_28_10,cifar100,16
  --config=configs/cifar_ibnn.py:vgg_ibnn_16,cifar10,4,runlocal        # CPU smoke run

The protocol, for every method: 300 epochs, batch 128, SGD-Nesterov 0.9, the paper's Table 2
rate λ₀ and weight decay of the architecture (the iBNN repository's BNN-VI: Adam at 1e-3 without
decay, as its ``train.py``).  λ₀ flat for 150 epochs, then linear to 0.01·λ₀ at epoch 270, then
flat — the paper's text ("anneal linearly to 0.01λ₀ during 120 epochs starting
from epoch 150") and the reference's LambdaLR (flat to 50%, linear to 90%) coincide at 300
epochs; ours is per step, the reference per epoch.  No warm-up epoch.  Inputs use the dataset's
own mean/std (the reference uses CIFAR-10 statistics for CIFAR-100 and ImageNet statistics for
VGG).  Evaluation: ECE with 15 bins; iBNN 5 draws of each of its K components, MC dropout and
BNN-VI the ``ensemble_sizes`` samples (20 = the 5·K of iBNN-4).

* iBNN: each example repeated S = 2 times per step; the posterior at the constant λ₁ without
  weight decay; prior N(1, s²); β = KL weight, linear 0 → 1 over the first 200 epochs.
* BNN-VI (``bnnvi``: ``vgg_bayesian_16``, ``wideresnet_bayesian_28_10``): the iBNN repository's
  own, the one its paper reports (trungtrinh44/ibnn at 665ba40: ``BayesianVGG16`` and
  ``BayesianWideResNet28x10``, ``models/utils.py``'s ``BayesianConv2d`` / ``BayesianLinear``,
  trained by ``train.py``).  Variational kernels and biases, σ initialised at |N(0.015, 0.001²)|,
  one weight sample per pass for the whole batch, the fixed prior N(1, 0.5²) of ``train.py``'s
  defaults (``prior_mean``, ``prior_std``, lines 44–45), the KL over kernels and biases; the same
  ELBO (mean NLL + β·KL/N, β over 200 epochs); Adam (lr 1e-3, β 0.9/0.999, ε 1e-8, no weight
  decay: ``adam_params``, lines 61–64, 141–153) on the protocol's schedule (its ``LambdaLR`` with
  ``lr_ratio_det`` 0.01).  Its WRN's stem is a plain deterministic conv.  One difference:
  ``train.py`` holds out 10% for validation by default (``validation``) and keeps the checkpoint
  of the best validation NLL; here, as for every method of this protocol, no split is held out.
* BNN-VI as uncertainty-baselines builds it (``bnnvi_ub``: ``vgg_bnnvi_16``,
  ``wideresnet_bnnvi_28_10``): the same ELBO with uncertainty-baselines' Flipout layers, posterior
  initialisation (σ₀ = 1e-3) and tied-mean prior (s = 0.1); weight decay on the deterministic
  parameters only (biases, BatchNorm), the protocol's SGD and rate.  Its WRN is the iBNN
  reference's, as the other methods' (``configs/cifar_resnet.py`` trains
  ``wideresnet_bnnvi_28_10`` as uncertainty-baselines' WRN: no conv biases, the stride on the
  first conv).
* Every method starts from the reference's initialisation (``kernel_init``): its VGG-16 draws
  the convs from N(0, 2 / (k²·C_out)) with zero biases and keeps PyTorch's defaults for the
  dense layers (U(±1/√fan_in) weights and biases); its WRN keeps PyTorch's defaults everywhere.
* The VGG-16 of every method is the iBNN reference's: no BatchNorm, the 512-512-C head
  (``classifier="mlp512"``).  Its SGD and MC dropout baselines are the reference's ``DetVGG16``:
  dropout 0.5 before both hidden layers of the head, train-only for SGD, kept on at test time
  for MC dropout (``test_dropout``), and none in the conv blocks (``vgg_mcdo_16``'s 0.3 after
  every block is the spatial-smoothing paper's placement, with BatchNorm).  WRN MC dropout: 0.3
  between the two convs of every block, as the reference's ``DetWideResNet28x10``.

Start an iBNN from a deterministic run of the same architecture with
``--config.ibnn.pretrained_workdir=<dir>`` (add ``--config.ibnn.freeze_deterministic`` to train
only the posterior): the ``vgg_dnn_16`` / ``wideresnet_dnn_28_10`` runs of this config.
"""
from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
)

ARGS = {"model": "vgg_ibnn_16", "dataset": "cifar10",  # positional, with defaults
        "num_components": 4}

# The methods compared, by architecture: {architecture: {method: model name}}.
METHODS = {
    "vgg": {"dnn": "vgg_dnn_16", "mcdo": "vgg_mcdo_16", "bnnvi": "vgg_bayesian_16",
            "bnnvi_ub": "vgg_bnnvi_16", "ibnn": "vgg_ibnn_16"},
    "wideresnet": {"dnn": "wideresnet_dnn_28_10", "mcdo": "wideresnet_mcdo_28_10",
                   "bnnvi": "wideresnet_bayesian_28_10", "bnnvi_ub": "wideresnet_bnnvi_28_10",
                   "ibnn": "wideresnet_ibnn_28_10"},
}
# The iBNN repository's BNN-VI (``train.py`` at 665ba40): its prior's defaults (``prior_mean``,
# ``prior_std``, lines 44–45) and its optimiser (``adam_params``, lines 61–64: torch.optim.Adam
# over every parameter, lines 141–153), whose β 0.9/0.999 and ε 1e-8 are optax.adam's defaults.
IBNN_BNNVI_PRIOR = (1.0, 0.5)  # (mean, std)
IBNN_BNNVI_ADAM = {"learning_rate": 1e-3, "weight_decay": 0.0}
INITS = {"vgg": "pytorch_dense", "wideresnet": "pytorch_default"}  # models.common.KERNEL_INITS
# (architecture, dataset): λ₀, λ₁, σ₀ of the iBNN μ initialisation, iBNN prior std s, weight
# decay (paper Table 2).
TABLE_2 = {
    ("vgg", "cifar10"): (0.05, 1.2, 0.75, 0.3, 5e-4),
    ("vgg", "cifar100"): (0.05, 1.6, 0.75, 0.3, 3e-4),
    ("wideresnet", "cifar10"): (0.1, 2.4, 0.5, 0.1, 5e-4),
    ("wideresnet", "cifar100"): (0.1, 4.8, 0.5, 0.1, 5e-4),
}


def method_of(model: str) -> tuple:
  """``(architecture, method)`` of a model of ``METHODS``; ValueError listing them."""
  for architecture, methods in METHODS.items():
    for method, name in methods.items():
      if name == model:
        return architecture, method
  known = [name for methods in METHODS.values() for name in methods.values()]
  raise ValueError(f"configs/cifar_ibnn.py compares {known}; got model {model!r}.")


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS)
  architecture, method = method_of(args.model)
  dataset = args.dataset
  base_dataset = "cifar10" if dataset.startswith("npz:") else dataset.split(":")[0]
  if (architecture, base_dataset) not in TABLE_2:
    raise ValueError(f"No Table 2 setting for ({args.model}, {dataset}); known datasets: "
                     "cifar10, cifar100, npz:<dir>.")
  det_lr, variational_lr, init_std, prior_std, weight_decay = TABLE_2[(architecture,
                                                                       base_dataset)]
  config = base_config()
  config.model = args.model
  if architecture == "vgg" and method in ("dnn", "mcdo"):  # the reference's DetVGG16
    config.model_kwargs.batch_norm = False
    config.model_kwargs.classifier = "mlp512"
    config.model_kwargs.head_dropout_rate = 0.5
    config.model_kwargs.head_mc_dropout = method == "mcdo"
    config.model_kwargs.dropout_rate = 0.0
  if architecture == "wideresnet" and method == "bnnvi_ub":  # the reference's WRN, as the others'
    config.model_kwargs.conv_bias = True
    config.model_kwargs.stride_first = False
    config.model_kwargs.head_bn_momentum = 0.1
  # The reference's initialisation, for every method: its VGG-16 sets only the convs', its WRN
  # none (PyTorch's defaults).
  config.model_kwargs.kernel_init = INITS[architecture]
  if method == "ibnn":
    config.model_kwargs.num_components = args.num_components
    config.model_kwargs.noise_init_std = init_std
  config.input.dataset = dataset
  config.optimizer = "sgd"           # iBNN models get the two-rate SGD-Nesterov optimiser
  config.momentum = 0.9
  config.nesterov = True
  config.input.batch_size = 128
  config.base_batch_size = 128
  config.learning_rate = det_lr
  config.weight_decay = weight_decay
  config.num_epochs = 300
  config.warmup_epochs = 0
  config.lr_schedule = "flat_linear"
  config.lr_final_ratio = 0.01
  config.ibnn.num_train_samples = 2
  config.ibnn.prior_std = prior_std
  config.ibnn.variational_lr = variational_lr
  config.ibnn.kl_anneal_epochs = 200
  config.ibnn.eval_samples = 5
  config.bnnvi.kl_anneal_epochs = 200
  if method == "bnnvi":  # the iBNN repository's BNN-VI: its prior and Adam
    config.bnnvi.prior_mean, config.bnnvi.prior_std = IBNN_BNNVI_PRIOR
    config.optimizer = "adam"
    config.learning_rate = IBNN_BNNVI_ADAM["learning_rate"]
    config.weight_decay = IBNN_BNNVI_ADAM["weight_decay"]
  config.eval_every_epochs = 10
  config.ece_bins = 15              # the reference's (IB ``ECELoss(n_bins=15)``) and the paper's
  if args.runlocal:
    shrink_for_cpu(config)
    config.ibnn.eval_samples = 2
  return finalize(config)
