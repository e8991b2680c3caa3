"""iBNN (Trinh et al., "Scalable Bayesian neural networks by layer-wise input augmentation").

The method (:class:`IBNN`), its training objective (paper Algorithm 1, Eqs. 22–24), the
two-learning-rate optimizer, K×S inference, component folding and out-of-distribution curves for
the node-noise models (``vgg_ibnn_16``, ``wideresnet_ibnn_28_10``; the layers are
in :mod:`smoothing_jax.layers.node_noise`).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections.config_dict import placeholder

from smoothing_jax.layers.functional import layers_holding
from smoothing_jax.layers.mean_field import gaussian_kl
from smoothing_jax.layers.node_noise import VARIATIONAL_PARAMS
from smoothing_jax.methods.base import Method, check_num_samples, setting
from smoothing_jax.metrics import uncertainty_decomposition
from smoothing_jax.models import is_ibnn
from smoothing_jax.passes import (
  Prediction,
  log_probs,
  map_in_chunks,
  pass_outputs,
  sample_rngs,
)
from smoothing_jax.variables import transfer_variables


class Objective(NamedTuple):
  """Static settings of the iBNN ELBO (hashable: a ``jit`` static argument)."""
  num_components: int       # K
  num_repeats: int          # S: each example is repeated S times per step
  prior_mean: float
  prior_std: float          # s of the prior N(1, s²)
  num_train: int            # N: the KL is divided by the training-set size
  steps_per_epoch: int
  kl_anneal_epochs: int     # β = min(1, epoch / kl_anneal_epochs)

  def check(self):
    if self.num_components < 1:
      raise ValueError(f"num_components (K) must be >= 1, got {self.num_components}.")
    if self.num_repeats < 1:
      raise ValueError(f"ibnn.num_train_samples (S) must be >= 1, got {self.num_repeats}.")
    if not self.prior_std > 0:
      raise ValueError(f"ibnn.prior_std must be > 0, got {self.prior_std}.")
    return self


def _is_variational(path) -> bool:
  return getattr(path[-1], "key", None) in VARIATIONAL_PARAMS


def param_labels(params):
  """``"variational"`` for z/b means and ρs, ``"deterministic"`` for everything else."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "variational" if _is_variational(path) else "deterministic", params)


def noise_layers(params) -> list:
  """The parameter dicts of every node-noise layer, in order."""
  return layers_holding(params, "z_mean")


def num_noise_nodes(params) -> int:
  """Input nodes with noise per component (paper Table 1: 9,475 for WRN-28-10)."""
  return sum(layer["z_mean"].shape[1] for layer in noise_layers(params))


def kl_divergence(params, prior_std: float, prior_mean: float = 1.0):
  """Σ over layers and elements of
  KL(N(mean_k μ_k, (√Σ_k σ_k² / K)²) ‖ N(prior_mean, prior_std²)).

  The Gaussian of the average of the K components (paper Eqs. 22–24, the
  reference's ``StoLayer.kl``), for the input noise z and the bias noise s.
  """
  total = 0.0
  for layer in noise_layers(params):
    for mean_name, rho_name in (("z_mean", "z_rho"), ("b_mean", "b_rho")):
      if mean_name in layer:
        mean, std = layer[mean_name], jax.nn.softplus(layer[rho_name])
        k = mean.shape[0]
        total += jnp.sum(
            gaussian_kl(mean.mean(0),
                        jnp.sqrt(jnp.sum(std**2, 0)) / k, prior_mean, prior_std))
  return total


def kl_weight(step, objective: Objective):
  """β annealed linearly per epoch: 0 in epoch 0, 1 from epoch ``kl_anneal_epochs`` on (always 1
  if that is 0)."""
  if objective.kl_anneal_epochs <= 0:
    return jnp.ones(())
  epoch = step // objective.steps_per_epoch
  return jnp.minimum(1.0, epoch / objective.kl_anneal_epochs)


def repeat_batch(images, labels, num_repeats: int, num_components: int):
  """Algorithm 1's batch: each example repeated S times in a row; row r uses component r mod K."""
  images = jnp.repeat(images, num_repeats, axis=0)
  labels = jnp.repeat(labels, num_repeats, axis=0)
  return images, labels, jnp.arange(images.shape[0]) % num_components


