"""smoothing_jax.workdir: config.json with the model_spec, load(workdir) without the dataset,
checkpoints across device counts, corrupted checkpoints.

The cheapest model to compile (one ResNet stage of width 4 on 16×16 images) keeps these tests to
seconds on CPU.
"""
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import cifar_resnet
from smoothing_jax import evaluate, train
from smoothing_jax import workdir as workdir_lib
from smoothing_jax.models import get_model
from tests.helpers import override

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def npz_config(data_dir, **overrides):
  """``resnet_dnn_18`` cut to one stage of width 4 on the 16×16 ``npz:`` set of ``_write_npz``."""
  return override(cifar_resnet.get_config(f"resnet_dnn_18,npz:{data_dir},runlocal"), **{
      "model_kwargs.width": 4,
      "model_kwargs.stage_sizes": (1,),
      "batch_size": 8,
      "eval_batch_size": 16,
      "num_train_steps": 4,
      "checkpoint_every_steps": 2,
      "ensemble_sizes": (1,),
      **overrides
  })


def _write_npz(root):
  rng = np.random.default_rng(0)
  for split, n in (("train", 32), ("test", 16)):
    images = rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8)
    np.savez(os.path.join(root, f"{split}.npz"), images=images, labels=rng.integers(0, 4, n))
  return str(root)


# ----------------------------------------------------------------------------- config.json, load


def test_config_and_model_spec_round_trip(tmp_path):
  config = npz_config(str(tmp_path / "data"))  # the config names the data; nothing reads it
  spec = {"num_classes": 4, "stem": "cifar", "image_shape": [16, 16, 3]}
  workdir_lib.write_config(str(tmp_path), config, spec)
  assert os.listdir(tmp_path) == [workdir_lib.CONFIG_FILE]  # written atomically: no .tmp left
  read, read_spec = workdir_lib.read_config(str(tmp_path))
  assert read_spec == spec
  assert json.loads(read.to_json_best_effort()) == json.loads(config.to_json_best_effort())
  assert "model_spec" not in read
  model = workdir_lib.build_model(read, read_spec)
  assert (model.num_classes, model.stem, model.width, tuple(model.stage_sizes)) == (4, "cifar", 4,
                                                                                      (1,))


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  """``gs://…`` paths served from ``tmp_path/gcs`` through ``etils.epath.testing.mock_epath``
  (every backend call rewritten; epath would otherwise pick TensorFlow's GCS client, which
  needs a network).  Orbax checkpoints go through TensorStore's own GCS driver: not covered."""
  from etils.epath import gpath, testing
  root = tmp_path / "gcs"
  root.mkdir()

  def local(path):
    path = os.fspath(path)
    return path.replace("gs://", f"{root}/", 1) if path.startswith("gs://") else path

  def one(original, path, *args, **kwargs):
    return original(local(path), *args, **kwargs)

  def two(original, source, destination, *args, **kwargs):
    return original(local(source), local(destination), *args, **kwargs)

  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  names = ("open", "exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "remove", "rmtree",
           "stat", "walk")
  with testing.mock_epath(**{name: one for name in names}, copy=two, rename=two, replace=two):
    yield root


def test_workdir_files_go_through_epath_to_gcs_paths(fake_gcs, tmp_path, monkeypatch):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  monkeypatch.chdir(tmp_path)
  workdir = "gs://bucket/run"
  assert str(workdir_lib.workdir_path(workdir)) == workdir  # a URI is never made "absolute"
  assert workdir_lib.workdir_path("relative/run") == tmp_path / "relative" / "run"
  config = npz_config(str(tmp_path / "data"))
  spec = {"num_classes": 4, "stem": "cifar", "image_shape": [16, 16, 3]}
  workdir_lib.write_config(workdir, config, spec)
  assert workdir_lib.read_config(workdir)[1] == spec
  results = workdir_lib.workdir_path(workdir) / "results"
  rows = [{"type": "fog", "severity": 1, "NLL": 1.5, "Acc": 0.5, "ECE": 0.1, "count": 10}]
  evaluate._write_table(rows, results, "corruptions")
  workdir_lib.save_figure(plt.figure(), results / "figure.png")
  assert evaluate.read_corruption_table(results / "corruptions.csv")[("fog", 1)]["nll"] == 1.5
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
  with pytest.raises(FileNotFoundError, match=message):
    workdir_lib.load(missing)
  os.makedirs(missing)
  with open(os.path.join(missing, "config.json"), "w") as f:
    json.dump({"model": "resnet_dnn_18"}, f)  # as written before model_spec was recorded
  with pytest.raises(ValueError, match="has no model_spec .*rerun the training command once"):
    workdir_lib.read_config(missing)


