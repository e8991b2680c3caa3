"""Pure functions the parameterised conv / dense layers share (node noise, mean-field weights,
BatchEnsemble): the PyTorch-padded convolution and the search for a kind of layer in a
parameter tree."""
from __future__ import annotations

import functools

import flax
import jax


def conv2d(x, kernel, stride: int = 1, padding: int = 0, groups: int = 1, dtype=None):
  """``nn.Conv2d``'s cross-correlation of ``x [B,H,W,C_in]`` with ``kernel [k,k,C_in/groups,
  C_out]``: symmetric zero padding, computed in ``dtype`` (None: the inputs').

  ``groups`` > 1 is a grouped convolution (``feature_group_count``); on XLA:CPU it is computed as
  ``groups`` convolutions over the channel blocks, the same sums: there XLA's grouped
  convolution took 17–60× as long forward and backward as those convolutions (3×3, batch 128,
  4–8 groups of 8–16 channels), longer than the dense convolution of all the channels."""
  if dtype is not None:
    x, kernel = x.astype(dtype), kernel.astype(dtype)
  convolve = functools.partial(jax.lax.conv_general_dilated, window_strides=(stride, stride),
                               padding=((padding, padding), (padding, padding)),
                               dimension_numbers=("NHWC", "HWIO", "NHWC"))
  if groups == 1 or jax.default_backend() != "cpu":
    return convolve(x, kernel, feature_group_count=groups)
  return jax.numpy.concatenate([convolve(a, k) for a, k in zip(
      jax.numpy.split(x, groups, axis=-1), jax.numpy.split(kernel, groups, axis=-1),
      strict=True)], axis=-1)


def layers_holding(params, name: str) -> list:
  """The parameter dicts that hold a parameter ``name`` (e.g. ``"z_mean"``: the node-noise
  layers; ``"kernel_rho"``: the mean-field ones), in order."""
  found = []

  def visit(tree):
    if isinstance(tree, (dict, flax.core.FrozenDict)):
      if name in tree:
        found.append(tree)
      for value in tree.values():
        visit(value)
  visit(params)
  return found


def in_layers_holding(params, name: str, keys) -> dict:
  """A boolean tree like ``params``: True for the parameters named in ``keys`` of every layer that
  holds a parameter ``name`` (an optax mask, e.g. a BatchEnsemble's fast weights)."""
  layers = set()
  jax.tree_util.tree_map_with_path(
      lambda path, _: layers.add(path[:-1]) if path[-1].key == name else None, params)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: path[:-1] in layers and path[-1].key in keys, params)
