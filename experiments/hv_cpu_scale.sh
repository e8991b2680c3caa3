#!/usr/bin/env bash
# CPU-scale run of HV's analyses (feature-map similarity, learning trajectories, small-data
# Hessian spectra): a ResNet (AlterNet's backbone), an AlterNet, a ViT, a Swin and a ViT on 6% of
# the training set, each trained briefly with the ViT recipe on CIFAR-10 from local arrays, then
# every figure of experiments/msa_figures.py.  About 20-30 minutes on 2 CPU cores.
#
#   bash experiments/hv_cpu_scale.sh <cifar10 npz dir> <output dir> [steps]
#
# Short-run settings (not HV's 300 epochs): batch 64, AdamW at 2e-3 (learning_rate 3e-3 at the
# recipe's base batch 96), no warm-up, cosine over about the run, no Mixup/CutMix/RandAugment;
# trajectories recorded every 25 steps on 256 random directions.
set -euo pipefail
DATA=${1:?cifar10 npz dir}; OUT=${2:?output dir}; STEPS=${3:-600}
cd "$(dirname "$0")/.."
COMMON=(--config.num_train_steps="$STEPS" --config.input.batch_size=64
        --config.learning_rate=3e-3 --config.warmup_epochs=0 --config.mixup_alpha=0 --config.cutmix_alpha=0
        --config.input.randaugment.num_layers=0 --config.trajectory_every_steps=25
        --config.trajectory_dims=256 --config.checkpoint_every_steps="$STEPS"
        --config.log_every_steps=100 --config.ensemble_sizes="(1,)")
train() {  # label model num_epochs extra-args...
  local label=$1 model=$2 epochs=$3; shift 3
  python -m smoothing_jax.main --config="configs/cifar_vit.py:$model,npz:$DATA,runlocal" \
      --workdir="$OUT/$label" --config.num_epochs="$epochs" "${COMMON[@]}" "$@"
}
train resnet alternet_18 1 --config.model_kwargs.msa_blocks="(0,0,0,0)"
train alternet alternet_18 1
train vit vit_ti 1 --config.model_kwargs.depth=4
train swin swin_t 1
train vit_6pct vit_ti 13 --config.model_kwargs.depth=4 --config.input.train_fraction=0.06
python experiments/msa_figures.py --out "$OUT/figures" \
    --workdir "ResNet=$OUT/resnet" --workdir "AlterNet=$OUT/alternet" --workdir "ViT=$OUT/vit" \
    --workdir "Swin=$OUT/swin" --workdir "ViT (6% data)=$OUT/vit_6pct"
