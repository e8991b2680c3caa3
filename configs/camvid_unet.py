"""The CamVid segmentation recipe of the paper (Appendix A.2) for the U-Nets.

Arguments (``:<args>``, parsed by ``smoothing_jax.experiment.config_base.parse_config_arg``):
``model`` (default ``unet_mcdo_smoothing``), ``dataset`` (default ``camvid``; or ``npz:<dir>``),
positionally or as ``name=value``; flag ``runlocal``: a CPU smoke run.

  --config=configs/camvid_unet.py                                  # unet_mcdo_smoothing on camvid
  --config=configs/camvid_unet.py:unet_mcdo,camvid
  # CPU smoke run
  --config=configs/camvid_unet.py:unet_dnn_smoothing,npz:<dir>,runlocal --config.num_classes=11

Pixel-wise cross-entropy with median-frequency class balancing and the void
label masked; Adam (lr 1e-3, β 0.9 / 0.999, no weight decay), batch 3, 130
epochs, lr 2e-4 from epoch 100; random crop + horizontal flip.  The paper does
not give the crop size: 352×480 crops of the 360×480 images (a multiple of 16,
the U-Net's total down-sampling) are used here; evaluation sees whole images.
CamVid comes from the ``camvid`` TFDS builder (``python -m smoothing_jax.data.camvid
--manual_dir=<release> --data_dir=<dir>`` prepares it, then ``--config.input.data_dir=<dir>``).
Evaluate temporal smoothing with ``--mode=streams``.  The global batch of 3 needs
1 or 3 devices (``--config.num_devices=1``), or a batch size the devices divide.
"""

from smoothing_jax.experiment.config_base import (
  base_config,
  finalize,
  parse_config_arg,
  shrink_for_cpu,
)

ARGS = {"model": "unet_mcdo_smoothing", "dataset": "camvid"}  # positional, with defaults


def get_config(arg: str = ""):
  args = parse_config_arg(arg, ARGS)
  config = base_config()
  config.model = args.model
  config.input.dataset = args.dataset
  config.input.download = False  # CamVid is prepared from a manual download
  config.optimizer = "adam"
  config.input.batch_size = 3
  config.base_batch_size = 3
  config.learning_rate = 1e-3
  config.weight_decay = 0.0
  config.num_epochs = 130
  config.warmup_epochs = 0
  config.lr_schedule = "multistep"
  config.lr_milestones = (100,)
  config.lr_decay = 0.2             # 1e-3 → 2e-4
  # Unused by Adam and multistep (the values this config has recorded).
  config.momentum = 0.9
  config.nesterov = False
  config.lr_final_ratio = 0.01
  config.input.crop_size = (352, 480)
  config.class_balancing = "median_frequency"
  config.eval_every_epochs = 10
  config.eval_batch_size = 4
  config.eval_chunk_size = 5
  config.checkpoint_every_steps = 500
  config.ensemble_sizes = (1, 2, 5, 10, 50)
  if args.runlocal:
    shrink_for_cpu(config)
    config.input.batch_size = 2
    config.base_batch_size = 2
    config.input.crop_size = None
    config.eval_batch_size = 8
    config.model_kwargs.encoder_convs = (1, 1, 1)
    config.model_kwargs.decoder_convs = (1, 1)
  return finalize(config)
