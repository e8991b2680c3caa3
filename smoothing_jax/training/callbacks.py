"""Hooks of the training loop (``train.train(run, callbacks=...)``): ``Callback``, and
``Preemption``, which turns a SIGTERM into a checkpoint and a clean exit.  The learning-trajectory
recorder (``smoothing_jax.training.trajectory_recorder.TrajectoryRecorder``) is another.
"""
from __future__ import annotations

import signal

import jax
import numpy as np
from absl import logging


class Callback:
  """The loop calls, in order: ``on_start(step, state)`` once (the restored or fresh state),
  ``on_step(step, state)`` after every step, ``should_stop(step)`` after every step (every
  callback is asked, then the loop checkpoints and stops if any said so),
  ``on_checkpoint(step)`` before each checkpoint is saved, and ``close()`` at the end, whatever
  happened.  Each does nothing by default."""

  def on_start(self, step: int, state) -> None:
    pass

  def on_step(self, step: int, state) -> None:
    pass

  def should_stop(self, step: int) -> bool:
    return False

  def on_checkpoint(self, step: int) -> None:
    pass

  def close(self) -> None:
    pass


class Preempted(SystemExit):
  """Raised after the checkpoint that a SIGTERM asked for has been written."""


class Preemption(Callback):
  """Turns SIGTERM into a request to stop after the current step (checkpoint, then
  :class:`Preempted`).  Several processes agree on the step: ``every`` steps an all-gather asks
  whether any process received the signal."""

  def __init__(self, every: int = 1):
    self.every = every
    self.requested = False
    self._previous = None

  def on_start(self, step: int, state) -> None:
    try:
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    except ValueError:  # not the main thread
      self._previous = None

  def _handle(self, signum, frame):
    logging.warning("SIGTERM received: saving a checkpoint before exiting.")
    self.requested = True

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def should_stop(self, step: int) -> bool:
    """One process: its own flag.  Several: any process's flag, compared by an all-gather every
    ``every`` steps; every process runs the same steps, so all stop (and save) at the same one,
    whichever received the SIGTERM."""
    if jax.process_count() == 1:
      return self.requested
    if step % self.every:
      return False
    from jax.experimental import multihost_utils
    return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested))))
