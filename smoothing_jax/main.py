"""Command line: ``python -m smoothing_jax.main --config=configs/<file>.py[:args] --workdir=<dir>``.

Modes::

  train (default)  train (resuming from ``workdir``), then the evaluators ``config.evals`` names
  fit              the post-hoc stage of the method (``--config.method=laplace``) on the trained
                   ``workdir``, stored in ``<workdir>/fits`` (training runs it when its method
                   has one)
  <evaluator>      one evaluator of ``smoothing_jax.evaluators`` on ``--workdir``, with the
                   options ``config.evals.<evaluator>``:
    ensemble_sizes (alias ``evaluate``)  the ensemble-size table (or of several
                   ``--ensemble_workdirs``); a workdir without checkpoints evaluates
                   ``--config.init_from`` (another workdir, or a torch checkpoint file such as
                   HV's released CIFAR-100 models)
    corruptions    corruption robustness (``baseline_csv`` for mCE / mCNLL / mCECE)
    streams        segmentation on CamVid video clips: one pass, MC dropout and temporal
                   smoothing (VQ-BNN), with consistency
    temporal       the same on shifted streams of test images (classifiers)
    ood, calibration, selective (alias ``uncertainty``)

Settings have one door: the config.  ``--config.<key>=…`` sets a key (``--config.model`` first,
so that ``model_kwargs`` are the new model's options); an evaluator's options are
``--config.evals.<name>.<option>=…``, which adds a registered evaluator the config does not
list.  An evaluation mode reads the workdir's recorded ``config.json`` as its config:
``--config`` is optional there, and overrides apply on top of the recorded run (one line lists
the keys that differ from it).  ``--num_samples``, ``--baseline_csv`` and ``--ensemble_workdirs``
are shorthands for the mode's ``config.evals.<name>`` options.  Results go to
``<workdir>/results``, or to ``--results_dir`` (e.g. for a read-only workdir); a folder that
cannot be written is refused before anything is computed.  ``main`` only dispatches: each
evaluator writes its tables and figures and says what to print.
"""
import ast
import os
import re
import signal
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from smoothing_jax import evaluators, methods  # noqa: E402
from smoothing_jax.data import DatasetUnavailableError  # noqa: E402
from smoothing_jax.experiment import (
  checkpoints,  # noqa: E402
  )
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.experiment import workdir as workdir_lib  # noqa: E402
from smoothing_jax.experiment.config_base import with_method, with_model  # noqa: E402
from smoothing_jax.experiment.run import RECORDED_KEYS, Run, check_config  # noqa: E402
from smoothing_jax.experiment.workdir_lock import lock_workdir  # noqa: E402
from smoothing_jax.training.callbacks import Callback, Preempted  # noqa: E402
from smoothing_jax.training.train import train  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "Experiment config, <file>.py[:<args>] (ml_collections "
                    "get_config()); in an evaluation mode the recorded config.json by default. "
                    "--config.<key>=<value> sets one key.")
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.")
flags.DEFINE_string("results_dir", None, "Where the evaluators write their tables and figures "
                    "(default: <workdir>/results), e.g. for a workdir that is read-only.")
flags.DEFINE_enum("mode", "train", ["train", "fit", *evaluators.REGISTRY, *evaluators.ALIASES],
                  "train; fit (the post-hoc stage of --config.method on the trained --workdir, "
                  "e.g. laplace); or the evaluator to run on --workdir.")
# Shorthands for options of the --mode evaluator (config.evals.<mode>.<option>).
flags.DEFINE_list("ensemble_workdirs", [], "Workdirs of deep-ensemble members: the first is "
                  "evaluated, the others join it (config.evals.<mode>.members).")
flags.DEFINE_string("baseline_csv", None, "config.evals.corruptions.baseline_csv: the baseline "
                    "table (reference layout or ours).")
flags.DEFINE_integer("num_samples", None, "config.evals.<mode>.num_samples: MC samples per "
                     "prediction (corruptions, streams, temporal).")
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
flags.mark_flags_as_required(["workdir"])

# Errors a user can cause (bad dataset, arrays, model name, config value, missing checkpoint):
# one line on stderr, the traceback with --verbosity=1 or SMOOTHING_JAX_TRACEBACK=1.  Exit
# status 2 for a refused setting (a ValueError or TypeError before the job's first step or
# evaluation: a usage error, as argparse's), 1 for a failure while it runs or data or files that
# cannot be read (OSError, DatasetUnavailableError) and a non-finite loss.
USER_ERRORS = (ValueError, TypeError, OSError, DatasetUnavailableError, FloatingPointError)
REFUSALS = (ValueError, TypeError)
TRACEBACK_ENV = "SMOOTHING_JAX_TRACEBACK"
# The ``--config.<key>=<value>`` arguments of the command line, in order (``parse_flags``).
CONFIG_OVERRIDES: list = []


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


