"""Last-layer Laplace (Daxberger et al. 2021): a Gaussian posterior N(θ_MAP, P⁻¹) over the
classifier's last ``nn.Dense`` only, θ = (kernel W [D, C], bias b [C]), the features φ [D] of the
rest of the network fixed.  P = GGN + diag(δ): the Gauss-Newton matrix of the softmax
cross-entropy summed over the training set, Σ_n J_nᵀ (diag p_n − p_n p_nᵀ) J_n with
J_n = ∂f_n/∂θ, in one of three structures ("diag", "kron", "full"), and δ the prior precision.

The pure numerical core, each function as laplace-torch 0.3 computes it for
``Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure=...)``
with its default (curvlinops) GGN backend; tests/methods/test_laplace.py checks them against it:

* θ is flattened in torch's order, θ = [Wᵀ row-major (class c, feature d at c·D + d), b] (torch's
  ``nn.Linear.weight`` is Wᵀ), P = C(D + 1) numbers;
* "kron" is KFAC: the kernel's block B ⊗ A with B = Σ_n (diag p_n − p_n p_nᵀ) [C, C] and
  A = (1/N) Σ_n φ_n φ_nᵀ [D, D], the bias's block B, each factor eigendecomposed once (eigenvalues
  clipped at 0), so that P = (Q_B ⊗ Q_A)(λ_B ⊗ λ_A + δ)(Q_B ⊗ Q_A)ᵀ is exact and cheap for any δ;
* the log marginal likelihood log p(D|θ) − ½(log det P − log det P₀ + θᵀP₀θ) (prior mean 0), and
  δ fitted on it by Adam (lr 0.1, 100 steps from δ = 1) on log δ;
* the GLM predictive of the logits f = φW + b, N(f_MAP, J Σ Jᵀ), its probit approximation
  softmax(f / √(1 + π/8 · diag Σ_f)), and samples θ = θ_MAP + S z of standard-normal z.

The training split streams through ``init_curvature``, ``accumulate_curvature`` (a batch at a
time) and ``finish_curvature``; ``build_posterior`` gives the fitted posterior, a dict of arrays.
Every function is jittable with ``structure`` static (``static_argnames="structure"``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.traverse_util import flatten_dict

from smoothing_jax.methods.base import Method, check_num_samples, nested_samples, setting
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.models import implied_method, is_segmentation_model
from smoothing_jax.passes import pass_outputs
from smoothing_jax.variables import classifier_paths

STRUCTURES = ("diag", "kron", "full")


def _check_structure(structure: str):
  if structure not in STRUCTURES:
    raise ValueError(f"Laplace structure {structure!r} is none of {STRUCTURES}.")


def _torch_order(features: int, classes: int) -> np.ndarray:
  """Indices into the augmented layout [C, D + 1] (the bias as feature D) that put it in
  torch's order: the kernel class-major, then the bias."""
  aug = np.arange(classes * (features + 1)).reshape(classes, features + 1)
  return np.concatenate([aug[:, :features].ravel(), aug[:, features]])


def flatten_last_layer(kernel: jax.Array, bias: jax.Array) -> jax.Array:
  """θ [P] = [Wᵀ.ravel(), b] of ``kernel`` W [D, C] and ``bias`` b [C] (torch's order)."""
  return jnp.concatenate([kernel.T.reshape(-1), bias])


def unflatten_last_layer(theta: jax.Array, features: int) -> tuple[jax.Array, jax.Array]:
  """(kernel [..., D, C], bias [..., C]) of θ [..., P] (``flatten_last_layer``'s inverse)."""
  classes = theta.shape[-1] // (features + 1)
  kernel = theta[..., :classes * features].reshape(*theta.shape[:-1], classes, features)
  return jnp.swapaxes(kernel, -1, -2), theta[..., classes * features:]


def softmax_hessian(probs: jax.Array) -> jax.Array:
  """∂²(−log softmax(f)_y)/∂f² = diag(p) − p pᵀ [B, C, C] of probabilities p [B, C]."""
  return jax.vmap(jnp.diag)(probs) - probs[:, :, None] * probs[:, None, :]


