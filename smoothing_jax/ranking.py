"""Metrics of a ranking by a confidence score: out-of-distribution detection and selective
prediction.

A *confidence* ranks examples, higher meaning "more likely in-distribution / correct":
``scores`` turns a predictive into the three the field uses — the maximum softmax probability
(MSP, Hendrycks & Gimpel 2017), minus the predictive entropy, and minus the mutual information
between prediction and weights (the epistemic part; 0 for a single deterministic pass).

**Detection** (:func:`detection_metrics`): an example is accepted as in-distribution when its
confidence is at least a threshold; the metrics name which class is the positive one:

* AUROC: P(c_in > c_out) + ½ P(c_in = c_out), the area under the ROC curve (the same with OOD
  as the positive class and −c as its score);
* AUPR-In: average precision with in-distribution positive and score c; AUPR-Out: with OOD
  positive and score −c (the two differ).  Average precision is the step sum
  Σ (Rₖ − Rₖ₋₁) Pₖ (scikit-learn's); OpenOOD integrates the PR curve with trapezoids, which
  differs with ties (by up to 0.006 in an audit of ours);
* FPR@95 in its two conventions.  ``fpr95_id_positive`` (Hendrycks & Gimpel, ODIN): the
  fraction of OOD examples accepted at the highest threshold that accepts 95% of the
  in-distribution ones.  ``fpr95_ood_positive`` (OpenOOD's ``auc_and_fpr_recall``,
  uncertainty-baselines' ``SpecificityAtSensitivity(0.95)`` on OOD labels): the fraction of
  in-distribution examples flagged at the threshold that flags 95% of the OOD ones.  On the same
  scores they can differ a lot (uncertainty-baselines issue #286 is about mixing them up).

**Selective prediction** (:func:`selective_metrics`, Geifman & El-Yaniv 2017; Geifman et al.
2019): keep the k most confident of n test examples; the accuracy–rejection curve is the
accuracy of the kept ones against the rejected share 1 − k/n.  Ties are broken at random in
expectation: within a group of equal confidence each example is kept with the same probability.
AURC = (1/n) Σ_k risk(k) (risk = 1 − selective accuracy), its excess over the oracle that keeps
every correct prediction first (E-AURC), and the largest coverage at which the selective
accuracy still reaches 95% and 99%.

Scores are gathered from every batch and process first (exact, no histogram); all of this is
numpy on the host.  We write these few lines instead of calling scikit-learn because the same
tie handling serves the selective metrics and they run where scikit-learn is not installed;
``tests/test_ranking.py`` pins them to ``sklearn.metrics`` and to hand-worked cases.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from smoothing_jax.metrics import uncertainty_decomposition

SCORES = ("msp", "entropy", "mutual_information")


def scores(sample_probs) -> dict:
  """``{"msp", "entropy", "mutual_information"}`` confidences ``[B]`` (higher: more confident) of
  the predictive ``[N, B, C]`` (N samples; its mean is the prediction): MSP, −H(mean) and −MI."""
  parts = uncertainty_decomposition(sample_probs)
  mean = jnp.mean(sample_probs, axis=0)
  # One sample has no epistemic part: exactly 0 (computed, it is round-off of either sign).
  epistemic = parts["epistemic"] if sample_probs.shape[0] > 1 else jnp.zeros_like(parts["total"])
  return {"msp": jnp.max(mean, axis=-1), "entropy": -parts["total"],
          "mutual_information": -epistemic}


def _threshold_counts(positive, negative):
  """Cumulative ``(true positives, false positives)`` accepted at each distinct score, from the
  highest down (accept: score ≥ threshold)."""
  values = np.concatenate([positive, negative]).astype(np.float64)
  is_positive = np.concatenate([np.ones(len(positive)), np.zeros(len(negative))])
  order = np.argsort(-values, kind="stable")
  values, is_positive = values[order], is_positive[order]
  last_of_group = np.r_[np.flatnonzero(np.diff(values) != 0), len(values) - 1]
  true_positives = np.cumsum(is_positive)[last_of_group]
  return true_positives, (last_of_group + 1) - true_positives


def roc_curve(positive, negative) -> tuple:
  """``(fpr, tpr)`` from (0, 0) through every distinct threshold to (1, 1)."""
  tp, fp = _threshold_counts(np.asarray(positive), np.asarray(negative))
  return np.r_[0.0, fp / len(negative)], np.r_[0.0, tp / len(positive)]


def auroc(positive, negative) -> float:
  """Area under the ROC curve (trapezoids: ties count ½)."""
  fpr, tpr = roc_curve(positive, negative)
  return float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))


def precision_recall_curve(positive, negative) -> tuple:
  """``(recall, precision)`` at every distinct threshold, from the highest down."""
  tp, fp = _threshold_counts(np.asarray(positive), np.asarray(negative))
  return tp / len(positive), tp / (tp + fp)


def average_precision(positive, negative) -> float:
  """Σ (Rₖ − Rₖ₋₁) Pₖ over the distinct thresholds (no interpolation), as
  ``sklearn.metrics.average_precision_score``."""
  recall, precision = precision_recall_curve(positive, negative)
  return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def fpr_at_tpr(positive, negative, tpr_level: float = 0.95) -> float:
  """The false-positive rate at the highest threshold whose true-positive rate is at least
  ``tpr_level``."""
  fpr, tpr = roc_curve(positive, negative)
  return float(fpr[np.argmax(tpr >= tpr_level - 1e-12)])


def detection_metrics(in_confidence, out_confidence) -> dict:
  """AUROC, AUPR-In, AUPR-Out and FPR@95 in both conventions (``fpr95_id_positive``,
  ``fpr95_ood_positive``) of in-distribution against OOD confidences ``[n]``, ``[m]`` (see the
  module docstring)."""
  in_confidence = np.asarray(in_confidence, np.float64)
  out_confidence = np.asarray(out_confidence, np.float64)
  if not (len(in_confidence) and len(out_confidence)):
    raise ValueError("Detection metrics need in-distribution and OOD examples, got "
                     f"{len(in_confidence)} and {len(out_confidence)}.")
  return {"auroc": auroc(in_confidence, out_confidence),
          "aupr_in": average_precision(in_confidence, out_confidence),
          "aupr_out": average_precision(-out_confidence, -in_confidence),
          "fpr95_id_positive": fpr_at_tpr(in_confidence, out_confidence, 0.95),
          "fpr95_ood_positive": fpr_at_tpr(-out_confidence, -in_confidence, 0.95)}


def selective_curve(confidence, correct) -> tuple:
  """``(coverage [n], accuracy [n])``: keeping the k = 1 … n most confident predictions, ties
  broken at random in expectation (a tied group contributes its mean correctness per example)."""
  confidence = np.asarray(confidence, np.float64)
  correct = np.asarray(correct, np.float64)
  n = len(confidence)
  order = np.argsort(-confidence, kind="stable")
  confidence, correct = confidence[order], correct[order]
  group = np.r_[0, np.cumsum(np.diff(confidence) != 0)]  # tie group of each position
  group_mean = np.bincount(group, correct) / np.bincount(group)
  kept = np.arange(1, n + 1)
  return kept / n, np.cumsum(group_mean[group]) / kept


def selective_metrics(confidence, correct,
                      accuracy_levels: Sequence[float] = (0.95, 0.99)) -> dict:
  """AURC, E-AURC (excess over the oracle), the overall accuracy and, for each level a,
  ``coverage_at_{100a}``: the largest share kept whose selective accuracy is at least a (0 if
  none)."""
  coverage, accuracy = selective_curve(confidence, correct)
  n, num_correct = len(coverage), float(np.sum(correct))
  kept = np.arange(1, n + 1)
  aurc = float(np.mean(1.0 - accuracy))
  oracle = float(np.mean(np.maximum(0.0, kept - num_correct) / kept))
  out = {"aurc": aurc, "excess_aurc": aurc - oracle, "accuracy": num_correct / n}
  for level in accuracy_levels:
    reached = coverage[accuracy >= level - 1e-12]
    out[f"coverage_at_{round(100 * level)}"] = float(reached.max()) if len(reached) else 0.0
  return out
