"""SWA and SWAG (Izmailov et al. 2018; Maddox et al. 2019): the running moments of the weights
collected along the SGD trajectory, their mean (SWA) and weight samples from the Gaussian they
define (SWAG: diagonal, or low-rank plus diagonal), over any parameter pytree.

Collection n + 1 of the weights θ (every leaf on its own; n models collected before):

    θ̄ ← (n θ̄ + θ) / (n + 1),    θ²‾ ← (n θ²‾ + θ²) / (n + 1),    D̂ ← [D̂, θ − θ̄],

the deviation taken from the *updated* mean, D̂ keeping its last K columns (K = ``rank``).  A
sample from given standard normals z₁ (one per weight) and z₂ (K per leaf):

    θ̃ = θ̄ + √s · (σ ⊙ z₁ + D̂ z₂ / √(K − 1)),    σ² = max(θ²‾ − θ̄², var_clamp);

the diagonal SWAG drops the D̂ term.  s = 1/2 gives the paper's
θ̃ = θ̄ + Σ_diag^½ z₁ / √2 + D̂ z₂ / √(2(K − 1)).

Everything follows TorchUncertainty 0.13.0's ``SWAG`` (``torch_uncertainty/methods/swag.py``,
modified from Maddox's ``swa_gaussian``; ``tests/methods/test_swag.py`` checks the parity):

* the divisor is √(K − 1), K its ``max_num_models``, also while fewer than K models are
  collected (the columns not yet collected add nothing);
* z₂ is drawn for each leaf on its own (its sample is block-diagonal over the parameter tensors);
  the same z₂ given to every leaf is Maddox's ``sample_fullrank``, one low-rank draw for the
  whole network;
* its defaults: s = 1 (``scale``), K = 20 (``max_num_models``), var_clamp = 1e-6.

SWA's mean is SWAG's θ̄, the arithmetic mean of the models collected (Izmailov et al.'s Eq. 2,
``torch.optim.swa_utils.AveragedModel``'s).  TorchUncertainty's own ``SWA`` class is not followed
there: it starts its count at 1 and adds 1 at the first collection, weighing the first model
twice, (2θ₁ + θ₂ + … + θₙ) / (n + 1).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax import lax

from smoothing_jax.methods.base import Method, setting
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.models import implied_method, is_stochastic
from smoothing_jax.passes import ensemble_log_probs, map_in_chunks, pass_outputs, sample_rngs

VAR_CLAMP = 1e-6  # the least σ², TorchUncertainty's default ``var_clamp``


@flax.struct.dataclass
class Moments:
  """The SWAG statistics of one network (pure arrays: they live in a train state, ``vmap`` over
  ensemble members, and checkpoint as one)."""
  mean: Any          # θ̄, the tree of the parameters
  sq_mean: Any       # θ²‾, the tree of the parameters
  deviations: Any    # per leaf [K, *leaf.shape]: collection i (from 0) in slot i mod K
  count: jax.Array   # n, the models collected: int32 []


def _dtype(leaf):
  # At least float32: σ² = θ²‾ − θ̄² cancels, and a bfloat16 mean of many models drifts.
  return jnp.promote_types(leaf.dtype, jnp.float32)


def _rank(moments: Moments) -> int:
  """K of one network's moments (static: the deviations' leading axis; 0 without leaves)."""
  leaves = jax.tree.leaves(moments.deviations)
  return leaves[0].shape[0] if leaves else 0


def init_moments(params, rank: int) -> Moments:
  """No model collected: zeros of the shapes of ``params`` (arrays or ``ShapeDtypeStruct``s),
  deviations ``[rank, *leaf.shape]`` (rank 0: the diagonal SWAG only)."""
  if rank < 0:
    raise ValueError(f"The SWAG rank must be non-negative, got {rank}.")

  def zeros(leaf, lead=()):
    return jnp.zeros(lead + tuple(leaf.shape), _dtype(leaf))

  return Moments(mean=jax.tree.map(zeros, params), sq_mean=jax.tree.map(zeros, params),
                 deviations=jax.tree.map(lambda leaf: zeros(leaf, (rank,)), params),
                 count=jnp.zeros((), jnp.int32))


def collect(moments: Moments, params) -> Moments:
  """``moments`` with the model ``params`` collected (pure, branch-free: whether to collect is the
  caller's ``jnp.where``/``lax.cond``)."""
  n = moments.count
  k = _rank(moments)
  params = jax.tree.map(lambda x, m: jnp.asarray(x, m.dtype), params, moments.mean)

  def average(avg, x):
    # TorchUncertainty's order of the operations, n·avg/(n + 1) + x/(n + 1).
    return avg * n / (n + 1) + x / (n + 1)

  mean = jax.tree.map(average, moments.mean, params)
  sq_mean = jax.tree.map(lambda s, x: average(s, jnp.square(x)), moments.sq_mean, params)
  deviations = moments.deviations
  if k:
    # A ring buffer: the new column overwrites the oldest once K are held (TorchUncertainty drops
    # its first row), one dynamic update whatever n, where a shift would copy all K.
    deviations = jax.tree.map(lambda d, x, m: lax.dynamic_update_index_in_dim(d, x - m, n % k, 0),
                              deviations, params, mean)
  return Moments(mean=mean, sq_mean=sq_mean, deviations=deviations, count=n + 1)


def swa_params(moments: Moments):
  """SWA's weights: the mean θ̄ of the models collected (in the moments' dtypes)."""
  return moments.mean


def variance(moments: Moments, var_clamp: float = VAR_CLAMP):
  """The diagonal σ² = max(θ²‾ − θ̄², var_clamp), the tree of the parameters."""
  return jax.tree.map(lambda s, m: jnp.maximum(s - jnp.square(m), var_clamp), moments.sq_mean,
                      moments.mean)


def low_rank_min_collections(rank: int) -> int:
  """The models to collect before a low-rank sample of rank K is the paper's: K, filling D̂,
  whose K columns the sample covariance D̂D̂ᵀ/(K − 1) assumes (``sample`` runs from the first, as
  TorchUncertainty's does).  Raises ``ValueError`` for K < 2: no 1/(K − 1)."""
  if rank < 2:
    raise ValueError(f"A low-rank SWAG sample needs a rank of at least 2, got {rank} (rank 0 is "
                     "the diagonal SWAG only; rank 1 has no sample covariance 1/(K - 1)).")
  return rank


def sample(moments: Moments, z_diag, z_low_rank, scale, diagonal_only: bool = False,
           var_clamp: float = VAR_CLAMP):
  """One weight sample θ̃ = θ̄ + √scale · (σ ⊙ z₁ + D̂ z₂ / √(K − 1)), the tree of the parameters.

  ``z_diag``: z₁, the tree of the parameters; ``z_low_rank``: z₂, per leaf ``[K]`` (z₂[i] weighs
  slot i of ``deviations``; ignored, may be None, with ``diagonal_only``, the sample without
  D̂).  ``diagonal_only`` is static; ``scale`` may be traced."""
  noise = jax.tree.map(lambda v, z: jnp.sqrt(v) * z, variance(moments, var_clamp), z_diag)
  if not diagonal_only:
    k = low_rank_min_collections(_rank(moments))
    noise = jax.tree.map(lambda e, d, z: e + jnp.tensordot(z, d, 1) / math.sqrt(k - 1), noise,
                         moments.deviations, z_low_rank)
  return jax.tree.map(lambda m, e: m + scale**0.5 * e, moments.mean, noise)


def sample_from_key(moments: Moments, key, scale, diagonal_only: bool = False,
                    var_clamp: float = VAR_CLAMP):
  """``sample`` with z₁ and z₂ drawn from ``key`` (each leaf its own keys)."""
  leaves, treedef = jax.tree.flatten(moments.mean)
  diag_keys, low_rank_keys = jax.random.split(key, (2, len(leaves)))

  def normals(keys, shape_of):
    return treedef.unflatten([jax.random.normal(k, shape_of(x), x.dtype)
                              for k, x in zip(keys, leaves, strict=True)])

  k = _rank(moments)
  z_low_rank = None if diagonal_only else normals(low_rank_keys, lambda x: (k,))
  return sample(moments, normals(diag_keys, jnp.shape), z_low_rank, scale, diagonal_only,
                var_clamp)


@functools.partial(jax.jit, static_argnames=("num_samples", "diagonal_only"))
def samples_from_key(moments: Moments, key, num_samples: int, scale, diagonal_only: bool = False,
                     var_clamp: float = VAR_CLAMP):
  """``num_samples`` samples stacked on a leading axis, sample i from ``split(key, N)[i]``
  (compiled once per parameter tree and N)."""
  return jax.vmap(lambda k: sample_from_key(moments, k, scale, diagonal_only, var_clamp))(
      jax.random.split(key, num_samples))


# --- The methods: SWAG's and SWA's moments collected in training, their predictive.

# The recipe's schedule (Maddox et al.'s ``swa_gaussian`` CIFAR runs, ``train/run_swag.py``):
# the initial rate to 50% of the collection's start, linear down to the SWA rate at 90%, then
# constant; collection once per epoch after epoch 161 of 300.
MADDOX_START_FRACTION = 161 / 300


def _moments(collection: dict) -> Moments:
  """The moments of the method's collection (a plain dict: Flax's ``apply`` takes variables whose
  collections are dicts)."""
  return Moments(**collection)


def _collection(moments: Moments) -> dict:
  return {"mean": moments.mean, "sq_mean": moments.sq_mean, "deviations": moments.deviations,
          "count": moments.count}


def maddox_schedule(lr: float, swa_lr: float, start_epoch: int, steps_per_epoch: int):
  """Maddox et al.'s per-epoch rate (``run_swag.py``'s ``schedule``): with t = epoch / start,
  ``lr`` for t ≤ 0.5, linear to ``swa_lr`` at t = 0.9, then ``swa_lr``."""
  ratio = swa_lr / lr

  def schedule(step):
    t = (step // steps_per_epoch) / start_epoch
    factor = jnp.where(t <= 0.5, 1.0, jnp.where(t <= 0.9, 1.0 - (1.0 - ratio) * (t - 0.5) / 0.4,
                                                ratio))
    return lr * factor
  return schedule


def batch_norm_statistics(model, samples, like, batches, max_batches: int = 0):
  """``[N, ...]`` BatchNorm statistics (the tree of ``like``, the trained ones) of each weight
  sample (``samples``: parameters stacked on N) recomputed on the training split, as
  ``swa_gaussian``'s ``bn_update``: a pass in training mode over each full batch of
  ``batches()`` (the padded last one is left out; ``max_batches`` > 0: the first that many), the
  statistics the average over batches of each batch's mean and (biased, as the model's own)
  variance.

  Flax's BatchNorm returns ``m · old + (1 − m) · batch`` in training mode: a pass from zero
  statistics gives (1 − m) · batch, and one pass from ones gives m (per statistic), so the batch's
  statistics come out whatever momentum each layer uses."""
  first = jax.tree.map(lambda x: x[0], samples)
  scaled = functools.partial(_scaled_statistics, model, like)
  total, count, momentum = None, 0, None
  for batch in batches():
    if not np.all(np.asarray(batch["mask"]) > 0):
      continue
    images = jnp.asarray(batch["image"])
    if momentum is None:
      zero = scaled(first, images, 0.0)
      momentum = jax.tree.map(lambda a, b: b - a, zero, scaled(first, images, 1.0))
      total = jax.tree.map(lambda x: jnp.zeros((len(jax.tree.leaves(samples)[0]),) + x.shape,
                                               x.dtype), zero)
    total = _add_each_samples(model, like, total, samples, images)
    count += 1
    if count == max_batches:
      break
  if count == 0:
    raise ValueError("No full training batch to recompute the BatchNorm statistics on: the "
                     "training split is smaller than one evaluation batch (lower "
                     "config.eval_batch_size).")
  return jax.tree.map(lambda t, m: t / count / (1.0 - m), total, momentum)


@functools.partial(jax.jit, static_argnums=0)
def _scaled_statistics(model, like, params, images, fill):
  """The BatchNorm statistics a training-mode pass returns from statistics all ``fill``."""
  stats = jax.tree.map(lambda s: jnp.full(s.shape, fill, s.dtype), like)
  _, updated = model.apply({"params": params, "batch_stats": stats}, images, train=True,
                           mutable=["batch_stats"], rngs=sample_rngs(jax.random.key(0)))
  return updated["batch_stats"]


@functools.partial(jax.jit, static_argnums=0)
def _add_each_samples(model, like, total, samples, images):
  """``total`` plus each sample's statistics from zeros on ``images`` (compiled once per model:
  every evaluator and member reuses it)."""
  return jax.tree.map(jnp.add, total, lax.map(
      lambda p: _scaled_statistics(model, like, p, images, 0.0), samples))


@dataclasses.dataclass(frozen=True)
class SWAG(MCDropout):
  """SWAG (Maddox et al. 2019) on a deterministic or MC-dropout network: the moments of the
  weights collected at the ends of epochs in training (``config.swag``), and the predictive of
  N weight samples, each with its BatchNorm statistics recomputed on the training split,
  averaged in probability space (a dropout network: one dropout pass per sample)."""
  name = "swag"
  # The moments' collection, SWA's and SWAG's alike: a run trained by one evaluates by the other
  # (SWA of a SWAG run; the diagonal SWAG of an SWA run, which keeps no deviations).
  collection = "swag"
  # ``swa_gaussian``'s CIFAR settings: collection from epoch 161 of 300 (a fraction here, so any
  # run length works), once per epoch, rank K = 20, sampling scale 0.5; its PreResNet-164 and
  # WRN-28-10 runs' SWA rate 0.05 for an initial 0.1 (``lr_ratio``), on its schedule.
  settings = {
      "start_fraction": MADDOX_START_FRACTION,  # collect after round(fraction × epochs) epochs
      "collect_every_epochs": 1,
      "lr_ratio": 0.5,  # the SWA rate / the recipe's (scaled) rate
      "lr_schedule": "maddox",  # or "recipe": the recipe's schedule, then the SWA rate
      "rank": 20,  # K, the deviations kept (0: the diagonal SWAG)
      "scale": 0.5,
      "covariance": "low_rank",  # or "diagonal"
      "bn_batches": 0,  # full training batches per sample's BatchNorm update (0: all)
      "sample_seed": 0,  # the weight samples' key (the same samples for every evaluator)
  }
  start_fraction: float = MADDOX_START_FRACTION
  collect_every_epochs: int = 1
  lr_ratio: float = 0.5
  lr_schedule: str = "maddox"
  rank: int = 20
  scale: float = 0.5
  covariance: str = "low_rank"
  bn_batches: int = 0
  sample_seed: int = 0

  @classmethod
  def refuses(cls, model) -> str | None:
    built_for = implied_method(model)
    if built_for in ("deterministic", "mc_dropout"):
      return None
    return (f"it collects the weights of one network trained by SGD (a deterministic or "
            f"MC-dropout model), and this one is built for {built_for}")

  @classmethod
  def from_config(cls, config, model) -> SWAG:
    settings = cls.settings_in(config)
    return cls(model, chunk_size=setting(config, "eval_chunk_size"), **vars(settings))

  def describe(self) -> str:
    return f"{self.name} ({self.covariance}, rank {self.rank}, scale {self.scale})"

  def check(self, config) -> SWAG:
    if self.covariance not in ("low_rank", "diagonal"):
      raise ValueError(f"{self.name}.covariance must be 'low_rank' or 'diagonal', got "
                       f"{self.covariance!r}.")
    if self.covariance == "low_rank":
      low_rank_min_collections(self.rank)
    if self.lr_schedule not in ("maddox", "recipe"):
      raise ValueError(f"{self.name}.lr_schedule must be 'maddox' or 'recipe', got "
                       f"{self.lr_schedule!r}.")
    if not 0 < self.start_fraction < 1 or self.collect_every_epochs < 1:
      raise ValueError(f"{self.name}.start_fraction must lie in (0, 1) and "
                       "collect_every_epochs be >= 1.")
    return self

  # Training: the schedule, and the collection at the end of an epoch.
  def start_epoch(self, num_epochs: int) -> int:
    """The epochs trained before the first collection (Maddox's ``swa_start``)."""
    return max(1, round(self.start_fraction * num_epochs))

  def collections(self, num_epochs: int) -> int:
    """The models a run of ``num_epochs`` collects."""
    return max(0, (num_epochs - self.start_epoch(num_epochs)) // self.collect_every_epochs)

  def min_collections(self) -> int:
    return 2  # a variance; the low-rank term then uses the deviations collected, as TU's

  def schedule(self, config, schedule, *, num_steps: int, steps_per_epoch: int):
    num_epochs = num_steps // steps_per_epoch
    collected = self.collections(num_epochs)
    if collected < self.min_collections():
      raise ValueError(
          f"{self.name} collects {collected} model(s) in {num_epochs} whole epochs (from epoch "
          f"{self.start_epoch(num_epochs)}, every {self.collect_every_epochs}) and needs at "
          f"least {self.min_collections()}: train longer or lower {self.name}.start_fraction.")
    lr = config.learning_rate * config.input.batch_size / config.base_batch_size
    start = self.start_epoch(num_epochs)
    if self.lr_schedule == "maddox":
      return maddox_schedule(lr, self.lr_ratio * lr, start, steps_per_epoch)
    return lambda step: jnp.where(step < start * steps_per_epoch, schedule(step),
                                  self.lr_ratio * lr)

  def init_state(self, variables) -> dict:
    rank = self.rank if self.covariance == "low_rank" else 0
    return {self.collection: _collection(init_moments(variables["params"], rank))}

  def after_step(self, method_state, variables, clock):
    start = self.start_epoch(clock.num_epochs)
    due = (clock.epoch_end & (clock.epoch > start)
           & ((clock.epoch - start) % self.collect_every_epochs == 0))
    moments = _moments(method_state[self.collection])
    moments = lax.cond(due, collect, lambda m, p: m, moments, variables["params"])
    return {**method_state, self.collection: _collection(moments)}

  def for_training_eval(self) -> Method:
    """The training's evaluation scores the network being trained (no sample yet exists)."""
    return MCDropout(self.model) if self.dropout else Deterministic(self.model)

  # The predictive.
  @property
  def dropout(self) -> bool:
    """Whether the network keeps dropout on at evaluation (a dropout pass per sample)."""
    return is_stochastic(self.model)

  @property
  def needs_training_data(self) -> bool:
    return True

  def moments_of(self, variables) -> Moments:
    """The collected moments in ``variables``, or ValueError (one line) where there are none."""
    if self.collection not in variables:
      raise ValueError(f"These variables hold no SWA/SWAG moments: the run was not trained with "
                       f"--config.method={self.name}.")
    moments = _moments(variables[self.collection])
    if not np.all(np.asarray(moments.count) > 0):  # (a deep ensemble's: every member's)
      raise ValueError(f"No model was collected for {self.name} yet (this checkpoint is from "
                       "before the collection began): train the run to its end.")
    return moments

  def weight_samples(self, moments: Moments, member: int = 0):
    """``[N, ...]`` parameters: N = ``num_samples`` draws from key ``sample_seed`` (a deep
    ensemble's member m > 0: that key folded with m, so that members draw independently)."""
    key = jax.random.key(self.sample_seed)
    key = jax.random.fold_in(key, member) if member else key
    return samples_from_key(moments, key, self.num_samples, self.scale,
                            self.covariance == "diagonal")

  def prediction_variables(self, variables, data):
    """``{"params", "batch_stats"}`` stacked on the N weight samples, each sample's BatchNorm
    statistics recomputed on the training split (:func:`batch_norm_statistics`)."""
    moments = self.moments_of(variables)
    if self.covariance == "low_rank" and _rank(moments) < 2:
      raise ValueError(f"The run kept no deviations (rank {_rank(moments)}: trained with swa or "
                       "the diagonal swag): evaluate it with --config.swag.covariance=diagonal.")
    logging.info("%s: %d weight samples, their BatchNorm statistics on the training split.",
                 self.describe(), self.num_samples)
    dtypes = jax.tree.map(lambda x: x.dtype, variables["params"])
    samples = jax.tree.map(lambda x, d: x.astype(d),
                           self.weight_samples(moments, data.member),
                           dtypes)
    return {"params": samples,
            "batch_stats": batch_norm_statistics(self.model, samples, variables["batch_stats"],
                                                 data.train_batches, self.bn_batches)}

  def sample_log_probs(self, variables, images, rng):
    # Sample n with dropout key split(rng, N)[n] where the network has dropout.
    return ensemble_log_probs(self.model, variables, images, rng if self.dropout else None,
                              self.chunk_size)

  def sample_outputs(self, variables, images, rng):
    keys = jax.random.split(rng, self.num_samples)
    per_draw = images.ndim == 5
    return map_in_chunks(
        lambda a: pass_outputs(self.model, a[0], a[2] if per_draw else images,
                               a[1] if self.dropout else None),
        (variables, keys, images if per_draw else None), self.chunk_size)

  def frame_probs(self, variables, frame, rng):
    raise ValueError(f"VQ-BNN temporal smoothing takes one network's pass; {self.name}'s "
                     "predictive is of weight samples.")


@dataclasses.dataclass(frozen=True)
class SWA(SWAG):
  """SWA (Izmailov et al. 2018): the mean of the collected weights, its BatchNorm statistics
  recomputed on the training split; one network (N = 1, or N dropout passes)."""
  name = "swa"
  settings = {k: v for k, v in SWAG.settings.items()
              if k not in ("rank", "scale", "covariance", "sample_seed")}
  covariance: str = "diagonal"
  rank: int = 0

  def describe(self) -> str:
    return self.name

  def min_collections(self) -> int:
    return 1

  @property
  def stochastic(self) -> bool:
    return self.dropout

  def with_samples(self, num_samples: int) -> SWA:
    return super().with_samples(num_samples) if self.dropout else self

  def nested(self, requested=()) -> tuple:
    return super().nested(requested) if self.dropout else (self, (1,))

  def prediction_variables(self, variables, data):
    """The SWA weights (one network) with their BatchNorm statistics recomputed."""
    params = jax.tree.map(lambda m, x: m.astype(x.dtype), swa_params(self.moments_of(variables)),
                          variables["params"])
    stats = batch_norm_statistics(self.model, jax.tree.map(lambda x: x[None], params),
                                  variables["batch_stats"], data.train_batches, self.bn_batches)
    return {"params": params, "batch_stats": jax.tree.map(lambda x: x[0], stats)}

  def sample_log_probs(self, variables, images, rng):
    return MCDropout.sample_log_probs(self, variables, images, rng)

  def sample_outputs(self, variables, images, rng):
    return MCDropout.sample_outputs(self, variables, images, rng)
