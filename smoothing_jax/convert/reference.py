"""PyTorch reference (SS, HV CNN) state dicts, and the convert-and-check loop of every layout.

``from_torch_state_dict("resnet_dnn_18", {k: v.numpy() for k, v in torch.load(p).items()})``
returns Flax variables ``{"params": ..., "batch_stats": ...}``.  Our submodule
names mirror the reference ``state_dict`` keys (``layer1_0/conv1`` ↔
``layer1.0.conv1``), so the mapping is by name: conv kernels OIHW → HWIO, dense
weights transposed, BatchNorm ``weight/bias/running_mean/running_var`` →
``scale/bias`` (params) and ``mean/var`` (batch_stats).  timm's keys are named by the rules of
``timm_rules``; both layouts are converted and checked by one loop (``convert_and_check``).
torch is not needed.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from smoothing_jax.layers import blur_kernel
from smoothing_jax.models import get_model
from smoothing_jax.variables import abstract_variables, classifier_paths, raise_on_mismatch

LEAF_NAMES = {
    ("params", "kernel"): "weight",
    ("params", "bias"): "bias",
    ("params", "scale"): "weight",
    ("batch_stats", "mean"): "running_mean",
    ("batch_stats", "var"): "running_var"
}
# Kernels by rank: the axes of the reference array in our order (conv OIHW → HWIO, dense
# (out, in) → (in, out)).
_KERNEL_AXES = {4: (2, 3, 1, 0), 2: (1, 0)}
_BLUR_FILTER = re.compile(r"^smooth\d+\.\d+\.layer1\.filter$")


def torch_key(path) -> str:
  """Reference ``state_dict`` key of a Flax variable path ``(collection, module..., leaf)``."""
  collection, *modules, leaf = path
  return ".".join([re.sub(r"_(\d+)$", r".\1", m) for m in modules] +
                  [LEAF_NAMES[(collection, leaf)]])


def reference_axes(array, leaf: str, inverse: bool = False) -> np.ndarray:
  """A reference array of our variable ``leaf`` in our axis order (``inverse``: ours in the
  reference's); only kernels differ (``_KERNEL_AXES``)."""
  axes = _KERNEL_AXES.get(np.ndim(array)) if leaf == "kernel" else None
  if axes is None:
    return np.asarray(array)
  return np.transpose(array, np.argsort(axes) if inverse else axes)


def convert_and_check(title: str, source: str, abstract, state_dict: Mapping[str, np.ndarray],
                      key_fn: Callable, buffer: Callable) -> dict:
  """Variables of the model whose :func:`abstract_variables` are ``abstract`` from
  ``state_dict``: each path ``(collection, module..., leaf)`` from the key that
  ``key_fn(path) -> (key, to_flax)`` names, ``to_flax(array, our shape)``.

  Args:
    title: the error's first line.
    source: the checkpoint's kind in shape mismatches ("reference", "timm").
    buffer: ``(key, array)`` of a key no path reads → None where it is unexpected, else (a
      buffer without parameters) the mismatch it shows, "" for none.

  Raises:
    ValueError: naming every missing key, unexpected key and shape mismatch.
  """
  converted, missing, mismatched, used = {}, [], [], set()
  for path, leaf in traverse_util.flatten_dict(dict(abstract)).items():
    key, to_flax = key_fn(path)
    used.add(key)
    if key not in state_dict:
      missing.append(key)
      continue
    value = to_flax(state_dict[key], leaf.shape)
    if value.shape != leaf.shape:
      mismatched.append(f"{key}: {source} {state_dict[key].shape} -> {value.shape}, "
                        f"expected {leaf.shape}")
      continue
    converted[path] = jnp.asarray(value, leaf.dtype)
  unexpected = []
  for key, value in state_dict.items():
    if key in used:
      continue
    problem = buffer(key, value)
    if problem is None:
      unexpected.append(key)
    elif problem:
      mismatched.append(problem)
  raise_on_mismatch(title, missing, unexpected, mismatched)
  return traverse_util.unflatten_dict(converted)


# ---------------------------------------------------------------------------------------------
# Reference state dicts (SS, HV CNNs): keys by ``torch_key``, kernels by ``_KERNEL_AXES``.

def _reference_key(path) -> tuple:
  """(reference key, (reference array, our shape) → ours) of one of our variable paths."""
  return torch_key(path), lambda array, _: reference_axes(array, path[-1])


def _reference_buffer(model, key: str, value: np.ndarray) -> str | None:
  """The mismatch an unread reference key shows ("" none), None where it is unexpected: BN's
  ``num_batches_tracked`` and the blur filters of spatial smoothing hold no parameters."""
  if key.endswith("num_batches_tracked"):
    return ""
  if not (_BLUR_FILTER.match(key) and model.smoothing):
    return None
  expected = blur_kernel(model.blur_size)
  matches = (value.ndim == 4 and value.shape[-2:] == expected.shape and
             np.allclose(value[:, 0], expected))
  return "" if matches else f"{key}: blur filter does not match blur_size={model.blur_size}"


def _infer_num_classes(model_name, state_dict, overrides) -> int:
  # The output layer's bias is the only bias whose shape follows num_classes.
  (output_bias,) = [p for p in classifier_paths(get_model(model_name, 1, **overrides))
                    if p[-1] == "bias"]
  key = torch_key(output_bias)
  if key not in state_dict:
    raise ValueError(
        f"Cannot infer num_classes: classifier key {key!r} is missing from the state_dict.")
  return int(np.shape(state_dict[key])[0])


def from_torch_state_dict(model_name: str, state_dict: Mapping[str, np.ndarray], *,
                          num_classes: int | None = None, **overrides) -> dict:
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
  return convert_and_check(
      f"state_dict does not match {model_name!r} (num_classes={num_classes})", "reference",
      abstract_variables(model), state_dict, _reference_key,
      functools.partial(_reference_buffer, model))


def to_torch_state_dict(variables) -> dict:
  """Inverse of :func:`from_torch_state_dict`: Flax variables → reference ``state_dict`` of numpy
  arrays (no ``num_batches_tracked``, no blur filters)."""
  return {torch_key(path): reference_axes(value, path[-1], inverse=True)
          for path, value in traverse_util.flatten_dict(dict(variables)).items()}
