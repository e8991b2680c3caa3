"""Data parallelism: the device mesh, batch sharding and the one sharded evaluation loop.

A 1-D ``Mesh`` with axis ``data`` spans every device of every process; batches are
sharded on ``data`` and parameters replicated, so ``jax.jit`` inserts the cross-device
reductions (BatchNorm statistics and metrics over the *global* batch).
"""
from __future__ import annotations

import collections
import functools
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def create_mesh(num_devices: int = -1) -> Mesh:
  """1-D mesh over all devices (``num_devices`` > 0: the first ``num_devices``)."""
  devices = jax.devices() if num_devices <= 0 else jax.devices()[:num_devices]
  return Mesh(np.asarray(devices), ("data",))


def shardings(mesh: Mesh) -> tuple:
  """``(replicated, batch-sharded)`` shardings of ``mesh``."""
  return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


@functools.lru_cache(maxsize=64)
def sharded_eval_step(fn: Callable, mesh: Mesh, *static) -> Callable:
  """``jit(partial(fn, *static))`` as an evaluation step ``(variables, batch, rng) -> outputs``
  on ``mesh``: variables and key replicated, the batch sharded on ``data``, outputs replicated.

  Built once per ``(fn, mesh, *static)`` (all hashable: a module-level function, the mesh, and
  e.g. the model and sizes), so training's periodic evaluation and every evaluator share the
  compiled step.
  """
  replicated, data_sharding = shardings(mesh)
  return jax.jit(functools.partial(fn, *static),
                 in_shardings=(replicated, data_sharding, replicated),
                 out_shardings=replicated)