def parse_flags(argv):
  """absl flag parsing with one-line errors; the ``--config.<key>=<value>`` arguments are kept
  aside in :data:`CONFIG_OVERRIDES` (applied to the config by :func:`resolve_config`)."""
  CONFIG_OVERRIDES.clear()
  rest = [argv[0]]
  for arg in argv[1:]:
    if arg.startswith("--config."):
      key, eq, value = arg[len("--config."):].partition("=")
      if not eq:
        _exit_with_error(f"{arg!r}: give a value, --config.{key}=<value>.", 2)
      CONFIG_OVERRIDES.append((key, value))
    else:
      rest.append(arg)
  try:
    return FLAGS(rest)
  except flags.Error as e:
    if _show_tracebacks(argv):
      raise
    _exit_with_error(str(e), 2)


def parse_value(config, key: str, text: str):
  """The value of ``--config.<key>=<text>`` for the existing ``key``: the text itself for a
  string key, else a Python literal (``8``, ``0.1``, ``True``, ``'(1, 2)'``)."""
  try:
    config_lib.check_key(config, key)
  except KeyError as error:
    block = key.split(".")[0]
    if block in methods.REGISTRY:  # another method's settings: the config holds its own alone
      raise ValueError(f"--config.{key}: config.{block} is the settings block of method "
                       f"{block}, and this config trains {config.method or 'its model'}'s "
                       f"method: add --config.method={block}.") from None
    raise ValueError(f"--config.{key}: {error.args[0]}.") from None
  *parents, leaf = key.split(".")
  node = config
  for name in parents:
    node = node[name]
  try:
    kind = node.get_ref(leaf).get_type()  # a placeholder's declared type, where it is None
  except ValueError:  # a None of a recorded config.json declares no type: read the text as is
    kind = None
  if kind is str:
    return text
  if kind is bool and text.lower() in ("true", "false"):
    return text.lower() == "true"
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text  # a string where the key takes another type: with_overrides names the mismatch


# The config file whose recipe (optimiser, schedule, epochs: the paper's) each family of models
# trains with; the first matching part of a model's name decides, cifar_resnet.py the rest.
RECIPE_FILES = (("unet", "camvid_unet.py"), ("ibnn", "cifar_ibnn.py"), ("vit", "cifar_vit.py"),
                ("pit_", "cifar_vit.py"), ("swin_", "cifar_vit.py"), ("alternet", "cifar_vit.py"))


def _name_the_recipe(config, config_arg, model: str) -> None:
  """One line where ``--config.model`` leaves the config file's recipe in place for a model whose
  paper recipe lives in another config file: which recipe runs, and the command for the other."""
  recipe = next((f for part, f in RECIPE_FILES if part in model), "cifar_resnet.py")
  given = os.path.basename(str(config_arg or "").split(":")[0])
  if given and given != recipe:
    logging.info(
        "--config.model=%s keeps %s's recipe (%s, learning rate %s, weight decay %s, Nesterov "
        "%s, %s epochs); %s's own recipe is --config=configs/%s:%s.", model, given,
        config.get("optimizer"), config.get("learning_rate"), config.get("weight_decay"),
        config.get("nesterov"), config.get("num_epochs"), model, recipe, model)


