"""Command line: ``python -m smoothing_jax.main --config=configs/<file>.py[:args] --workdir=<dir>``.

Modes:
  train (default)  train (resuming from ``workdir``), then the evaluators ``config.evals`` names
  <evaluator>      one evaluator of ``smoothing_jax.evaluators`` on ``--workdir``:
    ensemble_sizes (alias ``evaluate``)  the ensemble-size table (or of several
                   ``--ensemble_workdirs``); a workdir without checkpoints evaluates
                   ``--config.init_from`` (another workdir, or a torch checkpoint file such as
                   HV's released CIFAR-100 models)
    corruptions    corruption robustness (``--baseline_csv`` for mCE / mCNLL / mCECE)
    streams        segmentation on CamVid video clips: one pass, MC dropout (N = the largest
                   ``config.ensemble_sizes``) and temporal smoothing (VQ-BNN), with consistency
    temporal       the same on shifted streams of test images (classifiers)

``main`` only dispatches: each evaluator writes its tables and figures and says what to print.
"""
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax import evaluators  # noqa: E402
from smoothing_jax.experiment import workdir as workdir_lib  # noqa: E402
from smoothing_jax.data import DatasetUnavailableError  # noqa: E402
from smoothing_jax.experiment.run import Run  # noqa: E402
from smoothing_jax.training.train import train  # noqa: E402
from smoothing_jax.experiment.workdir_lock import lock_workdir  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config",
                                None,
                                "Experiment config file (ml_collections get_config()).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.")
flags.DEFINE_enum("mode", "train", ["train", *evaluators.REGISTRY, *evaluators.ALIASES],
                  "train, or the evaluator to run on --workdir.")
flags.DEFINE_list("ensemble_workdirs", [], "ensemble_sizes: workdirs of deep-ensemble members.")
flags.DEFINE_string("baseline_csv", None, "corruptions: baseline table (reference layout or ours); "
                    "default: the shipped AlexNet results on CIFAR-100-C / ImageNet-C.")
flags.DEFINE_integer("num_samples", None, "MC dropout samples per prediction (corruptions: default "
                     "1; streams, temporal: default the largest config.ensemble_sizes).")
flags.DEFINE_bool("multihost", False,
                  "Call jax.distributed.initialize() (multi-host TPU/GPU jobs; CPU processes use "
                  "gloo collectives).")
flags.DEFINE_string("coordinator_address", None,
                    "--multihost: host:port of process 0 (default: auto-detected on Cloud TPU "
                    "and SLURM).")
flags.DEFINE_integer("num_processes", None, "--multihost: number of processes (default: "
                     "auto-detected).")
flags.DEFINE_integer("process_id", None, "--multihost: this process's index (default: "
                     "auto-detected).")
flags.mark_flags_as_required(["config", "workdir"])

# Errors a user can cause (bad dataset, arrays, model name, config value, missing checkpoint):
# one line on stderr and exit status 1; the traceback with --verbosity=1 or
# SMOOTHING_JAX_TRACEBACK=1.
USER_ERRORS = (ValueError, TypeError, OSError, DatasetUnavailableError, FloatingPointError)
TRACEBACK_ENV = "SMOOTHING_JAX_TRACEBACK"


def _show_tracebacks(argv=()) -> bool:
  """``SMOOTHING_JAX_TRACEBACK`` set, or a verbosity of 1 or more (parsed, or in ``argv``)."""
  if os.environ.get(TRACEBACK_ENV):
    return True
  if FLAGS.is_parsed():
    return FLAGS.verbosity >= 1
  return any(re.fullmatch(r"--(verbosity|v)=[1-9]\d*", arg) for arg in argv)


def _exit_with_error(message: str, status: int):
  one_line = " ".join(str(message).split())
  print(f"smoothing_jax.main: error: {one_line} "
        f"(traceback: --verbosity=1 or {TRACEBACK_ENV}=1)", file=sys.stderr)
  sys.exit(status)


