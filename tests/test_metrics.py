"""Metrics against hand-worked examples (per image and per pixel with void, IoU, temporal
consistency), numpy, and exact accumulation over batches."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.metrics import (
  TemporalConsistency,
  UncertaintyMetrics,
  class_iou,
  entropy,
  evaluate,
  label_mask,
  uncertainty_decomposition,
)
from smoothing_jax.plots import plot_reliability_diagram

# Five predictions over three classes (worked by hand below).
PROBS = np.array([[0.95, 0.03, 0.02],   # y=0 correct, conf .95 (certain)
                  [0.50, 0.30, 0.20],   # y=1 wrong,   conf .50
                  [0.10, 0.85, 0.05],   # y=1 correct, conf .85
                  [0.02, 0.03, 0.95],   # y=0 wrong,   conf .95 (certain)
                  [0.02, 0.03, 0.95]],  # y=2 correct, conf .95 (certain)
                 np.float32)
LABELS = np.array([0, 1, 1, 0, 2])


def test_hand_worked_example():
  m = evaluate(PROBS, LABELS)
  assert m["count"] == 5
  assert m["nll"] == pytest.approx(
      -(math.log(.95) + math.log(.3) + math.log(.85) + math.log(.02) + math.log(.95)) / 5, rel=1e-5)
  assert m["acc"] == pytest.approx(3 / 5)
  assert m["top5"] == pytest.approx(1.0)  # only 3 classes
  # Brier: .0038 + .78 + .035 + 1.8638 + .0038
  assert m["brier"] == pytest.approx(2.6864 / 5, rel=1e-5)
  # Bins (.9, 1]: {e1, e4, e5} acc 2/3 conf .95; (.4, .5]: {e2} acc 0 conf .5;
  # (.8, .9]: {e3} acc 1 conf .85.
  assert m["ece"] == pytest.approx(3 / 5 * (0.95 - 2 / 3) + 1 / 5 * 0.5 + 1 / 5 * 0.15, rel=1e-5)
  assert m["ecse"] == pytest.approx(3 / 5 * (0.95 - 2 / 3) + 1 / 5 * 0.5 - 1 / 5 * 0.15, rel=1e-5)
  assert m["acc90"] == pytest.approx(2 / 3)
  assert m["unc90"] == pytest.approx(1 / 2)
  assert m["freq90"] == pytest.approx(3 / 5)
  # Confusion rows (true) [1,0,1], [1,1,0], [0,0,1]: IoU 1/3, 1/2, 1/2.
  assert m["iou"] == pytest.approx(4 / 9)
  # Certain rows [1,0,1], [0,0,0], [0,0,1]: classes 0 and 2 present, IoU 1/2 and 1/2.
  assert m["iou90"] == pytest.approx(1 / 2)


def test_cutoff_is_strict():
  probs = np.array([[0.9, 0.1], [0.91, 0.09]], np.float64).astype(np.float32)
  m = evaluate(probs, np.array([0, 0]))
  assert m["freq90"] == pytest.approx(0.5)


def test_reliability_bins_use_left_open_intervals():
  probs = np.array([[0.5, 0.5], [0.6, 0.4], [0.75, 0.25]], np.float32)
  stats = UncertaintyMetrics.from_model_output(probs, np.array([0, 1, 0]), num_bins=2)
  rel = stats.reliability()
  np.testing.assert_allclose(rel["count"], [1, 2])  # 0.5 ∈ (0, .5]; 0.6, 0.75 ∈ (.5, 1]
  np.testing.assert_allclose(rel["accuracy"], [1.0, 0.5])
  np.testing.assert_allclose(rel["confidence"], [0.5, 0.675], rtol=1e-6)


def test_top5_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(200, 7))
  probs = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
  labels = rng.integers(0, 7, size=200)
  rank = (probs > probs[np.arange(200), labels][:, None]).sum(-1)
  assert evaluate(probs, labels)["top5"] == pytest.approx(np.mean(rank < 5))


def test_batched_padded_accumulation_is_exact():
  rng = np.random.default_rng(1)
  logits = rng.normal(scale=3.0, size=(103, 10))
  probs = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
  labels = rng.integers(0, 10, size=103)
  whole = evaluate(probs, labels, num_bins=15)
  total = None
  for start in range(0, 103, 16):
    p, y = probs[start:start + 16], labels[start:start + 16]
    mask = np.ones(16, np.float32)
    mask[len(y):] = 0
    pad = 16 - len(y)
    p = np.concatenate([p, np.full((pad, 10), 0.1, np.float32)])
    y = np.concatenate([y, np.zeros(pad, y.dtype)])
    batch = UncertaintyMetrics.from_model_output(p, y, mask, num_bins=15)
    total = batch if total is None else total.merge(batch)
  batched = total.compute()
  assert batched["count"] == 103
  for key, value in whole.items():
    assert batched[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_merging_different_bins_fails():
  a = UncertaintyMetrics.from_model_output(PROBS, LABELS, num_bins=10)
  b = UncertaintyMetrics.from_model_output(PROBS, LABELS, num_bins=15)
  with pytest.raises(ValueError, match="different cutoff, num_bins or ece_convention"):
    a.merge(b)


SS_BINS = np.linspace(0.0, 1.0, 11)  # SS's 10 equal-width confidence bins


def _ss_ece(labels, probs, bins=SS_BINS):
  """SS ``ops/tests.py``, transcribed: per bin the confusion-matrix count and accuracy over
  confidences in (start, end], the confidence sum over [start, end), then ``ece``."""
  confidence, prediction = np.amax(probs, axis=1), np.argmax(probs, axis=1)
  count_bin, acc_bin, conf_bin = [], [], []
  for start, end in zip(bins, bins[1:], strict=False):
    in_cm = (confidence > start) & (confidence <= end)
    count = np.sum(in_cm)
    count_bin.append(count)
    acc_bin.append(np.sum(prediction[in_cm] == labels[in_cm]) / count if count else 0.0)
    in_sum = (confidence >= start) & (confidence < end)
    conf_bin.append(np.sum(confidence[in_sum]) / (count + 1e-7))
  count_bin, acc_bin, conf_bin = map(np.array, (count_bin, acc_bin, conf_bin))
  freq = np.nan_to_num(count_bin / (sum(count_bin) + 1e-7))
  return np.sum(np.absolute(acc_bin - conf_bin) * freq)


def test_ss_ece_convention_matches_the_reference_on_saturated_predictions():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 4, (2000, 10)).astype(np.float32)
  logits[:200, 0] += 40.0  # 10% saturate to a float32 confidence of exactly 1.0
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits)), np.float32)
  labels = rng.integers(0, 10, 2000)
  labels[:150] = 0
  assert np.sum(probs.max(1) == 1.0) >= 150
  ss = evaluate(probs, labels, ece_convention="ss")["ece"]
  consistent = evaluate(probs, labels)["ece"]
  assert ss == pytest.approx(_ss_ece(labels, probs), rel=1e-5)
  assert ss < consistent - 0.05  # the saturated predictions' confidences left out of the sums
  metrics = UncertaintyMetrics.from_model_output(probs, labels)
  assert metrics.replace(ece_convention="ss").compute()["ece"] == pytest.approx(ss, rel=1e-6)
  unsaturated = probs[200:], labels[200:]
  assert evaluate(*unsaturated, ece_convention="ss")["ece"] == pytest.approx(
      evaluate(*unsaturated)["ece"], abs=1e-6)
  with pytest.raises(ValueError, match="Unknown ece_convention 'pytorch'"):
    evaluate(probs, labels, ece_convention="pytorch")


def _at_confidences(confidences, num_classes=20, seed=0):
  """``(probs, labels)`` whose confidences are exactly the float32 ``confidences`` (class 0; the
  rest share 1 − c, each below c), labels 0 (correct) or 1 at random."""
  confidences = np.asarray(confidences, np.float32)
  probs = np.empty((len(confidences), num_classes), np.float32)
  probs[:, 0] = confidences
  probs[:, 1:] = ((1 - confidences) / (num_classes - 1))[:, None]
  assert np.all(probs.max(1) == confidences) and np.all(probs.argmax(1) == 0)
  return probs, np.random.default_rng(seed).integers(0, 2, len(confidences))


def _float32_edges(num_bins):
  """float32(e) and its two float32 neighbours for each float64 edge e strictly inside (0, 1)."""
  nearest = np.linspace(0.0, 1.0, num_bins + 1)[1:-1].astype(np.float32)
  return np.concatenate([nearest, np.nextafter(nearest, np.float32(0)),
                         np.nextafter(nearest, np.float32(1))])


def test_ece_bins_compare_float32_confidences_with_float64_edges():
  """Issue 44's example: float32(0.4), (0.6), (0.8) lie just above 0.4, 0.6, 0.8, so each is
  counted and summed in the bin above the edge; SS's ``ops/tests.py`` (``_ss_ece``, whose NumPy 2
  compares in float64) gives 0.350.  ``ceil(c · 10)`` in float32 counted them a bin low and gave
  0.500 under "ss"."""
  probs = np.array([[.4, .3, .3], [.3, .3, .4], [.6, .2, .2], [.8, .1, .1]], np.float32)
  labels = np.array([0, 0, 0, 1])
  assert _ss_ece(labels, probs) == pytest.approx(0.35)
  assert evaluate(probs, labels, ece_convention="ss")["ece"] == pytest.approx(0.35, rel=1e-6)
  assert evaluate(probs, labels)["ece"] == pytest.approx(0.35, rel=1e-6)
  # Every edge, its float32 neighbours, 0.5 (an edge float32 holds) and 1.0, against SS.
  confidences = np.concatenate([_float32_edges(10), [0.5, 1.0, 1.0]])
  probs, labels = _at_confidences(confidences)
  assert evaluate(probs, labels, ece_convention="ss")["ece"] == pytest.approx(
      _ss_ece(labels, probs), rel=1e-5)
  counts = UncertaintyMetrics.from_model_output(probs, labels).reliability()["count"]
  edges = np.linspace(0.0, 1.0, 11)
  np.testing.assert_array_equal(counts, [np.sum((confidences > lo) & (confidences <= hi))
                                         for lo, hi in zip(edges, edges[1:], strict=False)])


@pytest.mark.parametrize("num_bins", [10, 15])
def test_default_ece_equals_torchmetrics_at_the_bin_edges(num_bins):
  """On float64 confidences torchmetrics bins [lo, hi) with float64 edges; a float32 confidence
  never sits on an edge float32 cannot hold, so its bins are ours at every float32-rounded edge
  and its neighbours (0.5 and 1.0, which float32 holds, go to the bin above there by design)."""
  pytest.importorskip("torch")
  from tests.torch_reference import torchmetrics_calibration_error
  confidences = _float32_edges(num_bins)
  confidences = confidences[confidences != 0.5]
  probs, labels = _at_confidences(confidences, seed=num_bins)
  expected = torchmetrics_calibration_error(confidences.astype(np.float64),
                                            (labels == 0).astype(np.float64), num_bins)
  assert evaluate(probs, labels, num_bins=num_bins)["ece"] == pytest.approx(expected, rel=1e-6)


def test_bad_labels_are_rejected():
  with pytest.raises(ValueError, match="does not match probs shape"):
    evaluate(PROBS, LABELS[:3])
  with pytest.raises(TypeError, match="integer class indices"):
    evaluate(PROBS, LABELS.astype(np.float32))


def test_pixel_metrics_with_void_match_hand_worked_example():
  # One 2×3 image, 3 classes; label 3 (and -1) = void.
  probs = np.array([[[0.95, 0.03, 0.02], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1]],
                    [[0.2, 0.2, 0.6], [0.5, 0.25, 0.25], [0.05, 0.05, 0.9]]], np.float32)[None]
  labels = np.array([[[0, 1, 1], [2, 3, -1]]])
  mask = label_mask(labels, 3)
  np.testing.assert_array_equal(mask, [[[1, 1, 1], [1, 0, 0]]])
  m = UncertaintyMetrics.from_model_output(probs, labels, mask).compute()
  # Counted pixels: (0.95→0 ✓), (0.6→0, y=1 ✗), (0.8→1 ✓), (0.6→2 ✓).
  assert m["count"] == 4
  np.testing.assert_allclose(m["nll"],
                             -(np.log(0.95) + np.log(0.3) + np.log(0.8) + np.log(0.6)) / 4,
                             rtol=1e-6)
  np.testing.assert_allclose(m["acc"], 3 / 4)
  # ECE: bins (0.9,1]: conf .95 acc 1; (0.6,0.7]: confs .6,.6 acc 0,1 (float32(.6) > .6);
  # (0.8,0.9]: conf .8 acc 1 (float32(.8) > .8).
  np.testing.assert_allclose(m["ece"], (0.05 + 2 * abs(0.6 - 0.5) + 0.2) / 4, rtol=1e-5)
  # Certain (> 0.9): only the first pixel, correct.
  np.testing.assert_allclose([m["acc90"], m["freq90"], m["unc90"]], [1.0, 1 / 4, 1.0])
  # Confusion (rows true): class0 TP1; class1: TP1 FN1 (predicted 0); class2: TP1.
  # IoU0 = 1/(1+1) (FP from the class-1 pixel), IoU1 = 1/2, IoU2 = 1/1.
  np.testing.assert_allclose(m["iou"], (0.5 + 0.5 + 1.0) / 3)
  # IoU-90 on the certain pixel only: class 0 = 1; classes 1, 2 have no certain support.
  np.testing.assert_allclose(m["iou90"], 1.0)
  stats = UncertaintyMetrics.from_model_output(probs, labels, mask)
  # Void labels never count, even without an explicit mask.
  assert UncertaintyMetrics.from_model_output(probs, labels).compute() == m
  np.testing.assert_allclose(class_iou(stats.confusion), [0.5, 0.5, 1.0])
  np.testing.assert_allclose(class_iou(stats.certain_confusion), [1.0, np.nan, np.nan])


def test_temporal_consistency_hand_worked():
  # argmax of frames: [[0, 1], [1, 1]] then [[0, 0], [1, 2]]; pixel (1,1) void.
  a = jax.nn.one_hot(jnp.array([[0, 1], [1, 1]]), 3)
  b = jax.nn.one_hot(jnp.array([[0, 0], [1, 2]]), 3)
  mask = label_mask(jnp.array([[0, 2], [1, 9]]), 3)
  assert TemporalConsistency.from_model_output(
      b, a, mask).compute()["consistency"] == pytest.approx(2 / 3)
  # A per-example mask [B] covers every pixel of its example (here B = W = 2).
  per_example = TemporalConsistency.from_model_output(jnp.stack([b, b]), jnp.stack([a, b]),
                                                      jnp.array([1.0, 0.0]))
  assert per_example.compute()["consistency"] == pytest.approx(2 / 4)
  seq = jnp.stack([a, b, b])[None]  # [N=1, T=3, 2, 2, C]
  assert TemporalConsistency.from_sequence(seq).compute()["consistency"] == pytest.approx(
      (2 + 4) / 8)


def test_entropy_and_decomposition_hand_examples():
  assert float(entropy(jnp.array([0.5, 0.5]))) == pytest.approx(math.log(2))
  assert float(entropy(jnp.array([1.0, 0.0]))) == 0.0
  disagree = uncertainty_decomposition(jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]]))
  assert float(disagree["total"][0]) == pytest.approx(math.log(2))
  assert float(disagree["aleatoric"][0]) == pytest.approx(0.0)
  assert float(disagree["epistemic"][0]) == pytest.approx(math.log(2))
  agree = uncertainty_decomposition(jnp.array([[[0.5, 0.5]], [[0.5, 0.5]]]))
  assert float(agree["epistemic"][0]) == pytest.approx(0.0, abs=1e-7)
  assert float(agree["aleatoric"][0]) == pytest.approx(math.log(2))


def test_reliability_plot_is_written(tmp_path):
  fig = plot_reliability_diagram(UncertaintyMetrics.from_model_output(PROBS, LABELS))
  path = tmp_path / "reliability.png"
  fig.savefig(path)
  assert path.stat().st_size > 1000
