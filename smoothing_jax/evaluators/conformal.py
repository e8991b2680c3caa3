"""``conformal``: split conformal prediction sets (``smoothing_jax.conformal``: THR/LAC, APS, RAPS,
randomised and not) from the predictive at every nested ensemble size N, at each α of ``alphas``.

Calibration is on held-out examples never trained on: the run's held-out part of the training
split where it has one (``config.input.holdout_fraction`` > 0), else a seeded half of the
evaluation split (the other half is then the test set); every row says which
(``calibration``).  Reports, per N, α, score and variant: the threshold q̂, empirical coverage,
mean set size, the size-stratified coverage violation, the class-conditional coverage gap and the
share of empty sets.  Writes ``conformal.{json,csv}`` and ``conformal.png`` (mean set size against
N, one panel per α).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from smoothing_jax import conformal
from smoothing_jax.evaluators.common import (
  gather,
  nested_means,
  predictive,
  sample_probs,
  write_results,
)
from smoothing_jax.parallel import eval_batch_size, sharded_eval_step
from smoothing_jax.plots import plot_set_sizes


def nested_probs_step(method, sizes, variables, batch, key):
  """The predictive's probabilities ``[B, S, C]`` at each nested size of ``sizes`` (the mean of
  the first N draws) on one padded batch, with its ``mask`` and ``label``."""
  probs = jnp.stack(nested_means(sample_probs(method, variables, batch["image"], key), sizes),
                    axis=1)
  return {"probs": probs, "mask": batch["mask"], "label": batch["label"]}


def _variants(scores: Sequence[str], randomized: Sequence[bool]) -> list:
  """``(score, randomized)`` pairs: THR has no randomised form."""
  for score in scores:
    if score not in conformal.SCORES:
      raise ValueError(f"Unknown conformal score {score!r}; choose from {conformal.SCORES}.")
  return [(s, r) for s in scores for r in (sorted(set(randomized)) if s != "thr" else (False,))]


def evaluate(run, output_dir, *, sizes: Sequence[int] = (), members: Sequence[str] = (),
             seed: int = 0, alphas: Sequence[float] = (0.1, 0.05),
             scores: Sequence[str] = conformal.SCORES, randomized: Sequence[bool] = (False, True),
             raps_penalty: float = 0.1, raps_rank: int = 1, convention: str = "mapie") -> list:
  """Rows ``{"ensemble_size", "alpha", "score", "randomized", "qhat", "coverage", "mean_size",
  "size_stratified_violation", "class_coverage_gap", "empty", "calibration", ...}``.

  ``raps_penalty``, ``raps_rank``: RAPS's λ and k_reg (TorchUncertainty's defaults, 0.1 and 1);
  ``convention``: ``"mapie"`` or ``"torch_uncertainty"`` (``smoothing_jax.conformal``); ``seed``
  draws the randomised variants' uniforms and, without a held-out split, the calibration half."""
  if convention not in conformal.CONVENTIONS:
    raise ValueError(f"Unknown conformal convention {convention!r}; choose from "
                     f"{conformal.CONVENTIONS}.")
  variants = _variants(scores, randomized)
  config = run.config
  pred = predictive(run, members, sizes)
  step = sharded_eval_step(nested_probs_step, run.mesh, pred.method, pred.sizes)
  label = f"conformal: {pred.method.name}, {max(pred.sizes)} draws"
  test = gather(step, pred.variables, run.mesh, run.eval_batches(), seed + 1, f"{label}, test")
  if config.input.holdout_fraction > 0:
    held = gather(step, pred.variables, run.mesh,
                  run.pipeline.holdout_batches(eval_batch_size(config, run.mesh)), seed,
                  f"{label}, held-out split")
    calibration = "held-out training examples"
  else:  # a seeded half of the evaluation split calibrates, the other half is scored
    order = np.random.default_rng(seed).permutation(len(test["label"]))
    half = len(order) // 2
    held = {k: v[order[:half]] for k, v in test.items()}
    test = {k: v[order[half:]] for k, v in test.items()}
    calibration = f"half of the evaluation split (seed {seed})"
  for alpha in alphas:
    conformal.check_alpha(alpha, len(held["label"]))
  num_cal, (num_test, _, num_classes) = len(held["label"]), test["probs"].shape
  rng = np.random.default_rng(seed)
  cal_uniforms = rng.uniform(size=num_cal)
  test_uniforms = rng.uniform(size=num_test if convention == "mapie" else (num_test, num_classes))
  rows = []
  for j, n in enumerate(pred.sizes):
    for alpha in alphas:
      for score, random in variants:
        options = {"penalty": raps_penalty, "rank": raps_rank}
        draws = conformal.calibration_draws(score, random, convention)
        cal = conformal.label_scores(held["probs"][:, j], held["label"], score,
                                     uniforms=cal_uniforms if draws else None, **options)
        qhat = conformal.conformal_quantile(cal, alpha, convention)
        sets = conformal.prediction_sets(test["probs"][:, j], qhat, score, convention=convention,
                                         randomized=random, uniforms=test_uniforms, **options)
        rows.append({"method": pred.method.name, "ensemble_size": n, "alpha": alpha,
                     "score": score, "randomized": random, "qhat": qhat,
                     **conformal.set_metrics(sets, test["label"], alpha),
                     "convention": convention, "calibration": calibration,
                     "calibration_examples": num_cal, "test_examples": num_test,
                     "raps_penalty": raps_penalty if score == "raps" else None,
                     "raps_rank": raps_rank if score == "raps" else None,
                     **pred.scored})
  write_results(output_dir, "conformal", rows, {"conformal.png": lambda: plot_set_sizes(
      rows, f"{config.model} on {config.input.dataset}: conformal sets ({convention})")})
  return rows


def summary(rows: list, output_dir) -> str:
  lines = [f"Calibrated on {rows[0]['calibration']} ({rows[0]['calibration_examples']} examples; "
           f"{rows[0]['test_examples']} scored, {rows[0]['convention']}'s convention)",
           "N  | α    | score            | q̂      | coverage (%) | size  | SSCV (%) | CovGap (%) "
           "| empty (%)"]
  for r in rows:
    name = r["score"] + (", randomised" if r["randomized"] else "")
    lines.append(f"{r['ensemble_size']:2d} | {r['alpha']:.2f} | {name:16s} | {r['qhat']:.4f} | "
                 f"{100 * r['coverage']:12.2f} | {r['mean_size']:5.2f} | "
                 f"{100 * r['size_stratified_violation']:8.2f} | "
                 f"{100 * r['class_coverage_gap']:10.2f} | {100 * r['empty']:9.2f}")
  lines.append(f"Results: {output_dir}/conformal.{{json,csv,png}}")
  return "\n".join(lines)
