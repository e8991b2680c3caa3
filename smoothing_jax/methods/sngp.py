"""SNGP (Liu et al. 2020): a network with spectrally normalised hidden layers and a random-feature
Gaussian-process output layer (``resnet_sngp_18``, ``wideresnet_sngp_28_10``; the layers are
:mod:`smoothing_jax.layers.sngp`).

* Training: the cross-entropy of the GP's posterior-mean logits; the Laplace precision
  P = s I + Σ φφᵀ sums the random features of the training batches of the current epoch, reset to
  s I at each epoch's start (uncertainty-baselines' ``gp_cov_discount_factor`` = −1: the exact
  precision of the last epoch when training ends).
* Predictive: the variance v(x) = s φᵀ P⁻¹ φ of each example (P factored once per run,
  :meth:`SNGP.prediction_variables`), then either the mean-field
  logits f / √(1 + λ v) (``sngp.predictive`` = ``"mean_field"``, λ = ``sngp.mean_field_factor``,
  25 in uncertainty-baselines' CIFAR-10 recipe; N = 1), or N Monte-Carlo samples of the GP logits
  f + √v ε, ε ~ N(0, I) (``"mc"``, sample n with key ``split(key, N)[n]``), averaged in
  probability space.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from smoothing_jax.layers.sngp import mean_field_logits, reset_precision, with_whitening
from smoothing_jax.methods.base import Method, check_num_samples, nested_samples, setting
from smoothing_jax.passes import pass_outputs

PREDICTIVES = ("mean_field", "mc")


@dataclasses.dataclass(frozen=True)
class SNGP(Method):
  """A spectrally normalised network with a GP output layer; its predictive of
  ``predictive`` (mean-field logits, or ``num_samples`` MC samples of the GP's logits)."""
  name = "sngp"
  settings = {
      "mean_field_factor": 25.0,  # λ (uncertainty-baselines' CIFAR-10; 12.5 on CIFAR-100)
      "predictive": "mean_field",  # or "mc": num_samples samples of the GP logits
      "num_samples": 10,
  }
  mean_field_factor: float = 25.0
  predictive: str = "mean_field"

  @classmethod
  def from_config(cls, config, model) -> SNGP:
    predictive = setting(config, "sngp.predictive", "mean_field")
    if predictive not in PREDICTIVES:
      raise ValueError(f"Unknown sngp.predictive {predictive!r}; choose one of {PREDICTIVES}.")
    return cls(model, num_samples=check_num_samples(setting(config, "sngp.num_samples", 10)),
               chunk_size=setting(config, "eval_chunk_size"),
               mean_field_factor=float(setting(config, "sngp.mean_field_factor", 25.0)),
               predictive=predictive)

  def describe(self) -> str:
    return (f"{self.name} (mean-field logits, λ = {self.mean_field_factor:g})"
            if self.predictive == "mean_field" else f"{self.name} ({self.num_samples} GP samples)")

  # --- The predictive.
  @property
  def stochastic(self) -> bool:
    return self.predictive == "mc"

  @property
  def num_draws(self) -> int:
    return self.num_samples if self.stochastic else 1

  def with_samples(self, num_samples: int) -> SNGP:
    if not self.stochastic:
      return self
    return dataclasses.replace(self, num_samples=check_num_samples(num_samples))

  def nested(self, requested: Sequence[int] = ()) -> tuple:
    if not self.stochastic:
      return self, (1,)
    return nested_samples(self, requested)

  def gp_pass(self, variables, images, rng=None) -> dict:
    """One evaluation pass: ``{"logits" [B, C] (the GP's posterior mean), "variance" [B],
    "features" [B, D] (the GP layer's input)}`` in float32 (``passes.pass_outputs``)."""
    out = pass_outputs(self.model, variables, images, rng, intermediates=True)
    (variance,) = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(out["intermediates"])
                   if getattr(path[-2], "key", None) == "gp_variance"]
    return {"logits": out["logits"], "variance": variance, "features": out["features"]}

  def _draw_logits(self, out, rng):
    """``[N, B, C]`` logits of the N draws of one :meth:`gp_pass`."""
    if not self.stochastic:
      return mean_field_logits(out["logits"], out["variance"], self.mean_field_factor)[None]
    keys = jax.random.split(rng, self.num_samples)
    scale = jnp.sqrt(out["variance"])[:, None]
    return jax.vmap(lambda key: out["logits"] + scale * jax.random.normal(
        key, out["logits"].shape))(keys)

  def sample_log_probs(self, variables, images, rng):
    return jax.nn.log_softmax(self._draw_logits(self.gp_pass(variables, images), rng))

  def sample_outputs(self, variables, images, rng):
    if images.ndim == 5:  # one pass on the first draw's images: the draws share the pass
      images = images[0]
    out = self.gp_pass(variables, images)
    logits = self._draw_logits(out, rng)
    return {"logits": logits,
            "features": jnp.broadcast_to(out["features"], (len(logits),) + out["features"].shape)}

  def frame_probs(self, variables, frame, rng):
    return jnp.exp(self.sample_log_probs(variables, frame, rng)[0])

  @property
  def predicts_per_member(self) -> bool:
    return True

  def prediction_variables(self, variables, data):
    """The trained variables with each GP precision's L⁻¹ beside it (``layers.sngp``'s
    ``with_whitening``): the precision is factored once per run, not in every pass."""
    return {**variables, "batch_stats": jax.jit(with_whitening)(variables["batch_stats"])}

  # --- The objective: the cross-entropy, the precision summed over the current epoch.
  def loss(self, config, *, num_train: int, steps_per_epoch: int, class_weights=None):
    base = super().loss(config, num_train=num_train, steps_per_epoch=steps_per_epoch,
                        class_weights=class_weights)
    ridge = self.model.gp_ridge

    def loss_fn(params, batch_stats, batch, rng, step):
      fresh = step % steps_per_epoch == 0  # an epoch starts: the precision starts again
      return base(params, reset_precision(batch_stats, fresh, ridge), batch, rng, step)
    return loss_fn

  def check(self, config) -> SNGP:
    if setting(config, "grad_accum_steps", 1) > 1:
      raise ValueError("SNGP sums its GP precision over each step's batch; train it with "
                       "grad_accum_steps=1.")
    return self