def elbo_loss(model, objective: Objective, params, batch_stats, images, labels, rng, step):
  """Negative ELBO per example (training mode): mean NLL over the B·S rows + β·KL/N.
  Returns ``(loss, aux)``."""
  images, labels, components = repeat_batch(images, labels, objective.num_repeats,
                                            objective.num_components)
  logits, updates = model.apply({
      "params": params,
      "batch_stats": batch_stats
  },
                                images,
                                train=True,
                                components=components,
                                mutable=["batch_stats"],
                                rngs=sample_rngs(rng))
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
  kl = kl_divergence(params, objective.prior_std, objective.prior_mean)
  beta = kl_weight(step, objective)
  loss = nll + beta * kl / objective.num_train
  return loss, {"logits": logits, "labels": labels, "nll": nll, "kl": kl, "kl_weight": beta,
                "batch_stats": updates.get("batch_stats", {})}


def create_optimizer(det_schedule,
                     variational_lr: float,
                     weight_decay: float,
                     momentum: float = 0.9,
                     freeze_deterministic: bool = False) -> optax.GradientTransformation:
  """Two learning rates (``optax.multi_transform``): SGD-Nesterov with weight decay and
  ``det_schedule`` for the weights; SGD-Nesterov at the constant ``variational_lr`` without weight
  decay for the posterior."""
  deterministic = optax.set_to_zero() if freeze_deterministic else optax.chain(
      optax.add_decayed_weights(weight_decay),
      optax.sgd(det_schedule, momentum=momentum, nesterov=True))
  return optax.multi_transform(
      {"deterministic": deterministic,
       "variational": optax.sgd(variational_lr, momentum=momentum, nesterov=True)}, param_labels)


def load_deterministic(params, det_params):
  """``params`` with every deterministic weight replaced by the same path of ``det_params``
  (``variables.transfer_variables``; the variational parameters stay as they are).

  Raises a ValueError naming every path whose presence or shape differs.
  """
  loaded, _ = transfer_variables(
      params, det_params, keep_fresh=lambda path, *_: path[-1] in VARIATIONAL_PARAMS,
      title="Deterministic checkpoint does not match the iBNN architecture")
  return loaded


@functools.partial(jax.jit, static_argnames=("model", "num_samples"))
def _ibnn_log_probs(model, variables, images, rng, num_samples):
  k = model.num_components
  keys = jax.random.split(rng, k * num_samples).reshape(k, num_samples)

  def component(args):
    index, component_keys = args
    components = jnp.full((images.shape[0],), index)

    return map_in_chunks(
        lambda key: log_probs(model, variables, images, key, components=components),
        component_keys, None)
  samples = jax.lax.map(component, (jnp.arange(k), keys))          # [K, S, B, C]
  return jnp.swapaxes(samples, 0, 1).reshape((k * num_samples,) + samples.shape[2:])


def _ibnn_outputs(model, variables, images, rng, num_samples):
  """:func:`_ibnn_log_probs`'s draws as ``passes.pass_outputs`` (the same keys, sample-major
  ``[S·K, ...]``); ``images [S·K, B, ...]``: draw d on images[d]."""
  k = model.num_components
  keys = jax.random.split(rng, k * num_samples).reshape(k, num_samples)
  per_draw = images.ndim == 5
  if per_draw:  # [S·K, B, ...] sample-major → [K, S, B, ...] as the keys
    images = jnp.swapaxes(images.reshape((num_samples, k) + images.shape[1:]), 0, 1)

  def component(args):
    index, component_keys, component_images = args
    batch = (component_images if per_draw else images).shape[-4]
    components = jnp.full((batch,), index)
    return map_in_chunks(
        lambda a: pass_outputs(model, variables, a[1] if per_draw else images, a[0],
                               components=components),
        (component_keys, component_images), None)
  out = jax.lax.map(component, (jnp.arange(k), keys, images if per_draw else None))
  return jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape((k * num_samples,) + x.shape[2:]),
                      out)


