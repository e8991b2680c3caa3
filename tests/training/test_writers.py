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
  writers.MetricWriter(num_steps=40).write_scalars(3, {"loss": 0.25})
  writer.close()
  assert "[2] loss=0.5" in caplog.text and "[3/40] loss=0.25" in caplog.text
  assert not list(tmp_path.iterdir())


class _Recorder:
  def __init__(self):
    self.rows = []

  def write_scalars(self, step, scalars, log=True):
    assert not log  # the progress line says them: no second console line
    self.rows.append((step, scalars))


def test_progress_after_the_first_step_then_every_tenth_or_30_s(monkeypatch):
  from tests.helpers import absl_info_lines
  now = [0.0]
  monkeypatch.setattr(writers.time, "monotonic", lambda: now[0])
  recorder = _Recorder()
  progress = writers.ProgressReporter(200, recorder)  # t = 0: the loop starts

  def at(t, step):
    now[0] = t
    progress(step)

  def finished_at(t, step):  # dispatched at 40 s, the step done at t
    now[0] = 40.0
    progress(step, wait=lambda: now.__setitem__(0, t))

  with absl_info_lines() as lines:
    at(12.0, 1)   # the first step, compiled
    at(13.0, 2)   # too soon, and not a tenth of the run
    now[0] = 14.0
    with progress.timed("eval"):
      now[0] = 18.0
    at(20.0, 20)  # a tenth of the run: 19 steps in 8 s, 4 s of them evaluating
    at(49.0, 21)  # neither 30 s nor a tenth yet
    at(51.0, 30)  # 31 s since the last line
    finished_at(60.0, 200)  # the last step: timed once it is done, not when dispatched
  assert lines == [
      "Step 1/200: compiled and run in 12 s; steps/s and time left follow.",
      "Step 20/200: 2.38 steps/s, eval 50% of it, 1 min 16 s left.",
      "Step 30/200: 0.323 steps/s, 8 min 47 s left.",
      "Step 200/200: 18.9 steps/s, 0 s left."]
  assert recorder.rows == [
      (20, {"steps_per_sec": pytest.approx(19 / 8), "eval_fraction": pytest.approx(0.5)}),
      (30, {"steps_per_sec": pytest.approx(10 / 31)}),
      (200, {"steps_per_sec": pytest.approx(170 / 9)})]


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


def test_a_step_budget_inside_the_warm_up_or_short_of_the_schedule_warns_once(caplog):
  """CIFAR-10 at batch 128 (390 steps an epoch): 40 steps end inside the 390-step warm-up, at
  0.1 × 40 / 390 of the rate; 800 of the 78,390-step schedule cut it; the whole schedule is
  silent."""
  from configs import cifar_resnet
  from smoothing_jax.training.train import warn_of_a_cut_schedule
  config = cifar_resnet.get_config("resnet_dnn_18,cifar10")
  with caplog.at_level("WARNING"):
    warn_of_a_cut_schedule(config, 40, 390)
  assert caplog.messages == [
      "num_train_steps 40 ends the run inside the 390-step warm-up: its last learning rate is "
      "0.0103 (peak 0.1). To train a shorter run on the whole schedule, lower num_epochs (and "
      "warmup_epochs) instead."]
  caplog.clear()
  with caplog.at_level("WARNING"):
    warn_of_a_cut_schedule(config, 800, 390)
    warn_of_a_cut_schedule(config, 201 * 390, 390)
  assert len(caplog.messages) == 1 and "at step 800 of its epochs' 78390-step" in caplog.text
