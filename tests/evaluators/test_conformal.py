"""smoothing_jax.evaluators.conformal: a run's THR sets equal a direct numpy computation on the
model's own predictions, calibrated on the seeded half of the evaluation split."""
import math

import jax
import numpy as np
import pytest

from smoothing_jax.evaluators import conformal
from tests.helpers import initialised_run


def test_conformal_sets_of_a_run_equal_a_direct_computation(tmp_path):
  run = initialised_run(tmp_path, eval_batch_size=8)
  rows = conformal.evaluate(run, tmp_path / "results", sizes=(1,), alphas=(0.2,), seed=3)
  logits = run.model.apply(run.variables, run.normalize(run.pipeline.eval_images), train=False)
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  labels = run.pipeline.eval_labels
  order = np.random.default_rng(3).permutation(16)  # no held-out split: half calibrates
  cal, test = order[:8], order[8:]
  scores = np.sort(1 - probs[cal, labels[cal]])
  qhat = scores[math.ceil(9 * 0.8) - 1]  # the ⌈(n+1)(1−α)⌉-th smallest
  sets = 1 - probs[test] <= qhat + 1e-8
  thr = {r["score"]: r for r in rows if not r["randomized"]}["thr"]
  assert thr["qhat"] == pytest.approx(qhat, abs=1e-6)
  assert thr["coverage"] == pytest.approx(sets[np.arange(8), labels[test]].mean())
  assert thr["mean_size"] == pytest.approx(sets.sum(-1).mean())
  assert thr["calibration"] == "half of the evaluation split (seed 3)"
  assert [(r["score"], r["randomized"]) for r in rows] == [
      ("thr", False), ("aps", False), ("aps", True), ("raps", False), ("raps", True)]
  assert (tmp_path / "results" / "conformal.png").stat().st_size > 1000
  assert "coverage" in conformal.summary(rows, tmp_path)
  with pytest.raises(ValueError, match="needs at least 19 calibration examples"):
    conformal.evaluate(run, tmp_path / "results", sizes=(1,), alphas=(0.05,))
