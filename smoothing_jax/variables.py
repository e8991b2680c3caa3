"""A model's variables without computing them, and variables carried over from another model.

``abstract_variables(model, image_shape)`` is what ``model.init`` returns, as shapes and dtypes
(``jax.eval_shape``): the target that checkpoints and conversions fill; ``classifier_paths``
those of its variables whose shape follows the class count.
``transfer_variables(target, source)`` fills it from variables of the same architecture (a run's
checkpoint, a converted torch checkpoint, a deterministic run under an iBNN), naming every path
that does not match (:func:`raise_on_mismatch`).
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from smoothing_jax.passes import sample_rngs


def abstract_variables(model, image_shape: tuple | None = None):
  """``jax.eval_shape`` of ``model.init`` on one image of ``image_shape`` (H, W, C; default: the
  stem's, 32×32 or 224×224 RGB): every variable's shape and dtype, nothing computed (a ViT's
  position embedding follows the image size).

  Initialised with every RNG stream a stochastic pass uses (:func:`sample_rngs`: MC dropout,
  iBNN noise), so any registered model initialises.
  """
  if image_shape is None:
    size = 224 if model.stem == "imagenet" else 32
    image_shape = (size, size, 3)
  key = jax.random.key(0)
  images = jnp.zeros((1,) + tuple(image_shape), jnp.float32)
  return jax.eval_shape(lambda: model.init({"params": key, **sample_rngs(key)}, images))


def classifier_paths(model, image_shape: tuple | None = None) -> list:
  """Flattened variable paths ``(collection, module..., leaf)`` whose shape follows
  ``model.num_classes`` (the output layer's), on images of ``image_shape`` (default: the
  stem's)."""
  one, two = (traverse_util.flatten_dict(
      dict(abstract_variables(model.clone(num_classes=n), image_shape))) for n in (1, 2))
  return [p for p in one if one[p].shape != two[p].shape]


def raise_on_mismatch(title: str, missing, unexpected, mismatched) -> None:
  """ValueError listing the missing keys, unexpected keys and shape mismatches, if any (the first
  20 of each).

  Args:
    title: the first line, e.g. what did not match what.
    missing, unexpected, mismatched: lists of strings (keys, or a key with its shapes).
  """
  if missing or unexpected or mismatched:
    lines = [f"{title}:"]
    for heading, items in (("missing keys", missing), ("unexpected keys", unexpected),
                           ("shape mismatches", mismatched)):
      if items:
        lines.append(f"  {heading} ({len(items)}): " + ", ".join(items[:20]) +
                     (" ..." if len(items) > 20 else ""))
    raise ValueError("\n".join(lines))


def transfer_variables(target, source, *, keep_fresh: Callable | None = None,
                       title: str = "variables do not match the model") -> tuple:
  """``target`` with every leaf replaced by the leaf of ``source`` at the same path (cast to the
  target's dtype), except the leaves ``keep_fresh(path, target_leaf, source_leaf)`` selects
  (``source_leaf`` None where ``source`` lacks the path).

  Args:
    target: the variables (or their :func:`abstract_variables`) of the model to start, e.g. a
      fresh initialisation.
    source: variables of the same architecture, e.g. a checkpoint's.
    keep_fresh: e.g. the output layer when fine-tuning to another class count, iBNN's
      variational parameters when starting from a deterministic run.
    title: the first line of the error.

  Returns:
    ``(variables, kept)``: the merged variables and the sorted "/"-joined paths kept from
    ``target``.

  Raises:
    ValueError: naming every other path missing from ``source``, only in ``source``, or whose
      shape differs.
  """
  flat_target = traverse_util.flatten_dict(dict(target))
  flat_source = traverse_util.flatten_dict(dict(source))
  merged, kept, missing, mismatched = {}, [], [], []
  for path, leaf in flat_target.items():
    value = flat_source.get(path)
    name = "/".join(path)
    if keep_fresh is not None and keep_fresh(path, leaf, value):
      merged[path] = leaf
      kept.append(name)
    elif value is None:
      missing.append(name)
    elif np.shape(value) != leaf.shape:
      mismatched.append(f"{name}: {np.shape(value)}, expected {leaf.shape}")
    else:
      merged[path] = jnp.asarray(value, leaf.dtype)
  unexpected = ["/".join(p) for p in flat_source if p not in flat_target]
  raise_on_mismatch(title, missing, unexpected, mismatched)
  # Empty collections (a ViT's batch_stats) stay.
  return {**{k: {} for k in target}, **traverse_util.unflatten_dict(merged)}, sorted(kept)