def resolve_config(mode: str, workdir: str, config_arg=None, overrides=()):
  """The config of the job: the ``config_arg`` file (``train``) or the workdir's recorded run
  (an evaluation mode; a ``config_arg`` file there must name the recorded model, and its keys that
  differ apply as overrides), then ``overrides`` (``(key, text)`` pairs) on top, with every
  evaluator option of ``config.evals``, the mode's and those of the evaluators ``overrides`` set
  options of declared; a ``model`` override applies first (``config_base.with_model``), then a
  ``method`` override (``config_base.with_method``)."""
  recorded = None
  if mode != "train" and checkpoints.has_run(workdir):
    recorded = workdir_lib.read_config(workdir)[0]
  if config_arg:
    config = config_lib.load(config_arg)
    if recorded is not None:
      if config.model != recorded.model:
        raise ValueError(f"--config={config_arg} names model {config.model!r}, but {workdir} "
                         f"recorded {recorded.model!r}: drop --config (the recorded config is "
                         "the config) or give the changes as --config.<key>=… overrides.")
      # The model is the recorded one (its spec rebuilds it); so are the data split and members.
      changes = config_lib.differences(recorded, config,
                                       skip=RECORDED_KEYS + ("model_kwargs", "model"))
      if changes:
        logging.info("From --config=%s, on the recorded run: %s", config_arg,
                     ", ".join(f"{k}={v!r}" for k, v in changes.items()))
      config = config_lib.with_overrides(recorded, changes)
  elif recorded is not None:
    config = recorded
  else:
    raise ValueError(f"{'Training' if mode == 'train' else f'--mode={mode}'} needs --config="
                     f"<file>.py[:<args>]" + ("" if mode == "train" else
                                                f" ({workdir} records no run)") + ".")
  fixed = [key for key, _ in overrides if recorded is not None and key in RECORDED_KEYS]
  if fixed:
    raise ValueError(f"--config.{fixed[0]} is the recorded run's ({fixed[0]}="
                     f"{config_lib.flat(recorded)[fixed[0]]!r}): the data split and the ensemble "
                     "members decide what the run trained on, and an evaluation keeps them.")
  model = dict(overrides).get("model")
  if model is not None and model != config.model:
    if recorded is not None:  # its checkpoints hold that model's variables
      raise ValueError(f"--config.model={model}: {workdir} recorded model {recorded.model!r}, "
                       "and an evaluation rebuilds the recorded model; evaluate a workdir "
                       f"of {model} instead.")
    # First the model, so that the other overrides set its options, not the config file's model's.
    config = with_model(config, model)
    _name_the_recipe(config, config_arg, model)
  method = dict(overrides).get("method")
  if method is not None and method != config.method:
    # Then the method, whose settings block replaces the previous method's (an evaluation may
    # score the recorded run by another method, e.g. a Laplace fit of a deterministic run).
    config = with_method(config, method)
  # An option of any registered evaluator adds that evaluator (with its options declared), so
  # that a config without it can run it after training; an unregistered name fails, listing them.
  enabled = tuple(key.split(".")[1] for key, _ in overrides
                  if key.startswith("evals.") and key.count(".") >= 2)
  config = evaluators.declare_options(config, enabled + (() if mode in ("train", "fit")
                                                         else (mode,)))
  config = config_lib.with_overrides(
      config, {key: parse_value(config, key, text) for key, text in overrides})
  if recorded is not None:
    changed = config_lib.differences(recorded, config)
    logging.info("Evaluating the recorded run of %s%s", workdir,
                 f"; differing from it: {', '.join(changed)}" if changed else "")
  return config


def shorthand_options(mode: str, ensemble_workdirs=(), baseline_csv=None, num_samples=None):
  """``{evals.<name>.<option>: value}`` the shorthand flags stand for, for each evaluator of
  ``mode`` (ValueError in train mode)."""
  given = {k: v for k, v in (("members", tuple(ensemble_workdirs[1:])),
                             ("baseline_csv", baseline_csv), ("num_samples", num_samples))
           if v not in (None, ())}
  if not given:
    return {}
  if mode == "train":
    raise ValueError(f"--{', --'.join(given)} set options of an evaluation mode; after training, "
                     "set them as --config.evals.<name>.<option>=….")
  out = {}
  for name in evaluators.expand(mode):
    evaluators.check_options(name, given)
    out.update({f"evals.{name}.{k}": v for k, v in given.items()})
  return out


def _exit_at_once(signum, frame):
  """Ctrl-C outside the training loop, or a second one inside it: one line, exit 130 (128 +
  SIGINT) at once.  Training's first Ctrl-C saves a checkpoint instead (``Preemption``)."""
  print("smoothing_jax.main: stopped at once by SIGINT (checkpoints saved before are kept; "
        "rerun the same command to resume).", file=sys.stderr, flush=True)
  os._exit(128 + signal.SIGINT)  # no cleanup to wait for: the kernel drops the workdir lock


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  signal.signal(signal.SIGINT, _exit_at_once)  # no KeyboardInterrupt traceback
  _JobStarted.started = False
  if FLAGS.verbosity < 1:  # --verbosity=1 shows every library's INFO lines too
    show_only_our_info_lines()
  evaluated = FLAGS.ensemble_workdirs[0] if FLAGS.ensemble_workdirs else FLAGS.workdir
  try:  # a config the command line cannot make: a usage error (status 2), before anything runs
    workdir_lib.check_directories(FLAGS.workdir, *FLAGS.ensemble_workdirs)
    config = resolve_config(FLAGS.mode, evaluated, FLAGS.config, CONFIG_OVERRIDES)
    config = config_lib.with_overrides(config, shorthand_options(
        FLAGS.mode, FLAGS.ensemble_workdirs, FLAGS.baseline_csv, FLAGS.num_samples))
  except USER_ERRORS as e:
    _fail(e, 2)
  try:
    run(config, FLAGS.workdir, FLAGS.mode, evaluated_workdir=evaluated,
        results_dir=FLAGS.results_dir, multihost=FLAGS.multihost,
        coordinator_address=FLAGS.coordinator_address, num_processes=FLAGS.num_processes,
        process_id=FLAGS.process_id)
  except USER_ERRORS as e:
    _fail(e, 1 if _JobStarted.started or not isinstance(e, REFUSALS) else 2)
  except Preempted as stopped:  # after its checkpoint: the line that says how to resume
    print(stopped, file=sys.stderr)
    sys.exit(stopped.exit_status)


