"""Command line: ``python -m smoothing_jax.main --config=configs/<file>.py[:args] --workdir=<dir>``.

Modes:
  train (default)  train (resuming from ``workdir``), then evaluate ensemble sizes
  evaluate         ensemble-size table of ``--workdir`` (or of several ``--ensemble_workdirs``);
                   a workdir without checkpoints evaluates ``--config.init_from`` (another
                   workdir, or a torch checkpoint file such as HV's released CIFAR-100 models)
  corruptions      corruption robustness (``--baseline_csv`` for mCE / mCNLL / mCECE)
  streams          segmentation on CamVid video clips: one pass, MC dropout (N = the largest
                   ``config.ensemble_sizes``) and temporal smoothing (VQ-BNN), with consistency
"""
import importlib.util
import logging as std_logging
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from smoothing_jax import evaluate, train  # noqa: E402
from smoothing_jax import workdir as workdir_lib  # noqa: E402
from smoothing_jax.data import DatasetUnavailableError  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config",
                                None,
                                "Experiment config file (ml_collections get_config()).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.")
flags.DEFINE_enum("mode", "train", ["train", "evaluate", "corruptions", "streams"], "What to run.")
flags.DEFINE_list("ensemble_workdirs", [], "evaluate: workdirs of deep-ensemble members.")
flags.DEFINE_string("baseline_csv", None, "corruptions: baseline table (reference layout or ours); "
                    "default: the shipped AlexNet results on CIFAR-100-C / ImageNet-C.")
flags.DEFINE_integer("num_samples", 1, "corruptions: MC dropout samples per prediction.")
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
  path, _, config_arg = config_args[-1].partition(":")  # the config file alone, without overrides
  try:
    spec = importlib.util.spec_from_file_location("_config_file", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config(config_arg) if config_arg else module.get_config()
  except Exception:  # noqa: BLE001  (the flag error itself is reported instead)
    return ""
  for arg in argv:
    if not arg.startswith("--config."):
      continue
    path = arg[len("--config."):].split("=", 1)[0].split(".")
    node = config
    for i, key in enumerate(path):
      if node is None or not hasattr(node, "keys") or key not in node.keys():
        known = sorted(node.keys()) if hasattr(node, "keys") else []
        return (f"unknown config key {'.'.join(path[:i + 1])!r} in {arg!r}; keys there: "
                f"{', '.join(known)}")
      node = node[key]
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


class _OurInfoLines(std_logging.Filter):
  """INFO lines from smoothing_jax only (libraries' warnings and errors still show): orbax, for
  one, logs a dozen INFO lines per checkpoint."""

  def filter(self, record):
    return record.levelno >= std_logging.WARNING or f"{os.sep}smoothing_jax{os.sep}" in (
        record.pathname)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if FLAGS.verbosity < 1:  # --verbosity=1 shows every library's INFO lines too
    logging.get_absl_handler().addFilter(_OurInfoLines())
  try:
    run(FLAGS.config, FLAGS.workdir, FLAGS.mode)  # the other flags are read where they are used
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


def run(config, workdir: str, mode: str):
  """The job ``--mode`` names, on ``config`` and ``workdir``."""
  if FLAGS.multihost:
    initialize_multihost(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  results_dir = workdir_lib.workdir_path(workdir) / "results"
  logging.info("JAX devices: %d (%s), processes: %d", jax.device_count(), jax.devices()[0].platform,
               jax.process_count())
  if mode == "train":
    train.train_and_evaluate(config, workdir)
    rows = evaluate.evaluate_ensemble_sizes([workdir], results_dir, config)
  elif mode == "streams":
    rows = evaluate.evaluate_streams(workdir,
                                     results_dir,
                                     config,
                                     num_samples=max(config.ensemble_sizes))
    print("\nmethod   | passes | NLL    | Acc (%) | ECE (%) | mIoU (%) | Cons (%)")
    for r in rows:
      print(
          f"{r['method']:8s} | {r['passes_per_frame']:6d} | {r['nll']:.4f} | "
          f"{100 * r['acc']:7.2f} | {100 * r['ece']:7.2f} | {100 * r['iou']:8.2f} | "
          f"{100 * r['consistency']:8.2f}")
    print(f"\nResults: {results_dir}/streams.{{json,csv,png}}, {results_dir}/stream_examples.png")
    return
  elif mode == "evaluate":
    rows = evaluate.evaluate_ensemble_sizes(FLAGS.ensemble_workdirs or [workdir], results_dir,
                                            config)
  else:
    aggregates = evaluate.evaluate_corruptions(workdir, results_dir, FLAGS.baseline_csv,
                                               FLAGS.num_samples, config)
    print(f"Corruption robustness: {aggregates}\nTables in {results_dir}/corruptions.{{json,csv}}")
    return
  print("\nensemble size | NLL    | Acc (%) | ECE (%)")
  for r in rows:
    print(
        f"{r['ensemble_size']:13d} | {r['nll']:.4f} | {100 * r['acc']:7.2f} | {100 * r['ece']:7.2f}"
    )
  print(f"\nResults: {results_dir}/ensemble_sizes.{{json,csv,png}}, {results_dir}/reliability.png; "
        f"TensorBoard: tensorboard --logdir {workdir}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
