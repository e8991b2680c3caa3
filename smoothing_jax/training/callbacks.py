"""Hooks of the training loop (``train.train(run, callbacks=...)``): ``Callback``, and
``Preemption``, which turns SIGTERM or Ctrl-C into a checkpoint and a clean exit.  The
learning-trajectory recorder (``smoothing_jax.training.trajectory_recorder.TrajectoryRecorder``)
is another.
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


# The signals that stop training after a checkpoint: a scheduler's SIGTERM, and Ctrl-C.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
  """Raised after the checkpoint that a stop signal asked for has been written; the command
  line prints the message and exits with ``exit_status``: 130 (128 + SIGINT, the shell's
  convention) after Ctrl-C, 1 after SIGTERM."""

  def __init__(self, message: str, signum: int | None = None):
    super().__init__(message)
    self.exit_status = 128 + signal.SIGINT if signum == signal.SIGINT else 1


class Preemption(Callback):
  """Turns SIGTERM and SIGINT (Ctrl-C) into a request to stop after the current step
  (checkpoint, then :class:`Preempted`).  The first Ctrl-C puts the handler from before training
  back, so that a second one does at once what Ctrl-C did before (the command line: exit).
  Several processes agree on the step: ``every`` steps an all-gather asks whether any process
  received a signal."""

  def __init__(self, every: int = 1):
    self.every = every
    self.signum: int | None = None  # the first stop signal received (None: none yet)
    self._previous: dict = {}

  def on_start(self, step: int, state) -> None:
    for signum in STOP_SIGNALS:
      try:
        previous = signal.signal(signum, self._handle)
      except ValueError:  # not the main thread
        return
      # None: a handler installed outside Python, which signal.signal cannot put back.
      self._previous[signum] = signal.SIG_DFL if previous is None else previous

  def _handle(self, signum, frame):
    logging.warning("%s received: saving a checkpoint before exiting.",
                    signal.Signals(signum).name)
    if signum == signal.SIGINT:
      signal.signal(signum, self._previous.pop(signum))
    self.signum = self.signum or signum

  def close(self) -> None:
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}

  def should_stop(self, step: int) -> bool:
    """One process: whether it received a stop signal.  Several: whether any did, asked by an
    all-gather every ``every`` steps (which tells each process the signal, for its message);
    every process runs the same steps, so all stop (and save) at the same one, whichever
    received the signal."""
    if jax.process_count() == 1:
      return self.signum is not None
    if step % self.every:
      return False
    from jax.experimental import multihost_utils
    received = multihost_utils.process_allgather(np.int32(self.signum or 0))
    # The answer is the gathered values alone, the same on every process: a signal that arrives
    # during the gather (its handler runs as the gather returns) is sent at the next check, since
    # deciding on it here would stop this process alone and leave the others in a collective.
    agreed = next((int(s) for s in np.ravel(received) if s), None)
    self.signum = self.signum or agreed
    return agreed is not None