def init_curvature(structure: str, features: int, classes: int) -> dict:
  """Empty sums for ``accumulate_curvature``: the summed loss, the example count and
  "diag": Σ H_cc φ̃_i² [C, D + 1]; "full": Σ H_ck φ̃_i φ̃_j [C, D + 1, C, D + 1] (φ̃ = [φ, 1]);
  "kron": Σ φφᵀ [D, D] and Σ H [C, C]."""
  _check_structure(structure)
  sums = {"loss": jnp.zeros(()), "count": jnp.zeros(())}
  aug = features + 1
  if structure == "diag":
    sums["ggn"] = jnp.zeros((classes, aug))
  elif structure == "full":
    sums["ggn"] = jnp.zeros((classes, aug, classes, aug))
  else:
    sums["inputs"] = jnp.zeros((features, features))
    sums["outputs"] = jnp.zeros((classes, classes))
  return sums


def accumulate_curvature(state: dict, structure: str, phi: jax.Array, logits: jax.Array,
                         labels: jax.Array, mask: jax.Array | None = None) -> dict:
  """``state`` plus one batch: features φ [B, D], the last layer's logits [B, C] at θ_MAP, integer
  ``labels`` [B] and an optional ``mask`` [B] (0 for padding).  Per example the GGN of the
  cross-entropy is J_nᵀ H_n J_n with H_n = diag(p_n) − p_n p_nᵀ and J_n = [I_C ⊗ φ_nᵀ, I_C]."""
  _check_structure(structure)
  weight = jnp.ones(phi.shape[0]) if mask is None else mask.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  probs = jnp.exp(log_probs)
  nll = -jnp.take_along_axis(log_probs, labels[:, None], axis=-1)[:, 0]
  new = dict(state, loss=state["loss"] + jnp.sum(weight * nll),
             count=state["count"] + jnp.sum(weight))
  phi = phi.astype(jnp.float32)
  aug = jnp.concatenate([phi, jnp.ones_like(phi[:, :1])], axis=-1)
  if structure == "diag":
    # The diagonal only needs H_cc = p_c(1 − p_c), never the [B, C, C] Hessians.
    new["ggn"] = state["ggn"] + jnp.einsum("bc,bi->ci", weight[:, None] * probs * (1 - probs),
                                           aug ** 2)
  elif structure == "full":
    hessians = weight[:, None, None] * softmax_hessian(probs)
    new["ggn"] = state["ggn"] + jnp.einsum("bck,bi,bj->cikj", hessians, aug, aug)
  else:
    new["inputs"] = state["inputs"] + jnp.einsum("b,bi,bj->ij", weight, phi, phi)
    new["outputs"] = state["outputs"] + jnp.einsum("b,bck->ck", weight, softmax_hessian(probs))
  return new


def _eigh(matrix: jax.Array) -> tuple[jax.Array, jax.Array]:
  # laplace-torch clips the eigenvalues at 0: rounding may leave the smallest (B's is 0 exactly,
  # its eigenvector the ones) slightly negative, and log(λ_B λ_A + δ) must stay defined.
  eigvals, eigvecs = jnp.linalg.eigh(matrix)
  return jnp.maximum(eigvals, 0.0), eigvecs


def finish_curvature(state: dict, structure: str) -> dict:
  """The curvature of the whole training split from ``accumulate_curvature``'s sums: the summed
  cross-entropy ``loss`` (= −log p(D|θ_MAP)) and "diag": the GGN's diagonal [P]; "full": the GGN
  [P, P]; "kron": the eigendecompositions (``*_eigvals``, ``*_eigvecs``) of A = Σ φφᵀ / N
  ("in", [D]) and B = Σ H ("out", [C]).  laplace-torch's KFAC backend (curvlinops) normalises A
  by each batch's size and rescales it by batch / N: over the split, the mean over N."""
  _check_structure(structure)
  curvature = {"loss": state["loss"]}
  if structure == "kron":
    curvature["in_eigvals"], curvature["in_eigvecs"] = _eigh(state["inputs"] / state["count"])
    curvature["out_eigvals"], curvature["out_eigvecs"] = _eigh(state["outputs"])
    return curvature
  classes, aug = state["ggn"].shape[:2]
  order = _torch_order(aug - 1, classes)
  if structure == "diag":
    curvature["ggn"] = state["ggn"].reshape(-1)[order]
  else:
    size = classes * aug
    curvature["ggn"] = state["ggn"].reshape(size, size)[order][:, order]
  return curvature


