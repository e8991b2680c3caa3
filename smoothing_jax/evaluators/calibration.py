"""``calibration``: temperature scaling (``smoothing_jax.recalibration``) fitted for each ensemble
size N and each placement of the temperature (``"members"``: each sample tempered, then averaged;
``"ensemble"``: the average tempered, Ashukha et al. 2020) on the held-out part of the training
set (``config.input.holdout_fraction``, seeded by ``seed``, never trained on), and the test NLL,
ECE and Brier score before and after.  Writes ``calibration.{json,csv}`` and the reliability
diagrams of the largest N before and after (``reliability_before.png``,
``reliability_after_{members,ensemble}.png``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from smoothing_jax import recalibration
from smoothing_jax.evaluators.common import gather, predictive, sample_log_probs_step, write_results
from smoothing_jax.experiment.run import split_seed
from smoothing_jax.metrics import UncertaintyMetrics
from smoothing_jax.parallel import eval_batch_size, sharded_eval_step
from smoothing_jax.plots import plot_reliability_diagram


def _metrics(sample_log_probs, labels, temperature: float, num_bins: int,
             placement: str = "members") -> UncertaintyMetrics:
  probs = np.exp(recalibration.tempered_log_mean_probs(sample_log_probs, temperature, placement))
  return UncertaintyMetrics.from_model_output(jnp.asarray(probs, jnp.float32), jnp.asarray(labels),
                                              num_bins=num_bins)


def evaluate(run, output_dir, *, sizes: Sequence[int] = (), members: Sequence[str] = (),
             seed: int = 0) -> list:
  """Rows ``{"ensemble_size", "placement", "temperature", "nll_before", "nll_after",
  "ece_before", "ece_after", "brier_before", "brier_after", "accuracy", "holdout_examples",
  "holdout_fraction", "seed"}``, one per N and placement; ``seed`` is the held-out draw's
  (``experiment.run.split_seed``: an ensemble's members written out hold their ensemble's)."""
  config = run.config
  pred = predictive(run, members, sizes)
  step = sharded_eval_step(sample_log_probs_step, run.mesh, pred.method)
  held = gather(step, pred.variables, run.mesh,
                run.pipeline.holdout_batches(eval_batch_size(config, run.mesh)), seed,
                f"calibration: {pred.method.name}, held-out split")
  test = gather(step, pred.variables, run.mesh, run.eval_batches(), seed + 1,
                f"calibration: {pred.method.name}, test split")
  held_log_probs = np.swapaxes(held["log_probs"], 0, 1)  # [N, B, C]
  test_log_probs = np.swapaxes(test["log_probs"], 0, 1)
  rows, diagrams = [], {}
  for n in pred.sizes:
    before = _metrics(test_log_probs[:n], test["label"], 1.0, config.ece_bins)
    b = before.compute()
    diagrams = {"before": (before, b["ece"], 1.0)}
    for placement in recalibration.PLACEMENTS:
      temperature = recalibration.fit_temperature(held_log_probs[:n], held["label"],
                                                placement=placement)
      after = _metrics(test_log_probs[:n], test["label"], temperature, config.ece_bins,
                       placement)
      a = after.compute()
      rows.append({"method": pred.method.name, "ensemble_size": n, "placement": placement,
                   "temperature": temperature,
                   "nll_before": b["nll"], "nll_after": a["nll"], "ece_before": b["ece"],
                   "ece_after": a["ece"], "brier_before": b["brier"], "brier_after": a["brier"],
                   "accuracy": b["acc"], "holdout_examples": len(held["label"]),
                   "holdout_fraction": config.input.holdout_fraction,
                   "seed": split_seed(config),
                   **pred.scored})
      diagrams[f"after_{placement}"] = (after, a["ece"], temperature)
  write_results(output_dir, "calibration", rows, {
      f"reliability_{when}.png": functools.partial(
          plot_reliability_diagram, metrics, f"{config.model}, N={pred.sizes[-1]}, T = "
          f"{temperature:.3f} ({when.replace('_', ', T on the ')}): ECE {100 * ece:.2f}%")
      for when, (metrics, ece, temperature) in diagrams.items()})
  return rows


def summary(rows: list, output_dir) -> str:
  lines = ["N  | T on     | T      | NLL before → after | ECE (%) before → after | "
           "Brier before → after"]
  lines += [f"{r['ensemble_size']:2d} | {r['placement']:8s} | {r['temperature']:.3f} | "
            f"{r['nll_before']:.4f} → "
            f"{r['nll_after']:.4f}    | {100 * r['ece_before']:6.2f} → {100 * r['ece_after']:6.2f}"
            f"        | {r['brier_before']:.4f} → {r['brier_after']:.4f}" for r in rows]
  lines.append(f"Results: {output_dir}/calibration.{{json,csv}}, "
               f"{output_dir}/reliability_{{before,after_members,after_ensemble}}.png")
  return "\n".join(lines)
