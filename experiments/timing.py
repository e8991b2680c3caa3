"""Timing helpers shared by the benchmark scripts."""
import statistics
import time
from collections.abc import Callable

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


def alternating_seconds(calls: dict[str, Callable], repeats: int) -> dict[str, list]:
  """``{name: [seconds of each round]}``: one untimed call of each first (warm-up), then
  ``repeats`` rounds calling every ``calls[name]()`` once in turn, so that a change of the
  machine's load falls on all of them alike (their medians are then comparable)."""
  for fn in calls.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, fn in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return times
