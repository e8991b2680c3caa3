"""Data parallelism: the device mesh, batch sharding and the one sharded evaluation loop.

A 1-D ``Mesh`` with axis ``data`` spans every device of every process; batches are
sharded on ``data`` and parameters replicated, so ``jax.jit`` inserts the cross-device
reductions (BatchNorm statistics and metrics over the *global* batch).
"""
from __future__ import annotations

from typing import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def create_mesh(num_devices: int = -1) -> Mesh:
  """1-D mesh over all devices (``num_devices`` > 0: the first ``num_devices``)."""
  devices = jax.devices() if num_devices <= 0 else jax.devices()[:num_devices]
  return Mesh(np.asarray(devices), ("data",))


def shardings(mesh: Mesh) -> tuple:
  """``(replicated, batch-sharded)`` shardings of ``mesh``."""
  return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def eval_batch_size(config, mesh: Mesh) -> int:
  """``config.eval_batch_size`` rounded up to a multiple of the mesh size (padding is masked)."""
  return -(-config.eval_batch_size // mesh.size) * mesh.size


def shard_batch(batch: dict, sharding) -> dict:
  """Assemble global arrays from this process's part of the batch."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for k, v in batch.items()}


def _mergeable(x) -> bool:
  return hasattr(x, "merge")


def evaluate_batches(step_fn: Callable, variables, batches: Iterable[dict], sharding, rng):
  """``step_fn(variables, batch, fold_in(rng, i))`` over ``batches``, merged exactly.

  Batches are assembled as global arrays on ``sharding`` (None: passed as they are).

  The outputs' mergeable leaves (clu/metrics statistics with ``merge``) are merged over
  all batches; any other leaf keeps the first batch's value (e.g. example predictions).
  Returns the merged output pytree; ValueError when there are no batches.
  """
  total = None
  for i, batch in enumerate(batches):
    batch = batch if sharding is None else shard_batch(batch, sharding)
    out = step_fn(variables, batch, jax.random.fold_in(rng, i))
    total = out if total is None else jax.tree.map(
        lambda a, b: a.merge(b) if _mergeable(a) else a, total, out, is_leaf=_mergeable)
  if total is None:
    raise ValueError("No evaluation batches: the evaluation set is empty.")
  return total
