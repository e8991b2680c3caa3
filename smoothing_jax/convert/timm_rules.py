"""The rules that name the timm key of each of our variables (HV's released ViT / PiT / Swin
CIFAR-100 checkpoints are timm models; ``timm_families`` holds each family's table).

A family's table of ``TimmRule``s names the timm key of each of our flattened variable paths, and
how that array becomes ours; ``timm_families.from_timm_state_dict`` checks the whole mapping
(missing, unexpected, mismatched keys) in ``reference.convert_and_check``.  A rule's ``to_flax``
may leave axes fused that ours split (timm's heads axis h·d): ``_split_fused_axes`` splits them by
our shape.

Key names are timm 1.0.31's.  HV's notebooks pin timm 0.5.4, whose Swin and PiT name some keys
otherwise (``tests/fixtures/timm_0_5_4_keys.json``): a state_dict with a key only that layout has
is renamed to 1.0.31's first (``TimmFamily.old_keys``, ``renames``).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from smoothing_jax.convert.reference import LEAF_NAMES, reference_axes


class TimmRule(NamedTuple):
  """Our variables whose "/"-joined path (without the collection) ``ours`` (a regular expression)
  matches whole come from timm's ``timm`` key; or, where it matches all but the leaf (kernel,
  bias, scale), from ``timm`` + ``.weight`` / ``.bias``.  ``timm`` is formatted with the named
  groups of ``ours``, ``stage`` counted from 0 (ours from 1)."""
  ours: str
  timm: str
  to_flax: Callable | None = None  # timm's array → ours; default: as a reference array's


class TimmFamily(NamedTuple):
  """timm's names of one of our model classes."""
  rules: tuple                    # ``TimmRule``s; the first that matches a path names it
  buffers: str | None = None   # timm buffers that carry no parameters (a regular expression)
  old_keys: str | None = None  # keys only timm 0.5.4's layout has (a regular expression)
  renames: tuple = ()             # ``re.sub`` (pattern, replacement)s: timm 0.5.4 key → 1.0.31's

  def buffer(self, key: str, _) -> str | None:
    """The mismatch an unread ``key`` shows: "" (none) where it is a buffer, None where it is
    unexpected."""
    return "" if self.buffers and re.search(self.buffers, key) else None

  def new_key(self, key: str) -> str:
    """timm 1.0.31's name of a timm 0.5.4 key."""
    return functools.reduce(lambda k, rename: re.sub(*rename, k), self.renames, key)


# timm's transformer blocks (ViT and PiT ``Block``, ``SwinTransformerBlock``): the module of our
# unit (``<block>_msa``, ``<block>_mlp``) → timm's within the block.
_TIMM_BLOCK_KEYS = {
    "msa/norm": "norm1",
    "msa/attention/qkv": "attn.qkv",
    "msa/attention/out": "attn.proj",
    "mlp/norm": "norm2",
    "mlp/fc1": "mlp.fc1",
    "mlp/fc2": "mlp.fc2",
}


def block_rules(ours: str, timm: str) -> list:
  """The rules of the transformer blocks ``ours`` (a pattern of our block's name, e.g.
  ``block(?P<block>\\d+)``) whose timm key is ``timm`` (e.g. ``blocks.{block}``)."""
  return [TimmRule(f"{ours}_{unit}", f"{timm}.{key}") for unit, key in _TIMM_BLOCK_KEYS.items()]


def next_stage(stages: str, module: str) -> tuple:
  """The rename of ``<stages>.<i>.<module>.`` to stage i + 1: timm 0.5.4 downsamples at the end
  of a stage (``layers.0.downsample``), timm 1.0.31 at the start of the next (``layers.1``)."""
  return (rf"^{stages}\.(\d+)\.{module}\.",
          lambda m: f"{stages}.{int(m.group(1)) + 1}.{module}.")


def _split_fused_axes(value: np.ndarray, shape: tuple) -> np.ndarray:
  """``value`` reshaped to ``shape`` where ``shape`` only splits axes of ``value`` (e.g. timm's
  fused heads axis h·d into our (h, d): a rule need not know h); else ``value``."""
  groups, dims = [], list(shape)
  for size in value.shape:
    product = 1
    while dims and product < size:
      product *= dims.pop(0)
    groups.append(product)
  return value.reshape(shape) if groups == list(value.shape) and not dims else value


def timm_key(rules: tuple, path) -> tuple:
  """(timm key, (timm array, our shape) → ours) of one of our variable paths, by the first of
  ``rules`` that matches it."""
  name = "/".join(path[1:])
  for rule in rules:
    match = re.fullmatch(rf"(?:{rule.ours})(?:/(?P<leaf>kernel|bias|scale))?", name)
    if match is None:
      continue
    fields = {k: int(v) - 1 if k == "stage" else v for k, v in match.groupdict().items()}
    key = rule.timm.format(**fields)
    if fields["leaf"] is not None:
      key += "." + LEAF_NAMES[(path[0], fields["leaf"])]
    to_flax = rule.to_flax or functools.partial(reference_axes, leaf=path[-1])
    return key, functools.partial(_to_ours, to_flax)
  raise ValueError(f"No timm key for our variable {'/'.join(path)}.")


def _to_ours(to_flax, array, shape):
  """``to_flax(array)`` with its fused axes split to our ``shape``."""
  return _split_fused_axes(np.asarray(to_flax(array)), shape)
