"""smoothing_jax.training.callbacks: SIGTERM becomes a request to checkpoint and stop."""
import os
import signal

from smoothing_jax.training.callbacks import Preemption


def test_sigterm_sets_the_preemption_flag():
  preemption = Preemption()
  preemption.on_start(0, None)
  try:
    os.kill(os.getpid(), signal.SIGTERM)
    assert preemption.requested and preemption.should_stop(1)
  finally:
    preemption.close()
  assert signal.getsignal(signal.SIGTERM) is not preemption._handle  # the handler is restored
