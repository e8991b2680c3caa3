"""The figure-regenerating experiment script and the analysis studies on trained workdirs."""
import json
import os
import pathlib

import numpy as np
import pytest

from experiments import msa_figures, ood_near_far_cpu_scale, smoothing_figures
from smoothing_jax.analysis import trained

TINY_SIZES = [
    "num_batches=2", "batch_size=16", "max_iters=3", "num_images=8", "num_samples=2", "grid=3",
    "frequencies=3", "sequences=3", "pgd_steps=1"
]


# First in this file: the MSA workdirs are trained, and the figures made, while the other worker
# runs the notebooks, and the MSA notebook test (after them) then reads the AlterNet's compiled
# programs from the compilation cache (the fixture's docstring).
def test_msa_figures_on_an_alternet_trained_with_the_vit_recipe(msa_figures_run):
  folder, printed = msa_figures_run
  out = pathlib.Path(folder)
  report = json.loads(printed)
  assert report == json.load(open(out / "summary.json"))
  for name in msa_figures.FIGURES:
    assert os.path.getsize(out / f"{name}.png") > 1000
  assert os.path.getsize(out / "fourier_by_depth.png") > 1000
  assert os.path.getsize(out / "similarity_cross.png") > 1000
  assert "| layer3_1 | msa |" in open(out / "lesion.md").read()
  checks = report["orderings"]["AlterNet"]
  assert {"msa_lowers_high_frequencies", "msa_reduces_variance", "conv_raises_high_frequencies",
          "smaller_positive_max_eigenvalue_than_backbone",
          "blocks_of_a_stage_are_more_alike", "straighter_trajectory_than_backbone"} <= set(checks)
  trajectory = json.load(open(out / "trajectory.json"))["AlterNet"]
  assert list(trajectory["steps"]) == [0, 2, 4] and abs(trajectory["angle"][0]) < 1e-3
  similarity = json.load(open(out / "similarity.json"))["AlterNet"]
  assert similarity["rows"]["kinds"] == ["stem", "conv", "conv", "conv", "msa", "conv", "msa"]
  assert similarity["rows"]["resolution_changes"] == [2, 3, 5]  # the strided stage starts
  assert similarity["num_examples"] == 16
  cross = json.load(open(out / "similarity_cross.json"))["backbone vs AlterNet"]
  assert np.shape(cross["cka"]) == (7, 7) and cross["cols"] == similarity["rows"]
  assert "msa_lowers_high_frequencies" not in report["orderings"]["backbone"]
  spectra = json.load(open(out / "spectra.json"))["AlterNet"]
  assert len(spectra["min_eigenvalues"]) == 2
  assert report["checkpoints"]["AlterNet"]["step"] == 4


def test_every_figure_is_written_with_its_ordering(analysis_workdirs, tmp_path, capsys):
  args = [a for label, path in analysis_workdirs.items() for a in ("--workdir", f"{label}={path}")]
  args += ["--out", str(tmp_path)] + [a for size in TINY_SIZES for a in ("--size", size)]
  smoothing_figures.main(args)
  report = json.loads(capsys.readouterr().out)
  for name in smoothing_figures.FIGURES:
    assert os.path.getsize(tmp_path / f"{name}.png") > 1000
    assert set(json.load(open(tmp_path / f"{name}.json"))) == set(analysis_workdirs)
    assert list(report["orderings"][name]) == ["MC dropout + smoothing"]
  spectra = json.load(open(tmp_path / "spectra.json"))["MC dropout"]
  assert np.asarray(spectra["eigenvalues"]).shape == (2, 1)
  assert report["checkpoints"]["MC dropout"]["step"] == 0  # the fixture records step 0


def test_bad_figure_and_size_names_are_rejected(analysis_workdirs, tmp_path):
  workdir = next(iter(analysis_workdirs.values()))
  for bad in (["--figures", "spectrum"], ["--size", "grid=big"]):
    with pytest.raises(SystemExit):
      smoothing_figures.main(["--workdir", workdir, "--out", str(tmp_path)] + bad)


def test_landscape_study_centre_equals_the_training_loss(analysis_workdirs):
  model = trained.load_trained(analysis_workdirs["MC dropout + smoothing"])
  surface = trained.landscape_study(model, num_points=3, batch_size=16)
  assert surface["loss"].shape == (3, 3)
  # The centre of the grid is θ itself: the NLL of the batch under the study's fixed dropout key.
  import functools

  import jax
  import jax.numpy as jnp

  from smoothing_jax.analysis.spectrum import training_loss
  batch = trained.train_batches(model, 1, 16)[0]
  dropout_key = jax.random.split(jax.random.key(0), 3)[2]
  nll = functools.partial(training_loss, model.model,
                          0.0)(model.variables["batch_stats"], dropout_key,
                               jnp.asarray(batch["image"]), jnp.asarray(batch["label"]),
                               model.variables["params"])
  np.testing.assert_allclose(surface["loss"][1, 1], nll, rtol=1e-4)


