"""smoothing_jax.experiment.checkpoints: checkpoints across device counts, corrupted checkpoints,
and the state of a workdir (a run recorded, checkpoints written).

The cheapest model to compile (one ResNet stage of width 4 on 16×16 images) keeps these tests to
seconds on CPU.
"""
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import cifar_resnet
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.checkpoints import (
  NoIntactCheckpointError,
  evaluates_init_from,
  has_checkpoint,
  has_run,
  load_variables,
)
from smoothing_jax.experiment.spec import ModelSpec
from smoothing_jax.parallel import create_mesh
from smoothing_jax.training import train
from tests.helpers import (
    evaluate_workdir,
    flat_variables,
    override,
    small_npz_config,
    subprocess_xla_flags,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(data_dir, jobs):
  """Body of ``python -m tests.experiment.test_checkpoints DATA JOBS`` in a process with its own
  device count.

  ``jobs``: ``["train", workdir, stop_after_steps]`` (resumes if ``workdir`` has checkpoints)
  or ``["evaluate", workdir, output_dir]`` (``--mode=evaluate`` of ``workdir``, then the
  ``load_variables`` saved to ``output_dir/variables.npz``).
  """
  from absl import logging as absl_logging
  absl_logging.set_verbosity(absl_logging.INFO)  # "Resumed from step ..." on stderr
  for kind, workdir, arg in jobs:
    if kind == "train":
      train.train_from_config(small_npz_config(data_dir), workdir, stop_after_steps=arg)
    else:
      evaluate_workdir("ensemble_sizes", workdir, arg)
      step, variables = load_variables(workdir, create_mesh())
      np.savez(os.path.join(arg, "variables.npz"), step=step, **flat_variables(variables))


def _start_worker(num_devices: int, data_dir: str, jobs: list) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-m", "tests.experiment.test_checkpoints", data_dir,
                           json.dumps(jobs)], cwd=ROOT,
                          env=dict(os.environ, XLA_FLAGS=subprocess_xla_flags(num_devices),
                                   CUDA_VISIBLE_DEVICES=""),
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


def test_checkpoints_move_between_device_counts(small_npz_run, tmp_path, caplog):
  """8 → 1: evaluate (load_variables); 1 → 8 and 8 → 2: resume; the resumed runs end with the
  uninterrupted 8-device run's variables (to float32 round-off)."""
  data, full, final = small_npz_run
  cut8 = _copy_steps(full, tmp_path / "cut8", {2})  # = an 8-device run stopped after step 2
  cut1, results = str(tmp_path / "cut1"), str(tmp_path / "results")
  one = _start_worker(1, data, [["evaluate", full, results], ["train", cut1, 2]])
  two = _start_worker(2, data, [["train", cut8, None]])
  _finish(one)
  with caplog.at_level(logging.INFO):
    resumed = train.train_from_config(small_npz_config(data), cut1)  # 1 → 8
  assert "Resumed from step 2" in caplog.text
  assert int(resumed.step) == 4
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(resumed.params), final["params"])
  jax.tree.map(_ACROSS_DEVICE_COUNTS, jax.device_get(resumed.batch_stats), final["batch_stats"])

  rows = json.load(open(os.path.join(results, "ensemble_sizes.json")))  # 8 → 1
  assert rows[0]["count"] == 16 and np.isfinite(rows[0]["nll"])
  on_one = dict(np.load(os.path.join(results, "variables.npz")))
  assert int(on_one.pop("step")) == 4
  _, here = load_variables(full, create_mesh())
  assert on_one.keys() == flat_variables(here).keys()
  for key, value in flat_variables(here).items():
    np.testing.assert_array_equal(on_one[key], value, err_msg=key)

  assert "Resumed from step 2" in _finish(two)  # 8 → 2
  step, variables = load_variables(cut8, create_mesh())  # written by 2 devices, read on 8
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
def test_corrupted_latest_checkpoint_falls_back_to_the_newest_intact_one(small_npz_run, tmp_path,
                                                                         caplog):
  data, full, final = small_npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  _corrupt(workdir, 4)
  checkpoints = workdir / "checkpoints"
  before = _files(checkpoints)
  with caplog.at_level(logging.WARNING):
    step, _ = load_variables(str(workdir), create_mesh())
  assert step == 2
  assert f"Checkpoint step 4 in {checkpoints} cannot be restored (ValueError: " in caplog.text
  assert _files(checkpoints) == before  # load_variables changes nothing

  caplog.clear()
  with caplog.at_level(logging.WARNING):
    resumed = train.train_from_config(small_npz_config(data), str(workdir))
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
  step, variables = load_variables(str(workdir), create_mesh())
  assert step == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(variables["params"]), final["params"])


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no loop noise
def test_an_evaluation_names_the_older_step_it_fell_back_to_and_moves_nothing(small_npz_run,
                                                                              tmp_path, caplog,
                                                                              capsys):
  """One data file of the newest step (4) deleted: ``--mode=evaluate`` scores step 2 and says so
  in one warning line naming both steps and why, in the printed table's first line and in every
  row it writes; a reader leaves the damaged step where it is (a resuming training run sets it
  aside, above)."""
  from smoothing_jax import main
  _, full, _ = small_npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  checkpoints = workdir / "checkpoints"
  data_files = sorted(os.path.join(d, name) for d, _, names in os.walk(checkpoints / "4")
                      for name in names if os.path.basename(d) == "d")
  os.remove(data_files[0])
  before = _files(checkpoints)
  with caplog.at_level(logging.WARNING):
    main.run(main.resolve_config("evaluate", str(workdir)), str(workdir), "evaluate")
  (line,) = [r.getMessage() for r in caplog.records if "cannot be restored" in r.getMessage()]
  assert line.startswith(f"Checkpoint step 4 in {checkpoints} cannot be restored (")
  assert line.endswith("; using the older step 2 instead.") and "\n" not in line
  assert f"ensemble_sizes of step 2 ({checkpoints}/2):" in capsys.readouterr().out
  with open(workdir / "results" / "ensemble_sizes.json") as f:
    rows = json.load(f)
  assert rows and all((r["step"], r["checkpoint"]) == (2, f"{checkpoints}/2") for r in rows)
  with open(workdir / "results" / "ensemble_sizes.csv") as f:
    assert {"step", "checkpoint"} <= set(f.readline().strip().split(","))
  assert sorted(os.listdir(checkpoints)) == ["2", "4"] and _files(checkpoints) == before


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # no loop noise
def test_no_intact_checkpoint_is_a_one_line_error_and_deletes_nothing(small_npz_run, tmp_path,
                                                                      caplog):
  data, full, _ = small_npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  for step in (2, 4):
    _corrupt(workdir, step)
  checkpoints = workdir / "checkpoints"
  before = _files(checkpoints)
  with pytest.raises(FileNotFoundError) as error:
    load_variables(str(workdir), create_mesh())
  assert isinstance(error.value, NoIntactCheckpointError)
  message = str(error.value)
  assert message.startswith(f"No intact checkpoint in {checkpoints}: steps 4, 2 failed to restore")
  assert "\n" not in message
  with pytest.raises(NoIntactCheckpointError, match="No intact checkpoint in"):
    train.train_from_config(small_npz_config(data), str(workdir))
  assert _files(checkpoints) == before
  assert "never retrieved" not in caplog.text


