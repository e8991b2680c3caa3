"""A run's directory: the config it recorded, its checkpoints, and the trained model.

  <workdir>/config.json            the run's config, plus ``model_spec`` (classes, stem, image
                                   shape): enough to rebuild the model without the dataset
  <workdir>/checkpoints/<step>/    orbax checkpoints of the train state

``load(workdir) -> (config, model, variables)`` is what evaluation, analyses, notebooks
and benchmarks use.  ``config.init_from`` (another workdir, or a torch checkpoint file) gives the
variables a training run starts from (``init_from_variables``), and those of a workdir that
records it but has no checkpoint of its own (an evaluation run).  Checkpoints restore onto the
current devices, whatever device count wrote them; a step that cannot be read is skipped with a
warning (``restore_latest``).

A workdir is any path ``etils.epath`` opens: a local folder or ``gs://bucket/run``.
Every file under it is written through :func:`write_atomically` / :func:`save_figure`
(a temporary file renamed over the target), never through ``open``/``os.path``.
"""
from __future__ import annotations

import io
import json
import logging as std_logging
import re
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from smoothing_jax import convert
from smoothing_jax.inference import sample_rngs
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shardings

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"


def workdir_path(workdir) -> epath.Path:
  """``workdir`` as an ``epath.Path``: URIs (``gs://bucket/run``) as given, local paths made
  absolute (orbax needs absolute paths)."""
  path = epath.Path(workdir)
  return path if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", str(workdir)) else path.absolute()


def write_atomically(path, data) -> None:
  """Write ``data`` (str or bytes) to ``<path>.tmp``, then rename it over ``path``: readers see
  the old file or the new one, never half of one.  Creates the parent folder."""
  path = epath.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(path.name + ".tmp")
  if isinstance(data, bytes):
    tmp.write_bytes(data)
  else:
    tmp.write_text(data)
  tmp.replace(path)


def write_json(path, obj, indent: int = 2) -> None:
  """``obj`` as JSON at ``path`` (:func:`write_atomically`)."""
  write_atomically(path, json.dumps(obj, indent=indent))


def save_figure(fig, path, **savefig_kwargs) -> None:
  """A matplotlib figure at ``path`` (format from the suffix; :func:`write_atomically`)."""
  path = epath.Path(path)
  buffer = io.BytesIO()
  fig.savefig(buffer, format=path.suffix.lstrip(".") or "png", **savefig_kwargs)
  write_atomically(path, buffer.getvalue())


def checkpoint_dir(workdir) -> epath.Path:
  """``<workdir>/checkpoints`` (:func:`workdir_path`)."""
  return workdir_path(workdir) / CHECKPOINTS


def write_config(workdir, config: ml_collections.ConfigDict, model_spec: dict):
  """Record ``config`` and the ``model_spec`` in ``<workdir>/config.json`` (written atomically)."""
  record = json.loads(config.to_json_best_effort())
  record["model_spec"] = model_spec
  write_json(workdir_path(workdir) / CONFIG_FILE, record)


def _read_record(workdir) -> dict:
  path = workdir_path(workdir) / CONFIG_FILE
  if not path.exists():
    raise FileNotFoundError(f"No run in {workdir}: {path} does not exist (train into it first).")
  return json.loads(path.read_text())


def read_config(workdir) -> tuple:
  """``(config, model_spec)`` recorded in ``<workdir>/config.json``."""
  path = workdir_path(workdir) / CONFIG_FILE
  record = _read_record(workdir)
  spec = record.pop("model_spec", None)
  if spec is None:
    raise ValueError(f"{path} has no model_spec (written by an older version); rerun the training "
                     "command once to record it (it resumes from the last checkpoint).")
  return ml_collections.ConfigDict(record), spec


def compute_dtype(config):
  """The models' computation dtype: bfloat16 under ``config.half_precision`` (as in the Flax
  ImageNet example), else float32.  Parameters, optimizer state and BatchNorm statistics stay
  float32 either way, and softmax, losses and metrics are computed in float32."""
  return jnp.bfloat16 if config.get("half_precision", False) else jnp.float32


