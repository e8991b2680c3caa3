"""smoothing_jax.evaluators.corruptions: the aggregates (paper Eqs. 34–36) against a hand-worked
table, the baseline tables in both layouts, and the sweep on a run under mock data."""
import json

import numpy as np
import pytest

from smoothing_jax.data import CORRUPTIONS
from smoothing_jax.evaluators.corruptions import (
  corruption_aggregates,
  default_baseline,
  read_corruption_table,
)
from tests.helpers import evaluate_workdir, tiny_config

MODEL = {
    ("a", 1): {
        "err": .2,
        "nll": 1.0,
        "ece": .1
    },
    ("a", 2): {
        "err": .4,
        "nll": 2.0,
        "ece": .1
    },
    ("b", 1): {
        "err": .1,
        "nll": 0.5,
        "ece": .05
    },
    ("b", 2): {
        "err": .3,
        "nll": 1.5,
        "ece": .15
    }
}
BASELINE = {
    ("a", 1): {
        "err": .4,
        "nll": 2.0,
        "ece": .2
    },
    ("a", 2): {
        "err": .6,
        "nll": 3.0,
        "ece": .2
    },
    ("b", 1): {
        "err": .2,
        "nll": 1.0,
        "ece": .1
    },
    ("b", 2): {
        "err": .2,
        "nll": 3.0,
        "ece": .1
    }
}


def test_corruption_aggregates_hand_worked():
  out = corruption_aggregates(MODEL, BASELINE, corruptions=("a", "b"))
  assert out["mCE"] == pytest.approx((0.6 / 1.0 + 0.4 / 0.4) / 2)      # 0.8
  assert out["mCNLL"] == pytest.approx((3.0 / 5.0 + 2.0 / 4.0) / 2)    # 0.55
  assert out["mCECE"] == pytest.approx((0.2 / 0.4 + 0.2 / 0.2) / 2)    # 0.75
  assert out["mean_err"] == pytest.approx(0.25)
  assert out["mean_nll"] == pytest.approx(1.25)
  assert out["mean_ece"] == pytest.approx(0.1)
  assert set(corruption_aggregates(MODEL,
                                   corruptions=("a", "b"))) == {"mean_err", "mean_nll", "mean_ece"}
  # Only the requested types count in the means.
  assert corruption_aggregates(MODEL, corruptions=("a",))["mean_err"] == pytest.approx(0.3)
  with pytest.raises(ValueError, match="No results for the corruptions"):
    corruption_aggregates(MODEL)


def test_baseline_must_cover_every_severity():
  with pytest.raises(ValueError, match="baseline lacks"):
    corruption_aggregates(MODEL, {
        k: v for k, v in BASELINE.items() if k != ("b", 2)
    },
                          corruptions=("a", "b"))


def test_reference_csv_layout_in_percent(tmp_path):
  path = tmp_path / "alexnet.csv"
  path.write_text("severity,type,NLL,cut0,Acc,ECE\n1,fog,0.9,0,82.4,10.1\n2,fog,1.1,0,80.0,12.0\n")
  table = read_corruption_table(str(path))
  assert table[("fog", 1)] == pytest.approx({"nll": 0.9, "err": 0.176, "ece": 0.101})
  assert table[("fog", 2)]["err"] == pytest.approx(0.2)


# The reference's own summary of its AlexNet files (shared reference_semantics.md, "AlexNet
# corruption baselines"): means over the 15 standard types × 5 severities.
@pytest.mark.parametrize("base,err,nll,ece", [("cifar100", 0.5899, 4.012, 0.312),
                                              ("imagenet2012", 0.8054, 4.893, 0.095)])
def test_shipped_alexnet_baselines_load_in_the_reference_layout(base, err, nll, ece):
  table = read_corruption_table(default_baseline(base))
  assert {s for _, s in table} == {1, 2, 3, 4, 5} and set(CORRUPTIONS) <= {t for t, _ in table}
  out = corruption_aggregates(table, table)
  assert out["mean_err"] == pytest.approx(err, abs=5e-5)
  assert out["mean_nll"] == pytest.approx(nll, abs=5e-4)
  assert out["mean_ece"] == pytest.approx(ece, abs=5e-4)
  assert out["mCE"] == out["mCNLL"] == out["mCECE"] == pytest.approx(1.0)


def test_reference_csv_layout_without_header(tmp_path):
  """SS ``save_metrics`` rows: severity, type, nll, cutoff_0, cutoff_1, acc_0, ..., brier, ece."""
  path = tmp_path / "alexnet.csv"
  path.write_text(
      "1,zoom_blur,2.5,0.0,0.9,0.4952,0.77,0.0,0.8,0.34,0.59,1.0,0.43,0.76,0.73,0.2423\n"
      "2,zoom_blur,2.7,0.0,0.9,0.45,0.77,0.0,0.8,0.34,0.59,1.0,0.43,0.76,0.73,0.25\n")
  table = read_corruption_table(str(path))
  assert table[("zoom_blur", 1)] == pytest.approx({"nll": 2.5, "err": 0.5048, "ece": 0.2423})
  assert table[("zoom_blur", 2)]["err"] == pytest.approx(0.55)
  path.write_text("1,zoom_blur,2.5,0.0\n")
  with pytest.raises(ValueError, match="reference layout"):
    read_corruption_table(str(path))


def test_corruption_evaluation_under_mock_data(mock_cifar10_workdir, tmp_path):
  tfds = pytest.importorskip("tensorflow_datasets")  # CIFAR-10-C under TFDS mock data
  workdir = mock_cifar10_workdir
  with tfds.testing.mock_data(num_examples=8):
    aggregates = evaluate_workdir("corruptions", workdir, str(tmp_path), tiny_config(),
                                  corruptions=("fog",), num_samples=2)
  rows = json.load(open(tmp_path / "corruptions.json"))
  assert [(r["type"], r["severity"]) for r in rows] == [("fog", s) for s in range(1, 6)]
  assert all(r["count"] == 8 for r in rows)
  assert aggregates["mean_err"] == pytest.approx(np.mean([1 - r["Acc"] for r in rows]))



def test_corruption_sweep_keeps_what_it_computed_when_a_later_set_fails(
    mock_cifar10_workdir, tmp_path, monkeypatch):
  """CIFAR-10-C under its TFDS names (frosted_glass_blur, elastic); the table is on disk after
  each (type, severity), so a failure at elastic_transform 3 keeps the 7 rows before it."""
  from smoothing_jax.data.resident import ResidentPipeline as Pipeline
  tfds = pytest.importorskip("tensorflow_datasets")  # CIFAR-10-C under TFDS mock data
  workdir = mock_cifar10_workdir
  eval_batches = Pipeline.eval_batches

  def failing(self, batch_size=None, dataset=None):
    if dataset and dataset.endswith("elastic_transform_3"):
      raise OSError("disk error while reading elastic_transform_3")
    return eval_batches(self, batch_size, dataset)

  monkeypatch.setattr(Pipeline, "eval_batches", failing)
  with tfds.testing.mock_data(num_examples=8), pytest.raises(OSError, match="elastic_transform_3"):
    evaluate_workdir("corruptions", workdir, str(tmp_path), tiny_config(),
                     corruptions=("glass_blur", "elastic_transform"))
  rows = json.load(open(tmp_path / "corruptions.json"))
  assert [(r["type"], r["severity"]) for r in rows] == [("glass_blur", s) for s in range(1, 6)] + [
      ("elastic_transform", 1), ("elastic_transform", 2)]
  assert all(r["count"] == 8 for r in rows)
  assert len(open(tmp_path / "corruptions.csv").read().splitlines()) == 1 + len(rows)
