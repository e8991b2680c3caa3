"""``config.init_from``: the variables a run starts from (fine-tuning), or stands for (an evaluation
of another workdir or of a torch checkpoint file without checkpoints of its own).

A workdir source is read with ``checkpoints.load_variables``; only a torch checkpoint file imports
the torch/timm mappings of ``smoothing_jax.convert``.
"""
from __future__ import annotations

import numpy as np
from absl import logging

from smoothing_jax.experiment import checkpoints
from smoothing_jax.experiment.spec import ModelSpec, build_model, model_overrides
from smoothing_jax.experiment.workdir import workdir_path
from smoothing_jax.variables import classifier_paths, transfer_variables


def is_workdir(init_from: str) -> bool:
  """Whether ``init_from`` is a workdir (else a torch checkpoint file); FileNotFoundError when it
  is neither."""
  path = workdir_path(init_from)
  if not path.exists():
    raise FileNotFoundError(f"config.init_from {init_from!r}: no such workdir or torch checkpoint "
                            "file.")
  return path.is_dir()


def model_options(config) -> dict:
  """The model options that ``config.init_from`` needs and ``config.model_kwargs`` leaves unset:
  ``convert.TIMM_LAYOUTS[config.model]`` for a timm checkpoint file, else none (recorded as
  ``ModelSpec.model_options``, so every later load builds the same model)."""
  source = config.get("init_from")
  if not source or is_workdir(source):
    return {}
  from smoothing_jax import convert  # torch checkpoint files only
  if not convert.is_timm_state_dict(convert.read_torch_checkpoint(source)):
    return {}
  layout = convert.TIMM_LAYOUTS.get(config.model, {})
  return {k: v for k, v in layout.items() if config.model_kwargs.get(k) is None}


def variables(config, spec: ModelSpec, target, mesh, *, new_classifier: bool = False) -> dict:
  """The variables ``config.init_from`` holds for ``build_model(config, spec)``: the latest
  checkpoint of a workdir, or a torch checkpoint file (``convert.load_torch_checkpoint``: SS / HV
  CNNs, HV's timm ViT / PiT / Swin).

  Args:
    config, spec: the run's (``spec.image_shape`` sizes a ViT's position embedding).
    target: the model's variables (a fresh initialisation) or their ``jax.eval_shape``.
    mesh: where a workdir's checkpoint is restored (replicated).
    new_classifier: fine-tuning to another class count: where the output layer's shape differs
      (e.g. CIFAR-100 → CIFAR-10), keep ``target``'s (logged).

  Raises:
    FileNotFoundError: no such workdir or file, or a workdir without a checkpoint.
    ValueError: naming every variable that is missing, unexpected or of another shape.
  """
  source = config.init_from
  if is_workdir(source):
    step, loaded = checkpoints.load_variables(source, mesh)
    logging.info("init_from: step %d of %s", step, source)
  else:
    from smoothing_jax import convert  # torch checkpoint files only
    loaded = convert.load_torch_checkpoint(source, config.model, image_shape=spec.image_shape,
                                           **model_overrides(config, spec))
  classifier = set(classifier_paths(build_model(config, spec), spec.image_shape))
  result, kept = transfer_variables(
      target, loaded,
      keep_fresh=lambda path, new, old: new_classifier and path in classifier and old is not None
      and np.shape(old) != new.shape,
      title=f"config.init_from {source!r} does not match {config.model!r} "
      f"(num_classes={spec.num_classes})")
  if kept:
    logging.warning("init_from %s has another class count: re-initialised %s", source,
                    ", ".join(kept))
  return result
