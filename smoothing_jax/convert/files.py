"""Torch checkpoint files: ``torch.save`` output of the reference code (SS ``{"name",
"state_dict"[, "optimizer"]}``, HV ``{"state_dict"}`` as released), a bare ``state_dict``, or one
saved from ``nn.DataParallel`` (keys prefixed ``module.``), in the reference (SS / HV CNN) or timm
layout.  Only reading a file needs torch."""
from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
from etils import epath

from smoothing_jax.convert.reference import from_torch_state_dict
from smoothing_jax.convert.timm_families import from_timm_state_dict

# HV's post-activation ResNet blocks (``resnet_{dnn,mcdo}_block``) wrap each conv with its BN
# (and ReLU) in an ``nn.Sequential``: ``layer1.0.conv1.0`` is SS's ``layer1.0.conv1`` and
# ``layer1.0.conv1.1`` SS's ``layer1.0.bn1``; every other key (``layer0``, ``shortcut``,
# ``classifier``) is named as SS's.
_HV_BLOCK_KEY = re.compile(r"^(layer\d+\.\d+\.)conv(\d+)\.([01])\.")


def read_torch_checkpoint(path) -> dict:
  """The ``state_dict`` (names → numpy arrays) of a torch checkpoint file (any layout of the
  module docstring).

  Read with ``torch.load(weights_only=True)``: tensors and containers only, no pickled code.

  Raises:
    FileNotFoundError: no such file.
    ValueError: naming the file: PyTorch not installed, not a torch file (or one holding other
      Python objects), or no state_dict in it.
  """
  path = str(path)
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"Reading the torch checkpoint {path} needs PyTorch (pip install "
                     "-r requirements-test.txt, or pip install .[torch]).") from None
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"No torch checkpoint file {path}.")
  try:
    with epath.Path(path).open("rb") as f:
      checkpoint = torch.load(f, map_location="cpu", weights_only=True)
  except Exception as error:  # noqa: BLE001  (torch raises many kinds; all mean "cannot read")
    raise ValueError(f"{path} is not a torch checkpoint that torch.load(weights_only=True) reads "
                     f"({type(error).__name__}: {str(error).splitlines()[0][:300]}).") from None
  state_dict = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
  if not isinstance(state_dict, dict) or not state_dict or not all(
      isinstance(v, torch.Tensor) for v in state_dict.values()):
    found = sorted(checkpoint)[:10] if isinstance(checkpoint, dict) else type(checkpoint).__name__
    raise ValueError(f"{path} holds no state_dict (a dict of tensors, bare or under "
                     f"'state_dict'); found {found}.")
  if all(k.startswith("module.") for k in state_dict):
    state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
  return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in state_dict.items()}


def is_timm_state_dict(state_dict: Mapping[str, np.ndarray]) -> bool:
  """Whether a state_dict has timm's layout (its ViT, PiT and Swin, in timm 0.5.4 as in 1.0.31,
  all have ``patch_embed``)."""
  return any(k.startswith("patch_embed.") for k in state_dict)


def reference_keys(state_dict: Mapping[str, np.ndarray]) -> dict:
  """``state_dict`` with HV's ResNet block keys (``layer1.0.conv1.0.weight``,
  ``layer1.0.conv1.1.running_var``) renamed to SS's (``layer1.0.conv1.weight``,
  ``layer1.0.bn1.running_var``), which ``from_torch_state_dict`` reads; other keys as they are."""
  def rename(key):
    return _HV_BLOCK_KEY.sub(
        lambda m: f"{m.group(1)}{'conv' if m.group(3) == '0' else 'bn'}{m.group(2)}.", key)
  return {rename(k): v for k, v in state_dict.items()}


def load_torch_checkpoint(path, model_name: str, *, num_classes: int | None = None,
                          image_shape: tuple | None = None, **overrides) -> dict:
  """Flax variables of ``get_model(model_name)`` from a torch checkpoint file: timm layouts
  through :func:`from_timm_state_dict` (``TIMM_LAYOUTS[model_name]`` first), SS / HV CNN layouts
  through :func:`from_torch_state_dict` (:func:`reference_keys`).

  Args:
    path: a ``torch.save`` file (:func:`read_torch_checkpoint`), e.g. HV's released
      ``vit_ti_cifar100_9857b21357.pth.tar``.
    model_name: registry name, e.g. ``"vit_ti"``, ``"resnet_dnn_50"`` (HV's ``resnet_50``).
    num_classes: inferred from the classifier when omitted.
    image_shape: (H, W, 3) of the checkpoint's images (default: the stem's; a timm ViT's
      position embedding follows it).
    **overrides: model options.

  Raises:
    FileNotFoundError, ValueError: naming the file and the problem (every key that does not
      match).
  """
  state_dict = read_torch_checkpoint(path)
  try:
    if is_timm_state_dict(state_dict):
      return from_timm_state_dict(model_name, state_dict, num_classes=num_classes,
                                  image_shape=image_shape, **overrides)
    return from_torch_state_dict(model_name, reference_keys(state_dict), num_classes=num_classes,
                                 **overrides)
  except ValueError as error:
    raise ValueError(f"{path}: {error}") from None
