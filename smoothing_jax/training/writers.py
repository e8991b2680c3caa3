"""Training metrics on the console and in TensorBoard, and progress lines, without TensorFlow.

:class:`MetricWriter` logs ``[step/total] name=value`` lines and appends the scalars to a
TensorBoard event file in the workdir; :class:`ProgressReporter` logs step/total, steps/s, the
share of time spent in timed sections (evaluation) and the time left, every tenth of the run or
30 s, whichever comes first.

Why not clu's writers: importing ``clu.metric_writers`` (and ``clu.periodic_actions``, which
imports it) imports TensorFlow for its ``tf.summary`` writer, and the accelerator images have no
TensorFlow; the device-resident training path needs none.  The event files are written with
TensorBoard's own record writer (``tensorboard.summary.writer.record_writer``: protobuf and a
CRC, no TensorFlow), so TensorBoard reads them as it reads clu's.
"""
from __future__ import annotations

import contextlib
import logging as std_logging
import math
import os
import socket
import time
from collections.abc import Mapping

from absl import logging
from etils import epath


class MetricWriter:
  """Scalars to the log (``[step/total] name=value``; ``[step]`` without ``num_steps``) and,
  with a ``logdir``, to ``<logdir>/events.out.tfevents.*``."""

  def __init__(self, logdir: str | None = None, num_steps: int | None = None):
    self._records = None
    self._of_total = "" if num_steps is None else f"/{num_steps}"
    if logdir is not None:
      from tensorboard.compat.proto import event_pb2
      from tensorboard.summary.writer.record_writer import RecordWriter
      path = epath.Path(logdir)
      path.mkdir(parents=True, exist_ok=True)
      name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
      self._records = RecordWriter((path / name).open("wb"))
      self._event = event_pb2.Event
      self._write(self._event(wall_time=time.time(), file_version="brain.Event:2"))

  def _write(self, event):
    self._records.write(event.SerializeToString())

  def write_scalars(self, step: int, scalars: Mapping[str, float], log: bool = True):
    """Add ``scalars`` at ``step`` to the event file, and log them unless ``log`` is False
    (what a progress line already says)."""
    if log:
      logging.info("[%d%s] %s", step, self._of_total,
                   ", ".join(f"{k}={float(v):.6g}" for k, v in scalars.items()))
    if self._records is None:
      return
    from tensorboard.compat.proto import summary_pb2
    values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    self._write(self._event(wall_time=time.time(), step=int(step),
                            summary=summary_pb2.Summary(value=values)))

  def flush(self):
    if self._records is not None:
      self._records.flush()

  def close(self):
    if self._records is not None:
      self._records.close()
      self._records = None


def _duration(seconds: float) -> str:
  """``42 s``, ``3 min 05 s``, ``2 h 07 min``."""
  seconds = int(round(seconds))
  if seconds < 60:
    return f"{seconds} s"
  if seconds < 3600:
    return f"{seconds // 60} min {seconds % 60:02d} s"
  return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class ProgressReporter:
  """Progress lines of a run of ``num_train_steps``: one once the first step is compiled, then
  one every ``every_fraction`` of the run or every ``every_secs`` seconds, whichever comes first,
  and one at the last step.  Each says step/total, steps/s since the previous line (measured
  between finished steps: ``wait``, given, blocks until the step is done), the share of that time
  spent in :meth:`timed` sections (evaluation) where there was any, and the time left at that
  rate, and writes the scalars ``steps_per_sec`` and ``<section>_fraction`` to TensorBoard (not
  again to the console)."""

  def __init__(self, num_train_steps: int, writer: MetricWriter, every_secs: float = 30.0,
               every_fraction: float = 0.1):
    self.num_train_steps, self.writer, self.every_secs = num_train_steps, writer, every_secs
    self.every_steps = max(1, math.ceil(num_train_steps * every_fraction))
    self._started = time.monotonic()
    self._last_time, self._last_step = None, None
    self._sections: dict = {}

  def __call__(self, step: int, wait=None):
    first = self._last_time is None
    if not first and not (step % self.every_steps == 0 or step == self.num_train_steps
                          or time.monotonic() - self._last_time >= self.every_secs):
      return
    if wait is not None:  # the step dispatched is not the step done: time finished steps
      wait()
    now = time.monotonic()
    if first:  # the first step's time is mostly compilation: no rate from it
      logging.info("Step %d/%d: compiled and run in %s; steps/s and time left follow.",
                   step, self.num_train_steps, _duration(now - self._started))
      self._last_time, self._last_step, self._sections = now, step, {}
      return
    elapsed, steps = now - self._last_time, step - self._last_step
    if steps <= 0 or elapsed <= 0:
      return
    rate = steps / elapsed
    fractions = {f"{name}_fraction": seconds / elapsed for name, seconds in self._sections.items()}
    spent = "".join(f", {k.removesuffix('_fraction')} {v:.0%} of it" for k, v in fractions.items())
    logging.info("Step %d/%d: %.3g steps/s%s, %s left.", step, self.num_train_steps, rate, spent,
                 _duration((self.num_train_steps - step) / rate))
    self.writer.write_scalars(step, {"steps_per_sec": rate, **fractions}, log=False)
    self._last_time, self._last_step, self._sections = now, step, {}

  @contextlib.contextmanager
  def timed(self, name: str):
    """Count the wall time of the ``with`` body as ``name`` in the next report."""
    start = time.monotonic()
    try:
      yield
    finally:
      self._sections[name] = self._sections.get(name, 0.0) + time.monotonic() - start


# Library warnings that say nothing to a user: orbax warns whenever a checkpoint manager opens
# read-only, which every evaluation of a trained workdir does on purpose (``Run.manager``); TFDS
# warns of a dataset folder without data while it looks for a set that is not prepared, which the
# one-line DatasetUnavailableError then names with the folder searched; asyncio reports the
# abandoned per-array tasks of an orbax restore that failed (a checkpoint that does not fit the
# settings), whose failure ``ConfigChangedError`` or ``NoIntactCheckpointError`` already names.
_EXPECTED_WARNINGS = ("Given directory is read only", "Variant folder %s has no %s",
                      "Task exception was never retrieved")


class _OurInfoLines(std_logging.Filter):
  def filter(self, record):
    if record.levelno >= std_logging.WARNING:
      return not str(record.msg).startswith(_EXPECTED_WARNINGS)
    return f"{os.sep}smoothing_jax{os.sep}" in record.pathname


def show_only_our_info_lines() -> None:
  """The console (absl's handler) keeps smoothing_jax's INFO lines only; every library's warnings
  and errors still show, but the expected ones (:data:`_EXPECTED_WARNINGS`).  orbax, for one,
  logs a dozen INFO lines per checkpoint.  Outside ``absl.app.run`` (scripts, notebooks) it also
  installs absl's handler on the root logger."""
  logging.use_absl_handler()
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _OurInfoLines) for f in handler.filters):
    handler.addFilter(_OurInfoLines())
