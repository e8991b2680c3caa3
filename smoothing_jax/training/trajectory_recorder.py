"""Recording the learning trajectory during training (a loop callback of ``train.train``).

**Record.**  With ``config.trajectory_every_steps`` = k > 0, training keeps, at step 0, every k
steps and the last step, the flattened parameters θ ∈ Rⁿ projected on D =
``config.trajectory_dims`` fixed random Gaussian directions, and ‖θ‖²::

    y = G θ / √D,   G ∈ R^{D×n},  G_dj ~ N(0, 1) i.i.d.

in ``<workdir>/trajectory.npz`` (:class:`TrajectoryRecorder`; ``steps [S]``, ``projections
[S, D]``, ``norm_sq [S]``, ``dims``, ``seed``).  Row d of G restricted to parameter leaf i
(``jax.tree.leaves`` order, flattened row-major) is ``jax.random.normal(fold_in(fold_in(
direction_key(seed), i), d), (n_i,))``: G is a pure function of ``config.seed``, generated
inside the jitted :func:`random_projection` a few directions at a time (at most
``chunk_elements`` numbers at once), never as a D × n matrix.  Each record costs D·n Gaussian
draws and multiply-adds (measured on 2 busy CPU cores: 3.5·10⁷ draws/s, i.e. about 80 s for
ResNet-18 at D = 256; an accelerator is far faster): choose k, or D, accordingly.

**Estimator.**  For snapshots s, t, ‖y_s − y_t‖² = ‖G(θ_s − θ_t)‖² / D is an unbiased estimate
of ‖θ_s − θ_t‖², distributed as ‖θ_s − θ_t‖² · χ²_D / D (Johnson–Lindenstrauss): relative
error √(2/D) for squared distances, about √(1/(2D)) for distances (D = 256: 8.8% and 4.4%);
inner products of differences, hence angles, are estimated with errors of the same order.  The
exact ‖θ‖² lets a record check itself: ``norm_error`` = ‖y‖²/‖θ‖² − 1 per snapshot are draws
of that relative error.

The analysis (polar coordinates, HV Fig. 1b) is ``smoothing_jax.analysis.trajectory``.
"""
from __future__ import annotations

import dataclasses
import functools
import io

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.training.callbacks import Callback

TRAJECTORY_FILE = "trajectory.npz"
_DIRECTIONS_STREAM = 0x7472616A  # "traj": the directions' own stream of config.seed
CHUNK_ELEMENTS = 1 << 24  # Gaussian numbers generated at once per leaf (64 MiB in float32)


def direction_key(seed: int) -> jax.Array:
  """The key of the projection directions of ``config.seed`` (apart from every training key)."""
  return jax.random.fold_in(jax.random.key(seed), _DIRECTIONS_STREAM)