def test_load_rebuilds_the_model_without_the_dataset(tmp_path):
  (tmp_path / "data").mkdir()
  data = _write_npz(tmp_path / "data")
  workdir = str(tmp_path / "run")
  state = train.train_and_evaluate(npz_config(data, num_train_steps=2), workdir)
  shutil.rmtree(data)  # the dataset is gone: the model is rebuilt from config.json alone
  config, model, variables = workdir_lib.load(workdir)
  assert config.dataset == f"npz:{data}" and not os.path.exists(data)
  assert workdir_lib.read_config(workdir)[1] == {"num_classes": 4, "stem": "cifar",
                                                 "image_shape": [16, 16, 3],
                                                 "num_train_examples": 32}
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(variables),
               jax.device_get({"params": state.params, "batch_stats": state.batch_stats}))
  images = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
  expected = get_model("resnet_dnn_18", 4, width=4, stage_sizes=(1,)).apply(variables, images)
  np.testing.assert_array_equal(model.apply(variables, images), expected)
  # A given config (evaluation settings changed) is returned; the model is the recorded one.
  given, rebuilt, _ = workdir_lib.load(workdir, npz_config(data, eval_batch_size=32))
  assert given.eval_batch_size == 32 and rebuilt.num_classes == 4
  assert jnp.shape(rebuilt.apply(variables, images)) == (2, 4)


# ----------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def npz_run(tmp_path_factory):
  """``(data_dir, workdir, final variables)`` of 4 steps on 8 devices (checkpoints 2 and 4)."""
  data = _write_npz(tmp_path_factory.mktemp("npz_data"))
  workdir = str(tmp_path_factory.mktemp("npz_run"))
  state = train.train_and_evaluate(npz_config(data), workdir)
  return data, workdir, jax.device_get({"params": state.params, "batch_stats": state.batch_stats})


def _flat(variables) -> dict:
  from flax.traverse_util import flatten_dict
  return {k: np.asarray(v) for k, v in flatten_dict(jax.device_get(variables), sep="/").items()}


def _worker(data_dir, jobs):
  """Body of ``python -m tests.test_workdir DATA JOBS`` in a process with its own device count.

  ``jobs``: ``["train", workdir, stop_after_steps]`` (resumes if ``workdir`` has checkpoints)
  or ``["evaluate", workdir, output_dir]`` (``--mode=evaluate`` of ``workdir``, then the
  ``load_checkpoint`` variables saved to ``output_dir/variables.npz``).
  """
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.INFO)  # "Resumed from step ..." on stderr
  for kind, workdir, arg in jobs:
    if kind == "train":
      train.train_and_evaluate(npz_config(data_dir), workdir, stop_after_steps=arg)
    else:
      evaluate.evaluate_ensemble_sizes([workdir], arg)
      _, step, variables = workdir_lib.load_checkpoint(workdir)
      np.savez(os.path.join(arg, "variables.npz"), step=step, **_flat(variables))


