"""smoothing_jax.evaluators.ood: the detection metrics of a run against an OOD set equal
sklearn's on the model's own maximum softmax probabilities; sets of another shape are rejected."""
import json
import os

import jax
import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from smoothing_jax.evaluators import ood
from tests.helpers import initialised_run, npz_dataset


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  return initialised_run(tmp_path_factory.mktemp("ood"), eval_batch_size=8)


def _msp(run, images):
  logits = run.model.apply(run.variables, run.normalize(images), train=False)
  return np.asarray(jax.nn.softmax(logits).max(-1))


def test_detection_against_an_npz_set_equals_sklearn_on_the_model_s_msp(run, tmp_path):
  outside = npz_dataset(tmp_path, 16, num_train=4, num_test=11, num_classes=3)
  rows = ood.evaluate(run, tmp_path / "results", datasets=(f"npz:{outside}",))
  assert [(r["ensemble_size"], r["score"]) for r in rows] == [
      (1, "msp"), (1, "entropy"), (1, "mutual_information")]  # deterministic: N = 1
  msp = {r["score"]: r for r in rows}["msp"]
  assert (msp["count_in"], msp["count_out"]) == (16, 11)  # every example once, padding dropped
  inside = _msp(run, run.pipeline.eval_images)
  with np.load(os.path.join(outside, "test.npz")) as f:
    outside_msp = _msp(run, f["images"])
  expected = roc_auc_score(np.r_[np.ones(16), np.zeros(11)], np.r_[inside, outside_msp])
  assert msp["auroc"] == pytest.approx(expected, abs=1e-6)
  # A single deterministic pass has no epistemic part: every MI ties, AUROC ½.
  assert {r["score"]: r for r in rows}["mutual_information"]["auroc"] == pytest.approx(0.5)
  written = json.load(open(tmp_path / "results" / "ood.json"))
  assert written == json.loads(json.dumps(rows))
  assert any(name.startswith("ood_npz") and name.endswith(".png")
             for name in os.listdir(tmp_path / "results"))
  assert "AUROC" in ood.summary(rows, tmp_path)


def test_ood_sets_of_another_shape_or_unknown_are_clear_errors(run, tmp_path):
  small = npz_dataset(tmp_path, 8, num_train=2, num_test=3)
  with pytest.raises(ValueError, match=r"has images of shape \(8, 8, 3\), the model takes "
                     r"\(16, 16, 3\)"):
    ood.evaluate(run, tmp_path, datasets=(f"npz:{small}",))
  with pytest.raises(ValueError, match="No standard OOD sets for 'npz'"):
    ood.evaluate(run, tmp_path)
  assert ood.resolve_ood_datasets("cifar10", ()) == ["svhn_cropped", "cifar100"]
  assert ood.resolve_ood_datasets("cifar100", ("corruptions",))[0] == (
      "cifar100_corrupted/gaussian_noise_5")
  assert len(ood.resolve_ood_datasets("cifar10", ("corruptions", "npz:/x"))) == 16


def test_a_missing_ood_set_fails_before_the_in_distribution_pass(run, tmp_path, monkeypatch):
  from smoothing_jax.data import DatasetUnavailableError

  def computed(*args, **kwargs):
    raise AssertionError("the in-distribution pass ran before the OOD sets were checked")

  monkeypatch.setattr(ood, "predictive", computed)
  with pytest.raises(DatasetUnavailableError, match="missing/test.npz does not exist"):
    ood.evaluate(run, tmp_path, datasets=(f"npz:{tmp_path / 'missing'}",))
