"""smoothing_jax.recalibration: the fitted temperature minimises the NLL (against a fine grid) and
recovers the factor of logits made over-confident on purpose."""
import numpy as np
import pytest
from scipy import special

from smoothing_jax import recalibration


def _overconfident(factor: float, n: int = 4000, samples: int = 1, seed: int = 0):
  """Labels drawn from softmax(z); the model reports log softmax(factor · z) (per sample a little
  noise, so that an ensemble's members differ)."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 2, (n, 5))
  labels = np.array([rng.choice(5, p=p) for p in special.softmax(logits, axis=-1)])
  noisy = logits + rng.normal(0, 0.05, (samples, n, 5))
  return special.log_softmax(factor * noisy, axis=-1), labels


def _numpy_nll(log_probs, labels, t, placement):
  """−mean log p_T(y): members, 1/N Σ softmax(zᵢ/T); ensemble, softmax(log p̄ / T) (Ashukha et
  al.'s ``apply_t``), in plain numpy."""
  if placement == "members":
    p = np.mean(special.softmax(log_probs / t, axis=-1), axis=0)
  else:
    p = special.softmax(np.log(np.mean(np.exp(log_probs), axis=0)) / t, axis=-1)
  return -np.mean(np.log(p[np.arange(len(labels)), labels]))


@pytest.mark.parametrize("placement", ["members", "ensemble"])
@pytest.mark.parametrize("samples", [1, 4])
def test_fitted_temperature_minimises_the_nll_on_a_fine_grid(samples, placement):
  log_probs, labels = _overconfident(2.5, n=800, samples=samples, seed=samples)
  if samples > 1:  # members that disagree: the placements then differ
    log_probs = log_probs + np.random.default_rng(5).normal(0, 1.5, log_probs.shape)
  fitted = recalibration.fit_temperature(log_probs, labels, placement=placement)
  grid = np.exp(np.linspace(np.log(0.3), np.log(6), 2001))
  nll = [_numpy_nll(log_probs, labels, t, placement) for t in grid]
  best = grid[int(np.argmin(nll))]
  assert fitted == pytest.approx(best, rel=2e-3)
  assert recalibration.tempered_nll(log_probs, labels, fitted, placement) == pytest.approx(
      _numpy_nll(log_probs, labels, fitted, placement), rel=1e-9)
  assert recalibration.tempered_nll(log_probs, labels, fitted, placement) <= min(nll) + 1e-9


def test_the_two_placements_agree_for_one_sample_and_differ_for_an_ensemble():
  one, labels = _overconfident(2.5, n=800)
  assert recalibration.fit_temperature(one, labels, placement="members") == pytest.approx(
      recalibration.fit_temperature(one, labels, placement="ensemble"), rel=1e-4)
  members, labels = _overconfident(2.5, n=800, samples=4, seed=4)
  members = members + np.random.default_rng(5).normal(0, 1.5, members.shape)
  t_members, t_ensemble = (recalibration.fit_temperature(members, labels, placement=p)
                           for p in recalibration.PLACEMENTS)
  assert abs(t_members - t_ensemble) > 0.05 * t_members
  with pytest.raises(ValueError, match="Unknown temperature placement 'logits'"):
    recalibration.fit_temperature(members, labels, placement="logits")


def test_temperature_recovers_a_known_overconfidence_factor():
  log_probs, labels = _overconfident(3.0, n=20000)
  assert recalibration.fit_temperature(log_probs, labels) == pytest.approx(3.0, rel=0.05)
  log_probs, labels = _overconfident(0.5, n=20000, seed=1)  # under-confident: T < 1
  assert recalibration.fit_temperature(log_probs, labels) == pytest.approx(0.5, rel=0.05)


def test_the_tempered_mean_of_one_sample_at_t1_is_the_model_and_errors_are_clear():
  log_probs, labels = _overconfident(1.0, n=10)
  np.testing.assert_allclose(recalibration.tempered_log_mean_probs(log_probs, 1.0), log_probs[0],
                             atol=1e-12)
  with pytest.raises(ValueError, match="needs held-out examples"):
    recalibration.fit_temperature(log_probs[:, :0], labels[:0])


def test_the_evaluator_fits_on_the_held_out_training_examples_only(tmp_path):
  """``holdout_fraction`` 0.25 of the 32 training images (8 per class... class-balanced) are held
  out of training; the evaluator's temperature is the one fitted directly on the model's
  log-probabilities there, and its "before" NLL the model's own on the test set."""
  import jax

  from smoothing_jax.evaluators import calibration as evaluator
  from tests.helpers import initialised_run
  run = initialised_run(tmp_path, eval_batch_size=8, **{"input.holdout_fraction": 0.25})
  pipeline = run.pipeline
  held, kept = pipeline.holdout_images, pipeline.train_images
  assert len(held) + len(kept) == 32 and pipeline.num_train == len(kept)
  assert not {x.tobytes() for x in held} & {x.tobytes() for x in kept}
  rows = evaluator.evaluate(run, tmp_path / "results")

  def log_probs(images):
    logits = run.model.apply(run.variables, run.normalize(images), train=False)
    return np.asarray(jax.nn.log_softmax(logits), np.float64)[None]

  # A deterministic model: N = 1, where the two placements agree.
  assert [r["placement"] for r in rows] == ["members", "ensemble"]
  assert rows[0]["temperature"] == pytest.approx(rows[1]["temperature"], rel=1e-3)
  row = rows[0]
  expected = recalibration.fit_temperature(log_probs(held), pipeline.holdout_labels)
  assert row["temperature"] == pytest.approx(expected, rel=1e-3)
  assert row["holdout_examples"] == len(held) and row["holdout_fraction"] == 0.25
  test = log_probs(pipeline.eval_images)
  assert row["nll_before"] == pytest.approx(
      recalibration.tempered_nll(test, pipeline.eval_labels, 1.0), rel=1e-4)
  assert row["nll_after"] == pytest.approx(
      recalibration.tempered_nll(test, pipeline.eval_labels, row["temperature"]), rel=1e-4)
  for name in ("calibration.json", "calibration.csv", "reliability_before.png",
               "reliability_after_members.png", "reliability_after_ensemble.png"):
    assert (tmp_path / "results" / name).stat().st_size > 0
  no_holdout = initialised_run(tmp_path / "none", eval_batch_size=8)
  with pytest.raises(ValueError, match="set --config.input.holdout_fraction"):
    evaluator.evaluate(no_holdout, tmp_path / "none_results")
