"""Split conformal prediction sets for classification: a set C(x) ⊆ {1..K} per example that holds
the label with probability ≥ 1 − α when calibration and test examples are exchangeable.

Three scores, each the non-conformity s(x, y) of the label on the calibration split, whose
conformal quantile q̂ then thresholds every class of a test example:

* ``"thr"`` (THR / LAC, Sadinle et al. 2019): s = 1 − p_y; C(x) = {c : 1 − p_c ≤ q̂}.
* ``"aps"`` (Romano et al. 2020): with the classes sorted by decreasing probability,
  s = Σ_{j ≤ r(y)} p_(j) − u·p_y, the mass down to the label, minus a uniform share u of its own
  (u = 0 where not randomised); C(x) takes the classes down to where that mass reaches q̂.
* ``"raps"`` (Angelopoulos et al. 2021): the APS score plus λ·max(0, r(y) − k_reg), r the
  1-based rank, so that a long tail of classes costs more.

The field has two conventions, MAPIE's and TorchUncertainty's (``convention``); both are given,
MAPIE's the default, since only its quantile carries the finite-sample guarantee:

* q̂: MAPIE, the ⌈(n+1)(1−α)⌉-th smallest score (the split-conformal order statistic);
  TorchUncertainty, ``torch.quantile(s, 1 − α)`` (linear interpolation, no n + 1).
* THR sets: MAPIE, {c : 1 − p_c ≤ q̂}, which may be empty; TorchUncertainty, {c : p_c ≥ 1 − q̂}
  with the top class always added.
* APS/RAPS calibration: MAPIE subtracts u·p_y for every example, randomised or not;
  TorchUncertainty only where randomised.
* APS/RAPS sets: MAPIE, the classes down to the first whose (penalised) mass reaches q̂, that one
  included, and where randomised that last class dropped when V = (mass − q̂)/p_last > u (one u
  per example); TorchUncertainty, {c : s(x, c) ≤ q̂} with a u per rank position where
  randomised, and the lowest score where the set is empty.

MAPIE's randomised RAPS divides by p_last − λ·max(0, L − k_reg) + λ·[L > k_reg] (L the set's size,
``mapie/conformity_scores/sets/raps.py``), which we follow under its convention.  The uniforms are
arguments, so the same draws can be given to both (``tests/test_conformal.py`` pins every set and
q̂ against both libraries' recorded outputs).  Computed in float64 numpy: K·n numbers, a small
fraction of one forward pass (``experiments/bench_conformal.py``).
"""
from __future__ import annotations

import math

import numpy as np

SCORES = ("thr", "aps", "raps")
CONVENTIONS = ("mapie", "torch_uncertainty")
EPSILON = 1e-8  # MAPIE's tolerance in every comparison with q̂ (``mapie._machine_precision``)


def check_alpha(alpha: float, n: int) -> None:
  """ValueError (one line) for an α outside (0, 1), or one too small for ``n`` calibration
  examples (⌈(n+1)(1−α)⌉ > n: every set would be every class)."""
  if not 0.0 < alpha < 1.0:
    raise ValueError(f"Conformal alpha must be in (0, 1), got {alpha!r}.")
  if math.ceil((n + 1) * (1 - alpha)) > n:
    raise ValueError(f"alpha={alpha} needs at least {math.ceil(1 / alpha) - 1} calibration "
                     f"examples; there are {n}.")


def _sorted(probs):
  """``(order, sorted_probs, cumulative)`` with the classes by decreasing probability (ties in
  class order, as ``np.argsort`` flipped: MAPIE's)."""
  order = np.flip(np.argsort(probs, axis=-1), axis=-1)
  ordered = np.take_along_axis(probs, order, axis=-1)
  return order, ordered, np.cumsum(ordered, axis=-1)


def _penalty(num_classes: int, penalty: float, rank: int):
  """λ·max(0, r − k_reg) for the ranks r = 1..K."""
  return penalty * np.maximum(0, np.arange(1, num_classes + 1) - rank)


def calibration_draws(score: str, randomized: bool, convention: str = "mapie") -> bool:
  """Whether the calibration scores of ``score`` subtract u·p_y: where randomised, and under
  MAPIE's convention for APS and RAPS always (it draws u whatever ``include_last_label`` is)."""
  return randomized or (convention == "mapie" and score != "thr")


def label_scores(probs, labels, score: str, *, uniforms=None, penalty: float = 0.0,
                 rank: int = 1):
  """The non-conformity ``[n]`` of each label ``labels [n]`` under ``probs [n, K]``.

  ``uniforms [n]``: APS/RAPS's u (None: 0, not randomised); ``penalty``, ``rank``: RAPS's λ and
  k_reg."""
  probs = np.asarray(probs, np.float64)
  labels = np.asarray(labels)
  label_probs = np.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
  if score == "thr":
    return 1.0 - label_probs
  order, _, cumulative = _sorted(probs)
  position = np.argmax(order == labels[:, None], axis=-1)  # 0-based rank of the label
  scores = np.take_along_axis(cumulative, position[:, None], axis=-1)[:, 0]
  if uniforms is not None:
    scores = scores - np.asarray(uniforms, np.float64) * label_probs
  if score == "raps":
    scores = scores + _penalty(probs.shape[-1], penalty, rank)[position]
  return scores