def _start_worker(num_devices: int, data_dir: str, jobs: list) -> subprocess.Popen:
  flags = f"--xla_force_host_platform_device_count={num_devices} --xla_backend_optimization_level=0"
  return subprocess.Popen([sys.executable, "-m", "tests.test_workdir", data_dir, json.dumps(jobs)],
                          cwd=ROOT, env=dict(os.environ, XLA_FLAGS=flags, CUDA_VISIBLE_DEVICES=""),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(worker: subprocess.Popen) -> str:
  _, stderr = worker.communicate(timeout=600)
  assert worker.returncode == 0, stderr[-5000:]
  return stderr


def _copy_steps(source: str, destination, steps) -> str:
  """A copy of workdir ``source`` keeping only the checkpoint ``steps``."""
  shutil.copytree(source, destination)
  checkpoints = os.path.join(destination, "checkpoints")
  for name in os.listdir(checkpoints):
    if int(name) not in steps:
      shutil.rmtree(os.path.join(checkpoints, name))
  return str(destination)


# Steps 1-2 or 3-4 on another device count sum BatchNorm statistics and gradients over the
# batch in another order: float32 round-off, not bit equality (observed: at most 2.4e-7, about
# 2 ulp of the largest parameters ~1.4; relative 2e-5 only on entries ~1e-4 with a 5e-10 error).
_ACROSS_DEVICE_COUNTS = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)


def test_checkpoints_move_between_device_counts(npz_run, tmp_path, caplog):
  """8 → 1: evaluate (load_checkpoint); 1 → 8 and 8 → 2: resume; the resumed runs end with the
  uninterrupted 8-device run's variables (to float32 round-off)."""
  data, full, final = npz_run
  cut8 = _copy_steps(full, tmp_path / "cut8", {2})  # = an 8-device run stopped after step 2
  cut1, results = str(tmp_path / "cut1"), str(tmp_path / "results")
  one = _start_worker(1, data, [["evaluate", full, results], ["train", cut1, 2]])
  two = _start_worker(2, data, [["train", cut8, None]])
  _finish(one)
  with caplog.at_level(logging.INFO):
    resumed = train.train_and_evaluate(npz_config(data), cut1)  # 1 → 8
  assert "Resumed from step 2" in caplog.text
  assert int(resumed.step) == 4
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(resumed.params), final["params"])
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(resumed.batch_stats), final["batch_stats"])

  rows = json.load(open(os.path.join(results, "ensemble_sizes.json")))  # 8 → 1
  assert rows[0]["count"] == 16 and np.isfinite(rows[0]["nll"])
  on_one = dict(np.load(os.path.join(results, "variables.npz")))
  assert int(on_one.pop("step")) == 4
  _, _, here = workdir_lib.load_checkpoint(full)
  assert on_one.keys() == _flat(here).keys()
  for key, value in _flat(here).items():
    np.testing.assert_array_equal(on_one[key], value, err_msg=key)

  assert "Resumed from step 2" in _finish(two)  # 8 → 2
  _, step, variables = workdir_lib.load_checkpoint(cut8)  # written by 2 devices, read on 8
  assert step == 4
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(variables), final)


def _corrupt(workdir, step: int):
  """Flip every byte of the OCDBT data files (``d/*``) of checkpoint ``step``.

  orbax 0.12.8 writes ``<step>/default/ocdbt.process_0/d/*`` and merges them into
  ``<step>/default/d/*``; small arrays such as this test model's are stored inline in the
  merged file, larger ones in the per-process files, so all are flipped.
  """
  for directory, _, names in os.walk(os.path.join(workdir, "checkpoints", str(step))):
    for name in names if os.path.basename(directory) == "d" else ():
      with open(os.path.join(directory, name), "r+b") as f:
        data = f.read()
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in data))


