"""smoothing_jax.experiment.config: one load for every caller — a config file by path with its
arguments, then overrides of existing keys only, with values of their type."""
import pathlib

import pytest

from smoothing_jax.experiment.config import check_key, load, with_overrides

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
