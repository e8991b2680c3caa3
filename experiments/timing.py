"""Timing helpers shared by the benchmark scripts."""
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


def alternate(calls: dict, repeats: int, first_calls: dict | None = None) -> dict:
  """Each call of ``calls`` once per round, ``repeats`` rounds after one untimed call each:
  ``{name: [seconds per round]}``.  Other work on the machine then slows every call alike, and
  the per-round ratios stay comparable.  ``first_calls``, a dict: filled with the seconds of
  each first call (compiling what it compiles, as a fresh process does)."""
  for name, call in calls.items():
    start = time.perf_counter()
    jax.block_until_ready(call())
    if first_calls is not None:
      first_calls[name] = time.perf_counter() - start
  times = {name: [] for name in calls}
  for _ in range(repeats):
    for name, call in calls.items():
      start = time.perf_counter()
      jax.block_until_ready(call())
      times[name].append(time.perf_counter() - start)
  return times


def round_ratios(numerators, denominators) -> list:
  """The per-round ratios ``numerators[i] / denominators[i]`` of two :func:`alternate` times."""
  return [a / b for a, b in zip(numerators, denominators, strict=True)]
