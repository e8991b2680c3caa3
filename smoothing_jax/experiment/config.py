"""Loading a config: one ``load("<file>.py[:<args>]", overrides)`` for the command line, notebooks,
benchmarks and tests.

A config file is a Python file with ``get_config(<args>)`` returning a locked
``ml_collections.ConfigDict`` (``configs/``; ``config_base.finalize``).  Overrides are dotted keys,
as ``--config.<key>=…`` on the command line: only keys the config has, with values of their type.
"""
from __future__ import annotations

import copy
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import ml_collections

# Keys of the configs that 0.1.0 (and main before the methods) had, and where today's config
# holds them (dotted): recorded config.json files are upgraded (``workdir.upgrade_record``), and
# an override of an old key names the new one (``check_key``).
MOVED_KEYS = {
    "dataset": "input.dataset",
    "data_dir": "input.data_dir",
    "download": "input.download",
    "data_pipeline": "input.data_pipeline",
    "batch_size": "input.batch_size",
    "crop_size": "input.crop_size",
    "randaugment": "input.randaugment",
    "train_fraction": "input.train_fraction",
    "holdout_fraction": "input.holdout_fraction",
    "data_split_seed": "input.split_seed",
    "eval_cache": "input.eval_cache",
    # (written at the top level until each method's settings had their block)
    "ensemble_members": "deep_ensemble.members",
    "ensemble_shared_batches": "deep_ensemble.shared_batches",
    "ensemble_vmap_size": "deep_ensemble.vmap_size",
}


def from_file(path: str, arg: str = "") -> ml_collections.ConfigDict:
  """``get_config(arg)`` of the config file at ``path`` (``get_config()`` when ``arg`` is
  empty; ``configs/`` is not a package, so the file is loaded by path)."""
  if not path.endswith(".py") or not os.path.isfile(path):
    raise ValueError(f"Config {path!r} is not a config file (a .py path relative to "
                     f"{os.getcwd()}, e.g. 'configs/quickstart.py').")
  module_spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def check_key(config: ml_collections.ConfigDict, key: str) -> None:
  """Raise ``KeyError`` naming the first unknown part of the dotted ``key`` and the keys that
  exist there, or the new name of a key that moved (:data:`MOVED_KEYS`)."""
  node = config
  path = key.split(".")
  for i, name in enumerate(path):
    if not hasattr(node, "keys") or name not in node.keys():
      if i == 0 and name in MOVED_KEYS:  # a key of older configs: its new name, not the list
        raise KeyError(f"unknown config key {key!r} (moved to "
                       f"{'.'.join([MOVED_KEYS[name], *path[1:]])!r})")
      known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(none)"
      raise KeyError(f"unknown config key {'.'.join(path[:i + 1])!r}; keys there: {known}")
    node = node[name]


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of ``config`` with ``overrides`` set: dotted keys as ``--config.<key>=…`` (e.g.
  ``{"model_kwargs.width": 8}``); only keys the config has, with values of their type."""
  config = copy.deepcopy(config)
  for key, value in overrides.items():
    try:
      check_key(config, key)
    except KeyError as error:
      raise ValueError(f"Override {key!r}: {error.args[0]}.") from None
    try:
      config.update_from_flattened_dict({key: value})
    except TypeError as error:
      raise ValueError(f"Override {key}={value!r}: {error}") from None
  return config


def flat(config) -> dict:
  """``{dotted key: value}`` of every leaf of ``config`` (a ConfigDict or dict), lists as tuples
  (a recorded ``config.json`` holds lists where a config file holds tuples)."""
  items = config.items() if hasattr(config, "items") else ()
  out = {}
  for key, value in items:
    if hasattr(value, "items"):
      out.update({f"{key}.{k}": v for k, v in flat(value).items()})
    else:
      out[key] = tuple(value) if isinstance(value, list) else value
  return out


def differences(base, other, skip=()) -> dict:
  """``{dotted key: value in other}`` of the leaves both configs hold whose values differ, but
  those under the dotted keys ``skip``."""
  base, other = flat(base), flat(other)
  return {key: value for key, value in other.items()
          if key in base and base[key] != value and
          not any(key == s or key.startswith(f"{s}.") for s in skip)}


def load(config: str | ml_collections.ConfigDict,
         overrides: Mapping[str, Any] | None = None) -> ml_collections.ConfigDict:
  """``config`` — ``"<file>.py[:<args>]"`` as ``--config=`` of ``smoothing_jax.main`` (the path
  relative to the current directory, e.g. ``"configs/cifar_resnet.py:resnet_mcdo_18,cifar10"``)
  or a ConfigDict — with ``overrides`` (:func:`with_overrides`)."""
  if isinstance(config, str):
    path, _, arg = config.partition(":")
    config = from_file(path, arg)
  return with_overrides(config, overrides or {})