def conformal_quantile(scores, alpha: float, convention: str = "mapie") -> float:
  """q̂ of the calibration scores ``[n]``: the ⌈(n+1)(1−α)⌉-th smallest (``"mapie"``, the
  split-conformal order statistic), or their linear-interpolation quantile at 1 − α
  (``"torch_uncertainty"``)."""
  scores = np.asarray(scores, np.float64)
  n = len(scores)
  if convention == "torch_uncertainty":
    return float(np.quantile(scores, 1.0 - alpha))
  check_alpha(alpha, n)
  return float(np.quantile(scores, math.ceil((n + 1) * (1 - alpha)) / n, method="lower"))


def prediction_sets(probs, qhat: float, score: str, *, convention: str = "mapie",
                    randomized: bool = False, uniforms=None, penalty: float = 0.0,
                    rank: int = 1):
  """Boolean sets ``[B, K]`` of ``probs [B, K]`` at threshold ``qhat``.

  ``uniforms``: the randomised variant's draws, ``[B]`` under ``"mapie"`` (one per example,
  V ≤ u keeps the last class) and ``[B, K]`` under ``"torch_uncertainty"`` (one per rank: column j
  for the j-th most probable class, as TorchUncertainty applies its draws)."""
  probs = np.asarray(probs, np.float64)
  if score == "thr":
    if convention == "mapie":
      return (1.0 - probs) - qhat <= EPSILON
    sets = probs >= 1.0 - qhat
    sets[np.arange(len(probs)), np.argmax(probs, axis=-1)] = True
    return sets
  num_classes = probs.shape[-1]
  reg = _penalty(num_classes, penalty if score == "raps" else 0.0, rank)
  order, ordered, cumulative = _sorted(probs)
  if convention == "torch_uncertainty":
    noise = np.asarray(uniforms, np.float64) if randomized else 0.0  # per rank, as TU's
    scores = cumulative - ordered * noise + reg
    sorted_sets = scores <= qhat
    empty = ~sorted_sets.any(axis=-1)
    lowest = np.argmin(scores, axis=-1)
    sorted_sets[np.flatnonzero(empty), lowest[empty]] = True
  else:
    mass = cumulative + reg  # increasing along the sorted classes
    reached = mass - qhat >= -EPSILON
    # The last class: the first whose mass reaches q̂ (every class where none does).
    last = np.where(reached.any(axis=-1), np.argmax(reached, axis=-1), num_classes - 1)
    sorted_sets = np.arange(num_classes) <= last[:, None]
    if randomized:
      size = last + 1
      rows = np.arange(len(probs))
      lam = penalty if score == "raps" else 0.0
      v = (mass[rows, last] - qhat) / (ordered[rows, last] - lam * np.maximum(0, size - rank)
                                       + lam * (size > rank))
      drop = v - np.asarray(uniforms, np.float64) > EPSILON
      sorted_sets[rows[drop], last[drop]] = False
  sets = np.zeros_like(sorted_sets)
  np.put_along_axis(sets, order, sorted_sets, axis=-1)
  return sets


def set_metrics(sets, labels, alpha: float) -> dict:
  """What a set of prediction sets ``[B, K]`` achieves on ``labels [B]``:

  * ``coverage``: the share holding the label (target 1 − α); ``mean_size``; ``empty``: the
    share of empty sets;
  * ``size_stratified_violation`` (SSCV, Angelopoulos et al. 2021, §4): the largest
    |coverage − (1 − α)| over the strata of set size {0–1, 2–3, 4–10, 11–100, 101–1000, > 1000}
    that hold an example;
  * ``class_coverage_gap`` (CovGap, Ding et al. 2023): the mean over classes of
    |class-conditional coverage − (1 − α)|, over the classes present."""
  sets = np.asarray(sets, bool)
  labels = np.asarray(labels)
  covered = sets[np.arange(len(labels)), labels]
  sizes = sets.sum(axis=-1)
  target = 1.0 - alpha
  strata = np.digitize(sizes, [2, 4, 11, 101, 1001])
  sscv = max(abs(covered[strata == s].mean() - target) for s in np.unique(strata))
  classes = np.unique(labels)
  gap = np.mean([abs(covered[labels == c].mean() - target) for c in classes])
  return {"coverage": float(covered.mean()), "mean_size": float(sizes.mean()),
          "size_stratified_violation": float(sscv), "class_coverage_gap": float(gap),
          "empty": float(np.mean(sizes == 0))}