def ibnn_predict(model, variables, images, *, num_samples: int = 5, rng) -> Prediction:
  """S samples from each of the K components in one jitted call: :class:`IBNN`'s predictive
  (per component, the S passes in chunks of ``passes.default_chunk_size``).

  ``sample_probs`` is ``[S·K, B, C]`` ordered sample-major (rows s·K … s·K+K−1 are
  one draw of every component); ``mean_probs`` their mean (NLL = −log mean p: log-mean-exp).
  """
  if num_samples < 1:
    raise ValueError(f"num_samples (S) must be >= 1, got {num_samples}.")
  if not is_ibnn(model):
    raise ValueError(
        "ibnn_predict needs an iBNN model (num_components >= 1), e.g. get_model('vgg_ibnn_16', 10)."
    )
  return IBNN(model, num_samples=num_samples).predict(variables, images, rng=rng)


def fold_component(variables, k: int):
  """Deterministic variables with component k's means folded in (the reference's ``convert2det``).

  W ← W ⊙ μ_k (per input channel), b ← b · m_k; the variational parameters are
  dropped, so the result loads into the same architecture with ``num_components=0``.
  """
  def fold(tree):
    if not isinstance(tree, (dict, flax.core.FrozenDict)):
      return tree
    if "z_mean" not in tree:
      return {name: fold(value) for name, value in tree.items()}
    num_components = tree["z_mean"].shape[0]
    if not 0 <= k < num_components:
      raise ValueError(f"Component {k} out of range for K={num_components}.")
    kernel = tree["kernel"]
    scale = tree["z_mean"][k].reshape((1,) * (kernel.ndim - 2) + (-1, 1))
    out = {"kernel": kernel * scale}
    if "bias" in tree:
      out["bias"] = tree["bias"] * (tree["b_mean"][k] if "b_mean" in tree else 1.0)
    return out
  return {**variables, "params": fold(variables["params"])}


@dataclasses.dataclass(frozen=True)
class IBNN(Method):
  """K components of node noise on one set of weights: the predictive averages S draws of every
  component (``num_samples`` = S = ``config.ibnn.eval_samples``, N = K·S, sample-major, so the
  first K draws are one of each component; :func:`ibnn_predict`), the negative ELBO of
  ``config.ibnn``, the two-learning-rate optimiser, and a deterministic warm start
  (``config.ibnn.pretrained_workdir``)."""
  name = "ibnn"
  settings = {
      "num_train_samples": 2,  # S: repeats of each example per step (Algorithm 1)
      "prior_mean": 1.0,
      "prior_std": 0.1,  # s of N(1, s²): 0.1 WRN, 0.3 VGG
      "kl_anneal_epochs": 200,  # β: 0 → 1 linearly per epoch
      "variational_lr": 2.4,  # constant, no weight decay
      "eval_samples": 5,  # S at evaluation: K×S predictions
      "freeze_deterministic": False,  # train only the posterior (with pretrained_workdir)
      # Initialise W from a deterministic run of the same architecture (None: no warm start).
      "pretrained_workdir": placeholder(str),
  }


  @classmethod
  def from_config(cls, config, model) -> IBNN:
    return cls(model, num_samples=check_num_samples(setting(config, "ibnn.eval_samples", 5)),
               chunk_size=setting(config, "eval_chunk_size"))

  @property
  def stochastic(self) -> bool:
    return True

  @property
  def num_draws(self) -> int:
    return self.model.num_components * self.num_samples

  def with_samples(self, num_samples: int) -> IBNN:
    """S = ``num_samples`` draws of each of the K components."""
    return dataclasses.replace(self, num_samples=check_num_samples(num_samples))

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    """Each requested N below K·S, and K·S."""
    total = self.num_draws
    return self, tuple(sorted({n for n in requested if n < total} | {total}))

  def sample_log_probs(self, variables, images, rng):
    return _ibnn_log_probs(self.model, variables, images, rng, self.num_samples)

  def sample_outputs(self, variables, images, rng):
    return _ibnn_outputs(self.model, variables, images, rng, self.num_samples)

  def check(self, config) -> IBNN:
    if config.label_smoothing or config.mixup_alpha or config.cutmix_alpha:
      raise ValueError(
          "label_smoothing / mixup_alpha / cutmix_alpha are not supported with the iBNN ELBO.")
    if config.init_from and self.settings_in(config).pretrained_workdir:
      raise ValueError("Set config.init_from or config.ibnn.pretrained_workdir, not both.")
    return self

  def as_member(self, config=None) -> Method:
    model = f" {config.model!r}" if config is not None else ""
    raise ValueError(f"Model{model} is an iBNN, already a mixture of {self.model.num_components} "
                     "components sharing one set of weights; train it with "
                     "deep_ensemble.members=1.")

  def loss(self, config, *, num_train: int, steps_per_epoch: int, class_weights=None):
    """The negative ELBO (:func:`elbo_loss`), its NLL, KL and β joining the metrics."""
    settings = self.settings_in(config)
    objective = Objective(self.model.num_components, settings.num_train_samples,
                          settings.prior_mean, settings.prior_std, num_train,
                          steps_per_epoch, settings.kl_anneal_epochs).check()

    def loss_fn(params, batch_stats, batch, rng, step):
      loss, aux = elbo_loss(self.model, objective, params, batch_stats, batch["image"],
                            batch["label"], rng, step)
      metrics = {k: aux.pop(k) for k in ("nll", "kl", "kl_weight")}
      return loss, {**aux, "metrics": metrics}
    return loss_fn

  def optimizer(self, config, schedule) -> optax.GradientTransformation:
    settings = self.settings_in(config)
    return create_optimizer(schedule, settings.variational_lr, config.weight_decay,
                            config.momentum, settings.freeze_deterministic)

  def warm_start(self, config) -> str | None:
    return self.settings_in(config).pretrained_workdir or None

  def load_warm_start(self, variables, loaded):
    """The deterministic weights of ``loaded`` (:func:`load_deterministic`); the posterior stays
    fresh."""
    return {k: load_deterministic(v, loaded[k]) for k, v in variables.items()}


