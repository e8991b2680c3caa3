"""Evaluators plugged in by name (as big_vision's ``config.evals``).

``config.evals`` names the evaluators that run after training; ``--mode=<name>`` runs one on a
trained workdir.  Each evaluator is one module here with

* ``evaluate(run, output_dir, **options) -> result``: computes on the ``run``
  (``smoothing_jax.experiment.run.Run``) through the shared sharded step
  (``parallel.sharded_eval_step``) and writes its table (JSON + CSV) and figure into ``output_dir``;
* ``summary(result, output_dir) -> str``: the lines the command line prints.

A new evaluator is one file plus one line in ``REGISTRY``.  ``options`` come from the command
line's flags; an evaluator receives those its ``evaluate`` names (``run_evaluator``).
"""
from __future__ import annotations

import importlib
import inspect
from types import ModuleType
from typing import Any, Mapping, Sequence

from absl import logging

REGISTRY = {  # name → module
    "ensemble_sizes": "smoothing_jax.evaluators.ensemble_sizes",
    "corruptions": "smoothing_jax.evaluators.corruptions",
    "streams": "smoothing_jax.evaluators.streams",
    "temporal": "smoothing_jax.evaluators.temporal_smoothing",
    "ood": "smoothing_jax.evaluators.ood",
    "calibration": "smoothing_jax.evaluators.calibration",
    "selective": "smoothing_jax.evaluators.selective",
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


def run_evaluator(name: str, run, output_dir, options: Mapping[str, Any] = None):
  """``evaluate(run, output_dir, **options)`` of evaluator ``name``, given the ``options`` its
  ``evaluate`` accepts; returns ``(result, summary lines)``."""
  module = get(name)
  accepted = inspect.signature(module.evaluate).parameters
  kwargs = {k: v for k, v in (options or {}).items() if k in accepted}
  logging.info("Evaluator %s on %s", name, run.workdir)
  result = module.evaluate(run, output_dir, **kwargs)
  return result, module.summary(result, output_dir)


def run_evaluators(names: Sequence[str], run, output_dir,
                   options: Mapping[str, Any] = None) -> dict:
  """Each evaluator of ``names`` (aliases expanded) in turn on the same ``run``:
  ``{name: (result, summary)}``."""
  return {name: run_evaluator(name, run, output_dir, options)
          for alias in names for name in expand(alias)}
