"""smoothing_jax.experiment.config: one load for every caller — a config file by path with its
arguments, then overrides of existing keys only, with values of their type."""
import pathlib
import re

import pytest

from smoothing_jax.experiment.config import check_key, load, with_overrides
from smoothing_jax.experiment.config_base import with_model
from smoothing_jax.models import model_options
from tests.helpers import absl_info_lines

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path,arg",
                         [("configs/cifar_resnet.py", "vgg_mcdo_smoothing_16,cifar100,runlocal"),
                          ("configs/imagenet_resnet.py", "resnet_dnn_50"),
                          ("configs/quickstart.py", "")])
def test_configs_load_and_are_locked(path, arg, monkeypatch):
  monkeypatch.chdir(ROOT)  # config paths are relative to the current directory
  config = load(f"{path}:{arg}" if arg else path)
  assert config.model and config.input.dataset and config.input.batch_size > 0
  with pytest.raises(AttributeError):
    config.not_a_key = 1


def test_overrides_set_existing_keys_and_name_unknown_ones(monkeypatch):
  monkeypatch.chdir(ROOT)
  config = load("configs/quickstart.py:runlocal", {"model_kwargs.width": 4, "num_train_steps": 3})
  assert (config.model_kwargs.width, config.num_train_steps) == (4, 3)
  assert load(config, {}).num_train_steps == 3 and load(config, {}) is not config  # a copy
  with pytest.raises(ValueError, match=r"Override 'model_kwargs\.widht': unknown config key "
                     r"'model_kwargs\.widht'; keys there: .*width"):
    with_overrides(config, {"model_kwargs.widht": 4})
  with pytest.raises(ValueError, match="Override num_train_steps='many'"):
    with_overrides(config, {"num_train_steps": "many"})
  with pytest.raises(KeyError, match="unknown config key 'input.randaugment.layers'"):
    check_key(config, "input.randaugment.layers")
  check_key(config, "input.randaugment.num_layers")
  with pytest.raises(ValueError, match="'configs/nope.py' is not a config file"):
    load("configs/nope.py:runlocal")


def test_a_moved_key_names_its_new_place(monkeypatch):
  monkeypatch.chdir(ROOT)
  config = load("configs/quickstart.py")
  for old, new in (("dataset", "input.dataset"), ("ensemble_members", "deep_ensemble.members"),
                   ("randaugment.num_layers", "input.randaugment.num_layers")):
    with pytest.raises(ValueError, match=re.escape(
        f"Override {old!r}: unknown config key {old!r} (moved to {new!r}).")):
      with_overrides(config, {old: 1})


def test_another_model_brings_its_options_and_keeps_the_set_ones_it_takes(monkeypatch):
  monkeypatch.chdir(ROOT)
  config = load("configs/quickstart.py", {"model_kwargs.groups": 2})  # a ResNet-only option
  with absl_info_lines() as lines:
    switched = with_model(config, "wideresnet_ibnn_28_10")
  assert set(switched.model_kwargs) == set(model_options("wideresnet_ibnn_28_10"))
  assert (switched.model_kwargs.width, switched.model_kwargs.depth) == (16, None)  # width kept
  assert lines == ["Model wideresnet_ibnn_28_10 takes no option groups=2 of "
                   "resnet_mcdo_smoothing_18: dropped from model_kwargs.",
                   "Method ibnn: its settings (config.ibnn) at their defaults."]
  assert "ibnn" in switched and "ibnn" not in config  # the new model's method's block alone
  assert with_overrides(switched, {"model_kwargs.depth": 10}).model_kwargs.depth == 10
  assert config.model == "resnet_mcdo_smoothing_18" and "depth" not in config.model_kwargs
  with pytest.raises(AttributeError):  # locked as the config was
    switched.not_a_key = 1
  with pytest.raises(ValueError, match="Unknown model name 'wideresnet_ibnn_28_1'"):
    with_model(config, "wideresnet_ibnn_28_1")
