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