def test_an_interrupted_fine_tune_is_not_taken_for_an_evaluation_of_its_source(tmp_path):
  """A training run from ``init_from`` stopped before its first checkpoint records
  ``config.json`` with ``init_from`` too: only a workdir recorded by ``Run.record_init_from``
  (marked in its model spec) stands for the source's variables; the other is a run, never
  overwritten."""
  config = cifar_resnet.get_config("resnet_dnn_18,cifar10,runlocal")
  spec = ModelSpec(10, "cifar", (32, 32, 3))
  config = override(config, init_from=str(tmp_path / "source"))
  fine_tune, evaluation = str(tmp_path / "fine_tune"), str(tmp_path / "evaluation")
  workdir_lib.write_config(fine_tune, config, spec)
  workdir_lib.write_config(evaluation, config, dataclasses.replace(spec, evaluates_init_from=True))
  assert not evaluates_init_from(fine_tune) and has_run(fine_tune)
  assert evaluates_init_from(evaluation) and not has_run(evaluation)
  assert not has_run(str(tmp_path / "empty")) and not has_checkpoint(fine_tune)


if __name__ == "__main__":
  _worker(sys.argv[1], json.loads(sys.argv[2]))


def test_a_checkpoint_written_before_methods_kept_state_resumes_as_one_of_today(small_npz_run,
                                                                                 tmp_path):
  """The small run's checkpoints rewritten as the code before ``TrainState.method_state`` wrote
  them (no such field) resume, two steps further, to the variables that today's checkpoints of
  the same run resume to, bit for bit."""
  import orbax.checkpoint as ocp

  from smoothing_jax.experiment.checkpoints import checkpoint_manager
  data, workdir, _ = small_npz_run
  for name in ("before", "today"):
    shutil.copytree(workdir, tmp_path / name)
  with checkpoint_manager(str(tmp_path / "before"), read_only=True) as manager:
    saved = {step: manager.restore(step) for step in manager.all_steps()}
  assert all("method_state" in tree for tree in saved.values())
  shutil.rmtree(tmp_path / "before" / "checkpoints")
  with checkpoint_manager(str(tmp_path / "before")) as manager:
    for step, tree in saved.items():
      manager.save(step, args=ocp.args.StandardSave(
          {k: v for k, v in tree.items() if k != "method_state"}))
    manager.wait_until_finished()
  config = small_npz_config(data, num_train_steps=6)
  resumed = {name: train.train_from_config(config, str(tmp_path / name))
             for name in ("before", "today")}
  assert int(resumed["before"].step) == 6
  jax.tree.map(np.testing.assert_array_equal, resumed["before"].params, resumed["today"].params)
  jax.tree.map(np.testing.assert_array_equal, resumed["before"].opt_state,
               resumed["today"].opt_state)


def test_a_rerun_with_other_settings_names_them_not_the_checkpoints(small_npz_run, tmp_path):
  """Rerunning a trained workdir with ``model_kwargs.width`` 8 (trained at 4): the parameters'
  shapes differ, every step fails to restore, and the error names the settings that differ
  (recorded → given) and the two ways on; nothing is deleted or set aside."""
  from smoothing_jax.experiment.run import ConfigChangedError
  data, full, _ = small_npz_run
  workdir = shutil.copytree(full, tmp_path / "run")
  before = _files(workdir / "checkpoints")
  with pytest.raises(ConfigChangedError) as error:
    train.train_from_config(small_npz_config(data, **{"model_kwargs.width": 8}), str(workdir))
  message = str(error.value)
  assert "\n" not in message and "intact" not in message and "damaged" not in message
  assert "(model_kwargs.width: 4 → 8)" in message
  assert "train into a new --workdir, or drop those overrides to resume it" in message
  assert _files(workdir / "checkpoints") == before


def test_reading_a_workdir_says_nothing_of_orbax_s_read_only_directory(small_npz_run, caplog):
  from smoothing_jax.experiment.checkpoints import checkpoint_manager
  _, full, _ = small_npz_run
  with caplog.at_level("WARNING"):
    with checkpoint_manager(full, read_only=True) as manager:
      assert manager.latest_step() == 4
  assert "read only" not in caplog.text
