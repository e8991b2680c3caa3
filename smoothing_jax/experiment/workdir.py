"""A run's directory and its files (the run layer's I/O)::

  <workdir>/config.json            the run's config, plus ``model_spec`` (``spec.ModelSpec``:
                                   classes, stem, image shape): the model without the dataset
  <workdir>/checkpoints/<step>/    orbax checkpoints of the train state (``checkpoints``)
  <workdir>/results/               evaluators' tables and figures

A workdir is any path ``etils.epath`` opens: a local folder or ``gs://bucket/run``.
Every file under it is written through :func:`write_atomically` / :func:`save_figure`
(a temporary file renamed over the target), never through ``open``/``os.path``.
"""
from __future__ import annotations

import io
import json
import os
import re
import uuid

import jax
import ml_collections
from etils import epath

from smoothing_jax import methods
from smoothing_jax.experiment.config import MOVED_KEYS, flat
from smoothing_jax.experiment.config_base import blocks_of_others, chosen_method
from smoothing_jax.experiment.spec import ModelSpec

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"


def is_uri(workdir) -> bool:
  """``gs://bucket/run`` and other ``scheme://`` paths (object stores), not local paths."""
  return bool(re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(workdir)))


def workdir_path(workdir) -> epath.Path:
  """``workdir`` as an ``epath.Path``: URIs (``gs://bucket/run``) as given, local paths made
  absolute (orbax needs absolute paths)."""
  path = epath.Path(workdir)
  return path if is_uri(workdir) else path.absolute()


def check_directories(*workdirs) -> None:
  """NotADirectoryError (one line) naming the first of ``workdirs`` that is a file: a workdir is
  a directory, new or holding a run (checked before anything creates the lock beneath it)."""
  for workdir in workdirs:
    path = workdir_path(workdir)
    if path.exists() and not path.is_dir():
      raise NotADirectoryError(f"Workdir {workdir} is a file, not a directory: give a new "
                               "directory or one that holds a run.")


def write_atomically(path, data) -> None:
  """Write ``data`` (str or bytes) to a temporary file beside ``path``, then rename it over
  ``path``: readers see the old file or the new one, never half of one, and two processes
  writing the same file (two evaluators) each replace it whole.  Creates the parent folder."""
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
  if isinstance(data, bytes):
    tmp.write_bytes(data)
  else:
    tmp.write_text(data)
  tmp.replace(path)


def write_json(path, obj, indent: int = 2) -> None:
  """``obj`` as JSON at ``path`` (:func:`write_atomically`)."""
  write_atomically(path, json.dumps(obj, indent=indent))


def save_figure(fig, path, **savefig_kwargs) -> None:
  """A matplotlib figure at ``path`` (format from the suffix; :func:`write_atomically`)."""
  path = epath.Path(path)
  buffer = io.BytesIO()
  fig.savefig(buffer, format=path.suffix.lstrip(".") or "png", **savefig_kwargs)
  write_atomically(path, buffer.getvalue())


def checkpoint_dir(workdir) -> epath.Path:
  """``<workdir>/checkpoints`` (:func:`workdir_path`)."""
  return workdir_path(workdir) / CHECKPOINTS


def write_config(workdir, config: ml_collections.ConfigDict, model_spec: ModelSpec):
  """Record ``config`` and the ``model_spec`` in ``<workdir>/config.json`` (written atomically)."""
  record = json.loads(config.to_json_best_effort())
  record["model_spec"] = model_spec.to_record()
  write_json(workdir_path(workdir) / CONFIG_FILE, record)


def record_run(workdir, config: ml_collections.ConfigDict, model_spec: ModelSpec):
  """:func:`write_config` by process 0; every process returns once the file is written."""
  if jax.process_index() == 0:
    write_config(workdir, config, model_spec)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("record_run")


