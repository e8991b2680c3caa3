"""A run's orbax checkpoints: the manager, restoring the latest intact step onto the current
devices, and the state of a workdir (a run recorded, checkpoints written).

Checkpoints restore onto the current devices, whatever device count wrote them; a step that
cannot be read is skipped with a warning naming it and the step used instead, and a reader moves
or deletes nothing (``restore_latest``); a resuming training run renames it
``<step>.corrupt`` (``set_aside_newer_steps``).
"""
from __future__ import annotations

import logging as std_logging
import sys
from collections.abc import Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath

from smoothing_jax.experiment.workdir import CONFIG_FILE, checkpoint_dir, read_record, workdir_path
from smoothing_jax.parallel import shardings


def checkpoint_manager(workdir: str, max_to_keep: int | None = None,
                       read_only: bool = False) -> ocp.CheckpointManager:
  """The orbax manager of ``<workdir>/checkpoints`` (created unless ``read_only``)."""
  # A reader saves nothing (save_interval_steps 0; orbax warns when it has to set that itself).
  options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=not read_only,
                                         read_only=read_only,
                                         save_interval_steps=0 if read_only else 1)
  logger = logging.get_absl_logger()
  quiet = _ReadOnlyNotice()
  if read_only:  # orbax warns that a reader reads, which is what it was asked for
    logger.addFilter(quiet)
  try:
    return ocp.CheckpointManager(checkpoint_dir(workdir), options=options,
                                 item_handlers=ocp.StandardCheckpointHandler())
  finally:
    logger.removeFilter(quiet)


class _ReadOnlyNotice(std_logging.Filter):
  def filter(self, record) -> bool:
    return not str(record.msg).startswith("Given directory is read only")


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
  tried newest first; those that fail (e.g. corrupted or missing files) are skipped, and one
  warning line names them, why, and the older step restored.  Nothing is moved or deleted (a
  resuming training run sets them aside: :func:`set_aside_newer_steps`).  Raises
  ``NoIntactCheckpointError`` (a ``FileNotFoundError``) naming the directory when every step
  fails.
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
      continue
    _RESTORED_STEP_DIRS.discard(step_dir)
    if failures:  # one line: what was skipped, why, and what is used instead
      skipped = ", ".join(str(s) for s, _ in failures)
      reasons = (failures[0][1] if len(failures) == 1 else
                 "; ".join(f"step {s}: {reason}" for s, reason in failures))
      logging.warning("Checkpoint step%s %s in %s cannot be restored (%s); using the older step "
                      "%d instead.", "s" if len(failures) > 1 else "", skipped, manager.directory,
                      reasons, step)
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
  """Whether ``<workdir>/checkpoints`` holds a finalised checkpoint step (read from the
  directory: no manager is opened)."""
  directory = checkpoint_dir(workdir)
  return directory.exists() and bool(ocp.utils.checkpoint_steps(directory))


def evaluates_init_from(workdir) -> bool:
  """Whether ``workdir`` has no checkpoint and was recorded to stand for its ``init_from`` (an
  evaluation of another run or of a torch checkpoint file: ``Run.record_init_from``; the
  ``ModelSpec.evaluates_init_from`` flag))."""
  return (not has_checkpoint(workdir) and (workdir_path(workdir) / CONFIG_FILE).exists() and
          bool(read_record(workdir).get("model_spec", {}).get("evaluates_init_from")))


def load_variables(workdir, mesh, method_state: bool = False) -> tuple:
  """``(step, variables)`` of the latest intact checkpoint of ``workdir``, replicated on
  ``mesh`` whatever device count wrote it (corrupted newer steps are skipped with a warning:
  :func:`restore_latest`): ``{"params", "batch_stats"}``, what another run starts from, and with
  ``method_state`` the collections of its method too (what its predictive takes).  Raises
  ``FileNotFoundError`` when there is no checkpoint or none restores."""
  replicated, _ = shardings(mesh)
  with checkpoint_manager(workdir, read_only=True) as manager:
    restored = restore_latest(
        manager, lambda step: abstract_tree(manager.item_metadata(step).tree, replicated))
  if restored is None:
    raise FileNotFoundError(f"No checkpoint in {checkpoint_dir(workdir)}.")
  variables = variables_of_tree(restored[1])
  if not method_state:
    variables = {"params": variables["params"], "batch_stats": variables["batch_stats"]}
  return restored[0], variables


def variables_of_tree(tree) -> dict:
  """The variables of a restored train state (``TrainState`` or the dict orbax restores without
  a target): ``{"params", "batch_stats", **method_state}`` (a checkpoint written before methods
  had state of their own holds none)."""
  if not isinstance(tree, Mapping):
    tree = {"params": tree.params, "batch_stats": tree.batch_stats,
            "method_state": tree.method_state}
  return {"params": tree["params"], "batch_stats": tree["batch_stats"],
          **(tree.get("method_state") or {})}