def _unknown_config_key(argv) -> str:
  """The first ``--config.<key>=…`` argument whose key the config file lacks, described."""
  config_args = [a[len("--config="):] for a in argv if a.startswith("--config=")]
  if not config_args:
    return ""
  try:
    config = config_lib.load(config_args[-1])  # the config file alone, without overrides
  except Exception:  # noqa: BLE001  (the flag error itself is reported instead)
    return ""
  for arg in argv:
    if arg.startswith("--config."):
      try:
        config_lib.check_key(config, arg[len("--config."):].split("=", 1)[0])
      except KeyError as error:
        return f"{error.args[0]} in {arg!r}"
  return ""


def parse_flags(argv):
  """absl flag parsing with one-line errors (config files and ``--config.<key>`` overrides)."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    if _show_tracebacks(argv):
      raise
    # A config file's own exception arrives as a formatted traceback: keep its last line.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    flag = lines[0].split(":", 1)[0] if lines else ""
    _exit_with_error(
        _unknown_config_key(argv) or (f"{flag}: {lines[-1]}" if len(lines) > 1 else str(e)), 2)
  except (AttributeError, KeyError, TypeError, ValueError) as e:  # a bad --config.<key>=value
    if _show_tracebacks(argv):
      raise
    _exit_with_error(
        _unknown_config_key(argv) or f"bad config override: {type(e).__name__}: {e}", 2)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if FLAGS.verbosity < 1:  # --verbosity=1 shows every library's INFO lines too
    show_only_our_info_lines()
  try:
    run(FLAGS.config, FLAGS.workdir, FLAGS.mode, ensemble_workdirs=FLAGS.ensemble_workdirs,
        baseline_csv=FLAGS.baseline_csv, num_samples=FLAGS.num_samples,
        multihost=FLAGS.multihost, coordinator_address=FLAGS.coordinator_address,
        num_processes=FLAGS.num_processes, process_id=FLAGS.process_id)
  except USER_ERRORS as e:
    if _show_tracebacks():
      raise
    cause = f" ({e.__cause__})" if e.__cause__ and str(e.__cause__) not in str(e) else ""
    _exit_with_error(f"{type(e).__name__}: {e}{cause}", 1)


def initialize_multihost(coordinator_address=None, num_processes=None, process_id=None):
  """``jax.distributed.initialize`` (None arguments: auto-detected on Cloud TPU / SLURM), with
  gloo collectives for CPU devices, so that CPU processes form one mesh too."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)


def run(config, workdir: str, mode: str = "train", *, ensemble_workdirs=(), baseline_csv=None,
        num_samples=None, multihost: bool = False, coordinator_address=None,
        num_processes=None, process_id=None) -> dict:
  """The job ``mode`` names on ``config`` and ``workdir``: ``train`` (then ``config.evals``) or
  one evaluator; prints each evaluator's summary and returns ``{name: result}``."""
  if multihost:
    initialize_multihost(coordinator_address, num_processes, process_id)
  if mode == "train":  # one writer per workdir, refused before it reads or writes anything
    with lock_workdir(workdir):
      return _run(config, workdir, mode, ensemble_workdirs, baseline_csv, num_samples)
  return _run(config, workdir, mode, ensemble_workdirs, baseline_csv, num_samples)


def _run(config, workdir, mode, ensemble_workdirs, baseline_csv, num_samples) -> dict:
  logging.info("JAX devices: %d (%s), processes: %d", jax.device_count(), jax.devices()[0].platform,
               jax.process_count())
  options = {k: v for k, v in (("members", list(ensemble_workdirs[1:])),
                                ("baseline_csv", baseline_csv), ("num_samples", num_samples))
             if v is not None}  # unset: each evaluator's default
  if mode == "train":
    names, opened = config.get("evals", ("ensemble_sizes",)), Run.from_config(config, workdir)
  else:
    names = [mode]
    opened = Run.for_evaluation(ensemble_workdirs[0] if ensemble_workdirs else workdir, config)
  results_dir = workdir_lib.workdir_path(workdir) / "results"
  results = {}
  with opened as the_run:
    if mode == "train":
      train(the_run)
    for name, (result, summary) in evaluators.run_evaluators(names, the_run, results_dir,
                                                              options).items():
      print(f"\n{summary}")
      results[name] = result
  if mode == "train":
    print(f"TensorBoard: tensorboard --logdir {workdir}")
  return results


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
