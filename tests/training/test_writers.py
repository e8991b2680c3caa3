"""smoothing_jax.training.writers: event files TensorBoard reads back, progress lines and rates."""
import pytest

from smoothing_jax.training import writers


def test_scalars_read_back_by_tensorboard(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  writer = writers.MetricWriter(str(tmp_path))
  writer.write_scalars(3, {"train_loss": 1.5, "eval_acc": 0.25})
  writer.write_scalars(7, {"train_loss": 0.75})
  writer.close()
  events = EventAccumulator(str(tmp_path))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(3, 1.5), (7, 0.75)]
  assert [(e.step, e.value) for e in events.Scalars("eval_acc")] == [(3, 0.25)]


def test_a_writer_without_logdir_only_logs(tmp_path, caplog):
  caplog.set_level("INFO")
  writer = writers.MetricWriter()
  writer.write_scalars(2, {"loss": 0.5})
  writer.close()
  assert "[2] loss=0.5" in caplog.text and not list(tmp_path.iterdir())


class _Recorder:
  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars):
    self.rows.append((step, scalars))


def test_progress_reports_steps_per_second_and_timed_sections(monkeypatch):
  clock = iter([0.0, 10.0, 12.0, 30.0, 70.0, 71.0]).__next__
  monkeypatch.setattr(writers.time, "monotonic", clock)
  recorder = _Recorder()
  progress = writers.ProgressReporter(100, recorder, every_secs=60)
  progress(1)        # t = 0: the reference point (after the first step's compilation)
  progress(5)        # t = 10: too soon
  with progress.timed("eval"):  # t = 12 .. 30
    pass
  progress(61)       # t = 70: 60 steps in 70 s, 18 s of them evaluating
  assert recorder.rows == [(61, {"steps_per_sec": pytest.approx(60 / 70),
                                 "eval_fraction": pytest.approx(18 / 70)})]
  progress(100)      # t = 71: the last step always reports
  assert recorder.rows[-1] == (100, {"steps_per_sec": pytest.approx(39.0)})


def test_the_console_keeps_our_info_lines_and_the_warnings_that_say_something():
  import logging as std_logging
  import os

  from absl import logging as absl_logging

  from smoothing_jax.training.writers import show_only_our_info_lines
  handler = absl_logging.get_absl_handler()
  before = list(handler.filters)
  show_only_our_info_lines()
  try:
    def shown(level, pathname, msg):
      return bool(handler.filter(std_logging.LogRecord("x", level, pathname, 1, msg, (), None)))
    ours = os.path.join(os.sep, "src", "smoothing_jax", "training", "train.py")
    orbax = os.path.join(os.sep, "site", "orbax", "checkpoint", "checkpoint_manager.py")
    assert shown(std_logging.INFO, ours, "Step 10/10")
    assert not shown(std_logging.INFO, orbax, "Saving checkpoint")
    assert shown(std_logging.WARNING, orbax, "Checkpoint step 3 is corrupted")
    assert not shown(std_logging.WARNING, orbax, "Given directory is read only=%s")
    tfds = os.path.join(os.sep, "site", "tensorflow_datasets", "core", "utils", "file_utils.py")
    assert not shown(std_logging.WARNING, tfds, "Variant folder %s has no %s")
  finally:
    handler.filters[:] = before
