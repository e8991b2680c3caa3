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
  # The figure is named as the table names the set: npz:<its folder's name>, not the whole path.
  assert f"ood_npz_{os.path.basename(str(outside).rstrip('/'))}.png" in os.listdir(
      tmp_path / "results")
  assert "AUROC" in ood.summary(rows, tmp_path)


def test_ood_sets_of_another_size_are_resized_and_unknown_ones_are_clear_errors(run, tmp_path):
  small = npz_dataset(tmp_path, 8, num_train=2, num_test=3)  # 8×8 images, the model's 16×16
  rows = ood.evaluate(run, tmp_path, datasets=(f"npz:{small}",), scores=("msp",), sizes=(1,))
  assert {(r["ood_dataset"], r["score"], r["count_out"]) for r in rows
          if r["ood_dataset"] == f"npz:{small}"} == {(f"npz:{small}", "msp", 3)}
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


def _logits(run, images):
  return np.asarray(run.model.apply(run.variables, run.normalize(images), train=False))


def test_near_far_protocol_gives_every_score_per_set_and_group_means(run, tmp_path,
                                                                     monkeypatch):
  from scipy.special import logsumexp
  os.makedirs(tmp_path / "near")
  os.makedirs(tmp_path / "far")
  near = npz_dataset(tmp_path / "near", 16, num_train=4, num_test=11, num_classes=3)
  other = npz_dataset(tmp_path / "far", 16, num_train=4, num_test=7, num_classes=3)
  # A grayscale 8×8 set as one .npz file: converted as OpenOOD does (repeat, resize to 16).
  gray = np.random.default_rng(1).integers(0, 256, (9, 8, 8), dtype=np.uint8)
  np.savez(tmp_path / "gray.npz", images=gray, labels=np.zeros(9, np.int64))
  far = (str(tmp_path / "gray.npz"), f"npz:{other}")
  rows = ood.evaluate(run, tmp_path / "results", near=(f"npz:{near}",), far=far, knn_k=5)
  by = {(r["ood_dataset"], r["score"]): r for r in rows}
  sets = (f"npz:{near}", *far, "near mean", "far mean")
  assert sorted(by) == sorted((s, score) for s in sets for score in ood.SCORES)
  assert {r["ensemble_size"] for r in rows} == {1}  # deterministic: N = 1
  # Group means are the means of the group's sets.
  for score in ood.SCORES:
    for key in ood.METRICS:
      assert by["far mean", score][key] == pytest.approx(
          np.mean([by[s, score][key] for s in far]))
      assert by["near mean", score][key] == pytest.approx(by[f"npz:{near}", score][key])
  # Energy from the model's own logits; the grayscale set as OpenOOD's preprocessing makes it.
  inside = logsumexp(_logits(run, run.pipeline.eval_images), axis=-1)
  with np.load(os.path.join(near, "test.npz")) as f:
    outside = logsumexp(_logits(run, f["images"]), axis=-1)
  expected = roc_auc_score(np.r_[np.ones(16), np.zeros(11)], np.r_[inside, outside])
  assert by[f"npz:{near}", "energy"]["auroc"] == pytest.approx(expected, abs=1e-6)
  assert by[far[0], "msp"]["count_out"] == 9
  accuracy = np.mean(_logits(run, run.pipeline.eval_images).argmax(-1)
                     == run.pipeline.eval_labels)
  assert all(r["id_accuracy"] == pytest.approx(accuracy) for r in rows)
  assert json.load(open(tmp_path / "results" / "ood.json")) == json.loads(json.dumps(rows))
  assert "near mean" in ood.summary(rows, tmp_path)
  assert os.path.exists(tmp_path / "results" / f"ood_{tmp_path.name}_gray.npz.png")
  # The fitted statistics are cached: a second evaluation does not pass over the training set.
  assert os.path.exists(tmp_path / "results" / "ood_fitted.npz")
  monkeypatch.setattr(run, "train_eval_batches", lambda: pytest.fail("refitted"))
  again = ood.evaluate(run, tmp_path / "results", near=(f"npz:{near}",), scores=("mds", "vim"))
  assert again[0]["auroc"] == by[f"npz:{near}", "mds"]["auroc"]