def model_overrides(config, model_spec: dict) -> dict:
  """The ``get_model`` options of a run: ``model_spec["model_options"]`` (the layout of a timm
  ``init_from``, :func:`init_from_model_options`), then ``config.model_kwargs`` that are set, and
  the stem of ``model_spec`` unless set."""
  overrides = {**model_spec.get("model_options", {}),
               **{k: v for k, v in config.model_kwargs.items() if v is not None}}
  overrides.setdefault("stem", model_spec["stem"])
  return overrides


def build_model(config, model_spec: dict):
  """``config.model`` with :func:`model_overrides` for ``model_spec``'s classes and geometry,
  computing in :func:`compute_dtype` (training and every evaluation of the workdir alike)."""
  return get_model(config.model, int(model_spec["num_classes"]), dtype=compute_dtype(config),
                   **model_overrides(config, model_spec))


def _is_workdir(init_from: str) -> bool:
  path = workdir_path(init_from)
  if not path.exists():
    raise FileNotFoundError(f"config.init_from {init_from!r}: no such workdir or torch checkpoint "
                            "file.")
  return path.is_dir()


def init_from_model_options(config) -> dict:
  """The model options that ``config.init_from`` needs and ``config.model_kwargs`` leaves unset:
  ``convert.TIMM_LAYOUTS[config.model]`` for a timm checkpoint file, else none (recorded as
  ``model_spec["model_options"]``, so every later load builds the same model)."""
  init_from = config.get("init_from")
  if not init_from or _is_workdir(init_from) or not convert.is_timm_state_dict(
      convert.read_torch_checkpoint(init_from)):
    return {}
  layout = convert.TIMM_LAYOUTS.get(config.model, {})
  return {k: v for k, v in layout.items() if config.model_kwargs.get(k) is None}


def init_from_variables(config, model_spec: dict, target, *, new_classifier: bool = False) -> dict:
  """The variables ``config.init_from`` holds for ``build_model(config, model_spec)``: the latest
  checkpoint of a workdir, or a torch checkpoint file (``convert.load_torch_checkpoint``: SS / HV
  CNNs, HV's timm ViT / PiT / Swin).

  Args:
    config, model_spec: the run's (``model_spec["image_shape"]`` sizes a ViT's position
      embedding).
    target: the model's variables (a fresh initialisation) or their ``jax.eval_shape``.
    new_classifier: fine-tuning to another class count: where the output layer's shape differs
      (e.g. CIFAR-100 → CIFAR-10), keep ``target``'s (logged).

  Raises:
    FileNotFoundError: no such workdir or file, or a workdir without a checkpoint.
    ValueError: naming every variable that is missing, unexpected or of another shape.
  """
  source = config.init_from
  if _is_workdir(source):
    _, step, loaded = load_checkpoint(source)
    logging.info("init_from: step %d of %s", step, source)
  else:
    loaded = convert.load_torch_checkpoint(source, config.model,
                                           image_shape=tuple(model_spec["image_shape"]),
                                           **model_overrides(config, model_spec))
  classifier = set(convert.classifier_paths(build_model(config, model_spec),
                                            tuple(model_spec["image_shape"])))
  variables, kept = convert.transfer_variables(
      target, loaded,
      keep_fresh=lambda path, new, old: new_classifier and path in classifier and old is not None
      and np.shape(old) != new.shape,
      title=f"config.init_from {source!r} does not match {config.model!r} "
      f"(num_classes={model_spec['num_classes']})")
  if kept:
    logging.warning("init_from %s has another class count: re-initialised %s", source,
                    ", ".join(kept))
  return variables


def checkpoint_manager(workdir: str, max_to_keep: Optional[int] = None,
                       read_only: bool = False) -> ocp.CheckpointManager:
  """The orbax manager of ``<workdir>/checkpoints`` (created unless ``read_only``)."""
  # A reader saves nothing (save_interval_steps 0; orbax warns when it has to set that itself).
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=not read_only,
                                         read_only=read_only,
                                         save_interval_steps=0 if read_only else 1)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                               item_handlers=ocp.StandardCheckpointHandler())


class NoIntactCheckpointError(FileNotFoundError):
  """Every checkpoint step in a directory failed to restore."""


def abstract_tree(tree, sharding):
  """``tree`` with arrays (or orbax array metadata) as ``jax.ShapeDtypeStruct`` on ``sharding``."""
  def leaf(x):
    if isinstance(x, (jax.Array, np.ndarray, ocp.metadata.ArrayMetadata)):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x
  return jax.tree.map(leaf, tree)


