"""Ensembles of one training run's own weights: checkpoint ensembles (the network at M epoch ends
spaced ``every_epochs`` apart at the end of training) and snapshot ensembles (Huang et al. 2017:
M cycles of a cosine rate with restarts, a snapshot at the end of each).

The M snapshots (parameters and BatchNorm statistics) are the method's own state, written into
their slot inside the compiled step (``Method.after_step``), so they are sharded, checkpointed
and resumed with the train state; no checkpoint files are kept for them.  The predictive is the
mean of the snapshots' probabilities, newest first: N counts snapshots, and the ensemble of N is
that of the last N (Huang et al.'s Table 3 reports the last m).

Snapshot ensembles' rate, per iteration t = 0, 1, ... of T in M cycles (their Eq. 2, with
their t − 1 our t):

    α(t) = α₀ / 2 · (cos(π · (t − s_c) / (e_c − s_c)) + 1),   c = ⌊t · M / T⌋,

cycle c spanning iterations s_c = ⌈c · T / M⌉ to e_c = ⌈(c + 1) · T / M⌉, α₀ the recipe's
(scaled) rate, and snapshot c taken after iteration e_c.  Where M divides T this is Eq. 2's
(t mod L) / L with L = T / M; where it does not, Eq. 2's L = ⌈T / M⌉ would leave the last
cycles short or empty (T = 9, M = 4: cycles of 3, 3, 3 and none), these are as equal as whole
steps allow (3, 2, 2, 2).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from smoothing_jax.methods.base import Clock, Method, setting
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.models import implied_method, is_stochastic
from smoothing_jax.passes import ensemble_log_probs, map_in_chunks, pass_outputs


def cycle_bounds(step, num_steps: int, cycles: int) -> tuple:
  """``(c, s_c, e_c)`` of iteration ``step`` (0-based; integers or int arrays): its cycle and the
  cycle's first iteration and end (the module's docstring)."""
  cycle = step * cycles // num_steps
  return (cycle, -(-cycle * num_steps // cycles), -(-(cycle + 1) * num_steps // cycles))


def cosine_restarts(lr: float, num_steps: int, cycles: int):
  """Huang et al.'s Eq. 2 as an optax schedule of the step: ``lr`` at each cycle's start, cosine
  towards 0 over the cycle, then restarted (:func:`cycle_bounds`)."""
  def schedule(step):
    _, start, end = cycle_bounds(step, num_steps, cycles)
    return lr / 2 * (jnp.cos(jnp.pi * (step - start) / (end - start)) + 1)
  return schedule


@dataclasses.dataclass(frozen=True)
class CheckpointEnsemble(Method):
  """The network's weights at the ends of the last ``size`` × ``every_epochs`` epochs, every
  ``every_epochs``-th (the recipe's schedule unchanged), as an ensemble of ``size``."""
  name = "checkpoint_ensemble"
  settings = {"size": 5, "every_epochs": 1}
  size: int = 5
  every_epochs: int = 1

  @classmethod
  def refuses(cls, model) -> str | None:
    built_for = implied_method(model)
    if built_for in ("deterministic", "mc_dropout"):
      return None
    return (f"it keeps snapshots of one network (a deterministic or MC-dropout model), and this "
            f"one is built for {built_for}")

  @classmethod
  def from_config(cls, config, model) -> CheckpointEnsemble:
    return cls(model, chunk_size=setting(config, "eval_chunk_size"),
               **vars(cls.settings_in(config)))

  def describe(self) -> str:
    return f"{self.name} of {self.size}"

  def check(self, config) -> CheckpointEnsemble:
    if self.size < 1 or self.every_epochs < 1:
      raise ValueError(f"{self.name}.size and {self.name}.every_epochs must be >= 1, got "
                       f"{self.size} and {self.every_epochs}.")
    return self

  # Training: the snapshots, each in its slot.
  def schedule(self, config, schedule, *, num_steps: int, steps_per_epoch: int):
    epochs = num_steps // steps_per_epoch
    if epochs < self.size * self.every_epochs:
      raise ValueError(f"A {self.name} of {self.size} every {self.every_epochs} epoch(s) needs "
                       f"{self.size * self.every_epochs} whole epochs; this run has {epochs}: "
                       f"train longer or lower {self.name}.size.")
    return schedule

  def slot(self, clock: Clock):
    """``(due, slot)``: whether the step of ``clock`` takes a snapshot, and into which slot
    (0: the oldest)."""
    back = clock.num_epochs - clock.epoch  # epochs before the last
    due = clock.epoch_end & (back % self.every_epochs == 0) & (back < self.size * self.every_epochs)
    return due, self.size - 1 - back // self.every_epochs

  def init_state(self, variables) -> dict:
    """The M snapshots ``{"params", "batch_stats"}`` stacked, and which slots hold one
    (``filled`` [M])."""
    stacked = jax.tree.map(lambda x: jnp.zeros((self.size,) + x.shape, x.dtype), variables)
    return {self.name: {**stacked, "filled": jnp.zeros((self.size,), bool)}}

  def after_step(self, method_state, variables, clock):
    due, slot = self.slot(clock)

    def write(snapshots):
      written = jax.tree.map(lambda stack, x: lax.dynamic_update_index_in_dim(stack, x, slot, 0),
                             {k: snapshots[k] for k in variables}, variables)
      return {**written, "filled": snapshots["filled"].at[slot].set(True)}
    return {**method_state, self.name: lax.cond(due, write, lambda s: s, method_state[self.name])}

  def for_training_eval(self) -> Method:
    """The training's evaluation scores the network being trained."""
    return MCDropout(self.model) if self.dropout else Deterministic(self.model)

  # The predictive: the snapshots, newest first.
  @property
  def dropout(self) -> bool:
    return is_stochastic(self.model)

  @property
  def stochastic(self) -> bool:
    return self.dropout

  @property
  def num_draws(self) -> int:
    return self.size

  @property
  def prepares_variables(self) -> bool:
    return True

  def nested(self, requested=()) -> tuple:
    return self, tuple(range(1, self.size + 1))

  def prediction_variables(self, variables, data):
    """The ``size`` snapshots stacked newest first (``{"params", "batch_stats"}`` [M, ...])."""
    if self.name not in variables:
      raise ValueError(f"These variables hold no {self.name} snapshots: the run was not trained "
                       f"with --config.method={self.name}.")
    snapshots = dict(variables[self.name])
    filled = np.asarray(snapshots.pop("filled"))
    if not filled.all():
      raise ValueError(f"This checkpoint holds {int(filled.sum())} of the {filled.size} snapshots "
                       f"of its {self.name} (it is from before the end of training): train the "
                       "run to its end.")
    return jax.tree.map(lambda x: x[::-1], snapshots)

  def sample_log_probs(self, variables, images, rng):
    return ensemble_log_probs(self.model, variables, images, rng if self.dropout else None,
                              self.chunk_size)

  def sample_outputs(self, variables, images, rng):
    keys = jax.random.split(rng, self.size)
    per_draw = images.ndim == 5
    return map_in_chunks(
        lambda a: pass_outputs(self.model, a[0], a[2] if per_draw else images,
                               a[1] if self.dropout else None),
        (variables, keys, images if per_draw else None), self.chunk_size)

  def frame_probs(self, variables, frame, rng):
    raise ValueError(f"VQ-BNN temporal smoothing takes one network's pass; a {self.name} is "
                     f"{self.size} networks.")


@dataclasses.dataclass(frozen=True)
class SnapshotEnsemble(CheckpointEnsemble):
  """Snapshot ensembles (Huang et al. 2017): ``size`` = M cycles of the cosine rate with
  restarts (:func:`cosine_restarts`, which replaces the recipe's schedule), a snapshot at the
  end of each."""
  name = "snapshot_ensemble"
  settings = {"size": 5}

  def schedule(self, config, schedule, *, num_steps: int, steps_per_epoch: int):
    if num_steps < self.size:
      raise ValueError(f"A {self.name} of {self.size} cycles needs at least {self.size} steps; "
                       f"this run has {num_steps}.")
    lr = config.learning_rate * config.input.batch_size / config.base_batch_size
    return cosine_restarts(lr, num_steps, self.size)

  def slot(self, clock: Clock):
    cycle, _, end = cycle_bounds(clock.step - 1, clock.num_steps, self.size)
    return clock.step == end, cycle
