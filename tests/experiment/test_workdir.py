"""smoothing_jax.experiment.workdir: a run's files — config.json with the model spec, atomic
writes, and paths that may be ``gs://`` URIs."""
import json
import os
import re

import pytest

from smoothing_jax.evaluators.common import write_table
from smoothing_jax.evaluators.corruptions import read_corruption_table
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.config import MOVED_KEYS
from smoothing_jax.experiment.spec import ModelSpec
from tests.helpers import small_npz_config

SPEC = ModelSpec(4, "cifar", (16, 16, 3), 32)
# A config.json that version 0.1.0 wrote for configs/quickstart.py (data keys at the top level).
FIXTURE_0_1_0 = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures",
                             "config_0_1_0_quickstart.json")
# Keys of today's quickstart config that 0.1.0 did not record (none yet).
# (The settings blocks of other methods are not: a config holds its own method's alone.)
# The model options SNGP added (every model's options are config keys).
SNGP_OPTIONS = {"model_kwargs.spectral_norm", "model_kwargs.spectral_norm_iterations",
                "model_kwargs.gp_features", "model_kwargs.gp_ridge",
                "model_kwargs.filter_dropout_rate"}
ADDED_SINCE_0_1_0 = {"deep_ensemble.member_seeds", "model_kwargs.bnn_reference",
                     "model_kwargs.mimo_members", "steps_per_call", "input.image_size",
                     *SNGP_OPTIONS}
# A config.json written by main at d63e843 (every method's settings block in every config),
# of `configs/cifar_resnet.py:resnet_batchensemble_18,cifar10`: made by that commit's code,
# `config.to_json_best_effort()` plus a model_spec.
FIXTURE_D63E843 = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures",
                               "config_d63e843_batchensemble.json")


