"""The command line with bad input: one line naming the problem, a non-zero exit, no traceback."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs each command line through absl's app.run in one process (imports and compiles are paid
# once); every case uses different --config.<key> overrides, which absl defines once per process.
DRIVER = r"""
import contextlib, io, json, os, sys
from absl import app
from smoothing_jax import main
results = []
for argv, env in json.loads(sys.argv[1]):
  main.FLAGS.unparse_flags()
  os.environ.update(env)
  sys.argv = ["smoothing_jax.main"] + argv
  err = io.StringIO()
  try:
    with contextlib.redirect_stderr(err):
      app.run(main.main, argv=sys.argv, flags_parser=main.parse_flags)
    results.append({"code": 0, "stderr": err.getvalue()})
  except SystemExit as e:
    results.append({"code": e.code, "stderr": err.getvalue()})
  except Exception as e:  # the traceback a user asked for
    results.append({"code": "raised", "stderr": f"{type(e).__name__}: {e}"})
  for key in env:
    del os.environ[key]
print("RESULTS" + json.dumps(results))
"""


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory, analysis_workdirs):
  root = tmp_path_factory.mktemp("cli")
  trained = str(root / "trained")  # a recorded run (step 0) that evaluations may write into
  shutil.copytree(analysis_workdirs["MC dropout"], trained)
  # A recorded run whose results/ cannot be written (a file in the way: as root, permissions
  # would not stop a write), evaluated into --results_dir instead.
  unwritable, elsewhere = str(root / "unwritable"), str(root / "elsewhere")
  shutil.copytree(analysis_workdirs["MC dropout"], unwritable)
  open(os.path.join(unwritable, "results"), "w").close()
  rng = np.random.default_rng(0)
  good, floats = root / "good", root / "floats"
  for directory, dtype in ((good, np.uint8), (floats, np.float32)):
    directory.mkdir()
    for split in ("train", "test"):
      np.savez(directory / f"{split}.npz", images=rng.integers(0, 255, (8, 8, 8, 3)).astype(dtype),
               labels=rng.integers(0, 2, 8))
  damaged = root / "damaged"  # a recorded run whose config.json was cut short
  shutil.copytree(analysis_workdirs["MC dropout"], damaged)
  (damaged / "config.json").write_text((damaged / "config.json").read_text()[:60])
  existing = root / "existing"  # a workdir with files of its own, which a refusal leaves as it was
  existing.mkdir()
  (existing / "notes.txt").write_text("mine")
  cases = {
      "config argument typo":
          (["--config=configs/cifar_resnet.py:resnet_dnn_18,cifar10,runlokal"], {}),
      "unknown config key": (["--config=configs/cifar_resnet.py", "--config.not_a_key=3"], {}),
      "missing dataset":
          (["--config=configs/cifar_resnet.py:resnet_dnn_18,npz:/missing,runlocal"], {}),
      "wrong dtype":
          (["--config=configs/quickstart.py", f"--config.input.dataset=npz:{floats}"], {}),
      "unknown model":
          ([f"--config=configs/cifar_resnet.py:resnet_dnn_18x,npz:{good},runlocal"], {}),
      "unknown model in an existing workdir": ([
          f"--config=configs/cifar_resnet.py:resnet_dnn_18x,npz:{good},runlocal",
          f"--workdir={existing}"
      ], {}),
      "no deep-ensemble members":
          (["--config=configs/quickstart.py", "--config.deep_ensemble.members=0"], {}),
      "model/dataset mismatch": ([
          f"--config=configs/camvid_unet.py:unet_dnn,npz:{good},runlocal", "--config.num_devices=1"
      ], {}),
      "missing checkpoint": (["--config=configs/quickstart.py", "--mode=evaluate"], {}),
      "training needs a config": ([], {}),
      "an option the evaluator does not take":
          (["--config=configs/quickstart.py", "--mode=ensemble_sizes", "--num_samples=3"], {}),
      "an unknown evaluator option": ([
          "--config=configs/quickstart.py", "--config.evals.ensemble_sizes.num_samples=3"
      ], {}),
      "a bad evaluator option value": ([
          "--config=configs/quickstart.py", "--config.evals.ensemble_sizes.sizes=(0,)"
      ], {}),
      "a config of another model":
          (["--config=configs/quickstart.py", "--mode=evaluate", f"--workdir={trained}"], {}),
      "evaluation from the recorded run": ([
          "--mode=evaluate", f"--workdir={trained}", "--config.evals.ensemble_sizes.sizes=(1,2)",
          "--config.eval_batch_size=16"
      ], {}),
      "results not writable": (["--mode=evaluate", f"--workdir={unwritable}"], {}),
      "results elsewhere": ([
          "--mode=evaluate", f"--workdir={unwritable}", f"--results_dir={elsewhere}",
          "--config.evals.ensemble_sizes.sizes=(1,2)", "--config.eval_batch_size=16"
      ], {}),
      "a workdir that is a file":
          (["--config=configs/quickstart.py", f"--workdir={good / 'train.npz'}"], {}),
      "a moved key": (["--config=configs/quickstart.py", "--config.dataset=cifar10"], {}),
      "a damaged config.json": (["--mode=evaluate", f"--workdir={damaged}"], {}),
      "traceback on request":
          ([f"--config=configs/cifar_resnet.py:vgg_dnn_16x,npz:{good},runlocal"], {
              "SMOOTHING_JAX_TRACEBACK": "1"
          }),
  }
  # A workdir of its own for each case that names none, to see what each leaves behind.
  workdirs = {case: str(root / "workdirs" / str(i)) for i, (case, (argv, _)) in
              enumerate(cases.items()) if not any(a.startswith("--workdir") for a in argv)}
  payload = json.dumps([(argv + ([f"--workdir={workdirs[case]}"] if case in workdirs else []),
                         env) for case, (argv, env) in cases.items()])
  env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
  out = subprocess.run([sys.executable, "-c", DRIVER, payload],
                       cwd=ROOT,
                       env=env,
                       capture_output=True,
                       text=True,
                       timeout=600)
  line = [x for x in out.stdout.splitlines() if x.startswith("RESULTS")]
  assert line, out.stdout[-2000:] + out.stderr[-2000:]
  results = dict(zip(cases, json.loads(line[0][len("RESULTS"):]), strict=True))
  for case, workdir in workdirs.items():
    results[case]["workdir"] = workdir
  results["trained"], results["elsewhere"], results["existing"] = trained, elsewhere, existing
  return results


@pytest.mark.parametrize("case,code,expected", [
    ("config argument typo", 2, "Bad config argument 'runlokal'"),
    ("unknown config key", 2, "unknown config key 'not_a_key'"),
    ("missing dataset", 1, "/missing/train.npz does not exist"),
    ("wrong dtype", 2, "'images' must be uint8 [N,H,W,3] (or grayscale [N,H,W] / [N,H,W,1]), got "
     "float32"),
    ("unknown model", 2, "Unknown model name 'resnet_dnn_18x'"),
    ("unknown model in an existing workdir", 2, "Unknown model name 'resnet_dnn_18x'"),
    ("no deep-ensemble members", 2, "deep_ensemble.members must be an integer >= 1, got 0"),
    ("model/dataset mismatch", 2, "does not fit dataset"),
    ("missing checkpoint", 1, "No run in"),
    ("training needs a config", 2, "Training needs --config=<file>.py[:<args>]"),
    ("an option the evaluator does not take", 2,
     "The ensemble_sizes evaluator takes no option 'num_samples'; its options "
     "(config.evals.ensemble_sizes.<option>): sizes, members, seed"),
    ("an unknown evaluator option", 2, "unknown config key 'evals.ensemble_sizes.num_samples'; "
     "keys there: members, seed, sizes"),
    ("a bad evaluator option value", 2, "config.evals.ensemble_sizes.sizes must be ensemble sizes "
     "N >= 1 (empty: config.ensemble_sizes), got (0,)."),
    ("a config of another model", 2, "names model 'resnet_mcdo_smoothing_18', but"),
    ("results not writable", 1, "PermissionError: Cannot write the results into "),
    ("a workdir that is a file", 2, "train.npz is a file, not a directory"),
    ("a moved key", 2, "unknown config key 'dataset' (moved to 'input.dataset')"),
    ("a damaged config.json", 2, "damaged/config.json is damaged (not valid JSON: "),
])
def test_user_errors_print_one_line(cli_results, case, code, expected):
  result = cli_results[case]
  errors = [line for line in result["stderr"].splitlines() if "smoothing_jax.main: error:" in line]
  assert result["code"] == code, result
  assert len(errors) == 1 and expected in errors[0], result["stderr"][-3000:]
  assert "Traceback" not in result["stderr"]
  # Nothing left behind: no workdir, lock or TensorBoard file (an existing workdir unchanged).
  if case == "unknown model in an existing workdir":
    assert os.listdir(cli_results["existing"]) == ["notes.txt"]
  elif "workdir" in result:
    assert not os.path.exists(result["workdir"]), os.listdir(result["workdir"])


def test_evaluation_reads_the_recorded_config_and_applies_overrides_on_top(cli_results):
  result = cli_results["evaluation from the recorded run"]
  assert result["code"] is None, result["stderr"][-3000:]  # app.run's exit of a clean return
  with open(os.path.join(cli_results["trained"], "results", "ensemble_sizes.json")) as f:
    assert [row["ensemble_size"] for row in json.load(f)] == [1, 2]


def test_results_dir_takes_the_results_of_a_workdir_that_cannot_hold_them(cli_results):
  result = cli_results["results elsewhere"]
  assert result["code"] is None, result["stderr"][-3000:]
  with open(os.path.join(cli_results["elsewhere"], "ensemble_sizes.json")) as f:
    rows = json.load(f)
  assert [(row["ensemble_size"], row["step"]) for row in rows] == [(1, 0), (2, 0)]


def test_an_evaluation_lists_what_differs_from_the_recorded_run(analysis_workdirs):
  from smoothing_jax import main
  from smoothing_jax.experiment.workdir import read_config
  from tests.helpers import absl_info_lines
  workdir = analysis_workdirs["MC dropout"]
  recorded = read_config(workdir)[0]
  with absl_info_lines() as lines:
    config = main.resolve_config("evaluate", workdir, None, [("eval_batch_size", "16")])
  assert config.eval_batch_size == 16 and config.model_kwargs == recorded.model_kwargs
  # A key the record holds as None (no declared type), as the data_dir of a missing set asks.
  config = main.resolve_config("evaluate", workdir, None, [("input.data_dir", "/data/tfds")])
  assert recorded.input.data_dir is None and config.input.data_dir == "/data/tfds"
  with pytest.raises(ValueError, match=re.escape(
      f"--config.model=vgg_dnn_16: {workdir} recorded model 'resnet_mcdo_18', and an evaluation "
      "rebuilds the recorded model")):
    main.resolve_config("evaluate", workdir, None, [("model", "vgg_dnn_16")])
  assert any(line.endswith("; differing from it: eval_batch_size") for line in lines), lines
  # A config file of the recorded model: its keys that differ (here num_devices, the run's
  # length) apply on top; the model options and the recorded data split stay the recorded ones.
  arg = f"configs/cifar_resnet.py:resnet_mcdo_18,{recorded.input.dataset},runlocal"
  with absl_info_lines() as lines:
    config = main.resolve_config("evaluate", workdir, arg)
  assert (config.num_devices, config.model_kwargs.width) == (-1, recorded.model_kwargs.width)
  assert any(f"From --config={arg}, on the recorded run: " in line and "num_devices=-1" in line
             and "model_kwargs" not in line for line in lines), lines
  with pytest.raises(ValueError, match=r"--config.input.holdout_fraction is the recorded run's "
                     r"\(input.holdout_fraction=0.0\)"):
    main.resolve_config("evaluate", workdir, None, [("input.holdout_fraction", "0.5")])


def test_unwritable_results_are_refused_before_anything_is_computed(analysis_workdirs,
                                                                    tmp_path, monkeypatch):
  """A workdir whose results/ cannot be made (a file in the way; as root, permissions would not
  stop a write) is refused in one line before the run is opened; ``results_dir`` (the
  ``--results_dir`` flag, tested on the command line above) writes the tables elsewhere."""
  from smoothing_jax import main
  workdir = shutil.copytree(analysis_workdirs["MC dropout"], tmp_path / "run")
  (workdir / "results").write_text("")
  config = main.resolve_config("evaluate", str(workdir), None,
                               [("evals.ensemble_sizes.sizes", "(1,)")])
  opened = []
  monkeypatch.setattr(main.Run, "for_evaluation", lambda *args: opened.append(args))
  with pytest.raises(PermissionError) as error:
    main.run(config, str(workdir), "evaluate")
  assert str(error.value) == (f"Cannot write the results into {workdir}/results ({workdir}/results "
                              "is a file); give --results_dir=<a writable folder>.")
  assert not opened and sorted(os.listdir(workdir)) == ["checkpoints", "config.json", "results"]


def test_the_command_line_adds_any_evaluator_and_switches_the_model_first(monkeypatch):
  """``--config.evals.<name>.<option>`` adds a registered evaluator the config does not list;
  ``--config.model`` applies before the other overrides, which set the new model's options."""
  from smoothing_jax import evaluators, main
  monkeypatch.chdir(ROOT)
  config = main.resolve_config("train", "unused", "configs/quickstart.py", [
      ("evals.ood.datasets", '("svhn_cropped",)'), ("model_kwargs.depth", "10"),
      ("model", "wideresnet_ibnn_28_10")])
  assert evaluators.names_after_training(config) == ("ensemble_sizes", "ood")
  assert config.evals.ood.datasets == ("svhn_cropped",) and config.evals.ood.seed == 0
  assert (config.model, config.model_kwargs.depth) == ("wideresnet_ibnn_28_10", 10)
  for overrides, message in (
      ([("evals.odd.datasets", "()")], "Unknown evaluator 'odd'; registered: ensemble_sizes, "),
      ([("dataset", "cifar10")],
       "--config.dataset: unknown config key 'dataset' (moved to 'input.dataset')."),
      ([("model", "resnet_dnn_18x")], "Unknown model name 'resnet_dnn_18x'")):
    with pytest.raises(ValueError, match=re.escape(message)):
      main.resolve_config("train", "unused", "configs/quickstart.py", overrides)