def _files(directory) -> dict:
  """``{relative path: sha256}`` of every file under ``directory``."""
  digests = {}
  for d, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(d, name)
      with open(path, "rb") as f:
        digests[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
  return digests


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no loop noise
def test_corrupted_latest_checkpoint_falls_back_to_the_newest_intact_one(npz_run, tmp_path, caplog):
  data, full, final = npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  _corrupt(workdir, 4)
  checkpoints = workdir / "checkpoints"
  before = _files(checkpoints)
  with caplog.at_level(logging.WARNING):
    _, step, _ = workdir_lib.load_checkpoint(str(workdir))
  assert step == 2
  assert f"Checkpoint step 4 in {checkpoints} cannot be restored (ValueError: " in caplog.text
  assert _files(checkpoints) == before  # load_checkpoint changes nothing

  caplog.clear()
  with caplog.at_level(logging.WARNING):
    resumed = train.train_and_evaluate(npz_config(data), str(workdir))
  assert "Checkpoint step 4" in caplog.text and "4.corrupt" in caplog.text
  assert "never retrieved" not in caplog.text  # no noise of the reads the failed restore abandoned
  assert int(resumed.step) == 4  # steps 3-4 again, on the same devices: bit-identical
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), final["params"])
  # Nothing deleted: the unreadable step is kept as 4.corrupt, byte for byte, beside the new 4.
  after = _files(checkpoints)
  assert sorted(os.listdir(checkpoints)) == ["2", "4", "4.corrupt"]
  for name, digest in before.items():
    kept = "4.corrupt" + name[1:] if name.startswith("4" + os.sep) else name
    assert after[kept] == digest, name
  _, step, variables = workdir_lib.load_checkpoint(str(workdir))
  assert step == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(variables["params"]), final["params"])


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no loop noise
def test_no_intact_checkpoint_is_a_one_line_error_and_deletes_nothing(npz_run, tmp_path, caplog):
  data, full, _ = npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  for step in (2, 4):
    _corrupt(workdir, step)
  checkpoints = workdir / "checkpoints"
  before = _files(checkpoints)
  with pytest.raises(FileNotFoundError) as error:
    workdir_lib.load_checkpoint(str(workdir))
  assert isinstance(error.value, workdir_lib.NoIntactCheckpointError)
  message = str(error.value)
  assert message.startswith(f"No intact checkpoint in {checkpoints}: steps 4, 2 failed to restore")
  assert "\n" not in message
  with pytest.raises(workdir_lib.NoIntactCheckpointError, match="No intact checkpoint in"):
    train.train_and_evaluate(npz_config(data), str(workdir))
  assert _files(checkpoints) == before
  assert "never retrieved" not in caplog.text



# ----------------------------------------------------------------------------- config.init_from


def test_init_from_a_workdir_fine_tunes_with_a_fresh_classifier(npz_run, tmp_path, caplog):
  data, source, trained = npz_run
  workdir = tmp_path / "fine_tune"
  with caplog.at_level(logging.WARNING):  # 6 classes instead of 4; no step taken
    state = train.train_and_evaluate(npz_config(data, init_from=source, num_classes=6),
                                     str(workdir), stop_after_steps=0)
  before = _flat(trained)
  started = _flat({"params": state.params, "batch_stats": state.batch_stats})
  head = ["params/classifier_0/dense/bias", "params/classifier_0/dense/kernel"]
  assert started[head[0]].shape == (6,) and before[head[0]].shape == (4,)
  assert sorted(started) == sorted(before)
  for key in set(before) - set(head):
    np.testing.assert_array_equal(started[key], before[key])
  assert f"re-initialised {', '.join(head)}" in caplog.text
  assert json.load(open(workdir / workdir_lib.CONFIG_FILE))["init_from"] == source
  # Resuming reads the recorded model spec, not the init_from source (moved away here).
  moved = tmp_path / "source_copy"
  shutil.copytree(source, moved)
  config = npz_config(data, init_from=str(moved), num_classes=6)
  first = train.train_and_evaluate(config, str(tmp_path / "resumed"), stop_after_steps=2)
  shutil.rmtree(moved)
  again = train.train_and_evaluate(config, str(tmp_path / "resumed"), stop_after_steps=0)
  assert int(again.step) == int(first.step) == 2
  jax.tree.map(np.testing.assert_array_equal, again.params, first.params)


