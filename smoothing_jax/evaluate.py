"""Evaluation of trained workdirs by function call, as before the evaluators were plugged in by
name: each opens the workdir's ``Run`` (``Run.for_evaluation``) and runs one evaluator of
``smoothing_jax.evaluators`` on it.

* ``evaluate_ensemble_sizes``: clean test metrics against ensemble size N (or deep ensembles);
* ``evaluate_corruptions``: corruption robustness (paper Eqs. 34–36);
* ``evaluate_streams``: segmentation on CamVid video clips with temporal smoothing.
"""
from __future__ import annotations

from typing import Optional, Sequence

from smoothing_jax.data import CORRUPTIONS
from smoothing_jax import temporal
from smoothing_jax.evaluators import corruptions as corruptions_evaluator
from smoothing_jax.evaluators import ensemble_sizes, streams
from smoothing_jax.run import Run

# The tables' public helpers, where they were.
from smoothing_jax.evaluators.common import METRIC_COLUMNS, STREAM_COLUMNS  # noqa: F401
from smoothing_jax.evaluators.corruptions import (corruption_aggregates,  # noqa: F401
                                                  default_baseline, read_corruption_table)


def evaluate_ensemble_sizes(workdirs: Sequence[str], output_dir: str, config=None,
                            sizes: Optional[Sequence[int]] = None, seed: int = 0) -> list:
  """``evaluators.ensemble_sizes`` of ``workdirs[0]`` (its members: the other workdirs);
  ``config`` (evaluation settings) replaces the recorded one."""
  with Run.for_evaluation(workdirs[0], config) as run:
    return ensemble_sizes.evaluate(run, output_dir, members=workdirs[1:], sizes=sizes, seed=seed)


def evaluate_corruptions(workdir: str, output_dir: str, baseline_csv: Optional[str] = None,
                         num_samples: int = 1, config=None,
                         corruptions: Sequence[str] = CORRUPTIONS, seed: int = 0) -> dict:
  """``evaluators.corruptions`` of ``workdir``."""
  with Run.for_evaluation(workdir, config) as run:
    return corruptions_evaluator.evaluate(run, output_dir, baseline_csv=baseline_csv,
                                          num_samples=num_samples, corruptions=corruptions,
                                          seed=seed)


def evaluate_streams(workdir: str, output_dir: str, config=None, *, num_samples: int = 50,
                     num_frames: int = temporal.NUM_FRAMES, decay_rate: float = temporal.DECAY_RATE,
                     split: str = "test", seed: int = 0) -> list:
  """``evaluators.streams`` of ``workdir``."""
  with Run.for_evaluation(workdir, config) as run:
    return streams.evaluate(run, output_dir, num_samples=num_samples, num_frames=num_frames,
                            decay_rate=decay_rate, split=split, seed=seed)
