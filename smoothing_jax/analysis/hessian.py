"""Hessian analysis without materialising the Hessian: HVPs, power iteration, SLQ density, trace.

``loss_fn`` maps a parameter pytree to a scalar with everything else held fixed
(BatchNorm in inference mode, fixed dropout/augmentation keys, a fixed batch),
so the Hessian H = ∇²L(θ) is a fixed symmetric operator.  ``hvp`` is
forward-over-reverse: ``jvp(grad(L), θ, v)``.  Defaults follow PyHessian
(Yao et al. 2020): 100 power iterations, relative tolerance 1e-3, deflation by
orthogonalisation against the eigenvectors already found.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.tree_util import Partial


def as_pytree(loss_fn) -> Partial:
  """``loss_fn`` as a ``jax.tree_util.Partial``: a jit argument whose bound arrays (e.g. the batch)
  are traced, so a new batch with the same function reuses the compiled code."""
  return loss_fn if isinstance(loss_fn, Partial) else Partial(loss_fn)


@jax.jit
def _hvp(loss_fn, params, vector):
  return jax.jvp(jax.grad(loss_fn), (params,), (vector,))[1]


def hvp(loss_fn: Callable, params, vector):
  """Hessian-vector product ``∇²L(params) · vector`` (pytrees of the same structure), jitted.

  Forward-over-reverse: ``jax.jvp`` of ``jax.grad(loss_fn)``; memory of about two gradients.
  """
  return _hvp(as_pytree(loss_fn), params, vector)


def _flat_hvp(loss_fn, params):
  """``v ↦ H v`` on the flattened parameter vector."""
  _, unravel = ravel_pytree(params)
  return lambda v: ravel_pytree(jax.jvp(jax.grad(loss_fn), (params,), (unravel(v),))[1])[0]


def _normalize(v):
  return v / (jnp.linalg.norm(v) + 1e-12)


@jax.jit
def _power_step(loss_fn, params, v, basis, shift):
  """One power-iteration step on ``H − shift·I`` deflated by the rows of ``basis`` (zero rows:
  no-op).

  Returns the Rayleigh quotient of the deflated unit vector and the normalised image.
  """
  matvec = _flat_hvp(loss_fn, params)
  v = _normalize(v - basis.T @ (basis @ v))
  hv = matvec(v) - shift * v
  return jnp.vdot(hv, v), _normalize(hv)


def _power_iteration(loss_fn, params, v0, basis, shift, tol, max_iters):
  """Largest-magnitude eigenpair of the deflated, shifted Hessian (PyHessian's stopping rule).

  A Python loop over a jitted step: XLA runs convolutions inside ``lax.while_loop``
  bodies markedly slower on CPU, and one scalar per step is a negligible sync.
  """
  v, eigenvalue = v0, None
  for iteration in range(1, max_iters + 1):
    new, v = _power_step(loss_fn, params, v, basis, shift)
    new = float(new)
    if eigenvalue is not None and abs(new - eigenvalue) / (abs(eigenvalue) + 1e-6) < tol:
      eigenvalue = new
      break
    eigenvalue = new
  v = _normalize(v - basis.T @ (basis @ v))
  return jnp.asarray(eigenvalue, v0.dtype), v, iteration


class Eigenpairs(tuple):
  """``(eigenvalues [k], eigenvectors: list of k parameter pytrees)``, plus ``.iterations [k]``."""

  def __new__(cls, eigenvalues, eigenvectors, iterations):
    self = super().__new__(cls, (eigenvalues, eigenvectors))
    self.iterations = iterations
    return self

  @property
  def eigenvalues(self):
    return self[0]

  @property
  def eigenvectors(self):
    return self[1]


def _check_args(k, max_iters, tol):
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a positive integer, got {k!r}.")
  if not isinstance(max_iters, int) or max_iters < 1:
    raise ValueError(f"max_iters must be a positive integer, got {max_iters!r}.")
  if not tol > 0:
    raise ValueError(f"tol must be > 0, got {tol!r}.")


def top_eigenvalues(loss_fn: Callable, params, k: int = 1, max_iters: int = 100, tol: float = 1e-3,
                    rng: Optional[jax.Array] = None) -> Eigenpairs:
  """The ``k`` largest-magnitude Hessian eigenvalues by power iteration with deflation (PyHessian).

  Returns ``(eigenvalues [k], eigenvectors)`` (an :class:`Eigenpairs`; ``.iterations``
  gives the power iterations each eigenvalue took).  Eigenvectors are unit-norm
  pytrees shaped like ``params``.
  """
  _check_args(k, max_iters, tol)
  loss_fn = as_pytree(loss_fn)
  flat, unravel = ravel_pytree(params)
  rng = jax.random.key(0) if rng is None else rng
  basis = jnp.zeros((k, flat.shape[0]), flat.dtype)
  eigenvalues, iterations = [], []
  for i, key in enumerate(jax.random.split(rng, k)):
    v0 = jax.random.normal(key, flat.shape, flat.dtype)
    eigenvalue, vector, its = _power_iteration(loss_fn, params, v0, basis, 0.0, tol, max_iters)
    basis = basis.at[i].set(vector)
    eigenvalues.append(eigenvalue)
    iterations.append(its)
  return Eigenpairs(jnp.stack(eigenvalues), [unravel(v) for v in basis], jnp.stack(iterations))


def min_eigenvalue(loss_fn: Callable, params, max_iters: int = 100, tol: float = 1e-3,
                   rng: Optional[jax.Array] = None, top: Optional[float] = None):
  """The most negative (smallest) Hessian eigenvalue: power iteration on ``H − |λ_top|·I``.

  The shifted spectrum lies in ``[λ_min − |λ_top|, 0]``, so its largest-magnitude
  eigenvalue is ``λ_min − |λ_top|``.  ``top`` reuses a known top eigenvalue.
  Returns ``(λ_min, eigenvector pytree)``.
  """
  _check_args(1, max_iters, tol)
  loss_fn = as_pytree(loss_fn)
  rng = jax.random.key(0) if rng is None else rng
  top_key, key = jax.random.split(rng)
  if top is None:
    top = float(top_eigenvalues(loss_fn, params, 1, max_iters, tol, top_key).eigenvalues[0])
  flat, unravel = ravel_pytree(params)
  shift = abs(top)
  shifted, vector, _ = _power_iteration(loss_fn, params,
                                        jax.random.normal(key, flat.shape, flat.dtype),
                                        jnp.zeros((1, flat.shape[0]), flat.dtype), shift, tol,
                                        max_iters)
  return shifted + shift, unravel(vector)


@jax.jit
def _hutchinson_probe(loss_fn, params, key):
  flat, _ = ravel_pytree(params)
  v = jax.random.rademacher(key, flat.shape, flat.dtype)
  return jnp.vdot(v, _flat_hvp(loss_fn, params)(v))


def hessian_trace(loss_fn: Callable,
                  params,
                  num_samples: int = 100,
                  rng: Optional[jax.Array] = None):
  """Hutchinson's estimator tr(H) ≈ mean_i vᵢᵀ H vᵢ with Rademacher vᵢ; returns
  ``(mean, samples)``."""
  loss_fn = as_pytree(loss_fn)
  keys = jax.random.split(jax.random.key(0) if rng is None else rng, num_samples)
  samples = jnp.stack([_hutchinson_probe(loss_fn, params, key) for key in keys])
  return jnp.mean(samples), samples


@jax.jit
def _lanczos_step(loss_fn, params, basis, i, v, v_prev, beta_prev):
  """One Lanczos step with full reorthogonalisation against the rows of ``basis`` (zero rows:
  no-op)."""
  basis = basis.at[i].set(v)
  w = _flat_hvp(loss_fn, params)(v) - beta_prev * v_prev
  alpha = jnp.vdot(w, v)
  w = w - alpha * v
  w = w - basis.T @ (basis @ w)
  beta = jnp.linalg.norm(w)
  return basis, w / (beta + 1e-12), alpha, beta


def _lanczos(loss_fn, params, v0, num_iters):
  """Lanczos tridiagonalisation; returns (alphas [m], betas [m-1]) as numpy arrays."""
  basis = jnp.zeros((num_iters, v0.shape[0]), v0.dtype)
  v, v_prev, beta = _normalize(v0), jnp.zeros_like(v0), jnp.zeros((), v0.dtype)
  alphas, betas = [], []
  for i in range(num_iters):
    basis, v_next, alpha, beta = _lanczos_step(loss_fn, params, basis, i, v, v_prev, beta)
    v_prev, v = v, v_next
    alphas.append(alpha)
    betas.append(beta)
  return np.asarray(jnp.stack(alphas), np.float64), np.asarray(jnp.stack(betas[:-1]), np.float64)


class SpectralDensity(NamedTuple):
  """Gauss quadrature of the eigenvalue density: ``nodes`` / ``weights``
  ``[num_runs, num_iters]``."""
  nodes: np.ndarray
  weights: np.ndarray

  def on_grid(self, grid_size: int = 10000, sigma_squared: float = 1e-5, margin: float = 0.01):
    """Gaussian-smoothed density on a grid covering all nodes; integrates to 1 (PyHessian's
    estimate)."""
    lo, hi = float(self.nodes.min()), float(self.nodes.max())
    pad = margin * max(hi - lo, 1e-12) + 3 * np.sqrt(sigma_squared)
    grid = np.linspace(lo - pad, hi + pad, grid_size)
    kernel = np.exp(-(grid[None, None, :] - self.nodes[..., None]) ** 2 / (2 * sigma_squared))
    kernel /= np.sqrt(2 * np.pi * sigma_squared)
    density = np.mean(np.sum(self.weights[..., None] * kernel, axis=1), axis=0)
    return grid, density / (np.sum(density) * (grid[1] - grid[0]))


def eigenvalue_density(loss_fn: Callable, params, num_iters: int = 100, num_runs: int = 1,
                       rng: Optional[jax.Array] = None) -> SpectralDensity:
  """Stochastic Lanczos quadrature (Ghorbani et al. 2019): ``num_runs`` Lanczos runs of
  ``num_iters`` steps.

  Each run's tridiagonal matrix T has eigenvalues θ_j (nodes) and eigenvectors
  whose first components squared are the quadrature weights (they sum to 1).
  """
  loss_fn = as_pytree(loss_fn)
  flat, _ = ravel_pytree(params)
  num_iters = min(num_iters, flat.shape[0])
  nodes, weights = [], []
  for key in jax.random.split(jax.random.key(0) if rng is None else rng, num_runs):
    alphas, betas = _lanczos(loss_fn, params, jax.random.rademacher(key, flat.shape, flat.dtype),
                             num_iters)
    tridiagonal = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
    theta, vectors = np.linalg.eigh(tridiagonal)
    nodes.append(theta)
    weights.append(vectors[0] ** 2)
  return SpectralDensity(np.stack(nodes), np.stack(weights))