def test_pixels_are_normalised_like_the_input_pipeline(analysis_workdirs):
  model = trained.load_trained(analysis_workdirs["MC dropout"])
  pixels, labels = trained.eval_pixels(model, 5)
  batch = next(model.pipeline.eval_batches(8))
  np.testing.assert_allclose(model.normalize(pixels), batch["image"][:5], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(labels, batch["label"][:5])


def test_consistency_study_on_a_trained_model(analysis_workdirs):
  model = trained.load_trained(analysis_workdirs["MC dropout"])
  result = trained.consistency_study(model, num_images=4, length=5, max_shift=2, num_samples=2)
  assert 0.0 <= result["consistency"] <= 1.0 and result["cec"] > 0
  assert result["relative_confidence_curve"].shape == (5,)


def test_stage_end_summaries_and_orderings_by_hand():
  taps = {"stem": 7.0, "layer1_0": 4.0, "layer1_1": 3.0, "smooth1_0": 1.0, "layer2_0": 5.0,
          "layer2_1": 2.0}
  assert smoothing_figures.stage_ends(taps) == [1.0, 2.0]
  plain = {"layer1_0": {"data": 2.0, "model": 0.2}, "layer2_0": {"data": 4.0, "model": 0.4}}
  smooth = {"layer1_0": {"data": 9.0, "model": 0.9}, "smooth1_0": {"data": 1.0, "model": 0.1},
            "layer2_0": {"data": 3.0, "model": 0.3}}
  summaries = {"variance": {"plain": smoothing_figures.summarize("variance", plain),
                            "smooth": smoothing_figures.summarize("variance", smooth)}}
  assert summaries["variance"]["smooth"] == {"data": 2.0, "model": pytest.approx(0.2)}
  assert smoothing_figures.orderings(summaries) == {
      "variance": {
          "smooth": {
              "lower_feature_variance": True
          }
      }
  }


def test_changes_by_kind_by_hand():
  values = {"a": 1.0, "b": 3.0, "c": 2.0, "d": 2.5}
  kinds = {"a": "conv", "b": "conv", "c": "msa", "d": "msa"}
  assert msa_figures.changes_by_kind(values, kinds) == {"conv": 2.0, "msa": -0.25}


def test_near_far_summary_and_table_by_hand():
  def row(n, score, dataset, auroc, group="near"):
    return {"ensemble_size": n, "score": score, "ood_dataset": dataset, "ood_group": group,
            "auroc": auroc, "fpr95_ood_positive": 1 - auroc, "id_accuracy": 0.4 + 0.01 * n}
  rows = [row(1, "msp", "a.npz", 0.5), row(1, "msp", "near mean", 0.6),
          row(1, "msp", "far mean", 0.7, "far"), row(4, "msp", "near mean", 0.65),
          row(4, "msp", "far mean", 0.75, "far"), row(4, "mutual_information", "near mean", 0.8),
          row(4, "mutual_information", "far mean", 0.9, "far")]
  summary = ood_near_far_cpu_scale.summarise(rows)
  assert summary["msp"]["4"]["far"] == {"auroc": 0.75, "fpr95": 0.25}
  assert summary["id_accuracy"] == {"1": pytest.approx(0.41), "4": pytest.approx(0.44)}
  lines = ood_near_far_cpu_scale.table([{"method": "m", "summary": summary}]).splitlines()
  assert lines[2] == "| m (1 / 4; 41.0 / 44.0) | msp | 60.0 → 65.0 | 70.0 → 75.0 | " \
      "40.0 → 35.0 | 30.0 → 25.0 |"
  assert lines[2 + ood_near_far_cpu_scale.SCORES.index("mutual_information")] == (
      "|  | mutual_information | 80.0 | 90.0 | 20.0 | 10.0 |")


def test_temporal_smoothing_script_on_translated_streams(analysis_workdirs, tmp_path, capsys):
  from experiments import temporal_smoothing
  args = [a for label, path in analysis_workdirs.items() for a in ("--workdir", f"{label}={path}")]
  sizes = ["num_images=12", "num_samples=3"]
  temporal_smoothing.main(args + ["--out", str(tmp_path)] +
                          [a for s in sizes for a in ("--size", s)])
  report = json.loads(capsys.readouterr().out)
  results = json.load(open(tmp_path / "temporal.json"))
  for label in analysis_workdirs:
    rows = results[label]
    assert [r["method"] for r in rows] == ["single", "mc", "temporal"]
    assert [r["passes_per_frame"] for r in rows] == [1, 3, 1] and all(
        r["count"] == 12 for r in rows)
    assert set(report["summary"][label]) == {"temporal_lowers_nll", "temporal_lowers_ece",
                                             "temporal_raises_consistency"}
  assert os.path.getsize(tmp_path / "temporal.png") > 1000
  assert (tmp_path / "temporal.md").read_text().count("| temporal |") == 2


def test_temporal_smoothing_study_matches_explicit_average(analysis_workdirs):
  # The smoothed last frame = Σ π_t p_t of one pass per frame with the stream's keys.
  import jax
  import jax.numpy as jnp

  from smoothing_jax import temporal
  from smoothing_jax.analysis.perturbation import translate_sequences
  from smoothing_jax.passes import sample_rngs
  model = trained.load_trained(analysis_workdirs["MC dropout + smoothing"])
  pixels, labels = trained.eval_pixels(model, 4)
  frames = jnp.swapaxes(model.normalize(jnp.asarray(translate_sequences(pixels, 6, 3, 0))), 0, 1)
  key = jax.random.key(7)
  _, smoothed = temporal.vq_bnn_predict(model.model, model.variables, frames, rng=key)
  passes = [
      jax.nn.softmax(
          model.model.apply(model.variables,
                            frames[t],
                            rngs=sample_rngs(jax.random.fold_in(key, t)))) for t in range(6)
  ]
  weights = np.exp(-0.8 * np.arange(5))
  np.testing.assert_allclose(smoothed[-1],
                             sum(w * passes[5 - a] for a, w in enumerate(weights)) / weights.sum(),
                             rtol=1e-5,
                             atol=1e-6)