def test_grayscale_sets_are_converted_as_openood_preprocesses_them():
  from smoothing_jax.data.datasets import as_model_images
  gray = np.random.default_rng(2).integers(0, 256, (3, 8, 8, 1), dtype=np.uint8)
  converted = as_model_images("gray", gray, (16, 16, 3))
  # PIL's bilinear upsampling has half-pixel centres: jax.image.resize's "linear" (to rounding).
  expected = jax.image.resize(np.repeat(gray, 3, -1).astype(np.float32), (3, 16, 16, 3),
                              "linear")
  assert converted.dtype == np.uint8 and converted.shape == (3, 16, 16, 3)
  assert np.max(np.abs(converted.astype(np.int32) - np.round(np.asarray(expected)))) <= 1
  colour = np.random.default_rng(3).integers(0, 256, (2, 8, 12, 3), dtype=np.uint8)
  # Another size: the shorter side to the model's (8 → 16, 12 → 24), then the centre 16×16.
  expected = jax.image.resize(colour.astype(np.float32), (2, 16, 24, 3), "linear")[:, :, 4:20]
  fitted = as_model_images("colour", colour, (16, 16, 3))
  assert np.max(np.abs(fitted.astype(np.int32) - np.round(np.asarray(expected)))) <= 1
  with pytest.raises(ValueError, match=r"'two' has images of shape \(16, 16, 2\), the model "
                     r"takes \(16, 16, 3\)"):
    as_model_images("two", np.zeros((1, 16, 16, 2), np.uint8), (16, 16, 3))


def test_the_features_are_the_classifier_input(run):
  from smoothing_jax.passes import pass_outputs
  images = run.normalize(run.pipeline.eval_images[:5])
  out = pass_outputs(run.model, run.variables, images)
  head = {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(run.variables["params"])
          if "classifier" in jax.tree_util.keystr(path) and "dense" in jax.tree_util.keystr(path)}
  kernel = next(v for k, v in head.items() if "kernel" in k)
  bias = next(v for k, v in head.items() if "bias" in k)
  np.testing.assert_allclose(out["features"] @ kernel + bias, out["logits"], atol=1e-5)
  np.testing.assert_allclose(out["logits"], _logits(run, run.pipeline.eval_images[:5]),
                             atol=1e-6)


def test_sample_outputs_are_the_draws_of_sample_log_probs(analysis_workdirs):
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.methods.deep_ensemble import DeepEnsemble
  from smoothing_jax.passes import stack_variables
  key = jax.random.key(3)
  with Run.from_workdir(analysis_workdirs["MC dropout"]) as mc_run:
    images = mc_run.normalize(mc_run.pipeline.eval_images[:4])
    method = mc_run.method.with_samples(3)
    out = method.sample_outputs(mc_run.variables, images, key)
    np.testing.assert_allclose(jax.nn.log_softmax(out["logits"]),
                               method.sample_log_probs(mc_run.variables, images, key), atol=1e-5)
    # Per draw: draw n on images[n], with draw n's dropout key.
    per_draw = method.sample_outputs(mc_run.variables, np.stack([images, images / 2, images]),
                                     key)
    halved = method.sample_outputs(mc_run.variables, images / 2, key)
    for n, expected in enumerate((out, halved, out)):
      np.testing.assert_allclose(per_draw["logits"][n], expected["logits"][n], atol=1e-5)
    ensemble = DeepEnsemble.wrap(mc_run.method, size=2)
    stacked = stack_variables([mc_run.variables, mc_run.variables])
    members = ensemble.sample_outputs(stacked, images, key)
    assert members["features"].shape[:2] == (2, 4)
    np.testing.assert_allclose(jax.nn.log_softmax(members["logits"]),
                               ensemble.sample_log_probs(stacked, images, key), atol=1e-5)


