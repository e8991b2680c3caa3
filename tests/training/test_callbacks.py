"""smoothing_jax.training.callbacks: SIGTERM and Ctrl-C become a request to checkpoint and stop."""
import os
import signal

import pytest

from smoothing_jax.training.callbacks import Preempted, Preemption


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_sets_the_preemption_flag(signum):
  preemption = Preemption()
  preemption.on_start(0, None)
  try:
    assert not preemption.should_stop(1)
    os.kill(os.getpid(), signum)
    assert preemption.signum == signum and preemption.should_stop(2)
  finally:
    preemption.close()
  for stop_signal in (signal.SIGTERM, signal.SIGINT):  # the handlers are restored
    assert signal.getsignal(stop_signal) != preemption._handle


def test_a_second_ctrl_c_goes_to_the_handler_from_before_training():
  received = []
  before = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
  preemption = Preemption()
  preemption.on_start(0, None)
  try:
    os.kill(os.getpid(), signal.SIGINT)  # the first: a checkpoint, then stop
    assert preemption.should_stop(1) and not received
    os.kill(os.getpid(), signal.SIGINT)  # the second: what Ctrl-C did before (main: exit now)
    assert received == [signal.SIGINT]
  finally:
    preemption.close()
    signal.signal(signal.SIGINT, before)


def test_the_exit_status_is_the_shells_for_ctrl_c():
  assert Preempted("stopped", signal.SIGINT).exit_status == 130
  assert Preempted("stopped", signal.SIGTERM).exit_status == 1
  assert Preempted("stopped").exit_status == 1  # a callback's request


def test_processes_stop_on_the_gathered_signals_alone(monkeypatch):
  """Two processes: a SIGTERM that arrives while this process is in the gather (sent: 0) is not
  acted on until the next gather, which tells the other process too; stopping at once would stop
  this process alone and leave the other waiting in its next collective."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils
  other = [0, 0, signal.SIGINT]  # what the other process sends at each gather

  def allgather(value):  # the signal arrives during the first gather, after this value was sent
    if len(other) == 3:
      os.kill(os.getpid(), signal.SIGTERM)
    return np.stack([value, np.int32(other.pop(0))])

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  preemption, other_process = Preemption(), Preemption()
  preemption.on_start(0, None)
  try:
    assert not preemption.should_stop(5)  # both gathered (0, 0): both go on
    assert preemption.signum == signal.SIGTERM
    assert preemption.should_stop(10)  # both gather (SIGTERM, 0): both stop here
  finally:
    preemption.close()
  assert other_process.should_stop(15) and other_process.signum == signal.SIGINT  # the other's