def _prior_vector(prior_precision, num_params: int) -> jax.Array:
  """δ [P] of a scalar or per-parameter [P] prior precision ("diag" and "full")."""
  prior_precision = jnp.asarray(prior_precision, jnp.float32)
  if prior_precision.ndim == 0:
    return jnp.full((num_params,), prior_precision)
  if prior_precision.shape != (num_params,):
    raise ValueError(f"A prior precision is a scalar or [{num_params}], "
                     f"not {prior_precision.shape}.")
  return prior_precision


def _kron_prior(prior_precision) -> jax.Array:
  """δ of a scalar prior precision: "kron" adds one δ to every eigenvalue (laplace-torch's
  last-layer Kron takes no other)."""
  prior_precision = jnp.asarray(prior_precision, jnp.float32)
  if prior_precision.ndim != 0:
    raise ValueError(f"A kron prior precision is a scalar, not {prior_precision.shape}.")
  return prior_precision


def _kron_eigvals(curvature: dict, prior_precision) -> tuple[jax.Array, jax.Array]:
  """The posterior precision's eigenvalues: kernel λ_B ⊗ λ_A + δ [C, D], bias λ_B + δ [C]."""
  out = curvature["out_eigvals"]
  return jnp.outer(out, curvature["in_eigvals"]) + prior_precision, out + prior_precision


def posterior_precision(curvature: dict, structure: str, prior_precision) -> jax.Array:
  """P = GGN + diag(δ): [P] for "diag", else [P, P] (for "kron" made dense, as laplace-torch's
  ``to_matrix``: block-diag(B ⊗ A + δI, B + δI), P² numbers, for inspection)."""
  _check_structure(structure)
  if structure == "diag":
    return curvature["ggn"] + _prior_vector(prior_precision, curvature["ggn"].shape[0])
  if structure == "full":
    return curvature["ggn"] + jnp.diag(_prior_vector(prior_precision, curvature["ggn"].shape[0]))
  kernel_eigvals, bias_eigvals = _kron_eigvals(curvature, _kron_prior(prior_precision))
  q_out, q_in = curvature["out_eigvecs"], curvature["in_eigvecs"]
  q_kernel = jnp.kron(q_out, q_in)
  kernel = (q_kernel * kernel_eigvals.reshape(-1)) @ q_kernel.T
  bias = (q_out * bias_eigvals) @ q_out.T
  return jax.scipy.linalg.block_diag(kernel, bias)


def log_det_posterior_precision(curvature: dict, structure: str, prior_precision) -> jax.Array:
  """log det P from its eigenvalues ("diag", "kron") or Cholesky factor ("full": 2 Σ log L_ii),
  never a determinant (which over- or underflows float32 for a few hundred parameters)."""
  _check_structure(structure)
  if structure == "kron":
    kernel_eigvals, bias_eigvals = _kron_eigvals(curvature, _kron_prior(prior_precision))
    return jnp.sum(jnp.log(kernel_eigvals)) + jnp.sum(jnp.log(bias_eigvals))
  precision = posterior_precision(curvature, structure, prior_precision)
  if structure == "diag":
    return jnp.sum(jnp.log(precision))
  return 2.0 * jnp.sum(jnp.log(jnp.diag(jnp.linalg.cholesky(precision))))