def _flat(config, prefix="") -> dict:
  """``{dotted key: value}`` of the leaves of a ConfigDict or dict."""
  out = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      out.update(_flat(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def test_config_and_model_spec_round_trip(tmp_path):
  config = small_npz_config(str(tmp_path / "data"))  # the config names the data; nothing reads it
  workdir_lib.write_config(str(tmp_path), config, SPEC)
  assert os.listdir(tmp_path) == [workdir_lib.CONFIG_FILE]  # written atomically: no .tmp left
  assert json.load(open(tmp_path / workdir_lib.CONFIG_FILE))["model_spec"] == {
      "num_classes": 4, "stem": "cifar", "image_shape": [16, 16, 3], "num_train_examples": 32}
  read, read_spec = workdir_lib.read_config(str(tmp_path))
  assert read_spec == SPEC
  assert json.loads(read.to_json_best_effort()) == json.loads(config.to_json_best_effort())
  assert "model_spec" not in read


def test_workdir_files_go_through_epath_to_gcs_paths(fake_gcs, tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  monkeypatch.chdir(tmp_path)
  workdir = "gs://bucket/run"
  assert str(workdir_lib.workdir_path(workdir)) == workdir  # a URI is never made "absolute"
  assert workdir_lib.workdir_path("relative/run") == tmp_path / "relative" / "run"
  config = small_npz_config(str(tmp_path / "data"))
  workdir_lib.write_config(workdir, config, SPEC)
  assert workdir_lib.read_config(workdir)[1] == SPEC
  results = workdir_lib.workdir_path(workdir) / "results"
  rows = [{"type": "fog", "severity": 1, "NLL": 1.5, "Acc": 0.5, "ECE": 0.1, "count": 10}]
  write_table(rows, results, "corruptions")
  workdir_lib.save_figure(plt.figure(), results / "figure.png")
  assert read_corruption_table(results / "corruptions.csv")[("fog", 1)]["nll"] == 1.5
  stored = fake_gcs / "bucket" / "run"
  assert sorted(os.listdir(stored)) == ["config.json", "results"]
  assert sorted(os.listdir(stored / "results")) == ["corruptions.csv", "corruptions.json",
                                                     "figure.png"]  # no .tmp left behind
  assert (stored / "results" / "figure.png").read_bytes()[:4] == b"\x89PNG"
  assert not os.path.exists(tmp_path / "gs:")  # nothing went to a local "gs:/bucket" folder


def test_missing_run_and_missing_model_spec_are_clear_errors(tmp_path):
  missing = str(tmp_path / "never_trained")
  message = re.escape(f"No run in {missing}: {os.path.join(missing, 'config.json')} does not "
                      "exist (train into it first).")
  with pytest.raises(FileNotFoundError, match=message):
    workdir_lib.read_config(missing)
  os.makedirs(missing)
  with open(os.path.join(missing, "config.json"), "w") as f:
    json.dump({"model": "resnet_dnn_18"}, f)  # as written before model_spec was recorded
  with pytest.raises(ValueError, match="has no model_spec .*rerun the training command once"):
    workdir_lib.read_config(missing)


def test_config_json_of_0_1_0_reads_in_todays_layout(tmp_path):
  """The data keys move under ``input`` and the deep ensemble's under ``deep_ensemble``
  (``MOVED_KEYS``) with their values; the upgraded config has
  exactly the keys of today's quickstart config, each of a type it takes; its data loads."""
  from configs import quickstart
  from smoothing_jax.data import create_pipeline
  from smoothing_jax.experiment.config import with_overrides
  old = json.load(open(FIXTURE_0_1_0))
  (tmp_path / workdir_lib.CONFIG_FILE).write_text(json.dumps(old))
  config, spec = workdir_lib.read_config(str(tmp_path))
  assert set(MOVED_KEYS) == {"dataset", "data_dir", "download", "data_pipeline", "batch_size",
                             "crop_size", "randaugment", "train_fraction", "holdout_fraction",
                             "data_split_seed", "eval_cache", "ensemble_members",
                             "ensemble_shared_batches", "ensemble_vmap_size"}
  for old_key, new_key in MOVED_KEYS.items():
    assert old_key not in config, old_key
    value = config[new_key]
    assert (value.to_dict() if hasattr(value, "to_dict") else value) == old[old_key], new_key
  assert config.input.split_seed == old["data_split_seed"] == -1
  today = quickstart.get_config()
  upgraded = _flat(config)
  assert set(_flat(today)) - set(upgraded) == ADDED_SINCE_0_1_0
  # Every recorded key exists today and takes its recorded value (JSON lists as tuples).
  rebuilt = _flat(with_overrides(today, upgraded))
  assert {k: rebuilt[k] for k in upgraded} == {
      k: tuple(v) if isinstance(v, list) else v for k, v in upgraded.items()}
  pipeline = create_pipeline(config.input, config.seed)
  assert pipeline.num_train == spec.num_train_examples == 1437


def test_config_json_of_main_before_config_method_keeps_its_methods_block_alone(tmp_path):
  """A record of d63e843 (before ``config.method``) reads as today's config of the same recipe:
  ``method`` unset (the model's, BatchEnsemble), its ``batch_ensemble`` block with the recorded
  values, and no other method's block."""
  from configs import cifar_resnet
  from smoothing_jax.methods import resolve
  from smoothing_jax.models import get_model
  old = json.load(open(FIXTURE_D63E843))
  assert {"ibnn", "bnnvi", "mimo", "batch_ensemble"} <= set(old)  # every block, as then
  (tmp_path / workdir_lib.CONFIG_FILE).write_text(json.dumps(old))
  config, _ = workdir_lib.read_config(str(tmp_path))
  assert config.method is None
  assert {"ibnn", "bnnvi", "mimo"}.isdisjoint(config.keys())
  assert config.batch_ensemble.to_dict() == old["batch_ensemble"]
  today = cifar_resnet.get_config("resnet_batchensemble_18,cifar10")
  added_since = {"steps_per_call", "input.image_size", *SNGP_OPTIONS}  # defaulted
  assert set(_flat(today)) - set(_flat(config)) == added_since
  assert set(_flat(config)) <= set(_flat(today))
  model = get_model(config.model, 10, width=4)
  assert resolve(config, model).name == "batch_ensemble"


def test_upgrade_record_leaves_a_record_of_today_unchanged():
  from configs import quickstart
  record = json.loads(quickstart.get_config().to_json_best_effort())
  record["model_spec"] = SPEC.to_record()
  assert workdir_lib.upgrade_record(record) == record


def test_a_damaged_config_json_and_a_workdir_that_is_a_file_are_named(tmp_path):
  workdir = tmp_path / "run"
  workdir_lib.write_config(str(workdir), small_npz_config(str(tmp_path / "data")), SPEC)
  path = workdir / workdir_lib.CONFIG_FILE
  path.write_text(path.read_text()[:40])  # truncated, as by a full disk or a killed copy
  with pytest.raises(ValueError) as err:
    workdir_lib.read_config(str(workdir))
  assert str(err.value).startswith(f"{path} is damaged (not valid JSON: ")
  assert "\n" not in str(err.value)
  workdir_lib.check_directories(str(workdir), str(tmp_path / "new"))  # directories, new or not
  with pytest.raises(NotADirectoryError, match=re.escape(
      f"Workdir {path} is a file, not a directory: give a new directory or one that holds a run.")):
    workdir_lib.check_directories(str(workdir), str(path))
