"""Load checkpoints trained with the PyTorch reference implementations (SS, HV) and with timm.

``from_torch_state_dict("resnet_dnn_18", {k: v.numpy() for k, v in torch.load(p).items()})``
returns Flax variables ``{"params": ..., "batch_stats": ...}``.  Our submodule
names mirror the reference ``state_dict`` keys (``layer1_0/conv1`` ↔
``layer1.0.conv1``), so the mapping is by name: conv kernels OIHW → HWIO, dense
weights transposed, BatchNorm ``weight/bias/running_mean/running_var`` →
``scale/bias`` (params) and ``mean/var`` (batch_stats).  torch is not needed.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from smoothing_jax.layers import blur_kernel
from smoothing_jax.models import get_model

_LEAF_NAMES = {
    ("params", "kernel"): "weight",
    ("params", "bias"): "bias",
    ("params", "scale"): "weight",
    ("batch_stats", "mean"): "running_mean",
    ("batch_stats", "var"): "running_var"
}
_BLUR_FILTER = re.compile(r"^smooth\d+\.\d+\.layer1\.filter$")


def torch_key(path) -> str:
  """Reference ``state_dict`` key of a Flax variable path ``(collection, module..., leaf)``."""
  collection, *modules, leaf = path
  return ".".join([re.sub(r"_(\d+)$", r".\1", m) for m in modules] +
                  [_LEAF_NAMES[(collection, leaf)]])


def _to_flax(array: np.ndarray, leaf: str) -> np.ndarray:
  if leaf == "kernel" and array.ndim == 4:
    return np.transpose(array, (2, 3, 1, 0))  # OIHW -> HWIO
  if leaf == "kernel" and array.ndim == 2:
    return array.T  # (out, in) -> (in, out)
  return array


def _abstract_variables(model):
  size = 224 if model.stem == "imagenet" else 32
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(0)}
  return jax.eval_shape(lambda: model.init(rngs, jnp.zeros((1, size, size, 3), jnp.float32)))


def _infer_num_classes(model_name, state_dict, overrides) -> int:
  one, two = (traverse_util.flatten_dict(
      dict(_abstract_variables(get_model(model_name, n, **overrides)))) for n in (1, 2))
  # The output layer's bias is the only bias whose shape follows num_classes.
  (output_bias,) = [p for p in one if p[-1] == "bias" and one[p].shape != two[p].shape]
  key = torch_key(output_bias)
  if key not in state_dict:
    raise ValueError(
        f"Cannot infer num_classes: classifier key {key!r} is missing from the state_dict.")
  return int(np.shape(state_dict[key])[0])


def from_torch_state_dict(model_name: str, state_dict: Mapping[str, np.ndarray], *,
                          num_classes: Optional[int] = None, **overrides) -> dict:
  """Map a reference ``state_dict`` (names → numpy arrays) onto ``get_model(model_name)``
  variables.

  Args:
    model_name: registry name, e.g. ``"resnet_dnn_18"``.
    state_dict: mapping of reference parameter/buffer names to arrays.
    num_classes: inferred from the classifier bias when omitted.
    **overrides: model options, e.g. ``stem="imagenet"`` for ImageNet checkpoints.

  Raises:
    ValueError: naming every missing key, unexpected key and shape mismatch.
  """
  state_dict = {k: np.asarray(v) for k, v in state_dict.items()}
  if num_classes is None:
    num_classes = _infer_num_classes(model_name, state_dict, overrides)
  model = get_model(model_name, num_classes, **overrides)
  flat = traverse_util.flatten_dict(dict(_abstract_variables(model)))

  converted, missing, mismatched = {}, [], []
  for path, abstract in flat.items():
    key = torch_key(path)
    if key not in state_dict:
      missing.append(key)
      continue
    value = _to_flax(state_dict[key], path[-1])
    if value.shape != abstract.shape:
      mismatched.append(
          f"{key}: reference {state_dict[key].shape} -> {value.shape}, expected {abstract.shape}")
      continue
    converted[path] = jnp.asarray(value, abstract.dtype)

  used = {torch_key(p) for p in flat}
  unexpected = []
  for key, value in state_dict.items():
    if key in used or key.endswith("num_batches_tracked"):
      continue
    if _BLUR_FILTER.match(key) and model.smoothing:
      expected = blur_kernel(model.blur_size)
      if value.ndim != 4 or value.shape[-2:] != expected.shape or not np.allclose(
          value[:, 0], expected):
        mismatched.append(f"{key}: blur filter does not match blur_size={model.blur_size}")
      continue
    unexpected.append(key)

  _raise_on_mismatch(f"state_dict does not match {model_name!r} (num_classes={num_classes})",
                     missing, unexpected, mismatched)
  return traverse_util.unflatten_dict(converted)


def _raise_on_mismatch(title: str, missing, unexpected, mismatched) -> None:
  """ValueError listing the missing keys, unexpected keys and shape mismatches, if any."""
  if missing or unexpected or mismatched:
    lines = [f"{title}:"]
    for heading, items in (("missing keys", missing), ("unexpected keys", unexpected),
                           ("shape mismatches", mismatched)):
      if items:
        lines.append(f"  {heading} ({len(items)}): " + ", ".join(items[:20]) +
                     (" ..." if len(items) > 20 else ""))
    raise ValueError("\n".join(lines))


def to_torch_state_dict(variables) -> dict:
  """Inverse mapping: Flax variables → reference ``state_dict`` of numpy arrays."""
  out = {}
  for path, value in traverse_util.flatten_dict(dict(variables)).items():
    value = np.asarray(value)
    if path[-1] == "kernel" and value.ndim == 4:
      value = np.transpose(value, (3, 2, 0, 1))
    elif path[-1] == "kernel" and value.ndim == 2:
      value = value.T
    out[torch_key(path)] = value
  return out


# ---------------------------------------------------------------------------------------------
# timm state dicts (HV's released ViT / PiT / Swin CIFAR-100 checkpoints are timm models).
#
# Each family maps one of our flattened variable paths ``(collection, module..., leaf)`` to the
# timm key it comes from and the function that turns that array into ours:
# ``key_fn(path) -> (timm_key, to_flax)``.  ``from_timm_state_dict`` checks the whole mapping
# (missing, unexpected, mismatched keys) in one place.

TimmKeyFn = Callable[[tuple], tuple]

# Model class -> key function; filled in below by each family's section.
_TIMM_KEYS: dict = {}
# Model class -> regular expressions of timm buffers that carry no parameters (e.g. Swin's
# ``relative_position_index``, ``attn_mask``): ignored when checking for unexpected keys.
_TIMM_BUFFERS: dict = {}
# Registry name -> ``get_model`` overrides that reproduce the timm constructor of HV's released
# CIFAR-100 checkpoint (HV README), e.g. ``TIMM_LAYOUTS["vit_ti"]``.
TIMM_LAYOUTS: dict = {}


def from_timm_state_dict(model_name: str, state_dict: Mapping[str, np.ndarray], *,
                         num_classes: Optional[int] = None, **overrides) -> dict:
  """Map a timm ``state_dict`` (names → numpy arrays) onto ``get_model(model_name)`` variables.

  Args:
    model_name: registry name of a family timm also has (``vit_*``, ``pit_*``, ``swin_*``).
    state_dict: timm parameter/buffer names → arrays (``{k: v.numpy() for k, v in sd.items()}``).
    num_classes: inferred from ``head.weight`` when omitted.
    **overrides: model options; ``TIMM_LAYOUTS[model_name]`` (the layout of HV's checkpoints) is
      applied first.

  Raises:
    ValueError: a family without a timm mapping, or naming every missing key, unexpected key
      and shape mismatch.
  """
  state_dict = {k: np.asarray(v) for k, v in state_dict.items()}
  overrides = {**TIMM_LAYOUTS.get(model_name, {}), **overrides}
  if num_classes is None:
    if "head.weight" not in state_dict:
      raise ValueError("Cannot infer num_classes: 'head.weight' is missing from the state_dict.")
    num_classes = int(state_dict["head.weight"].shape[0])
  model = get_model(model_name, num_classes, **overrides)
  key_fn = _TIMM_KEYS.get(type(model))
  if key_fn is None:
    raise ValueError(f"No timm mapping for {model_name!r} ({type(model).__name__}); timm "
                     f"checkpoints load into {sorted(c.__name__ for c in _TIMM_KEYS)} models.")
  flat = traverse_util.flatten_dict(dict(_abstract_variables(model)))
  converted, missing, mismatched, used = {}, [], [], set()
  for path, abstract in flat.items():
    key, to_flax = key_fn(path)
    used.add(key)
    if key not in state_dict:
      missing.append(key)
      continue
    value = np.asarray(to_flax(state_dict[key]))
    if value.shape != abstract.shape:
      mismatched.append(
          f"{key}: timm {state_dict[key].shape} -> {value.shape}, expected {abstract.shape}")
      continue
    converted[path] = jnp.asarray(value, abstract.dtype)
  buffers = [re.compile(b) for b in _TIMM_BUFFERS.get(type(model), ())]
  unexpected = [k for k in state_dict
                if k not in used and not any(b.search(k) for b in buffers)]
  _raise_on_mismatch(f"timm state_dict does not match {model_name!r} "
                     f"(num_classes={num_classes}, options={overrides})",
                     missing, unexpected, mismatched)
  return traverse_util.unflatten_dict(converted)
