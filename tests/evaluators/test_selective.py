"""smoothing_jax.evaluators.selective: the AURC of a run equals a direct numpy computation on the
model's own predictions."""
import jax
import numpy as np
import pytest

from smoothing_jax.evaluators import selective
from tests.helpers import initialised_run


def test_selective_metrics_of_a_run_equal_a_direct_computation(tmp_path):
  run = initialised_run(tmp_path, eval_batch_size=8)
  rows = selective.evaluate(run, tmp_path / "results")
  logits = run.model.apply(run.variables, run.normalize(run.pipeline.eval_images),
                           train=False)
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  correct = probs.argmax(-1) == run.pipeline.eval_labels
  order = np.argsort(-probs.max(-1), kind="stable")  # no ties among 16 float MSPs
  risks = 1 - np.cumsum(correct[order]) / np.arange(1, 17)
  msp = {r["score"]: r for r in rows}["msp"]
  assert msp["aurc"] == pytest.approx(risks.mean(), abs=1e-6)
  assert msp["accuracy"] == pytest.approx(correct.mean())
  assert msp["count"] == 16
  assert (tmp_path / "results" / "selective.png").stat().st_size > 1000
  assert "AURC" in selective.summary(rows, tmp_path)