def random_projection(params, key: jax.Array, dims: int,
                      chunk_elements: int = CHUNK_ELEMENTS) -> jax.Array:
  """``G θ / √dims`` (float32 ``[dims]``) of the flattened pytree ``params`` (see the module
  docstring for G); jittable.

  Leaves of one size are drawn together, ``vmap`` over their keys (the same numbers as leaf by
  leaf): one loop per leaf size rather than per leaf, which compiles several times faster (a
  network has many leaves of few sizes).  Directions are drawn a few at a time (``lax.map``), at
  most about ``chunk_elements`` numbers at once, so memory stays bounded whatever the model.
  """
  leaves = [jnp.ravel(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(params)]
  by_size = {}
  for i, flat in enumerate(leaves):
    by_size.setdefault(flat.size, []).append(i)
  projection = jnp.zeros((dims,), jnp.float32)
  for size, indices in by_size.items():
    together = max(1, chunk_elements // max(size, 1))  # leaves drawn at once
    for start in range(0, len(indices), together):
      part = indices[start:start + together]
      flats = jnp.stack([leaves[i] for i in part])  # [L, size]
      keys = jnp.stack([jax.random.fold_in(key, i) for i in part])

      def along(d, flats=flats, keys=keys):
        def one(leaf_key, flat):
          return jnp.dot(jax.random.normal(jax.random.fold_in(leaf_key, d), flat.shape), flat)
        return jnp.sum(jax.vmap(one)(keys, flats))

      batch = max(1, min(dims, chunk_elements // max(len(part) * size, 1)))
      projection += jax.lax.map(along, jnp.arange(dims), batch_size=batch)
  return projection / jnp.sqrt(jnp.float32(dims))


def squared_norm(params) -> jax.Array:
  """‖θ‖² (float32) of the flattened pytree ``params``."""
  return sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(params))


@functools.cache
def _snapshot_function(seed: int, dims: int):
  """Jitted ``params -> (projection [dims], ‖θ‖²)``, one per (seed, dims): compiled once for
  every run (and resume) of a process."""
  return jax.jit(lambda params: (random_projection(params, direction_key(seed), dims),
                                 squared_norm(params)))


@dataclasses.dataclass
class Trajectory:
  """A learning-trajectory record: ``steps`` int ``[S]``, ``projections`` float32 ``[S, dims]``
  (y = G θ / √dims), ``norm_sq`` ``[S]`` (‖θ‖²), and the ``dims`` and ``seed`` of G."""
  steps: np.ndarray
  projections: np.ndarray
  norm_sq: np.ndarray
  dims: int
  seed: int

  def upto(self, step: int) -> Trajectory:
    """The rows before ``step``."""
    keep = self.steps < step
    return dataclasses.replace(self, steps=self.steps[keep], projections=self.projections[keep],
                               norm_sq=self.norm_sq[keep])

  def to_bytes(self) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, steps=self.steps, projections=self.projections, norm_sq=self.norm_sq,
             dims=self.dims, seed=self.seed)
    return buffer.getvalue()


def load_trajectory(workdir) -> Trajectory:
  """The record ``<workdir>/trajectory.npz``; FileNotFoundError saying how to make one."""
  path = workdir_lib.workdir_path(workdir) / TRAJECTORY_FILE
  if not path.exists():
    raise FileNotFoundError(f"No learning trajectory in {workdir}: {path} does not exist (train "
                            "with --config.trajectory_every_steps=k > 0 to record one).")
  with np.load(io.BytesIO(path.read_bytes())) as data:
    return Trajectory(data["steps"], data["projections"], data["norm_sq"], int(data["dims"]),
                      int(data["seed"]))


class TrajectoryRecorder(Callback):
  """Keeps the learning trajectory of one training run (a callback of :func:`train.train`).

  :meth:`observe` projects the parameters after each recorded step (inside one jitted call,
  on the devices); :meth:`write` writes the whole record atomically (process 0 only), which
  training does before each checkpoint.  A resumed run (:meth:`start`) drops the rows after
  the restored step (written before a crash, or after a corrupted checkpoint that was skipped)
  and records that step again, so the record continues exactly as an uninterrupted run's.
  With ``every_steps`` 0 every method does nothing.
  """

  def __init__(self, workdir, every_steps: int, dims: int, seed: int, last_step: int):
    if isinstance(every_steps, bool) or not isinstance(every_steps, int) or every_steps < 0:
      raise ValueError(f"trajectory_every_steps must be an integer >= 0 (0: off), got "
                       f"{every_steps!r}.")
    if isinstance(dims, bool) or not isinstance(dims, int) or dims < 1:
      raise ValueError(f"trajectory_dims must be a positive integer, got {dims!r}.")
    self.path = workdir_lib.workdir_path(workdir) / TRAJECTORY_FILE
    self.every_steps, self.dims, self.seed, self.last_step = every_steps, dims, seed, last_step
    self.record = Trajectory(np.zeros(0, np.int64), np.zeros((0, dims), np.float32),
                             np.zeros(0, np.float32), dims, seed)
    if self.enabled and self.path.exists():  # read by every process: all record the same steps
      previous = load_trajectory(self.path.parent)
      if (previous.dims, previous.seed) != (dims, seed):
        raise ValueError(
            f"{self.path} was recorded with trajectory_dims {previous.dims} and seed "
            f"{previous.seed}, this run has {dims} and {seed}: restore those settings or move "
            "the file away.")
      self.record = previous
    self._pending = []  # (step, projection, ‖θ‖²) still on the devices
    self._snapshot = _snapshot_function(seed, dims)

  @classmethod
  def for_run(cls, config, workdir, last_step: int) -> TrajectoryRecorder:
    """The recorder of ``config.trajectory_every_steps`` / ``trajectory_dims`` / ``seed``."""
    return cls(workdir, config.trajectory_every_steps, config.trajectory_dims, config.seed,
               last_step)

  @property
  def enabled(self) -> bool:
    return self.every_steps > 0

  def start(self, step: int, params) -> None:
    """Continue the record from the training state at ``step`` (0: a new run): its rows before
    ``step`` are kept, then ``params`` are recorded if ``step`` is a recorded step (see
    :meth:`observe`) or the record has no row (a run that turns recording on when resumed starts
    its record there)."""
    if not self.enabled:
      return
    self.record = self.record.upto(step)
    if step > 0 and not len(self.record.steps):
      logging.warning("The learning trajectory starts at step %d: the steps before it were not "
                      "recorded.", step)
    if not len(self.record.steps):
      self._pending.append((step, *self._snapshot(params)))
    else:
      self.observe(step, params)

  def observe(self, step: int, params) -> None:
    """Record ``params``, the parameters after ``step``, at every k-th step and the last."""
    if self.enabled and (step % self.every_steps == 0 or step == self.last_step):
      self._pending.append((step, *self._snapshot(params)))

  def write(self) -> None:
    """Append the rows observed since the last write and write the record (process 0)."""
    if not self._pending:
      return
    steps, projections, norm_sq = zip(*jax.device_get(self._pending), strict=True)
    self._pending = []
    record = self.record
    self.record = dataclasses.replace(
        record, steps=np.concatenate([record.steps, np.asarray(steps, np.int64)]),
        projections=np.concatenate([record.projections, np.stack(projections)]),
        norm_sq=np.concatenate([record.norm_sq, np.asarray(norm_sq, np.float32)]))
    if jax.process_index() == 0:
      workdir_lib.write_atomically(self.path, self.record.to_bytes())

  # The training loop's hooks (``callbacks.Callback``).
  def on_start(self, step: int, state) -> None:
    self.start(step, state.params)

  def on_step(self, step: int, state) -> None:
    self.observe(step, state.params)

  def on_checkpoint(self, step: int) -> None:
    self.write()  # before the checkpoint: a restored step always has its rows