def log_marginal_likelihood(curvature: dict, structure: str, mean: jax.Array,
                            prior_precision) -> jax.Array:
  """log p(D) ≈ log p(D|θ) − ½ (log det P − log det P₀ + θᵀ P₀ θ) at θ = ``mean`` [P] (the MAP,
  ``flatten_last_layer`` of the trained layer), prior N(0, P₀⁻¹), P₀ = diag(δ) (laplace-torch's
  ``log_marginal_likelihood(prior_precision)``)."""
  if structure == "kron":
    prior_precision = _kron_prior(prior_precision)
  prior = _prior_vector(prior_precision, mean.shape[0])
  log_det_ratio = (log_det_posterior_precision(curvature, structure, prior_precision)
                   - jnp.sum(jnp.log(prior)))
  return -curvature["loss"] - 0.5 * (log_det_ratio + jnp.sum(prior * mean ** 2))


def fit_prior_precision(curvature: dict, structure: str, mean: jax.Array,
                        init_prior_precision=1.0, num_steps: int = 100,
                        learning_rate: float = 0.1) -> jax.Array:
  """δ maximising ``log_marginal_likelihood``, as laplace-torch's
  ``optimize_prior_precision(method="marglik")`` with its defaults: Adam (β = 0.9, 0.999,
  ε = 1e-8; optax's update is torch's) on log δ from log ``init_prior_precision``, ``num_steps``
  steps of −log p(D)'s gradient.  The shape of ``init_prior_precision`` (scalar, or [P] for
  "diag" and "full") is the shape fitted."""
  optimizer = optax.adam(learning_rate)
  log_prior = jnp.log(jnp.asarray(init_prior_precision, jnp.float32))
  loss_grad = jax.grad(
      lambda log_p: -log_marginal_likelihood(curvature, structure, mean, jnp.exp(log_p)))

  def step(carry, _):
    log_p, opt_state = carry
    updates, opt_state = optimizer.update(loss_grad(log_p), opt_state)
    return (optax.apply_updates(log_p, updates), opt_state), None

  (log_prior, _), _ = jax.lax.scan(step, (log_prior, optimizer.init(log_prior)), None,
                                   length=num_steps)
  return jnp.exp(log_prior)


def _precision_to_scale_tril(precision: jax.Array) -> jax.Array:
  """The lower-triangular L with L Lᵀ = P⁻¹ (torch's ``_precision_to_scale_tril``, which
  laplace-torch's full Laplace samples with): the Cholesky factor of P with both axes reversed,
  flipped back and inverted, never forming P⁻¹."""
  flipped = jnp.linalg.cholesky(precision[::-1, ::-1])
  inv_scale = flipped[::-1, ::-1].T
  return jax.scipy.linalg.solve_triangular(inv_scale, jnp.eye(precision.shape[0]), lower=True)


def build_posterior(curvature: dict, structure: str, mean: jax.Array, prior_precision) -> dict:
  """The fitted posterior N(``mean``, P⁻¹), a dict of arrays: the ``mean`` θ [P], the
  ``prior_precision`` and "diag": the ``precision`` [P]; "full": ``scale_tril`` L [P, P]
  (L Lᵀ = P⁻¹); "kron": the factors' eigendecompositions of ``finish_curvature``."""
  _check_structure(structure)
  if structure == "kron":
    factors = {k: v for k, v in curvature.items() if k != "loss"}
    return {"mean": mean, "prior_precision": _kron_prior(prior_precision), **factors}
  posterior = {"mean": mean, "prior_precision": jnp.asarray(prior_precision, jnp.float32)}
  precision = posterior_precision(curvature, structure, prior_precision)
  if structure == "diag":
    posterior["precision"] = precision
  else:
    posterior["scale_tril"] = _precision_to_scale_tril(precision)
  return posterior