def test_the_traceback_is_kept_on_request(cli_results):
  result = cli_results["traceback on request"]
  assert result["code"] == "raised" and "Unknown model name 'vgg_dnn_16x'" in result["stderr"]


def test_two_processes_stop_together_and_match_one_process(tmp_path):
  """2 processes × 4 simulated CPU devices (``--multihost``, gloo collectives on localhost) train
  the quickstart; a SIGTERM to process 1 alone stops both at the same step, which both save.
  One process with 8 devices trained for that many steps ends with the same parameters: the
  global batches do not depend on the number of processes."""
  import re
  import signal
  import socket
  import threading
  import time

  import jax

  from configs import quickstart
  from smoothing_jax.experiment.checkpoints import load_variables
  from smoothing_jax.parallel import create_mesh
  from smoothing_jax.training import train
  from tests.helpers import override, subprocess_xla_flags
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  workdir = tmp_path / "two_processes"
  sizes = {"model_kwargs.width": 4, "model_kwargs.stage_sizes": (1,), "input.batch_size": 16,
           "log_every_steps": 5, "checkpoint_every_steps": 1000, "num_train_steps": 1000}
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": subprocess_xla_flags(4)}
  command = [sys.executable, "-m", "smoothing_jax.main", "--config=configs/quickstart.py:runlocal",
             f"--workdir={workdir}", "--multihost", f"--coordinator_address=localhost:{port}",
             "--num_processes=2"] + [f"--config.{k}={v}" for k, v in sizes.items()]
  processes = [subprocess.Popen(command + [f"--process_id={i}"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
  lines = [[], []]  # each process's output, read as it comes
  readers = [threading.Thread(target=lambda p, out: out.extend(p.stdout), args=(p, out),
                              daemon=True) for p, out in zip(processes, lines, strict=True)]
  for reader in readers:
    reader.start()
  try:
    # SIGTERM once process 0 logs its first training metrics (step 5): every step is a collective
    # of both processes, so both are then past installing their stop-signal handlers.  (A fixed
    # wait raced with process 1's start under load: the signal killed it before its handler
    # existed, and process 0 waited for it in a collective until the test timed out.)
    deadline = time.time() + 200
    while not any("[5/1000]" in line for line in list(lines[0])):
      assert time.time() < deadline, "".join(lines[0])[-3000:]
      assert all(p.poll() is None for p in processes), "".join(lines[0])[-3000:]
      time.sleep(0.2)
    processes[1].send_signal(signal.SIGTERM)
    for p, reader in zip(processes, readers, strict=True):
      try:  # saving under a loaded CI machine has taken over 60 s
        p.wait(timeout=150)
      except subprocess.TimeoutExpired:
        pytest.fail("a process did not stop within 150 s of the SIGTERM; their output:\n"
                    + "\n-----\n".join("".join(out)[-2000:] for out in lines))
      reader.join(timeout=10)
  finally:
    for p in processes:
      p.kill()
  outputs = ["".join(out) for out in lines]
  stopped = [re.findall(r"Stopped at step (\d+) after SIGTERM", out) for out in outputs]
  assert all(len(s) == 1 for s in stopped), [out[-3000:] for out in outputs]
  step = int(stopped[0][0])
  assert stopped[1] == [str(step)] and [p.returncode for p in processes] == [1, 1]
  assert 0 < step < 1000 and step % 5 == 0
  assert sorted(os.listdir(workdir / "checkpoints")) == [str(step)]

  assert jax.device_count() == 8 and jax.process_count() == 1
  config = override(quickstart.get_config("runlocal"), **{**sizes, "num_train_steps": step})
  single = train.train_from_config(config, str(tmp_path / "one_process"))
  saved_step, variables = load_variables(str(workdir), create_mesh())
  assert saved_step == step
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6),
               jax.device_get(variables["params"]), jax.device_get(single.params))


def test_switching_the_model_names_the_recipe_kept_and_the_model_s_own():
  from smoothing_jax import main
  from tests.helpers import absl_info_lines
  with absl_info_lines() as lines:
    config = main.resolve_config("train", None, "configs/quickstart.py",
                                 [("model", "resnet_batchensemble_18")])
    main.resolve_config("train", None, "configs/cifar_resnet.py:resnet_dnn_18,cifar10",
                        [("model", "resnet_mcdo_18")])
  named = [line for line in lines if "recipe" in line]
  assert named == [
      f"--config.model=resnet_batchensemble_18 keeps quickstart.py's recipe (sgd, learning rate "
      f"{config.learning_rate}, weight decay {config.weight_decay}, Nesterov {config.nesterov}, "
      f"{config.num_epochs} epochs); resnet_batchensemble_18's own recipe is "
      "--config=configs/cifar_resnet.py:resnet_batchensemble_18."]
