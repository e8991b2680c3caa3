"""Deep ensembles (Lakshminarayanan et al. 2017) trained as one compiled job:
``config.deep_ensemble.members`` = M > 1, each member trained by its base method (an ensemble of
MC-dropout networks is a deep ensemble of MC dropout).

The train state is stacked along a leading member axis (parameters, BatchNorm statistics and
optimizer state; one shared step counter), and one jitted step updates every member.  Member m
is the single run with seed ``config.deep_ensemble.member_seeds[m]``, derived from the pair
(``config.seed``, m) (:func:`member_seeds`; recorded in ``config.json``): its initialisation, its
dropout / noise keys, its data order and its augmentation draws (``Pipeline.seed``;
``config.deep_ensemble.shared_batches`` feeds every member the batches of ``config.seed``
instead).  So ensembles of different seeds share no member (with the earlier ``seed + m``, the
ensembles of seeds 0 and 1 shared M − 1); workdirs trained under that rule read as ``seed + m``
(``experiment.workdir.upgrade_record``).  The split of the training data
(``input.train_fraction``, ``input.holdout_fraction``) comes from ``config.seed`` (or
``input.split_seed``) and is the ensemble's: every member trains on the same examples and none on
those held out (members differ by initialisation and shuffling).

The predictive is the mean of the members' probabilities, member m one draw of its base method
with key ``split(key, M)[m]`` (``passes.ensemble_log_probs``), so N counts members: the
evaluators report the ensembles of the first N = 1..M.

How the step computes M members (``config.deep_ensemble.vmap_size`` = k): the members in groups
of k, each group ``jax.vmap`` ed over its stacked state, the groups one after another in the same
program.  k = 1 unrolls the members (M copies of the single step in one program); k = M vmaps
them all.  0 chooses unrolled on every backend: a vmapped convolution over stacked kernels (a
grouped convolution) runs slower than M plain ones, on XLA:CPU (``experiments/bench_ensemble.py``:
4 members of ``resnet_dnn_18``, vmapped 0.3×, unrolled 1.5× the speed of four sequential steps)
and on an H200 (``experiments/device_check.py``, 8 members at batch 128: vmapped 0.52×, unrolled
0.98×).  Members stay replicated and the batch sharded on ``data`` (each device computes
every member on its slice of the batch), so the same mesh serves any M.
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.data.resident import device_memory_bytes
from smoothing_jax.methods.base import Method, setting
from smoothing_jax.metrics import UncertaintyMetrics
from smoothing_jax.passes import (
  ensemble_log_probs,
  map_in_chunks,
  member_of,
  pass_outputs,
  stack_variables,
)

MAX_STATE_FRACTION = 0.5  # of one device's memory; activations, gradients and data need the rest
# Members vmapped together when ``config.deep_ensemble.vmap_size`` is 0: unrolled, on every
# backend measured so far (the module's docstring).
DEFAULT_VMAP_SIZE = 1


def members_of(config) -> int:
  """M = ``config.deep_ensemble.members`` (1 where unset), or ValueError (one line) for a value
  that is not an integer >= 1."""
  members = setting(config, "deep_ensemble.members", 1)
  if not isinstance(members, int) or isinstance(members, bool) or members < 1:
    raise ValueError(f"deep_ensemble.members must be an integer >= 1, got {members!r}.")
  return members


def member_seeds(seed: int, members: int) -> tuple:
  """The seeds of an ensemble's ``members``: member m's the first 31 bits of
  SHA-256("deep_ensemble/<seed>/<m>"), a hash of the pair, so that ensembles of different seeds
  share no member (two pairs collide with probability 2⁻³¹), each a non-negative int32."""
  return tuple(int.from_bytes(hashlib.sha256(f"deep_ensemble/{seed}/{m}".encode()).digest()[:4],
                              "big") >> 1 for m in range(members))


def seeds_of(config, members: int | None = None) -> tuple:
  """The seeds of ``members`` (default ``config.deep_ensemble.members``) members:
  ``deep_ensemble.member_seeds`` where recorded, else :func:`member_seeds` of ``config.seed``;
  ValueError (one line) for a recorded list of another length."""
  members = members_of(config) if members is None else members
  recorded = tuple(setting(config, "deep_ensemble.member_seeds", ()))
  if not recorded:
    return member_seeds(config.seed, members)
  if len(recorded) != members:
    raise ValueError(f"deep_ensemble.member_seeds holds {len(recorded)} seeds for an ensemble "
                     f"of {members} members.")
  return recorded


def member_seed_settings(config, recorded=None) -> dict:
  """The setting that records a deep ensemble's member seeds, ``{"deep_ensemble.member_seeds":
  seeds}`` (``{}`` for a single run): those ``config`` sets, else the ``recorded`` run's where it
  resumes that run (same seed and members: one trained before seeds were derived resumes with
  its ``seed + m``), else derived from ``config.seed``."""
  members = members_of(config)
  if members == 1:
    return {}
  resumed = (recorded is not None and not setting(config, "deep_ensemble.member_seeds", ())
             and (recorded.seed, members_of(recorded)) == (config.seed, members))
  return {"deep_ensemble.member_seeds": seeds_of(recorded if resumed else config)}


def member_keys(seeds: Sequence[int], index: int) -> jax.Array:
  """``[M]`` keys: for member m, ``split(key(seeds[m]), 3)[index]`` (the single run's
  0: initialisation, 1: dropout / noise, 2: evaluation)."""
  return jnp.stack([jax.random.split(jax.random.key(seed), 3)[index] for seed in seeds])


@dataclasses.dataclass(frozen=True)
class DeepEnsemble(Method):
  """``size`` members of the ``base`` method, their variables stacked along a leading axis."""
  name = "deep_ensemble"
  settings = {
      "members": 1,  # M (1: one model, no ensemble)
      # Every member trains on the batches of ``seed`` (for speed comparisons; members then
      # differ by initialisation and dropout only).
      "shared_batches": False,
      "vmap_size": 0,  # members vmapped together in the step (1: unrolled, M: all; 0: per backend)
      # The members' seeds (empty: derived from ``seed``, :func:`member_seeds`); a run records
      # them.
      "member_seeds": (),
  }
  base: Method | None = None
  size: int = 1
  shared_batches: bool = False
  vmap_size: int = 0

  @classmethod
  def wrap(cls, base: Method, config=None, size: int | None = None) -> Method:
    """An ensemble of ``size`` ``base`` networks; without ``size``, of
    ``config.deep_ensemble.members``, and ``base`` itself where that is 1."""
    if size is None and members_of(config) == 1:
      return base
    base = base.as_member(config)
    return cls(base.model, chunk_size=base.chunk_size, base=base,
               size=members_of(config) if size is None else size,
               shared_batches=bool(setting(config, "deep_ensemble.shared_batches", False)),
               vmap_size=setting(config, "deep_ensemble.vmap_size", 0) or DEFAULT_VMAP_SIZE)

  def describe(self) -> str:
    return f"{self.name} of {self.size} {self.base.describe()}"

  # The predictive: one draw of each member; or, for a base method that predicts per member
  # (``Method.predicts_per_member``: a fit, weights collected or drawn, test-time augmentation), S
  # draws of each member's base predictive, N = M·S in sample-major order (the first M draws one
  # of each member: MultiSWAG, Wilson & Izmailov 2020).
  @property
  def _per_member_draws(self) -> bool:
    return self.base.predicts_per_member

  @property
  def stochastic(self) -> bool:
    return self.base.stochastic

  @property
  def num_draws(self) -> int:
    return self.size * (self.base.num_draws if self._per_member_draws else 1)

  def with_samples(self, num_samples: int) -> DeepEnsemble:
    if not self._per_member_draws:
      return self
    return dataclasses.replace(self, base=self.base.with_samples(-(-num_samples // self.size)))

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    if not self._per_member_draws:
      return self, tuple(range(1, self.size + 1))
    method = self.with_samples(max(requested or (self.size,)))
    return method, tuple(sorted({n for n in requested if n <= method.num_draws} |
                                {method.num_draws}))

  def sample_log_probs(self, variables, images, rng):
    if not self._per_member_draws:
      return ensemble_log_probs(self.model, variables, images, rng, self.chunk_size)
    return self._interleaved(self.base.sample_log_probs, variables, images, rng)

  def sample_outputs(self, variables, images, rng):
    if self._per_member_draws:
      return self._interleaved(self.base.sample_outputs, variables, images, rng)
    # Member m with key split(rng, M)[m], as ensemble_log_probs; on images[m] where per draw.
    keys = None if rng is None else jax.random.split(rng, self.size)
    per_draw = images.ndim == 5
    return map_in_chunks(
        lambda a: pass_outputs(self.model, a[0], a[2] if per_draw else images, a[1]),
        (variables, keys, images if per_draw else None), self.chunk_size)

  def _interleaved(self, member_draws, variables, images, rng):
    """``member_draws(member m's variables, images, key m) -> [S, ...]`` of every member (key
    ``split(rng, M)[m]``), as ``[S·M, ...]`` with draw s·M + m member m's draw s; ``images``
    ``[B, H, W, 3]``, or ``[S·M, B, H, W, 3]`` with draw s·M + m on its own image, given to
    member m as its ``[S, ...]``."""
    keys = jax.random.split(rng, self.size)
    if images.ndim == 5:  # [S·M, ...] → [M, S, ...]: each member its own draws' images
      per_member = jnp.swapaxes(images.reshape((-1, self.size) + images.shape[1:]), 0, 1)
      out = jax.lax.map(lambda a: member_draws(*a), (variables, per_member, keys))
    else:
      out = jax.lax.map(lambda a: member_draws(a[0], images, a[1]), (variables, keys))
    return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape((-1,) + x.shape[2:]), out)

  def eval_metrics(self, variables, batch, rng, num_bins: int) -> dict:
    """The ensemble's metrics (the mean of its members' probabilities, ``""``), then each
    member's (``"/member_<m>"``)."""
    probs = jnp.exp(self.sample_log_probs(variables, batch["image"], rng))
    metrics = lambda p: UncertaintyMetrics.from_model_output(  # noqa: E731
        p, batch["label"], batch["mask"], num_bins=num_bins)
    return {"": metrics(jnp.mean(probs, axis=0)),
            **{f"/member_{m}": metrics(p) for m, p in enumerate(probs)}}

  def for_training_eval(self) -> DeepEnsemble:
    return dataclasses.replace(self, base=self.base.for_training_eval())

  # The base method's state, hooks, schedule, post-hoc stage and prediction variables, run on
  # each member.
  @property
  def per_member(self) -> Method:
    return self.base

  def schedule(self, config, schedule, *, num_steps: int, steps_per_epoch: int):
    return self.base.schedule(config, schedule, num_steps=num_steps,
                              steps_per_epoch=steps_per_epoch)

  @property
  def fit_name(self) -> str | None:
    return self.base.fit_name

  def fit(self, variables, batches):
    """The base method's fit of each member, stacked."""
    return stack_variables([self.base.fit(member_of(variables, m), batches)
                            for m in range(self.size)])

  @property
  def needs_training_data(self) -> bool:
    return self.base.needs_training_data

  def prediction_variables(self, variables, data):
    """The base method's prediction variables of each member (its slice of a stacked fit),
    stacked."""
    if not self._per_member_draws:
      return variables
    fitted = None if self.fit_name is None else data.fit(self.fit_name)
    return stack_variables([
        self.base.prediction_variables(member_of(variables, m), data._replace(
            fit=lambda name, m=m: member_of(fitted, m), member=m))
        for m in range(self.size)])

  # What it cannot do.
  def frame_probs(self, variables, frame, rng):
    raise self._one_model_error("VQ-BNN temporal smoothing")

  def one_model(self, what: str, workdir: str = "") -> Method:
    raise self._one_model_error(what, workdir)

  def _one_model_error(self, what: str, workdir: str = "") -> ValueError:
    where = f"{workdir} holds" if workdir else "this is"
    return ValueError(f"{what} takes one model's predictions; {where} an ensemble of "
                      f"{self.size} members: evaluate a member (Run.write_member(m, workdir), "
                      "then that workdir).")

  def as_member(self, config=None) -> Method:
    raise ValueError(f"This run is a deep ensemble of {self.size} members already; "
                     "--ensemble_workdirs joins single runs.")

  def check(self, config) -> DeepEnsemble:
    for key in ("init_from", "trajectory_every_steps"):
      if setting(config, key):
        raise ValueError(f"{key} is for single runs (deep_ensemble.members={self.size}): train "
                         "the members apart to use it.")
    seeds_of(config, self.size)  # a member_seeds list of another length, refused before the data
    self.base.check(config)
    return self

  # Training: each member by its base method.
  def tile(self, *arrays) -> tuple:
    return self.base.tile(*arrays)

  def loss(self, config, *, num_train: int, steps_per_epoch: int, class_weights=None):
    return self.base.loss(config, num_train=num_train, steps_per_epoch=steps_per_epoch,
                          class_weights=class_weights)

  def optimizer(self, config, schedule):
    return self.base.optimizer(config, schedule)

  def weight_decay(self, config):
    return self.base.weight_decay(config)

  def update_scaling(self, config):
    return self.base.update_scaling(config)

  @property
  def members(self) -> int:
    return self.size

  def init_train_state(self, config, init_one: Callable, devices=()):
    """The stacked train state of the M members (one compiled call, ``vmap`` over their keys;
    random draws under ``vmap`` equal those of each key alone), its step counter shared; first
    :func:`check_fits`."""
    check_fits(config, init_one, self.size, devices)
    state = jax.jit(jax.vmap(init_one))(member_keys(seeds_of(config, self.size), 0))
    return state.replace(step=state.step[0])

  def train_keys(self, config) -> jax.Array:
    return member_keys(seeds_of(config, self.size), 1)

  def train_pipelines(self, config, pipeline) -> list:
    """``pipeline`` with member m's seed for member m (its own order and augmentation draws; the
    arrays and the split are shared), or ``[pipeline]`` alone with ``shared_batches``."""
    if self.shared_batches:
      return [pipeline]
    return [dataclasses.replace(pipeline, seed=seed) for seed in seeds_of(config, self.size)]

  def train_step(self, step: Callable, state, member_batch: Callable, rngs, *, shared: bool):
    return ensemble_train_step(step, self.vmap_size, state, member_batch, rngs, shared=shared)

  def train_scalars(self, prefix: str, means: dict) -> dict:
    """The mean over members of each metric, then each member's (``<key>/member_<m>``; the
    learning rate, which they share, once)."""
    each = {k: v for k, v in means.items() if k != "learning_rate"}
    return {**super().train_scalars(prefix, means), **member_summaries(prefix, each, self.size)}