def read_record(workdir) -> dict:
  """The JSON of ``<workdir>/config.json``; FileNotFoundError naming the workdir without one,
  ValueError naming a damaged one."""
  path = workdir_path(workdir) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(f"No run in {workdir}: {path} does not exist (train into it first).")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:  # a truncated or overwritten file: name it, not the parser
    raise ValueError(f"{path} is damaged (not valid JSON: {e}): restore it from a copy, or "
                     "remove it and rerun the training command, which resumes from the "
                     "checkpoints and records it again.") from None


def upgrade_record(record: dict) -> dict:
  """A ``config.json`` record of 0.1.0 in today's layout: ``evals`` as a list of names becomes
  ``{name: {}}`` (every option at its default), ``ood_datasets`` the ``ood`` evaluator's
  ``datasets``, each of ``config.MOVED_KEYS`` moves to its new place, and a deep ensemble
  recorded without ``member_seeds`` (trained when member m was the run of ``seed + m``) records
  those; a record without ``method`` (every one before it was a key) gets ``method`` None, and
  keeps the settings block of its model's method alone; a composing method's block
  (``methods.COMPOSED``) missing is added at its defaults.  Today's records come back equal."""
  record = json.loads(json.dumps(record))
  if isinstance(record.get("evals"), list):
    record["evals"] = {name: {} for name in record["evals"]}
  datasets = record.pop("ood_datasets", None)
  if datasets:
    record["evals"].setdefault("ood", {}).setdefault("datasets", datasets)
  for old, new in MOVED_KEYS.items():
    if old in record:
      *parents, leaf = new.split(".")
      node = record
      for name in parents:
        node = node.setdefault(name, {})
      node.setdefault(leaf, record.pop(old))
  # The blocks of the methods that compose with any (test-time augmentation's came later):
  # at their defaults where not recorded.
  for name, method in methods.COMPOSED.items():
    record.setdefault(name, json.loads(json.dumps(dict(method.settings))))
  ensemble = record.get("deep_ensemble", {})
  if ensemble.get("members", 1) > 1 and "member_seeds" not in ensemble:
    ensemble["member_seeds"] = [record["seed"] + m for m in range(ensemble["members"])]
  # Recorded before ``method`` was a key, every method's settings block was in every config:
  # the method is the model's, and the others' blocks go.
  if "method" not in record:
    record["method"] = None
    chosen = chosen_method(record.get("model"), record.get("model_kwargs"), None)
    for name in blocks_of_others(chosen) if chosen else ():  # unknown: every block kept
      record.pop(name, None)
  return record


def config_differences(workdir, config: ml_collections.ConfigDict) -> list[str]:
  """``"<key>: <recorded> → <given>"`` for every setting in which ``config`` differs from the
  one recorded in ``<workdir>/config.json`` (:func:`upgrade_record`), in key order; empty where
  they agree or nothing is recorded."""
  if not (workdir_path(workdir) / CONFIG_FILE).exists():
    return []
  record = upgrade_record(read_record(workdir))
  record.pop("model_spec", None)
  recorded = flat(record)
  given = flat(json.loads(config.to_json_best_effort()))
  # A key the record lacks (an option added since) differs only where it is given a value.
  for key in set(given) - set(recorded):
    if given[key] is None:
      recorded[key] = None
  unset = "(unset)"
  return [f"{key}: {recorded.get(key, unset)} → {given.get(key, unset)}"
          for key in sorted(set(recorded) | set(given))
          if recorded.get(key, unset) != given.get(key, unset)]


def read_config(workdir) -> tuple:
  """``(config, ModelSpec)`` recorded in ``<workdir>/config.json`` (:func:`upgrade_record`)."""
  record = upgrade_record(read_record(workdir))
  spec = record.pop("model_spec", None)
  if spec is None:
    raise ValueError(f"{workdir_path(workdir) / CONFIG_FILE} has no model_spec (written by an "
                     "older version); rerun the training command once to record it (it resumes "
                     "from the last checkpoint).")
  return ml_collections.ConfigDict(record), ModelSpec.from_record(spec)