def test_mc_dropout_gives_every_score_at_every_nested_size(analysis_workdirs, tmp_path):
  from smoothing_jax import evaluators
  from smoothing_jax.experiment.run import Run
  near = npz_dataset(tmp_path, 16, num_train=4, num_test=6, num_classes=4)
  with Run.from_workdir(analysis_workdirs["MC dropout"]) as mc_run:
    rows, text = evaluators.run_evaluator("ood", mc_run, tmp_path / "results", {
        "near": (f"npz:{near}",), "sizes": (1, 2), "knn_k": 5})
  assert sorted({(r["ensemble_size"], r["score"]) for r in rows}) == sorted(
      (n, s) for n in (1, 2) for s in ood.SCORES)
  by = {(r["ood_dataset"], r["ensemble_size"], r["score"]): r for r in rows}
  for score in ("mutual_information", "expected_pairwise_kl"):  # 0 for one draw: all tie
    assert by[f"npz:{near}", 1, score]["auroc"] == pytest.approx(0.5)
    assert by[f"npz:{near}", 2, score]["auroc"] != pytest.approx(0.5)
    assert by[f"npz:{near}", 2, score]["combine"] == "predictive"
  assert by["near mean", 2, "knn"]["auroc"] == by[f"npz:{near}", 2, "knn"]["auroc"]
  assert "near mean" in text and "ID acc" in text
  assert {r["combine"] for r in rows if r["score"] in ("energy", "odin", "knn")} == {"score_mean"}
  # The other convention: max-logit, energy and ODIN of the first n draws' mean.
  with Run.from_workdir(analysis_workdirs["MC dropout"]) as mc_run:
    mean_rows = ood.evaluate(mc_run, tmp_path / "mean", near=(f"npz:{near}",), sizes=(1, 2),
                             scores=("energy", "odin"), combine="mean")
  got = {(r["ensemble_size"], r["score"]): r for r in mean_rows if r["ood_dataset"] != "near mean"}
  assert {r["combine"] for r in got.values()} == {"mean"}
  for score in ("energy", "odin"):  # one draw: the two conventions agree
    assert got[1, score]["auroc"] == pytest.approx(by[f"npz:{near}", 1, score]["auroc"])
  with pytest.raises(ValueError, match="combine must be one of"):
    ood.evaluate(mc_run, tmp_path, near=(f"npz:{near}",), combine="median")
  with pytest.raises(ValueError, match="knn_k must be an integer >= 1, got 0"):
    ood.evaluate(mc_run, tmp_path, near=(f"npz:{near}",), knn_k=0)
  with pytest.raises(ValueError, match="odin_temperature must be > 0 and odin_noise >= 0"):
    ood.evaluate(mc_run, tmp_path, near=(f"npz:{near}",), odin_temperature=0.0)
  with pytest.raises(ValueError, match=r"Unknown OOD scores \['mahalanobis'\]"):
    ood.evaluate(mc_run, tmp_path, near=(f"npz:{near}",), scores=("mahalanobis",))
  with pytest.raises(ValueError, match="near/far or by config.evals.ood.datasets, not both"):
    ood.evaluate(mc_run, tmp_path, near=(f"npz:{near}",), datasets=(f"npz:{near}",))


def test_the_printed_table_keeps_whole_names_aligned_and_the_curves_distinct_colours(tmp_path):
  from smoothing_jax.plots import plot_detection_curves
  row = {"ensemble_size": 10, "score": "mutual_information", "auroc": 1.0, "aupr_in": 0.5,
         "aupr_out": 0.25, "fpr95_id_positive": 1.0, "fpr95_ood_positive": 0.0,
         "id_accuracy": 0.987}
  rows = [{**row, "ood_dataset": "/data/cifar100/test_jpeg75.npz"},
          {**row, "ood_dataset": "far mean", "ensemble_size": 1, "score": "msp"}]
  lines = ood.summary(rows, tmp_path).splitlines()[:3]
  assert "cifar100/test_jpeg75.npz" in lines[1] and "100.00" in lines[1]
  assert len({len(line) for line in lines}) == 1  # every row as wide as the header
  assert len({line.index("|") for line in lines}) == 1
  curve = {"fpr": np.linspace(0, 1, 3), "tpr": np.linspace(0, 1, 3),
           "recall": np.linspace(0, 1, 3), "precision": np.ones(3)}
  fig = plot_detection_curves({f"score {i}": curve for i in range(11)})
  colours = {tuple(line.get_color()) for line in fig.axes[0].lines[:-1]}
  assert len(colours) == 11
