"""Reproducer of the worker abort of the test suite: ``Fatal Python error: Aborted`` inside an
eager ``metrics.merge`` on 8-device sharded arrays (``tests/test_parallel.py``), seen in full
runs of the suite and never in the file alone.

For ``--seconds`` it loops what that test does (metrics of a padded batch computed eagerly on
arrays sharded over 8 CPU devices, then merged), under the conditions each candidate cause needs:

  --eager               the metrics as they were: the statistics and the merge dispatched operation
                        by operation (about forty programs over 8 devices, all-reduces among
                        them, queued at once); without it, as they are: one jitted program each
  --new-shapes          every iteration a new batch size, so every eager op compiles anew
                        (what a long test worker does: thousands of new programs)
  --release-every K     ``jax.clear_caches()`` every K iterations (the workers release each test
                        file's executables)
  --prefetch            a ``parallel.prefetch_to_devices`` thread assembling batches all along
  --siblings N          N other processes compiling new programs into the same persistent
                        compilation cache (the other xdist worker, notebook kernels)
  --stress N            N busy-looping processes (a loaded machine)

It prints one JSON line (iterations, seconds, versions, settings) and exits 0; an abort ends it
with status -6 (SIGABRT), which ``--gdb`` turns into the native stack of every thread.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/abort_repro.py \\
      --seconds 60 --eager --new-shapes --release-every 20 --prefetch --siblings 1

What it found (jax/jaxlib 0.10.2, 2 CPU cores): with ``--eager`` and the flags above, 2 of the
first 3 runs stalled and aborted: seven of the eight participants of an all-reduce wait in
``xla::cpu::InProcessCommunicator::AllReduce`` (rendezvous), the eighth is stuck in
``xla::Semaphore::Acquire`` inside ``CpuPjRtRawLoadedExecutable::Execute`` (the per-device limit
of 32 programs in flight, held by later programs that wait for this one's result), and after 40 s
XLA writes ``F… rendezvous.cc:161] Termination timeout for `all reduce …` of 40 seconds
exceeded`` and aborts.  Without ``--eager`` (the library since the fix) 7 of 7 runs of 40 s ran
to their end.  jax/jaxlib 0.11.2 (``.venv-accel``, Python 3.12): 1 of 5 ``--eager`` runs aborted
the same way.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

# The children end when this process does, even when it aborts (no `finally` runs then): each
# checks that its parent is still the one that started it.
SIBLING = """
import itertools, os, sys, jax, jax.numpy as jnp
for n in itertools.count(1):
  jax.jit(lambda x: jnp.tanh(x) * n)(jnp.ones((n % 97 + 1, 3))).block_until_ready()
  if n % 200 == 0:
    jax.clear_caches()
  if os.getppid() != int(sys.argv[1]):
    break
"""

STRESS = """
import itertools, os, sys
for n in itertools.count():
  if n % 1000000 == 0 and os.getppid() != int(sys.argv[1]):
    break
"""


def _children(args) -> list:
  """The sibling compilers and the busy loops, sharing this process's environment (and so its
  persistent compilation cache)."""
  me = str(os.getpid())
  return ([subprocess.Popen([sys.executable, "-c", SIBLING, me]) for _ in range(args.siblings)] +
          [subprocess.Popen([sys.executable, "-c", STRESS, me]) for _ in range(args.stress)])


def run(args) -> dict:
  import jax
  import jax.numpy as jnp
  import jaxlib.version
  import numpy as np

  from smoothing_jax import metrics
  from smoothing_jax.parallel import create_mesh, prefetch_to_devices, shard_batch, shardings

  _, data = shardings(create_mesh())
  if args.eager:  # what from_model_output and merge were: one program per operation
    def statistics(probs, labels, mask):
      return metrics.UncertaintyMetrics(
          **metrics.batch_statistics.__wrapped__(probs, labels, mask, 10, 0.9))
    merge = lambda a, b: jax.tree.map(jnp.add, a, b)  # noqa: E731
  else:
    statistics, merge = metrics.UncertaintyMetrics.from_model_output, metrics.add_statistics
  rng = np.random.default_rng(0)

  def endless():
    while True:
      yield {"image": rng.normal(size=(8, 4)).astype(np.float32)}

  prefetched = prefetch_to_devices(endless(), data, size=2) if args.prefetch else None
  start, iterations = time.monotonic(), 0
  try:
    while time.monotonic() - start < args.seconds:
      size = 8 * (1 + (iterations % 64 if args.new_shapes else 0))
      probs = rng.dirichlet(np.ones(4), size).astype(np.float32)
      labels = rng.integers(0, 4, size)
      batch = shard_batch({"probs": probs, "label": labels,
                           "mask": np.ones(size, np.float32)}, data)
      total = None
      for _ in range(3):  # three batches merged, as evaluate_batches does
        out = statistics(batch["probs"], batch["label"], batch["mask"])
        total = out if total is None else merge(total, out)
      assert float(total.count) == 3 * size
      if prefetched is not None:
        next(prefetched)
      iterations += 1
      if args.release_every and iterations % args.release_every == 0:
        jax.clear_caches()
  finally:
    if prefetched is not None:
      prefetched.close()
  return {"iterations": iterations, "seconds": round(time.monotonic() - start, 1),
          "jax": jax.__version__, "jaxlib": jaxlib.version.__version__}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seconds", type=float, default=60)
  parser.add_argument("--eager", action="store_true")
  parser.add_argument("--new-shapes", action="store_true")
  parser.add_argument("--release-every", type=int, default=0)
  parser.add_argument("--prefetch", action="store_true")
  parser.add_argument("--siblings", type=int, default=0)
  parser.add_argument("--stress", type=int, default=0)
  parser.add_argument("--gdb", action="store_true",
                      help="rerun this command under gdb: on a fatal signal, every thread's stack")
  args = parser.parse_args(argv)
  if args.gdb:
    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--gdb"]
    os.execvp("gdb", ["gdb", "-batch", "-ex", "handle SIGPIPE nostop noprint", "-ex", "run",
                      "-ex", "thread apply all bt 30", "--args", sys.executable,
                      os.path.abspath(__file__), *rest])
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # a cache of this run's own, removed after it
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="abort_repro_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  children = _children(args)
  try:
    result = run(args)
  finally:
    for child in children:
      child.kill()
      child.wait()
  print(json.dumps({**result, **{k: v for k, v in vars(args).items() if k != "gdb"}}))


if __name__ == "__main__":
  main()
