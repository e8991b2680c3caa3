"""Timing helper shared by the benchmark scripts."""
import statistics
import time

import jax


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of ``fn()`` over ``repeats`` runs, after one untimed run (compile +
  warm-up)."""
  jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)