def gaussian_blend(images, gamma: float, rng):
  """x̂ = (1 − γ)·x + γ·ε with ε ~ N(0, 1) (in the normalised input space, as the
  reference)."""
  return (1.0 - gamma) * images + gamma * jax.random.normal(rng, images.shape, images.dtype)


def salt_and_pepper(images, probability: float, rng):
  """IB ``ood_test.add_imnoise``: u ~ U(0, 1) per value; 0 where u < p, 1 where u > 1 − p.

  So 2p of the values change in all (p each to 0 and to 1; at p = 0.5 every value), set on the
  normalised inputs as in the reference.
  """
  u = jax.random.uniform(rng, images.shape)
  return jnp.where(u > 1.0 - probability, 1.0, jnp.where(u < probability, 0.0, images))


def ood_entropy_curves(predict: Callable,
                       images,
                       kind: str = "blend",
                       levels: Sequence[float] | None = None,
                       rng=None) -> dict:
  """Mean total / aleatoric / epistemic entropy vs corruption level (paper Fig. 8).

  ``predict(images) -> sample_probs [N, B, C]``; ``kind`` is ``"blend"`` (γ ∈ [0, 1])
  or ``"salt_pepper"`` (p ∈ [0, 0.5]).
  """
  corrupt = {"blend": gaussian_blend, "salt_pepper": salt_and_pepper}
  if kind not in corrupt:
    raise ValueError(f"Unknown corruption {kind!r}; choose 'blend' or 'salt_pepper'.")
  if levels is None:
    levels = np.linspace(0, 1, 11) if kind == "blend" else np.linspace(0, 0.5, 11)
  rng = jax.random.key(0) if rng is None else rng
  curves = {"levels": np.asarray(levels), "total": [], "aleatoric": [], "epistemic": []}
  for i, level in enumerate(levels):
    parts = uncertainty_decomposition(
        predict(corrupt[kind](images, float(level), jax.random.fold_in(rng, i))))
    for key in ("total", "aleatoric", "epistemic"):
      curves[key].append(float(jnp.mean(parts[key])))
  return {k: np.asarray(v) for k, v in curves.items()}