def logit_moments(posterior: dict, structure: str, phi: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The GLM predictive of the logits f = φW + b of features φ [B, D]: the mean f_MAP [B, C] and
  the covariance Σ_f = J Σ Jᵀ [B, C, C] (J = [I_C ⊗ φᵀ, I_C], Σ = P⁻¹; diagonal for "diag")."""
  _check_structure(structure)
  phi = phi.astype(jnp.float32)
  features = phi.shape[-1]
  kernel, bias = unflatten_last_layer(posterior["mean"], features)
  mean = phi @ kernel + bias
  classes = bias.shape[-1]
  if structure == "diag":
    variance = 1.0 / posterior["precision"]
    f_var = phi ** 2 @ variance[:classes * features].reshape(classes, features).T
    return mean, jax.vmap(jnp.diag)(f_var + variance[classes * features:])
  if structure == "full":
    # J L [B, C, P] with L Lᵀ = Σ: Σ_f = (J L)(J L)ᵀ, positive semi-definite by construction.
    scale = posterior["scale_tril"]
    jac_scale = (jnp.einsum("bd,cdp->bcp", phi,
                            scale[:classes * features].reshape(classes, features, -1))
                 + scale[classes * features:])
    return mean, jnp.einsum("bcp,bkp->bck", jac_scale, jac_scale)
  # Σ_kernel = (Q_B ⊗ Q_A) (λ_B ⊗ λ_A + δ)⁻¹ (Q_B ⊗ Q_A)ᵀ and J_c = e_cᵀ ⊗ φᵀ:
  # Σ_f[c, c'] = Σ_k Q_B[c, k] Q_B[c', k] Σ_j (φᵀ Q_A)_j² / (λ_B,k λ_A,j + δ), plus the bias's.
  kernel_eigvals, bias_eigvals = _kron_eigvals(posterior, posterior["prior_precision"])
  projected = (phi @ posterior["in_eigvecs"]) ** 2
  per_eigvec = projected @ (1.0 / kernel_eigvals).T + 1.0 / bias_eigvals
  q_out = posterior["out_eigvecs"]
  return mean, jnp.einsum("ck,bk,lk->bcl", q_out, per_eigvec, q_out)


def probit_predictive(mean: jax.Array, cov: jax.Array) -> jax.Array:
  """The probit ("closed form") approximation of E[softmax(f)], f ~ N(``mean`` [B, C], ``cov``
  [B, C, C]): softmax(f / √(1 + π/8 · diag Σ_f)) [B, C], laplace-torch's
  ``link_approx="probit"``."""
  variance = jnp.diagonal(cov, axis1=-2, axis2=-1)
  return jax.nn.softmax(mean / jnp.sqrt(1.0 + jnp.pi / 8.0 * variance), axis=-1)


def sample_parameters(posterior: dict, structure: str, noise: jax.Array) -> jax.Array:
  """Posterior samples θ = θ_MAP + S z [N, P] of standard-normal ``noise`` z [N, P], S as
  laplace-torch's ``sample``: P^-½ ("diag"), lower-triangular with S Sᵀ = P⁻¹ ("full"),
  symmetric P^-½ = (Q_B ⊗ Q_A)(λ_B ⊗ λ_A + δ)^-½ (Q_B ⊗ Q_A)ᵀ per block ("kron")."""
  _check_structure(structure)
  mean = posterior["mean"]
  if structure == "diag":
    return mean + noise * jax.lax.rsqrt(posterior["precision"])
  if structure == "full":
    return mean + noise @ posterior["scale_tril"].T
  q_out, q_in = posterior["out_eigvecs"], posterior["in_eigvecs"]
  classes, features = q_out.shape[0], q_in.shape[0]
  kernel_eigvals, bias_eigvals = _kron_eigvals(posterior, posterior["prior_precision"])
  # (Q_B ⊗ Q_A) vec(Z) = vec(Q_B Z Q_Aᵀ) for Z [C, D] in the kernel's class-major order.
  kernel = noise[:, :classes * features].reshape(-1, classes, features)
  kernel = q_out @ ((q_out.T @ kernel @ q_in) * jax.lax.rsqrt(kernel_eigvals)) @ q_in.T
  bias = ((noise[:, classes * features:] @ q_out) * jax.lax.rsqrt(bias_eigvals)) @ q_out.T
  return mean + jnp.concatenate([kernel.reshape(noise.shape[0], -1), bias], axis=-1)


def sample_logits(posterior: dict, structure: str, phi: jax.Array,
                  noise: jax.Array) -> jax.Array:
  """Logits [N, B, C] of features φ [B, D] under the last layers ``sample_parameters`` draws
  from standard-normal ``noise`` [N, P] (the MC predictive averages their softmax)."""
  kernels, biases = unflatten_last_layer(sample_parameters(posterior, structure, noise),
                                         phi.shape[-1])
  return jnp.einsum("bd,ndc->nbc", phi.astype(jnp.float32), kernels) + biases[:, None, :]


# --- The method: a post-hoc fit of a trained deterministic network (or of each member of a
# deep ensemble: a Laplace ensemble), and its predictive.

@dataclasses.dataclass(frozen=True)
class LastLayerLaplace(Method):
  """Last-layer Laplace on a trained deterministic network: ``fit`` builds the posterior of the
  classifier's last layer over the training split (``config.laplace``: its structure, and the
  prior precision fitted by marginal likelihood where ``prior_precision`` is 0); the predictive
  is the probit approximation (N = 1) or N Monte-Carlo samples of the last layer."""
  name = "laplace"
  settings = {
      "structure": "kron",  # "diag", "kron" (KFAC) or "full" GGN of the last layer
      "prior_precision": 0.0,  # δ (0: fitted by marginal likelihood, laplace-torch's marglik)
      "predictive": "probit",  # or "mc": N samples of the last layer
  }
  structure: str = "kron"
  prior_precision: float = 0.0
  predictive: str = "probit"

  @classmethod
  def refuses(cls, model) -> str | None:
    if is_segmentation_model(model):
      return "it fits a classifier's last dense layer, and a segmentation model has none"
    built_for = implied_method(model)
    if built_for == "deterministic":
      return None
    return (f"it fits the last layer of a deterministic network, and this one is built for "
            f"{built_for}")

  @classmethod
  def from_config(cls, config, model) -> LastLayerLaplace:
    return cls(model, chunk_size=setting(config, "eval_chunk_size"),
               **vars(cls.settings_in(config)))

  def describe(self) -> str:
    prior = "marglik" if self.prior_precision == 0 else f"prior {self.prior_precision:g}"
    return f"{self.name} ({self.structure}, {prior}, {self.predictive})"

  def check(self, config) -> LastLayerLaplace:
    _check_structure(self.structure)
    if self.predictive not in ("probit", "mc"):
      raise ValueError(f"laplace.predictive must be 'probit' or 'mc', got {self.predictive!r}.")
    if self.prior_precision < 0:
      raise ValueError(f"laplace.prior_precision must be >= 0 (0: fitted), got "
                       f"{self.prior_precision!r}.")
    return self

  # The post-hoc stage.
  @property
  def fit_name(self) -> str:
    prior = "marglik" if self.prior_precision == 0 else f"prior{self.prior_precision:g}"
    return f"{self.name}_{self.structure}_{prior}"

  def fit(self, variables, batches) -> dict:
    """``{"laplace": posterior}`` (:func:`build_posterior`) of the last layer at the trained
    weights, its curvature summed over ``batches()`` (padding masked)."""
    kernel, bias = last_layer(self.model, variables["params"])
    state = init_curvature(self.structure, kernel.shape[0], kernel.shape[1])
    for batch in batches():
      state = _accumulate(self.model, self.structure, state, variables, batch)
    mean = flatten_last_layer(kernel, bias)
    return {self.name: _posterior(state, self.structure, mean, self.prior_precision,
                                  fit_prior=self.prior_precision == 0)}

  # The predictive.
  @property
  def stochastic(self) -> bool:
    return self.predictive == "mc"

  @property
  def num_draws(self) -> int:
    return self.num_samples if self.stochastic else 1

  def with_samples(self, num_samples: int) -> LastLayerLaplace:
    if not self.stochastic:
      return self
    return dataclasses.replace(self, num_samples=check_num_samples(num_samples))

  def nested(self, requested=()) -> tuple:
    if not self.stochastic:
      return self, (1,)
    return nested_samples(self, requested)

  def _logits(self, variables, images, rng):
    """``(logits [N, B, C], features [N, B, D])`` of ``images`` ``[B, H, W, 3]`` (or
    ``[N, B, H, W, 3]``, draw n on ``images[n]``): the probit-scaled mean logits (N = 1, whose
    softmax is the probit predictive) or N sampled last layers' (noise from ``rng``)."""
    if self.name not in variables:
      raise ValueError("These variables hold no Laplace posterior: fit it first (--mode=fit "
                       "--config.method=laplace).")
    posterior = variables[self.name]
    features = lambda x: pass_outputs(self.model, variables, x)["features"]  # noqa: E731
    phi = jax.vmap(features)(images) if images.ndim == 5 else features(images)[None]
    if self.predictive == "probit":
      mean, cov = logit_moments(posterior, self.structure, phi[0])
      variance = jnp.diagonal(cov, axis1=-2, axis2=-1)
      return (mean / jnp.sqrt(1.0 + jnp.pi / 8.0 * variance))[None], phi[:1]
    noise = jax.random.normal(rng, (self.num_samples, posterior["mean"].shape[0]))
    if phi.shape[0] == 1:
      return sample_logits(posterior, self.structure, phi[0], noise), jnp.broadcast_to(
          phi, (self.num_samples,) + phi.shape[1:])
    logits = jax.vmap(lambda p, z: sample_logits(posterior, self.structure, p, z[None])[0])(
        phi, noise)
    return logits, phi

  def sample_log_probs(self, variables, images, rng):
    return jax.nn.log_softmax(self._logits(variables, images, rng)[0], axis=-1)

  def sample_outputs(self, variables, images, rng):
    logits, phi = self._logits(variables, images, rng)
    return {"logits": logits, "features": phi}

  def for_training_eval(self) -> Method:
    """The training's evaluation scores the network being trained (no posterior yet)."""
    return Deterministic(self.model)

  def frame_probs(self, variables, frame, rng):
    return jnp.exp(self.sample_log_probs(variables, frame, rng)[0])