def state_bytes(init_one: Callable) -> int:
  """Bytes of one member's train state (parameters, BatchNorm statistics, optimizer state),
  from its abstract shapes (nothing computed)."""
  abstract = jax.eval_shape(init_one, jax.random.key(0))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def check_fits(config, init_one: Callable, members: int, devices) -> None:
  """ValueError (one line) when M stacked train states would take more than
  ``MAX_STATE_FRACTION`` of a device's memory (each device holds every member); no-op where the
  backend does not say how much it has (the CPU)."""
  limits = [m for m in (device_memory_bytes(d) for d in devices) if m]
  if not limits or members == 1:
    return
  one = state_bytes(init_one)
  if members * one > MAX_STATE_FRACTION * min(limits):
    raise ValueError(
        f"An ensemble of {members} {config.model} needs {members * one / 2**30:.2f} GiB for its "
        f"stacked train state ({members} × {one / 2**30:.2f} GiB of parameters, BatchNorm "
        f"statistics and optimizer state) on each device, more than "
        f"{MAX_STATE_FRACTION:.0%} of the {min(limits) / 2**30:.1f} GiB a device has: use fewer "
        "members, or train them apart (one run per seed) and join them with "
        "--ensemble_workdirs.")


def ensemble_train_step(member_step, vmap_size: int, state, member_batch, rngs, *,
                        shared: bool = False):
  """One step of every member: ``member_step(state, batch, rng) -> (state, metrics)`` on member
  m's state, ``member_batch(m)`` and ``rngs[m]``; members in groups of ``vmap_size`` vmapped
  together, the groups unrolled (see the module).  ``shared``: every member takes
  ``member_batch(0)``, made once.  Returns the stacked state and ``[M]`` metrics."""
  members, step = rngs.shape[0], state.step
  rest = state.replace(step=None)
  shared_batch = member_batch(0) if shared else None
  outputs = []
  for start in range(0, members, vmap_size):
    group = range(start, min(members, start + vmap_size))
    if len(group) == 1:
      batch = shared_batch if shared else member_batch(start)
      out = member_step(member_of(rest, start).replace(step=step), batch, rngs[start])
      outputs.append(jax.tree.map(lambda x: x[None], out))
      continue
    batches = shared_batch if shared else jax.tree.map(
        lambda *xs: jnp.stack(xs), *[member_batch(m) for m in group])
    one = lambda s, b, r: member_step(s.replace(step=step), b, r)  # noqa: E731
    outputs.append(jax.vmap(one, in_axes=(0, None if shared else 0, 0))(
        jax.tree.map(lambda x, group=group: x[group.start:group.stop], rest), batches,
        rngs[group.start:group.stop]))
  new_state, metrics = jax.tree.map(lambda *xs: jnp.concatenate(xs), *outputs)
  return new_state.replace(step=new_state.step[0]), metrics


def member_summaries(prefix: str, values: dict, members: int) -> dict:
  """``{prefix + key + "/member_m": float}`` of ``[M]`` values, for the metric writer."""
  return {f"{prefix}{k}/member_{m}": float(np.asarray(v)[m])
          for k, v in values.items() for m in range(members)}