def eval_batch_size(config, mesh: Mesh) -> int:
  """``config.eval_batch_size`` rounded up to a multiple of the mesh size (padding is masked)."""
  return -(-config.eval_batch_size // mesh.size) * mesh.size


def shard_batch(batch, sharding):
  """Assemble global arrays from this process's part of the batch (a pytree of host arrays, e.g.
  a dict, or a tuple of an ensemble's member batches); global ``jax.Array`` s (a device-resident
  pipeline's batches) are already assembled."""
  return jax.tree.map(lambda v: v if isinstance(v, jax.Array) else
                      jax.make_array_from_process_local_data(sharding, np.asarray(v)), batch)


class _Failure:
  def __init__(self, error: BaseException):
    self.error = error


_END = object()


def prefetch_to_devices(batches: Iterable[dict], sharding, size: int = 2) -> Iterator[dict]:
  """``shard_batch(b, sharding)`` for each host batch ``b``, assembled up to ``size`` batches
  ahead by a background thread, so the host's work and the transfers overlap the running step.

  Same order and contents as without prefetching; an error in ``batches`` is raised here, at
  the batch it replaces.  Closing the generator (or leaving the loop) stops the thread.
  ``size`` 0 assembles each batch when it is asked for.
  """
  if size <= 0:
    yield from (shard_batch(b, sharding) for b in batches)
    return
  ready, stop = queue.Queue(maxsize=size), threading.Event()

  def put(item) -> bool:
    while not stop.is_set():
      try:
        ready.put(item, timeout=0.05)
        return True
      except queue.Full:
        pass
    return False

  def fill():
    try:
      for batch in batches:
        if not put(shard_batch(batch, sharding)):
          return
      put(_END)
    except BaseException as error:  # noqa: BLE001  (re-raised in the consuming thread)
      put(_Failure(error))

  thread = threading.Thread(target=fill, name="prefetch_to_devices", daemon=True)
  thread.start()
  try:
    while True:
      item = ready.get()
      if item is _END:
        return
      if isinstance(item, _Failure):
        raise item.error
      yield item
  finally:
    stop.set()
    thread.join()


# XLA:CPU admits at most 32 programs in flight per device (``max_inflight_computations_per_device``
# of its CPU client, which JAX does not expose) and launches the per-device parts of a program on a
# thread pool, in no fixed order.  With dozens of programs queued behind a multi-device one with a
# collective, later programs that wait for its result can take every slot of one device before its
# part on that device is launched: the other parts wait in the collective's rendezvous, and after
# 40 s XLA aborts the process ("Termination timeout for `all reduce ...`"; reproduced with stacks by
# experiments/abort_repro.py at jax/jaxlib 0.10.2 and 0.11.2).  Our loops keep few programs
# unfinished.
MAX_PROGRAMS_IN_FLIGHT = 8


class DispatchWindow:
  """Call with each output as it is dispatched: waits for the output given ``size`` calls before,
  so that at most ``size`` calls' programs are unfinished (the host still runs ahead of the
  devices by that many, which keeps them busy); ``on_finished()`` is called as each is waited
  for (:meth:`drain` waits for the rest)."""

  def __init__(self, size: int = MAX_PROGRAMS_IN_FLIGHT, on_finished: Callable | None = None):
    self.size, self._outputs, self.on_finished = size, collections.deque(), on_finished

  def __call__(self, output):
    self._outputs.append(output)
    if len(self._outputs) > self.size:
      self._finish()
    return output

  def _finish(self):
    jax.block_until_ready(self._outputs.popleft())
    if self.on_finished is not None:
      self.on_finished()

  def drain(self):
    """Waits for every output still unfinished."""
    while self._outputs:
      self._finish()


def _mergeable(x) -> bool:
  return hasattr(x, "merge")


PROGRESS_EVERY_S = 15.0  # an evaluation pass longer than this says how far it is


class _Progress:
  """Progress lines of one evaluation pass named ``label``: while it runs, a line at least every
  :data:`PROGRESS_EVERY_S` (from a timer thread, so that compiling and waiting are not silent):
  the batches and images *finished*, the rate since the first finished, and the time left where
  the batches know their count; its wall time at the end of a pass that took longer."""

  def __init__(self, label: str, count: int | None, examples: int | None = None):
    self.label, self.count, self.examples = label, count, examples
    self.start = self.last = time.monotonic()
    self.first = None  # when the first batch finished (its compile included)
    self.finished, self.images = 0, 0
    self._sizes = collections.deque()
    self._lock, self._stop = threading.Lock(), threading.Event()
    if label:
      threading.Thread(target=self._heartbeat, daemon=True).start()

  def dispatched(self, batch_size: int):
    self._sizes.append(batch_size)

  def finished_one(self):
    self.finished += 1
    self.images = min(self.images + self._sizes.popleft(), self.examples or float("inf"))
    if self.first is None:
      self.first = time.monotonic()
    if time.monotonic() - self.last >= PROGRESS_EVERY_S:
      self._report()

  def _heartbeat(self):
    while not self._stop.wait(PROGRESS_EVERY_S / 5):
      if time.monotonic() - self.last >= PROGRESS_EVERY_S:
        self._report()

  def _report(self):
    with self._lock:
      now = time.monotonic()
      if not self.label or now - self.last < PROGRESS_EVERY_S or self._stop.is_set():
        return
      self.last = now
      if not self.finished:
        logging.info("%s: compiling and running the first batches (%.0f s)", self.label,
                     now - self.start)
        return
      of = f"/{self.count}" if self.count else ""
      left = ""
      if self.count and self.finished > 1 and now > self.first:
        rate = (self.finished - 1) / (now - self.first)  # batches per second after compiling
        left = f", about {(self.count - self.finished) / rate:.0f} s left"
      logging.info("%s: batch %d%s finished (%d images), %.0f images/s%s", self.label,
                   self.finished, of, self.images, self.images / (now - self.start), left)

  def done(self):
    self._stop.set()
    elapsed = time.monotonic() - self.start
    if self.label and elapsed >= PROGRESS_EVERY_S:
      logging.info("%s: %d batch%s (%d images) in %.0f s", self.label, self.finished,
                   "" if self.finished == 1 else "es", self.images, elapsed)


def evaluate_batches(step_fn: Callable, variables, batches: Iterable[dict], sharding, rng, *,
                     concatenate: bool = False, label: str = ""):
  """``step_fn(variables, batch, fold_in(rng, i))`` over ``batches``, merged exactly.

  Batches are assembled as global arrays on ``sharding`` (None: passed as they are).

  The outputs' mergeable leaves (clu/metrics statistics with ``merge``) are merged over
  all batches; any other leaf keeps the first batch's value (e.g. example predictions).
  At most :data:`MAX_PROGRAMS_IN_FLIGHT` batches are unfinished at a time (:class:`DispatchWindow`).
  With ``concatenate`` the outputs are arrays, joined on the first axis instead (numpy).
  ``label`` (e.g. "ood cifar100"): a pass that takes longer than :data:`PROGRESS_EVERY_S`
  says how far it is, with the time left where ``batches`` has a ``len``, and its wall time.
  Returns the merged output pytree; ValueError when there are no batches.
  """
  progress = _Progress(label, len(batches) if hasattr(batches, "__len__") else None,
                       getattr(batches, "examples", None))
  total, parts, window = None, [], DispatchWindow(MAX_PROGRAMS_IN_FLIGHT, progress.finished_one)
  try:
    for i, batch in enumerate(batches):
      batch = batch if sharding is None else shard_batch(batch, sharding)
      out = step_fn(variables, batch, jax.random.fold_in(rng, i))
      progress.dispatched(len(jax.tree.leaves(batch)[0]))
      if concatenate:
        parts.append(out)
      elif total is not None:  # the running total depends on every program before it
        out = jax.tree.map(lambda a, b: a.merge(b) if _mergeable(a) else a, total, out,
                           is_leaf=_mergeable)
      total = window(out)
    if total is None:
      raise ValueError("No evaluation batches: the evaluation set is empty.")
    window.drain()
    if concatenate:
      total = jax.tree.map(lambda *xs: np.concatenate(jax.device_get(xs)), *parts)
  finally:
    progress.done()
  return total