def last_layer(model, params) -> tuple[jax.Array, jax.Array]:
  """``(kernel [D, C], bias [C])`` of ``model``'s output layer (``variables.classifier_paths``:
  the parameters whose shapes follow the class count)."""
  paths = [p for p in classifier_paths(model) if p[0] == "params"]
  flat = flatten_dict(params)
  leaves = {p[-1]: flat[p[1:]] for p in paths}
  if set(leaves) != {"kernel", "bias"} or leaves["kernel"].ndim != 2:
    raise ValueError(f"{type(model).__name__}: last-layer Laplace needs an output layer that is "
                     f"one dense layer with a bias; its class-sized parameters are {paths}.")
  return leaves["kernel"], leaves["bias"]


@functools.partial(jax.jit, static_argnames=("structure", "fit_prior"))
def _posterior(state: dict, structure: str, mean: jax.Array, prior_precision, fit_prior: bool):
  """``build_posterior`` from ``accumulate_curvature``'s sums, the prior precision fitted by
  marginal likelihood where ``fit_prior``: one program per structure, compiled once (run eagerly,
  the fit's scan of Adam steps compiled again at every fit)."""
  curvature = finish_curvature(state, structure)
  if fit_prior:
    prior_precision = fit_prior_precision(curvature, structure, mean)
  return build_posterior(curvature, structure, mean, prior_precision)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _accumulate(model, structure, state, variables, batch):
  """``accumulate_curvature`` of one batch's features and logits (compiled once per model and
  structure: every fit reuses it)."""
  outputs = pass_outputs(model, variables, batch["image"])
  return accumulate_curvature(state, structure, outputs["features"], outputs["logits"],
                              batch["label"], batch["mask"])
