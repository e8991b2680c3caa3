"""smoothing_jax.ranking: detection metrics against sklearn.metrics (random and tied scores) and a
hand-worked case; selective metrics against a brute force over every tie-breaking order."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as sk

from smoothing_jax import ranking


def _sklearn(positive, negative) -> dict:
  scores = np.r_[positive, negative]
  labels = np.r_[np.ones(len(positive)), np.zeros(len(negative))]
  fpr, tpr, _ = sk.roc_curve(labels, scores, drop_intermediate=False)
  # OOD as the positive class, −confidence its score (OpenOOD, uncertainty-baselines).
  fpr_ood, tpr_ood, _ = sk.roc_curve(1 - labels, -scores, drop_intermediate=False)
  return {"auroc": sk.roc_auc_score(labels, scores),
          "aupr_in": sk.average_precision_score(labels, scores),
          "aupr_out": sk.average_precision_score(1 - labels, -scores),
          "fpr95_id_positive": fpr[np.argmax(tpr >= 0.95)],
          "fpr95_ood_positive": fpr_ood[np.argmax(tpr_ood >= 0.95)]}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detection_metrics_equal_sklearn(seed, tied):
  rng = np.random.default_rng(seed)
  positive, negative = rng.normal(0.7, 1, 300), rng.normal(0, 1, 170)
  if tied:  # a few distinct values: many ties within and across the classes
    positive, negative = np.round(positive * 2) / 2, np.round(negative * 2) / 2
  ours, theirs = ranking.detection_metrics(positive, negative), _sklearn(positive, negative)
  assert ours.keys() == theirs.keys()
  for key in ours:
    assert ours[key] == pytest.approx(theirs[key], abs=1e-12), key


def test_detection_metrics_of_a_hand_worked_case():
  """In: 0.9, 0.8, 0.4; OOD: 0.8, 0.3, 0.1.  Pairs (in > out): 0.9 beats 3, 0.8 beats 2 and ties
  1, 0.4 beats 2: AUROC = (3 + 2.5 + 2) / 9.  AUPR-In: thresholds 0.9 (R 1/3, P 1), 0.8 (R 2/3,
  P 2/3), 0.4 (R 1, P 3/4): 1/3·(1 + 2/3 + 3/4).  AUPR-Out (OOD positive, score −c): thresholds
  −0.1 (R 1/3, P 1), −0.3 (R 2/3, P 1), −0.4 (no OOD), −0.8 (R 1, P 3/5): 1/3·(1 + 1 + 3/5).
  FPR@95, in-distribution positive: 95% of it first reached at threshold 0.4, where 1 of 3 OOD
  passes; OOD positive: 95% of the OOD flagged first at −c ≥ −0.8, where 2 of 3 in-distribution
  (0.8 and 0.4) are flagged too."""
  out = ranking.detection_metrics([0.9, 0.8, 0.4], [0.8, 0.3, 0.1])
  assert out["auroc"] == pytest.approx(7.5 / 9)
  assert out["aupr_in"] == pytest.approx((1 + 2 / 3 + 3 / 4) / 3)
  assert out["aupr_out"] == pytest.approx((1 + 1 + 3 / 5) / 3)
  assert out["fpr95_id_positive"] == pytest.approx(1 / 3)
  assert out["fpr95_ood_positive"] == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="need in-distribution and OOD examples, got 2 and 0"):
    ranking.detection_metrics([0.1, 0.2], [])


def _brute_force_selective(confidence, correct):
  """Mean over every order of the tied examples of the top-k accuracies, k = 1..n."""
  confidence, correct = np.asarray(confidence, float), np.asarray(correct, float)
  groups = [np.flatnonzero(confidence == c) for c in sorted(set(confidence), reverse=True)]
  curves = [np.cumsum(correct[np.concatenate(order)]) / np.arange(1, len(correct) + 1)
            for order in itertools.product(*(itertools.permutations(g) for g in groups))]
  return np.mean(curves, axis=0)


def test_selective_metrics_against_a_brute_force_over_tie_orders():
  confidence = [0.9, 0.9, 0.7, 0.7, 0.7, 0.5, 0.2]
  correct = [1, 0, 1, 1, 0, 1, 0]
  coverage, accuracy = ranking.selective_curve(confidence, correct)
  expected = _brute_force_selective(confidence, correct)
  np.testing.assert_allclose(coverage, np.arange(1, 8) / 7)
  np.testing.assert_allclose(accuracy, expected, rtol=1e-12)
  out = ranking.selective_metrics(confidence, correct)
  assert out["aurc"] == pytest.approx(np.mean(1 - expected))
  oracle = np.mean([max(0, k - 4) / k for k in range(1, 8)])  # 4 correct kept first
  assert out["excess_aurc"] == pytest.approx(np.mean(1 - expected) - oracle)
  assert out["accuracy"] == pytest.approx(4 / 7)
  # By hand: k=1, 2 keep the 0.9 pair at accuracy 1/2; k=5 keeps 3 of 5 correct; only k=... none
  # reach 95%.  An untied case: 1, 1, 0 ranked in that order keep 100% up to coverage 2/3.
  assert out["coverage_at_95"] == 0.0 and accuracy[4] == pytest.approx(3 / 5)
  assert ranking.selective_metrics([3, 2, 1], [1, 1, 0])["coverage_at_99"] == pytest.approx(2 / 3)


def test_scores_rank_confident_agreeing_samples_first():
  sharp = jnp.array([[0.9, 0.05, 0.05]] * 2)
  disagreeing = jnp.array([[0.9, 0.05, 0.05], [0.05, 0.9, 0.05]])
  flat = jnp.full((2, 3), 1 / 3)
  probs = jnp.stack([sharp, disagreeing, flat], axis=1)  # [N=2, B=3, C=3]
  out = jax.tree.map(np.asarray, ranking.scores(probs))
  assert out["msp"][0] > out["msp"][1] > out["msp"][2]
  assert out["entropy"][0] > out["entropy"][1] > out["entropy"][2]
  # Only the disagreeing samples carry epistemic uncertainty: MI > 0 there, 0 elsewhere.
  np.testing.assert_allclose(out["mutual_information"][[0, 2]], 0, atol=1e-6)
  assert out["mutual_information"][1] < -0.1