def test_init_from_errors_name_the_source_and_every_mismatch(npz_run, tmp_path):
  data, source, _ = npz_run
  with pytest.raises(FileNotFoundError, match="config.init_from '.*nowhere': no such workdir"):
    train.train_and_evaluate(npz_config(data, init_from=str(tmp_path / "nowhere")),
                             str(tmp_path / "run"), stop_after_steps=0)
  spec = {"num_classes": 6, "stem": "cifar", "image_shape": [16, 16, 3]}

  def target(config):
    model = workdir_lib.build_model(config, spec)
    return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 16, 16, 3))))

  config = npz_config(data, init_from=source)  # evaluation: no fresh classifier
  with pytest.raises(ValueError, match=r"(?s)does not match 'resnet_dnn_18' \(num_classes=6\):.*"
                     r"shape mismatches \(2\): params/classifier_0/dense/bias: \(4,\)"):
    workdir_lib.init_from_variables(config, spec, target(config))
  wider = npz_config(data, init_from=source, **{"model_kwargs.width": 8})
  with pytest.raises(ValueError, match=r"params/layer0_0/kernel: \(3, 3, 3, 4\), expected"):
    workdir_lib.init_from_variables(wider, spec, target(wider), new_classifier=True)


def test_evaluation_and_analyses_of_a_timm_checkpoint_file(npz_run, tmp_path):
  """HV's released ViT layout (timm, saved as ``{"state_dict": ...}``), evaluated by
  ``--mode=evaluate`` in a workdir with no checkpoint, then loaded by the analyses."""
  from configs import cifar_vit
  from smoothing_jax.analysis.trained import eval_pixels, load_trained
  from smoothing_jax.convert import TIMM_LAYOUTS
  from tests.helpers import import_timm, model_options
  timm = import_timm()  # skips without torch or timm, before anything imports them
  import torch
  from smoothing_jax.torch_reference import randomize
  data = npz_run[0]
  vit = randomize(timm.models.vision_transformer.VisionTransformer(
      num_classes=4, img_size=16, patch_size=2, embed_dim=16, depth=2, num_heads=2,
      qkv_bias=False))
  torch.save({"state_dict": vit.state_dict()}, tmp_path / "vit.pth.tar")
  config = override(cifar_vit.get_config(f"vit_ti,npz:{data},runlocal"),
                    **model_options(hidden_dim=16, depth=2, num_heads=2, head_dim=8, mlp_dim=64,
                                    patch_size=None),  # the timm layout's patch size, 2
                    init_from=str(tmp_path / "vit.pth.tar"), eval_batch_size=16,
                    ensemble_sizes=(1,))
  workdir = str(tmp_path / "evaluation")
  (row,) = evaluate.evaluate_ensemble_sizes([workdir], f"{workdir}/results", config)
  assert workdir_lib.read_config(workdir)[1]["model_options"] == TIMM_LAYOUTS["vit_ti"]
  trained = load_trained(workdir)
  assert trained.step == 0 and not workdir_lib.has_checkpoint(workdir)
  pixels, labels = eval_pixels(trained, 16)
  images = np.array(trained.normalize(pixels))
  with torch.no_grad():
    expected = vit(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
  np.testing.assert_allclose(trained.model.apply(trained.variables, images), expected, rtol=1e-4,
                             atol=1e-4)
  assert row["count"] == 16 and row["acc"] == pytest.approx(np.mean(expected.argmax(-1) == labels))


def test_an_interrupted_fine_tune_is_not_taken_for_an_evaluation_of_its_source(tmp_path):
  """A training run from ``init_from`` stopped before its first checkpoint records
  ``config.json`` with ``init_from`` too: only a workdir recorded by ``record_init_from`` (marked
  in its model spec) stands for the source's variables; the other is a run, never overwritten."""
  config = cifar_resnet.get_config("resnet_dnn_18,cifar10,runlocal")
  spec = {"num_classes": 10, "stem": "cifar", "image_shape": [32, 32, 3]}
  config = override(config, init_from=str(tmp_path / "source"))
  fine_tune, evaluation = str(tmp_path / "fine_tune"), str(tmp_path / "evaluation")
  workdir_lib.write_config(fine_tune, config, spec)
  workdir_lib.write_config(evaluation, config, {**spec, workdir_lib.EVALUATES_INIT_FROM: True})
  assert not workdir_lib.evaluates_init_from(fine_tune) and workdir_lib.has_run(fine_tune)
  assert workdir_lib.evaluates_init_from(evaluation) and not workdir_lib.has_run(evaluation)
  assert not workdir_lib.has_run(str(tmp_path / "empty"))


if __name__ == "__main__":
  _worker(sys.argv[1], json.loads(sys.argv[2]))