def _fail(error: Exception, status: int):
  """A user error as one line and exit ``status`` (raised again where tracebacks are asked for)."""
  if _show_tracebacks():
    raise error
  cause = (f" ({error.__cause__})" if error.__cause__ and str(error.__cause__) not in str(error)
           else "")
  _exit_with_error(f"{type(error).__name__}: {error}{cause}", status)


def initialize_multihost(coordinator_address=None, num_processes=None, process_id=None):
  """``jax.distributed.initialize`` (None arguments: auto-detected on Cloud TPU / SLURM), with
  gloo collectives for CPU devices, so that CPU processes form one mesh too."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address, num_processes, process_id)


def check_writable(directory) -> None:
  """PermissionError (one line) unless files can be written into ``directory``, or where it does
  not exist yet, into the nearest existing folder above it (where it would be made): tried by
  writing and removing a probe file, so that nothing is left behind and a read-only filesystem,
  missing permissions (also of a ``gs://`` bucket) or a file in the way are all caught."""
  path = existing = workdir_lib.workdir_path(directory)
  while not existing.exists() and existing.parent != existing:
    existing = existing.parent
  if not existing.is_dir():
    reason = f"{existing} is a file"
  else:
    probe = existing / f".smoothing_jax_write_probe.{os.getpid()}"
    try:
      probe.write_text("")
      probe.unlink()
      return
    except OSError as error:
      reason = error.strerror or str(error)
  raise PermissionError(f"Cannot write the results into {path} ({reason}); give "
                        "--results_dir=<a writable folder>.")


def run(config, workdir: str, mode: str = "train", *, evaluated_workdir=None, results_dir=None,
        multihost: bool = False, coordinator_address=None, num_processes=None,
        process_id=None) -> dict:
  """The job ``mode`` names on ``config`` and ``workdir``: ``train`` (then ``config.evals``) or
  one evaluator (of ``evaluated_workdir``, default ``workdir``), each with its ``config.evals``
  options, writing into ``results_dir`` (default ``<workdir>/results``; checked writable before
  anything is computed); prints each evaluator's summary and returns ``{name: result}``."""
  names = (evaluators.names_after_training(config) if mode == "train" else
           () if mode == "fit" else (mode,))
  for name in (n for alias in names for n in evaluators.expand(alias)):
    evaluators.options_of(config, name)  # a bad option fails before anything runs
  if mode == "train":  # a refused config leaves no workdir, lock or TensorBoard file behind
    check_config(config)
  if multihost:
    initialize_multihost(coordinator_address, num_processes, process_id)
  results_dir = workdir_lib.workdir_path(results_dir or workdir_lib.workdir_path(workdir) /
                                         "results")
  if names and jax.process_index() == 0:  # process 0 writes the results
    check_writable(results_dir)
  if mode == "train":  # one writer per workdir, refused before it reads or writes anything
    with lock_workdir(workdir):
      return _run(config, workdir, mode, names, workdir, results_dir)
  return _run(config, workdir, mode, names, evaluated_workdir or workdir, results_dir)


class _JobStarted(Callback):
  """Marks the job started at the training loop's start: the settings were all taken."""
  started = False

  def on_start(self, step: int, state) -> None:
    type(self).started = True


def _run(config, workdir, mode, names, evaluated_workdir, results_dir) -> dict:
  logging.info("%s %s: reading %s and building the model (JAX devices: %d %s, processes: %d).",
               "Training" if mode == "train" else f"Mode {mode} on", evaluated_workdir,
               config.input.dataset, jax.device_count(), jax.devices()[0].platform,
               jax.process_count())
  if mode == "train":
    opened = Run.from_config(config, workdir)
  else:
    opened = Run.for_evaluation(evaluated_workdir, config)
  results = {}
  with opened as the_run:
    if mode == "train":
      train(the_run, callbacks=[_JobStarted()])
    _JobStarted.started = True  # (a fit's or an evaluation's errors are failures, status 1)
    if mode == "fit":
      print(f"Fitted {the_run.method.describe()}: {the_run.fit()}")
    for name, (result, summary) in evaluators.run_evaluators(names, the_run,
                                                              results_dir).items():
      print(f"\n{summary}")
      results[name] = result
  if mode == "train":
    print(f"TensorBoard: tensorboard --logdir {workdir}")
  return results


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
