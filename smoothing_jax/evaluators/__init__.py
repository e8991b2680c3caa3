"""Evaluators plugged in by name, with their options in ``config.evals`` (as big_vision's).

``config.evals`` maps each evaluator to run after training to its options, e.g.
``config.evals.ood = dict(datasets=("svhn_cropped",), sizes=(1, 10))``;
``--config.evals.<name>.<option>=…`` sets one from the command line and ``--mode=<name>`` runs
that evaluator, with those options, on a trained workdir.  Each evaluator is one module here with

* ``evaluate(run, output_dir, *, <options>) -> result``: computes on the ``run``
  (``smoothing_jax.experiment.run.Run``) through the shared sharded step
  (``parallel.sharded_eval_step``) and writes its table (JSON + CSV) and figure into
  ``output_dir``; its keyword-only parameters are its options, their defaults the defaults;
* ``summary(result, output_dir) -> str``: the lines the command line prints, after a first line
  naming the step and checkpoint scored (``run_evaluator``).

Every row of a table (and every JSON) records the ``step`` and ``checkpoint`` it scored
(``common.scored``): an evaluation that fell back from a damaged newest checkpoint to an older
step says so in its results, not only in the log.

A new evaluator is one file plus one line in ``REGISTRY``.  An option an evaluator does not take
is an error (``check_options``) before anything runs.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import numbers
import time
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import ml_collections
from absl import logging

REGISTRY = {  # name → module
    "ensemble_sizes": "smoothing_jax.evaluators.ensemble_sizes",
    "corruptions": "smoothing_jax.evaluators.corruptions",
    "streams": "smoothing_jax.evaluators.streams",
    "temporal": "smoothing_jax.evaluators.temporal_smoothing",
    "ood": "smoothing_jax.evaluators.ood",
    "calibration": "smoothing_jax.evaluators.calibration",
    "selective": "smoothing_jax.evaluators.selective",
    "conformal": "smoothing_jax.evaluators.conformal",
}
# Other names for evaluators, or for several run in turn.
ALIASES = {"evaluate": ("ensemble_sizes",), "uncertainty": ("ood", "calibration", "selective")}


def expand(name: str) -> tuple:
  """The evaluator names ``name`` stands for (itself, or an alias's)."""
  return ALIASES.get(name, (name,))


def get(name: str) -> ModuleType:
  """The evaluator module registered as ``name``; ValueError listing the names."""
  if name not in REGISTRY:
    aliases = ", ".join(f"{a} = {' + '.join(n)}" for a, n in ALIASES.items())
    raise ValueError(f"Unknown evaluator {name!r}; registered: {', '.join(REGISTRY)} (aliases: "
                     f"{aliases}).")
  return importlib.import_module(REGISTRY[name])


def default_options(name: str) -> dict:
  """``{option: default}`` of evaluator ``name``: its ``evaluate``'s keyword-only parameters."""
  parameters = inspect.signature(get(name).evaluate).parameters.values()
  return {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}


# Option values checked with the names, before anything runs (a run that trains first would
# otherwise train for nothing): what each shared option must be.
_COUNTS = ("num_frames", "num_images", "length", "batch_size")  # integers >= 1
_NON_NEGATIVE = ("seed", "num_samples", "max_shift")  # integers >= 0 (num_samples 0: default)


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bad_value(option: str, value) -> str | None:
  """What is wrong with ``value`` of a shared ``option`` (None: nothing, or not shared)."""
  if option == "sizes" and not (isinstance(value, (tuple, list))
                                and all(_is_int(n) and n >= 1 for n in value)):
    return "ensemble sizes N >= 1 (empty: config.ensemble_sizes)"
  if option in _COUNTS and not (_is_int(value) and value >= 1):
    return "an integer >= 1"
  if option in _NON_NEGATIVE and not (_is_int(value) and value >= 0):
    return "an integer >= 0"
  if option == "decay_rate" and not (isinstance(value, (int, float)) and 0 < value <= 1):
    return "a number in (0, 1]"
  return None


def check_options(name: str, options: Mapping[str, Any]) -> None:
  """ValueError (one line) naming the options ``name`` does not take, and those it takes; or
  naming an option whose value it cannot take (sizes, counts, seeds, rates)."""
  known = default_options(name)
  unknown = [key for key in options if key not in known]
  if unknown:
    raise ValueError(f"The {name} evaluator takes no option {', '.join(map(repr, unknown))}; "
                     f"its options (config.evals.{name}.<option>): {', '.join(known)}.")
  for option, value in options.items():
    wanted = _bad_value(option, value)
    if wanted:
      raise ValueError(f"config.evals.{name}.{option} must be {wanted}, got {value!r}.")
  own_checks = getattr(get(name), "check_option_values", None)  # an evaluator's own options
  if own_checks:
    own_checks(**{**known, **options})


def names_after_training(config) -> tuple:
  """The evaluators ``config.evals`` runs after training (a ConfigDict's keys: sorted)."""
  return tuple(config.get("evals", {}).keys())


def options_of(config, name: str) -> dict:
  """``config.evals.<name>`` as keyword arguments, checked (``check_options``); ``{}`` (every
  default) when the config has no entry."""
  entry = config.get("evals", {}).get(name)
  options = entry.to_dict() if isinstance(entry, ml_collections.ConfigDict) else dict(entry or {})
  check_options(name, options)
  return options


def declare_options(config: ml_collections.ConfigDict, names: Sequence[str] = ()
                    ) -> ml_collections.ConfigDict:
  """A copy of ``config`` whose ``evals`` entries (and one for each evaluator of ``names``,
  aliases expanded) hold every option, unset ones at their default, so that
  ``--config.evals.<name>.<option>=…`` can set any of them; unknown names and options fail
  (one line)."""
  evals = config.get("evals") or {}
  wanted = list(evals.keys()) + [n for alias in names for n in expand(alias) if n not in evals]
  declared = ml_collections.ConfigDict(
      {name: {**default_options(name), **options_of(config, name)} for name in wanted})
  config = copy.deepcopy(config)
  with config.unlocked():
    if "evals" in config:
      del config["evals"]
    config.evals = declared
  return config


def _scored_line(name: str, result, run) -> str:
  """``<name> of step <step> (<checkpoint>):``, from the step and checkpoint ``result`` records
  (its first row's, or its own keys), else the run's (an evaluator that records neither)."""
  record = result[0] if isinstance(result, list) and result else result
  if not (isinstance(record, Mapping) and "checkpoint" in record):
    record = {"step": run.step, "checkpoint": run.checkpoint}
  return f"{name} of step {record['step']} ({record['checkpoint']}):"


def run_evaluator(name: str, run, output_dir, options: Mapping[str, Any] = None):
  """``evaluate(run, output_dir, **options)`` of evaluator ``name`` (``options``: default
  ``run.config.evals.<name>``); returns ``(result, summary lines)``, the first line naming the
  step and checkpoint scored."""
  module = get(name)
  options = options_of(run.config, name) if options is None else dict(options)
  check_options(name, options)
  logging.info("Evaluator %s on %s", name, run.workdir)
  start = time.monotonic()
  result = module.evaluate(run, output_dir, **options)
  logging.info("Evaluator %s done in %.0f s.", name, time.monotonic() - start)
  return result, f"{_scored_line(name, result, run)}\n{module.summary(result, output_dir)}"


def run_evaluators(names: Sequence[str], run, output_dir) -> dict:
  """Each evaluator of ``names`` (aliases expanded) in turn on the same ``run``, with its
  ``run.config.evals`` options: ``{name: (result, summary)}``."""
  return {name: run_evaluator(name, run, output_dir)
          for alias in names for name in expand(alias)}