def _short_reason(error: BaseException) -> str:
  """First line of the innermost cause of ``error`` (orbax wraps TensorStore's), its spec cut."""
  for _ in range(10):
    if error.__cause__ is None:
      break
    error = error.__cause__
  line = (str(error).strip().splitlines() or [""])[0].split(" [tensorstore_spec")[0]
  return f"{type(error).__name__}: {line[:600]}"


# "<checkpoint dir>/<step>/" of the restores under way or failed (see _late_read_error).
_RESTORED_STEP_DIRS = set()


def _late_read_error(error) -> bool:
  """True for a late error of the reads that a failed orbax restore abandoned.

  orbax restores on a fresh event loop and closes it at the first failed read; the other
  reads then end in the closed loop and are reported at any later time, burying the real
  error ("Event loop is closed", "Future exception was never retrieved", "Exception
  ignored in: <coroutine ...>").  They name the step's directory, as does the real error.
  """
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True
  for _ in range(5):
    if error is None:
      return False
    if any(step_dir in str(error) for step_dir in _RESTORED_STEP_DIRS):
      return True
    error = error.__cause__ or error.__context__
  return False


class _LateReadErrorFilter(std_logging.Filter):
  def filter(self, record):
    return not (record.exc_info and _late_read_error(record.exc_info[1]))


def _mute_late_read_errors():
  """Drop the late read errors of failed restores from asyncio's log and unraisable reports."""
  asyncio_logger = std_logging.getLogger("asyncio")
  if not any(isinstance(f, _LateReadErrorFilter) for f in asyncio_logger.filters):
    asyncio_logger.addFilter(_LateReadErrorFilter())
  previous = sys.unraisablehook
  if getattr(previous, "mutes_late_read_errors", False):
    return

  def hook(unraisable):
    if not _late_read_error(unraisable.exc_value):
      previous(unraisable)

  hook.mutes_late_read_errors = True
  sys.unraisablehook = hook


def restore_latest(manager: ocp.CheckpointManager, target):
  """``(step, tree)`` of the newest step of ``manager`` that restores; None if it has no steps.

  ``target`` is the abstract tree to restore onto (``abstract_tree``: shapes, dtypes and
  the current devices' shardings), or a function of the step returning it.  Steps are
  tried newest first; one that fails (e.g. corrupted files) is skipped with a warning
  naming it and why.  Nothing is deleted.  Raises ``NoIntactCheckpointError`` (a
  ``FileNotFoundError``) naming the directory when every step fails.
  """
  _mute_late_read_errors()
  failures = []
  for step in sorted(manager.all_steps(), reverse=True):
    step_dir = f"{manager.directory / str(step)}/"
    _RESTORED_STEP_DIRS.add(step_dir)  # before any read can fail
    try:
      tree = target(step) if callable(target) else target
      restored = manager.restore(step, args=ocp.args.StandardRestore(tree))
    except Exception as error:  # noqa: BLE001  (whatever the reason, an older step may restore)
      failures.append((step, _short_reason(error)))
      logging.warning("Checkpoint step %d in %s cannot be restored (%s); trying an older step.",
                      step, manager.directory, failures[-1][1])
      continue
    _RESTORED_STEP_DIRS.discard(step_dir)
    return step, restored
  if failures:
    steps = ", ".join(str(s) for s, _ in failures)
    raise NoIntactCheckpointError(
        f"No intact checkpoint in {manager.directory}: steps {steps} failed to restore (step "
        f"{failures[0][0]}: {failures[0][1]}); nothing was deleted.") from None
  return None


def set_aside_newer_steps(manager: ocp.CheckpointManager, step: int):
  """Rename the steps newer than ``step`` (they failed to restore) to ``<step>.corrupt[.n]``.

  Nothing is deleted: the files stay for inspection (remove them by hand), but orbax no
  longer sees them, so the resumed run can save those steps again and ``max_to_keep``
  never counts or removes them.
  """
  newer = [s for s in manager.all_steps() if s > step]
  if not newer:
    return
  if jax.process_index() == 0:
    for s in newer:
      source = epath.Path(manager.directory) / str(s)
      destination, n = source.with_name(f"{s}.corrupt"), 0
      while destination.exists():
        n += 1
        destination = source.with_name(f"{s}.corrupt.{n}")
      source.rename(destination)
      logging.warning("Unreadable checkpoint step %d moved to %s (not deleted).", s, destination)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("set_aside_newer_steps")
  manager.reload()


