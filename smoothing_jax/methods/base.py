"""What an uncertainty method is: :class:`Method`, the one object that training, every evaluator,
``Run.predict``, VQ-BNN and the analyses ask for a method's predictive, objective, optimiser
rules, train state and refusals.  Nothing outside ``smoothing_jax.methods`` (and the layer
factory in ``smoothing_jax.models``) asks which method a run uses.

A method is a frozen dataclass holding its model and settings, so it is hashable and ``jit``
takes it as a static argument.  Its defaults here are those of one network trained on the
cross-entropy and evaluated by one pass; each method overrides what it does differently (the
architecture page of the docs walks through adding one).
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import FieldReference

from smoothing_jax.methods import losses
from smoothing_jax.metrics import UncertaintyMetrics
from smoothing_jax.models import implied_method
from smoothing_jax.models.cnn import check_images
from smoothing_jax.passes import Prediction, check_rng, log_probs, mean_probs, pass_outputs


def setting(config, dotted: str, default=None):
  """``config``'s value at the dotted key, or ``default`` where ``config`` (None: no config) does
  not hold it."""
  node = config
  for name in dotted.split("."):
    if node is None or not hasattr(node, "get"):
      return default
    node = node.get(name)
  return default if node is None else node


class Clock(NamedTuple):
  """Where a training step stands: ``step`` (steps done, this one included), ``epoch`` (epochs
  completed: ``step // steps_per_epoch``) and ``epoch_end`` (whether this step ends one), int32
  and bool scalars inside the compiled step; and the run's length, ``num_steps`` and
  ``num_epochs`` (its whole epochs), Python ints: what a method's phases are fractions of."""
  step: jax.Array
  epoch: jax.Array
  epoch_end: jax.Array
  num_epochs: int
  num_steps: int

  @classmethod
  def after(cls, step, steps_per_epoch: int, num_steps: int) -> Clock:
    """The clock of the step that brings the step counter to ``step`` in a run of
    ``num_steps``."""
    return cls(step, step // steps_per_epoch, step % steps_per_epoch == 0,
               num_steps // steps_per_epoch, num_steps)


class PredictionData(NamedTuple):
  """What a predictive may read beside the trained variables (``Method.prediction_variables``):
  ``train_batches()``, a fresh iterator of the training split's padded, masked, unaugmented
  batches, ``fit(name)``, the stored result of a post-hoc stage (``Method.fit``), and ``member``,
  which member of a deep ensemble the variables are (what a member's own random draws fold in:
  members draw independently)."""
  train_batches: Callable
  fit: Callable
  member: int = 0


@dataclasses.dataclass(frozen=True)
class Method:
  """One uncertainty method on one model (immutable and hashable: a ``jit`` static argument).

  ``model``: the Flax module; ``num_samples``: the stochastic passes N of the predictive where
  the method samples (an iBNN's: draws S of each component); ``chunk_size``: passes evaluated
  together (``passes.map_in_chunks``; None: the backend's default).
  """
  name: ClassVar[str] = ""
  # The defaults of ``config.<name>``, the method's settings block: a config holds the block of
  # the method it names (``config.method``) and no other (``config_base.declare_method``).
  settings: ClassVar[dict] = {}
  model: nn.Module
  num_samples: int = 1
  chunk_size: int | None = None

  # --- Which models it takes (``methods.resolve`` builds the one ``config.method`` names).
  @classmethod
  def refuses(cls, model) -> str | None:
    """Why this method cannot train and evaluate ``model`` (one line), or None where it can.
    Default: the models built for it (``models.implied_method``)."""
    built_for = implied_method(model)
    if built_for == cls.name:
      return None
    return (f"it takes the models built for it (this one is built for {built_for}; "
            f"`--config.method={built_for}` or leave method unset)")

  @classmethod
  def settings_in(cls, config) -> types.SimpleNamespace:
    """The method's settings: ``config.<name>`` over the defaults :attr:`settings` (a config
    whose block was declared for another method, e.g. after an override made the model
    mean-field, holds none: every setting at its default)."""
    def value(key, default):
      if isinstance(default, FieldReference):  # a placeholder: its value (None)
        default = default.get()
      return setting(config, f"{cls.name}.{key}", default)
    return types.SimpleNamespace(**{key: value(key, default)
                                    for key, default in cls.settings.items()})

  @classmethod
  def from_config(cls, config, model) -> Method:
    """This method for ``model`` with its settings from ``config`` (None: the defaults)."""
    return cls(model, chunk_size=setting(config, "eval_chunk_size"))

  def describe(self) -> str:
    """The method's name as logs, tables and the docs write it."""
    return self.name

  # --- The predictive.
  @property
  def stochastic(self) -> bool:
    """Whether two draws of the predictive differ."""
    return False

  @property
  def num_draws(self) -> int:
    """N: the draws (samples, members or component draws) of :meth:`sample_log_probs`."""
    return 1

  def with_samples(self, num_samples: int) -> Method:
    """This method drawing ``num_samples`` stochastic passes (ignored where N is fixed)."""
    return self

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    """``(method, sizes)``: the nested ensemble sizes N this method reports for the requested
    ones (the first N draws of one predictive), and the method drawing enough for all."""
    return self, (self.num_draws,)

  def sample_log_probs(self, variables, images, rng) -> jax.Array:
    """``[N, B, ..., C]`` float32 log-probabilities of the N draws on ``images`` (pure: under
    ``jit``, ``grad`` and ``vmap``)."""
    return log_probs(self.model, variables, images, rng)[None]

  def sample_outputs(self, variables, images, rng) -> dict:
    """``{"logits" [N, B, C], "features" [N, B, D]}`` of the N draws of
    :meth:`sample_log_probs` (the same draws: log_softmax of these logits are its
    log-probabilities), the features being each draw's classifier input
    (``passes.pass_outputs``).  ``images``: ``[B, H, W, 3]``, or ``[N, B, H, W, 3]`` with draw
    n on ``images[n]`` (ODIN steps each draw's input by its own gradient).  This default is
    one network's pass; a method of several draws overrides it with :meth:`sample_log_probs`."""
    if self.num_draws != 1:
      raise NotImplementedError(f"{type(self).__name__} has {self.num_draws} draws but gives the "
                                "outputs of one: it must override sample_outputs.")
    images = images[0] if images.ndim == 5 else images
    return jax.tree.map(lambda x: x[None], pass_outputs(self.model, variables, images, rng))

  def predict(self, variables, images, *, rng) -> Prediction:
    """The predictive in one jitted call: ``Prediction(sample_probs [N, B, C], mean_probs
    [B, C])``, the mean in probability space, p̄ = (1/N) Σ_n softmax(f_n(x)).  ``rng`` may be
    None where the method is not :attr:`stochastic`."""
    check_images(images)
    rng = None if rng is None and not self.stochastic else check_rng(rng)
    samples = _jit_sample_log_probs(self, variables, images, rng)
    return Prediction(jnp.exp(samples), mean_probs(samples))

  def frame_probs(self, variables, frame, rng) -> jax.Array:
    """One pass on ``frame``: the probabilities ``[B, ..., C]`` VQ-BNN smooths over time (one
    stochastic pass per frame)."""
    return jnp.exp(log_probs(self.model, variables, frame, rng))

  def one_network(self, batch_size: int) -> dict:
    """``model.apply`` keyword arguments of one network's pass (what the feature analyses tap)."""
    return {}

  def eval_metrics(self, variables, batch, rng, num_bins: int) -> dict:
    """``{tag suffix: UncertaintyMetrics}`` of one padded, masked batch: ``""`` the predictive's
    mean (what the training's periodic evaluation logs as ``eval_<metric>``)."""
    probs = mean_probs(self.sample_log_probs(variables, batch["image"], rng))
    return {"": UncertaintyMetrics.from_model_output(probs, batch["label"], batch["mask"],
                                                     num_bins=num_bins)}

  def for_training_eval(self) -> Method:
    """The predictive the training's periodic evaluation scores (one draw where it samples)."""
    return self.with_samples(1)

  # --- Refusals.
  def check(self, config) -> Method:
    """ValueError (one line) for settings this method cannot train with; returns itself."""
    return self

  def as_member(self, config=None) -> Method:
    """This method as a deep-ensemble member, or ValueError (one line) where it cannot be one."""
    return self

  def one_model(self, what: str, workdir: str = "") -> Method:
    """This method where ``what`` takes one model's predictions, or ValueError (one line)."""
    return self

  # --- The training objective.
  def tile(self, *arrays) -> tuple:
    """The training batch of the batch's ``arrays`` (images, labels, ...: a BatchEnsemble's
    repeats every row for its members)."""
    return arrays

  def loss(self, config, *, num_train: int, steps_per_epoch: int, class_weights=None) -> Callable:
    """``loss_fn(params, batch_stats, batch, rng, step) -> (loss, aux)`` of this method's
    objective (default: :func:`losses.supervised_loss`, the cross-entropy)."""
    return losses.supervised_loss(self.model, losses.training_mixing(config, self.model),
                                  class_weights, self.tile)

  # --- The optimiser rules (``training.optim.create_optimizer`` asks these).
  def optimizer(self, config, schedule) -> optax.GradientTransformation | None:
    """An optimiser of the method's own (None: the config's, with :meth:`weight_decay`)."""
    return None

  def weight_decay(self, config) -> optax.GradientTransformation:
    """The coupled weight decay of ``config.weight_decay`` on the parameters it applies to."""
    return optax.add_decayed_weights(config.weight_decay)

  def update_scaling(self, config) -> optax.GradientTransformation | None:
    """Applied to the optimiser's updates (e.g. a BatchEnsemble's fast-weight rate; None:
    nothing)."""
    return None

  def warm_start(self, config) -> str | None:
    """A workdir whose weights a fresh train state starts from (None: none)."""
    return None

  def load_warm_start(self, variables, loaded):
    """``variables`` with what this method takes from the :meth:`warm_start` run's ``loaded``."""
    raise NotImplementedError

  # --- State of its own, hooks and the schedule (one network's: a deep ensemble runs its base
  # method's per member).
  def init_state(self, variables: dict) -> dict:
    """The method's own collections beside ``params`` and ``batch_stats`` (``{name: pytree}``,
    e.g. SWAG's moments), initialised from one network's fresh ``variables`` (``{"params",
    "batch_stats"}``): they live in the train
    state (``TrainState.method_state``), are sharded, saved and restored with it, and join the
    variables the predictive takes.  Pure: ``vmap`` ed over a deep ensemble's members."""
    return {}

  def after_step(self, method_state: dict, variables: dict, clock: Clock) -> dict:
    """The method's collections after the optimiser step of ``clock``, given the network's new
    ``variables`` (``{"params", "batch_stats"}``), inside the compiled step (no host round
    trip; an act "at an epoch's end" tests ``clock.epoch_end``).  Pure: a condition on the
    clock is a ``lax.cond``."""
    return method_state

  def schedule(self, config, schedule: Callable, *, num_steps: int, steps_per_epoch: int
               ) -> Callable:
    """The learning-rate schedule training uses, given the recipe's ``schedule`` (the method may
    own it or a phase of it, e.g. SWA's constant rate), or ValueError (one line) for a run it
    cannot train (e.g. too short to collect what it needs)."""
    return schedule

  # --- A post-hoc stage over the training split, and data at prediction.
  @property
  def fit_name(self) -> str | None:
    """Where the result of :meth:`fit` lives, ``<workdir>/fits/<fit_name>/<step>`` (None: this
    method has no post-hoc stage)."""
    return None

  def fit(self, variables, batches: Callable) -> dict:
    """The post-hoc stage: ``{collection: pytree}`` fitted on the training split after training
    (``batches()``: a fresh iterator of its padded, masked, unaugmented batches), joined to the
    variables the predictive takes (``experiment.fits`` stores it, resumably and under the
    workdir's lock)."""
    raise NotImplementedError

  def prediction_variables(self, variables, data: PredictionData):
    """The variables the predictive takes, made from the trained ``variables``: default
    themselves, joined by the method's stored fit where it has a post-hoc stage
    (``data.fit``); a method may draw weights and recompute what depends on the training data
    (SWAG's BatchNorm statistics per sample, from ``data.train_batches``).  The run caches the
    result per method (``Run.prediction_variables``), so every evaluator shares one
    preparation."""
    if self.fit_name is None:
      return variables
    return {**variables, **data.fit(self.fit_name)}

  @property
  def needs_training_data(self) -> bool:
    """Whether :meth:`prediction_variables` reads the training split."""
    return False

  @property
  def prepares_variables(self) -> bool:
    """Whether the predictive takes variables of its own (a fit, weights collected or drawn)
    rather than the trained network's."""
    return self.needs_training_data or self.fit_name is not None

  @property
  def predicts_per_member(self) -> bool:
    """Whether a deep ensemble of this method runs its whole predictive on each member (N = M·S
    draws) rather than one pass of each: where the predictive takes variables of its own, or
    transforms the input (test-time augmentation)."""
    return self.prepares_variables

  # --- The train state and step (one network; a deep ensemble stacks them).
  @property
  def per_member(self) -> Method:
    """The method of one network of the train state, whose state and hooks the step runs (a
    deep ensemble's base method, run on each member)."""
    return self

  @property
  def members(self) -> int:
    """Train states stacked along a leading axis (1: one network)."""
    return 1

  def init_train_state(self, config, init_one: Callable, devices=()) -> Any:
    """The train state from ``init_one(key)`` with the key of ``config.seed``, in one compiled
    call (outside ``jit`` the optimizer state would be created leaf by leaf)."""
    return jax.jit(init_one)(jax.random.split(jax.random.key(config.seed), 3)[0])

  def train_keys(self, config) -> jax.Array:
    """The dropout / noise key(s) of the training steps."""
    return jax.random.split(jax.random.key(config.seed), 3)[1]

  def train_pipelines(self, config, pipeline) -> list:
    """The pipelines whose batches the train state learns from."""
    return [pipeline]

  def train_step(self, step: Callable, state, member_batch: Callable, rngs, *, shared: bool):
    """One optimiser step ``step(state, batch, rng) -> (state, metrics)`` on ``member_batch(0)``."""
    return step(state, member_batch(0), rngs)

  def train_scalars(self, prefix: str, means: dict) -> dict:
    """The scalars written for the training metrics' means ``means``."""
    return {f"{prefix}{k}": float(np.mean(v)) for k, v in means.items()}


@functools.partial(jax.jit, static_argnums=(0,))
def _jit_sample_log_probs(method: Method, variables, images, rng):
  return method.sample_log_probs(variables, images, rng)


def nested_samples(method: Method, requested: Sequence[int] = ()) -> tuple:
  """``Method.nested`` of a predictive of N independent samples (MC dropout, SWAG, a sampled
  Laplace or SNGP): every requested N (1 where none), and the method drawing the largest."""
  sizes = sorted({check_num_samples(n) for n in requested or (1,)})
  return method.with_samples(sizes[-1]), tuple(sizes)


def check_num_samples(num_samples) -> int:
  """``num_samples`` if it is a positive integer; ValueError (one line) otherwise."""
  if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 1:
    raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}.")
  return num_samples
