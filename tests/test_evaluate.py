"""Corruption aggregates (paper Eqs. 34–36) against a hand-worked table; configs load."""
import importlib.util
import pathlib

import pytest

from smoothing_jax.evaluate import corruption_aggregates, read_corruption_table

MODEL = {("a", 1): {"err": .2, "nll": 1.0, "ece": .1}, ("a", 2): {"err": .4, "nll": 2.0, "ece": .1},
         ("b", 1): {"err": .1, "nll": 0.5, "ece": .05}, ("b", 2): {"err": .3, "nll": 1.5, "ece": .15}}
BASELINE = {("a", 1): {"err": .4, "nll": 2.0, "ece": .2}, ("a", 2): {"err": .6, "nll": 3.0, "ece": .2},
            ("b", 1): {"err": .2, "nll": 1.0, "ece": .1}, ("b", 2): {"err": .2, "nll": 3.0, "ece": .1}}


def test_corruption_aggregates_hand_worked():
  out = corruption_aggregates(MODEL, BASELINE, corruptions=("a", "b"))
  assert out["mCE"] == pytest.approx((0.6 / 1.0 + 0.4 / 0.4) / 2)      # 0.8
  assert out["mCNLL"] == pytest.approx((3.0 / 5.0 + 2.0 / 4.0) / 2)    # 0.55
  assert out["mCECE"] == pytest.approx((0.2 / 0.4 + 0.2 / 0.2) / 2)    # 0.75
  assert out["mean_err"] == pytest.approx(0.25)
  assert out["mean_nll"] == pytest.approx(1.25)
  assert out["mean_ece"] == pytest.approx(0.1)
  assert set(corruption_aggregates(MODEL)) == {"mean_err", "mean_nll", "mean_ece"}


def test_baseline_must_cover_every_severity():
  with pytest.raises(ValueError, match="baseline lacks"):
    corruption_aggregates(MODEL, {k: v for k, v in BASELINE.items() if k != ("b", 2)}, corruptions=("a", "b"))


def test_reference_csv_layout_in_percent(tmp_path):
  path = tmp_path / "alexnet.csv"
  path.write_text("severity,type,NLL,cut0,Acc,ECE\n1,fog,0.9,0,82.4,10.1\n2,fog,1.1,0,80.0,12.0\n")
  table = read_corruption_table(str(path))
  assert table[("fog", 1)] == pytest.approx({"nll": 0.9, "err": 0.176, "ece": 0.101})
  assert table[("fog", 2)]["err"] == pytest.approx(0.2)


@pytest.mark.parametrize("path,arg", [("configs/cifar_resnet.py", "vgg_mcdo_smoothing_16,cifar100,runlocal"),
                                      ("configs/imagenet_resnet.py", "resnet_dnn_50"),
                                      ("configs/quickstart.py", "")])
def test_configs_load_and_are_locked(path, arg):
  root = pathlib.Path(__file__).resolve().parents[1]
  spec = importlib.util.spec_from_file_location("config_module", root / path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(arg)
  assert config.model and config.dataset and config.batch_size > 0
  with pytest.raises(AttributeError):
    config.not_a_key = 1
