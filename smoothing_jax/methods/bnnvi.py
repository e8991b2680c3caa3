"""BNN-VI (Blundell et al. 2015): the ELBO of the mean-field models (the layers are in
:mod:`smoothing_jax.layers.mean_field`): uncertainty-baselines' (``vgg_bnnvi_16``,
``wideresnet_bnnvi_28_10``: Flipout, deterministic biases) and the iBNN repository's own
(``vgg_bayesian_16``, ``wideresnet_bayesian_28_10``: one sample per pass, variational biases,
whose KL joins the kernels').

Predictive: N weight samples, as MC dropout's N passes (pass n with the noise key of
``split(key, N)[n]``).  The objective is the iBNN paper's, so the two compare under one
protocol: per example,

    −ELBO / N = mean NLL of one pass + β · KL(q(W) ‖ p(W)) / N,

β annealed linearly per epoch from 0 to 1 (:func:`smoothing_jax.methods.ibnn.kl_weight`; per
step with ``config.bnnvi.kl_anneal_per_step``, as uncertainty-baselines does), N the
training-set size.  The prior is uncertainty-baselines' (``variational_inference.py``): N(μ, s²)
with its mean tied to the posterior's and s = 0.1, so the KL pulls every σ towards s; a fixed
prior mean (``config.bnnvi.prior_mean``) gives Blundell et al.'s N(m, s²) instead, the iBNN
repository's (``configs/cifar_ibnn.py`` sets its ``train.py`` defaults, N(1, 0.5²), and Adam).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from ml_collections.config_dict import placeholder

from smoothing_jax.layers.functional import in_layers_holding
from smoothing_jax.layers.mean_field import kl_divergence
from smoothing_jax.methods.ibnn import kl_weight
from smoothing_jax.methods.mc_dropout import MCDropout


class Objective(NamedTuple):
  """Static settings of the BNN-VI ELBO (hashable: a ``jit`` static argument)."""
  prior_std: float
  prior_mean: float | None  # None: tied to the posterior mean
  num_train: int
  steps_per_epoch: int
  kl_anneal_epochs: int
  kl_anneal_per_step: bool = False

  def check(self):
    if not self.prior_std > 0:
      raise ValueError(f"bnnvi.prior_std must be > 0, got {self.prior_std}.")
    return self


def decay_mask(params):
  """True for the parameters weight decay applies to: all but the variational kernels' and
  biases' μ and ρ, which the KL regularises (uncertainty-baselines: L2 on BatchNorm and biases
  only; the iBNN repository's biases are variational)."""
  kernels = in_layers_holding(params, "kernel_rho", ("kernel", "kernel_rho"))
  biases = in_layers_holding(params, "bias_rho", ("bias", "bias_rho"))
  return jax.tree.map(lambda kernel, bias: not (kernel or bias), kernels, biases)


def annealed_kl_weight(step, objective: Objective):
  """β of the 0-based ``step``: per epoch (:func:`smoothing_jax.methods.ibnn.kl_weight`, the iBNN
  protocol), or with ``kl_anneal_per_step`` uncertainty-baselines' ``kl_scale`` =
  min(1, (step + 1) / (steps_per_epoch · kl_anneal_epochs)) (``baselines/cifar/
  variational_inference.py``: ``optimizer.iterations + 1``, the iterations before this step)."""
  if not objective.kl_anneal_per_step or objective.kl_anneal_epochs <= 0:
    return kl_weight(step, objective)
  return jnp.minimum(1.0, (step + 1) / (objective.steps_per_epoch * objective.kl_anneal_epochs))


def elbo_terms(params, objective: Objective, nll, step):
  """``(loss, metrics)``: ``nll + β·KL/N`` and the KL, β of ``step``."""
  kl = kl_divergence(params, objective.prior_std, objective.prior_mean)
  beta = annealed_kl_weight(step, objective)
  return nll + beta * kl / objective.num_train, {"nll": nll, "kl": kl, "kl_weight": beta}


@dataclasses.dataclass(frozen=True)
class BNNVI(MCDropout):
  """Mean-field Gaussian weights (Flipout, or the iBNN repository's one sample per pass): the
  predictive of N weight samples, the ELBO of ``config.bnnvi``, weight decay on everything but
  the posterior."""
  name = "bnnvi"
  settings = {
      "prior_std": 0.1,  # s of the prior N(μ, s²) (uncertainty-baselines' --prior_stddev)
      # None: tied to the posterior mean (uncertainty-baselines); the iBNN repository's is 1.0
      "prior_mean": placeholder(float),
      "kl_anneal_epochs": 200,  # β: 0 → 1 linearly per epoch (the iBNN protocol)
      "kl_anneal_per_step": False,  # β per step instead (uncertainty-baselines)
  }


  def check(self, config) -> BNNVI:
    if config.optimizer == "adamw":
      raise ValueError("optimizer 'adamw' decays every parameter; BNN-VI trains with 'sgd' or "
                       "'adam' (coupled decay that skips its variational weights).")
    return self

  def loss(self, config, *, num_train: int, steps_per_epoch: int, class_weights=None):
    """The cross-entropy of one pass + β·KL/N (:func:`elbo_terms`)."""
    settings = self.settings_in(config)
    objective = Objective(settings.prior_std, settings.prior_mean, num_train, steps_per_epoch,
                          settings.kl_anneal_epochs, settings.kl_anneal_per_step).check()
    nll_fn = super().loss(config, num_train=num_train, steps_per_epoch=steps_per_epoch,
                          class_weights=class_weights)

    def elbo_fn(params, batch_stats, batch, rng, step):
      nll, aux = nll_fn(params, batch_stats, batch, rng, step)
      loss, metrics = elbo_terms(params, objective, nll, step)
      return loss, {**aux, "metrics": metrics}
    return elbo_fn

  def weight_decay(self, config) -> optax.GradientTransformation:
    return optax.add_decayed_weights(config.weight_decay, mask=decay_mask)