def has_run(workdir) -> bool:
  """Whether ``workdir`` records a run (``config.json``), e.g. a training run interrupted before
  its first checkpoint, which an evaluation must not overwrite."""
  return (workdir_path(workdir) / CONFIG_FILE).exists() and not evaluates_init_from(workdir)


def has_checkpoint(workdir) -> bool:
  """Whether ``<workdir>/checkpoints`` holds a checkpoint step."""
  if not checkpoint_dir(workdir).exists():
    return False
  with checkpoint_manager(workdir, read_only=True) as manager:
    return bool(manager.all_steps())


# ``model_spec`` key of a workdir recorded to stand for its ``init_from`` (an evaluation), as
# opposed to a fine-tuning run interrupted before its first checkpoint.
EVALUATES_INIT_FROM = "evaluates_init_from"


def evaluates_init_from(workdir) -> bool:
  """Whether ``workdir`` has no checkpoint and was recorded to stand for its ``init_from`` (an
  evaluation of another run or of a torch checkpoint file: ``evaluate.record_init_from``)."""
  return (not has_checkpoint(workdir) and (workdir_path(workdir) / CONFIG_FILE).exists() and
          bool(_read_record(workdir).get("model_spec", {}).get(EVALUATES_INIT_FROM)))


def record_run(workdir, config: ml_collections.ConfigDict, model_spec: dict):
  """:func:`write_config` by process 0; every process returns once the file is written."""
  if jax.process_index() == 0:
    write_config(workdir, config, model_spec)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("record_run")


def _init_from_checkpoint(workdir) -> tuple:
  """``(0, variables)`` of the ``init_from`` recorded in a workdir without checkpoints (an
  evaluation of another run or of a torch checkpoint file)."""
  recorded, spec = read_config(workdir)
  model = build_model(recorded, spec)
  key = jax.random.key(0)
  target = jax.eval_shape(lambda: model.init({"params": key, **sample_rngs(key)},
                                             jnp.zeros((1,) + tuple(spec["image_shape"]))))
  return 0, init_from_variables(recorded, spec, target)


def load_checkpoint(workdir: str, config: Optional[ml_collections.ConfigDict] = None):
  """``(config, step, variables)`` of the latest intact checkpoint in ``workdir``.

  The config comes from ``workdir/config.json`` unless given.  Variables are restored
  replicated on all current devices, whatever device count wrote them; corrupted newer
  steps are skipped with a warning (``restore_latest``).  A workdir without checkpoints whose
  recorded config has ``init_from`` gives those variables (:func:`init_from_variables`) at step
  0.  Raises ``FileNotFoundError`` when there is no checkpoint (nor ``init_from``) or none
  restores.
  """
  if config is None:  # the variables need no model_spec
    record = _read_record(workdir)
    record.pop("model_spec", None)
    config = ml_collections.ConfigDict(record)
  replicated, _ = shardings(create_mesh())
  if evaluates_init_from(workdir):
    step, variables = _init_from_checkpoint(workdir)
    return config, step, jax.device_put(variables, replicated)
  with checkpoint_manager(workdir, read_only=True) as manager:
    restored = restore_latest(
        manager, lambda step: abstract_tree(manager.item_metadata(step).tree, replicated))
  if restored is None:
    raise FileNotFoundError(f"No checkpoint in {checkpoint_dir(workdir)}.")
  step, tree = restored
  return config, step, {"params": tree["params"], "batch_stats": tree["batch_stats"]}


def load(workdir: str, config: Optional[ml_collections.ConfigDict] = None) -> tuple:
  """``(config, model, variables)`` of a trained run, without its dataset.

  ``config`` (e.g. with evaluation settings changed) replaces the recorded one in the
  result; the model is always rebuilt from the recorded config and ``model_spec``.
  """
  recorded, spec = read_config(workdir)
  config, _, variables = load_checkpoint(workdir, recorded if config is None else config)
  return config, build_model(recorded, spec), variables
