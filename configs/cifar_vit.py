"""The HV training recipe for ViTs (and, in the paper, the CNNs compared with them) on CIFAR.

Arguments (``:<args>``, parsed by ``smoothing_jax.experiment.config_base.parse_config_arg``):
``model`` (default ``vit_ti``), ``dataset`` (default ``cifar100``; TFDS name or ``npz:<dir>``),
positionally or as ``name=value``; flag ``runlocal``: a CPU smoke run.

  --config=configs/cifar_vit.py                          # vit_ti on cifar100
  --config=configs/cifar_vit.py:alternet_50,cifar10
  --config=configs/cifar_vit.py:swin_t,cifar100          # Swin-T: patch 1, window 4
  --config=configs/cifar_vit.py:pit_ti,cifar100          # PiT-Ti: patch 2, stride 8 (HV's class)
  --config=configs/cifar_vit.py:vit_ti,cifar10,runlocal  # CPU smoke run (narrow model, few steps)

AdamW (lr 1.25e-4 at batch 96, scaled linearly with the batch; weight decay
0.05), 5 warm-up epochs then cosine annealing to 0 over 300 epochs, label
smoothing 0.1, Mixup α 1.0 / CutMix α 0.8 (switching with probability 0.5),
RandAugment n 2, m 9 (std 1.0), gradient clipping at global norm 5, stochastic
depth 0.1, random crop (pad 4) + flip.  ViTs use patch size 2 on 32×32 images and no
dropout (HV; ``--config.model_kwargs.dropout_rate_train`` and ``.embedding_dropout_rate``
set it), AlterNets window 4.
"""

from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
)

ARGS = {"model": "vit_ti", "dataset": "cifar100"}  # positional, with defaults


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS)
  config = base_config()
  config.model = args.model
  config.input.dataset = args.dataset
  config.optimizer = "adamw"
  config.input.batch_size = 96
  config.base_batch_size = 96
  config.learning_rate = 1.25e-4
  config.weight_decay = 0.05
  config.lr_schedule = "cosine"
  config.warmup_epochs = 5
  config.num_epochs = 300
  # Unused by AdamW and cosine (the values this config has recorded).
  config.momentum = 0.9
  config.nesterov = False
  config.lr_milestones = (60, 130, 160)
  config.lr_decay = 0.2
  config.lr_final_ratio = 0.01
  config.grad_clip_norm = 5.0
  config.label_smoothing = 0.1
  config.mixup_alpha = 1.0
  config.cutmix_alpha = 0.8
  config.mixup_switch_prob = 0.5
  config.input.randaugment.num_layers = 2
  config.input.randaugment.magnitude = 9.0
  config.input.randaugment.magnitude_std = 1.0
  config.model_kwargs.stochastic_depth = 0.1
  config.eval_every_epochs = 10
  family = args.model.split("_")[0]
  if family == "vit":  # HV's ViT has no dropout (AlterNet takes no such options)
    config.model_kwargs.dropout_rate_train = 0.0
    config.model_kwargs.embedding_dropout_rate = 0.0
  if args.runlocal:
    shrink_for_cpu(config)
    config.model_kwargs.width = None
    config.model_kwargs.update(_RUNLOCAL_SIZES.get(family, {}))
  return finalize(config)


# Narrow models for CPU smoke runs.
_RUNLOCAL_SIZES = {
    "vit": {
        "hidden_dim": 32,
        "depth": 2,
        "num_heads": 2,
        "head_dim": 16,
        "mlp_dim": 64,
        "patch_size": 4
    },
    "alternet": {
        "width": 8,
        "stage_sizes": (1, 2, 2, 2),
        "msa_blocks": (0, 1, 1, 1),
        "num_heads": (1, 2, 2, 2),
        "head_dim": 8
    },
    "swin": {
        "embed_dim": 16,
        "depths": (2, 2),
        "num_heads": (1, 2),
        "head_dim": 8,
        "patch_size": 2
    },
    "pit": {
        "depths": (1, 1, 1),
        "num_heads": (1, 2, 4),
        "head_dim": 8
    },
}
