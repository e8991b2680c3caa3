"""Hessian analysis without materialising the Hessian: HVPs, top eigenpairs, SLQ density, trace.

``loss_fn`` maps a parameter pytree to a scalar with everything else held fixed
(BatchNorm in inference mode, fixed dropout/augmentation keys, a fixed batch),
so the Hessian H = ∇²L(θ) is a fixed symmetric operator.  ``hvp`` is
forward-over-reverse: ``jvp(grad(L), θ, v)``.  Iterative methods linearise
``grad(L)`` at θ once (``linearized_hvp``) and then apply only the tangent part,
like PyHessian keeps the gradient's graph; each iteration (HVP, orthogonalisation,
norms) is one jitted call.

Two eigensolvers (``method``):

* ``"lanczos"`` (default): Lanczos with full reorthogonalisation; the wanted Ritz
  pairs (θ, y) stop when their residual ‖Hy − θy‖ ≤ tol·|θ|.
* ``"power"``: PyHessian's (Yao et al. 2020) power iteration with deflation,
  stopping when the eigenvalue changes by less than ``tol`` relative.  On a
  crowded spectrum (near-equal |λ| at the top) that rule stops early at an
  unconverged value; the reported residuals show it.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.tree_util import Partial

METHODS = ("lanczos", "power")
_BLOCK = 8  # rows per reorthogonalisation block; the Lanczos basis is padded to a multiple


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


@jax.jit
def _linearize(loss_fn, params):
  return jax.linearize(jax.grad(loss_fn), params)[1]


def linearized_hvp(loss_fn: Callable, params) -> Partial:
  """``v ↦ ∇²L(params)·v`` for parameter pytrees ``v``, with ``grad(L)`` linearised once.

  The forward and backward pass at ``params`` run here; each application then runs
  only their tangents (~0.7× the cost of ``hvp`` on a ResNet), at the memory of
  the stored activations.  The result is a ``Partial`` of arrays: pass it to jitted
  functions; the same ``loss_fn`` on a new batch of the same shape reuses their
  compiled code.
  """
  return _linearize(as_pytree(loss_fn), params)


def _flat_matvec(linear, params):
  """``v ↦ H v`` on the flattened parameter vector."""
  _, unravel = ravel_pytree(params)
  return lambda v: ravel_pytree(linear(unravel(v)))[0]


def _normalize(v):
  return v / (jnp.linalg.norm(v) + 1e-30)


class Eigenpairs(tuple):
  """``(eigenvalues, eigenvectors)`` with the solver's record as attributes.

  ``eigenvalues`` [k] (a scalar from :func:`min_eigenvalue`), ``eigenvectors`` a list
  of k unit-norm parameter pytrees (one pytree from :func:`min_eigenvalue`);
  ``residuals`` ‖Hv − λv‖ per pair, ``relative_residuals`` the same over |λ|;
  ``iterations`` the iterations behind each pair (power: its own loop; Lanczos: the
  shared Krylov dimension); ``hvps`` the Hessian-vector products used in total;
  ``method`` the solver.
  """

  def __new__(cls, eigenvalues, eigenvectors, *, iterations, residuals, hvps, method):
    self = super().__new__(cls, (eigenvalues, eigenvectors))
    self.iterations, self.residuals, self.hvps, self.method = iterations, residuals, hvps, method
    return self

  @property
  def eigenvalues(self):
    return self[0]

  @property
  def eigenvectors(self):
    return self[1]

  @property
  def relative_residuals(self):
    return np.asarray(self.residuals) / np.maximum(np.abs(np.asarray(self.eigenvalues)), 1e-30)


def _check_args(k, max_iters, tol, method):
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a positive integer, got {k!r}.")
  if not isinstance(max_iters, int) or max_iters < 1:
    raise ValueError(f"max_iters must be a positive integer, got {max_iters!r}.")
  if not tol > 0:
    raise ValueError(f"tol must be > 0, got {tol!r}.")
  if method not in METHODS:
    raise ValueError(f"Unknown eigensolver method {method!r}; choose one of {METHODS}.")


# --- power iteration (PyHessian) -------------------------------------------------------------


@jax.jit
def _power_step(linear, params, v, basis, shift):
  """One power-iteration step on ``H − shift·I`` with the iterate deflated by the rows of
  ``basis`` (zero rows: no-op).

  Returns the Rayleigh quotient λ of the deflated unit iterate v, the residual
  ‖Hv − (λ + shift)v‖, v itself and the next iterate (H − shift·I)v / ‖·‖.
  """
  v = _normalize(v - basis.T @ (basis @ v))
  hv = _flat_matvec(linear, params)(v) - shift * v
  rayleigh = jnp.vdot(hv, v)
  return rayleigh, jnp.linalg.norm(hv - rayleigh * v), v, _normalize(hv)


def _power_iteration(linear, params, v0, basis, shift, tol, max_iters):
  """Largest-magnitude eigenpair of the deflated, shifted Hessian (PyHessian's stopping rule).

  A Python loop over a jitted step: XLA runs convolutions inside ``lax.while_loop``
  bodies markedly slower on CPU, and one scalar per step is a negligible sync.
  Returns ``(λ of H − shift·I, residual, unit vector, iterations)``.
  """
  nxt, eigenvalue = v0, None
  for iteration in range(1, max_iters + 1):
    new, residual, vector, nxt = _power_step(linear, params, nxt, basis, shift)
    new = float(new)
    converged = (eigenvalue is not None
                 and abs(new - eigenvalue) / (abs(eigenvalue) + 1e-6) < tol)
    eigenvalue = new
    if converged:
      break
  return eigenvalue, float(residual), vector, iteration


def _power_top(linear, params, flat, k, max_iters, tol, rng):
  basis = jnp.zeros((k, flat.shape[0]), flat.dtype)
  eigenvalues, residuals, iterations = [], [], []
  for i, key in enumerate(jax.random.split(rng, k)):
    v0 = jax.random.normal(key, flat.shape, flat.dtype)
    eigenvalue, residual, vector, its = _power_iteration(linear, params, v0, basis, 0.0, tol,
                                                         max_iters)
    basis = basis.at[i].set(vector)
    eigenvalues.append(eigenvalue)
    residuals.append(residual)
    iterations.append(its)
  return np.asarray(eigenvalues), basis, np.asarray(residuals), np.asarray(iterations)


# --- Lanczos with full reorthogonalisation ---------------------------------------------------


@functools.partial(jax.jit, donate_argnames="basis")
def _lanczos_step(linear, params, basis, i, beta_prev):
  """Lanczos step i: rows 0..i of ``basis`` hold the orthonormal vectors v₀..vᵢ (the rest zero).

  w = H vᵢ − β_{i−1} v_{i−1} − αᵢ vᵢ, then one classical Gram–Schmidt pass against
  all of v₀..vᵢ (full reorthogonalisation, in blocks of 8 rows so only the filled
  part of the basis is read); v_{i+1} = w / βᵢ goes to row i + 1.
  Returns ``(basis, αᵢ, βᵢ)``.
  """
  v, v_prev = basis[i], basis[jnp.maximum(i - 1, 0)]
  w = _flat_matvec(linear, params)(v) - beta_prev * v_prev
  alpha = jnp.vdot(w, v)
  w = w - alpha * v

  def orthogonalize(b, w):
    block = jax.lax.dynamic_slice_in_dim(basis, b * _BLOCK, _BLOCK)
    return w - block.T @ (block @ w)

  w = jax.lax.fori_loop(0, i // _BLOCK + 1, orthogonalize, w)
  beta = jnp.linalg.norm(w)
  return basis.at[i + 1].set(w / (beta + 1e-30)), alpha, beta


@jax.jit
def _fresh_direction(basis, i, key):
  """Row i ← a random unit vector orthogonal to rows 0..i−1 (after a Lanczos breakdown)."""
  w = jax.random.normal(key, basis.shape[1:], basis.dtype)
  for _ in range(2):  # twice is enough
    w = w - basis.T @ (basis @ w)
  return basis.at[i].set(_normalize(w))


@jax.jit
def _ritz_vectors(basis, coefficients):
  """``coefficients [r, capacity] @ basis [capacity, n]``: Ritz vectors as rows."""
  return coefficients @ basis


def _tridiagonal(alphas, betas):
  return np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)


def _lanczos(linear, params, v0, num_iters, select=None, want=0, tol=None, rng=None):
  """Up to ``num_iters`` Lanczos steps from ``v0``; stops early once there are ``want`` Ritz
  pairs and every pair ``select(θ)`` picks has ‖Hy − θy‖ = |βₘ sₘⱼ| ≤ tol·|θ| (the Lanczos
  residual, exact up to rounding with full reorthogonalisation).

  Returns ``(alphas [m], betas [m], basis)`` as float64 numpy arrays and the device basis
  whose first m rows are the Lanczos vectors.
  """
  n = v0.shape[0]
  num_iters = min(num_iters, n)
  capacity = -(-(num_iters + 1) // _BLOCK) * _BLOCK
  basis = jnp.zeros((capacity, n), v0.dtype).at[0].set(_normalize(v0))
  alphas, betas, beta = [], [], jnp.zeros((), v0.dtype)
  for m in range(1, num_iters + 1):
    basis, alpha, beta = _lanczos_step(linear, params, basis, m - 1, beta)
    if select is None:
      alphas.append(alpha)
      betas.append(beta)
      continue
    alphas.append(float(alpha))
    betas.append(float(beta))
    theta, vectors = np.linalg.eigh(_tridiagonal(np.asarray(alphas), np.asarray(betas[:-1])))
    wanted = select(theta)
    if m == n:
      break
    if betas[-1] <= 1e-6 * np.max(np.abs(theta)):  # an invariant subspace: exact Ritz pairs
      if m >= want:
        break
      betas[-1] = 0.0  # too few pairs yet: go on in a fresh orthogonal direction
      beta = jnp.zeros((), v0.dtype)
      rng, key = jax.random.split(rng)
      basis = _fresh_direction(basis, m, key)
      continue
    residuals = np.abs(betas[-1] * vectors[-1, wanted])
    if m >= want and np.all(residuals <= tol * np.abs(theta[wanted])):
      break
  return (np.asarray(alphas, np.float64), np.asarray(betas, np.float64), basis)


def _lanczos_pairs(linear, params, flat, select, want, max_iters, tol, rng):
  """Ritz pairs picked by ``select`` → ``(θ [r], vectors [r, n], residuals [r], m)``."""
  start_key, restart_key = jax.random.split(rng)
  v0 = jax.random.normal(start_key, flat.shape, flat.dtype)
  alphas, betas, basis = _lanczos(linear, params, v0, max_iters, select, want, tol, restart_key)
  m = len(alphas)
  theta, vectors = np.linalg.eigh(_tridiagonal(alphas, betas[:-1]))
  wanted = select(theta)
  coefficients = np.zeros((len(wanted), basis.shape[0]), np.float32)
  coefficients[:, :m] = vectors[:, wanted].T
  ritz = _ritz_vectors(basis, jnp.asarray(coefficients)).astype(flat.dtype)
  residuals = np.abs(betas[-1] * vectors[-1, wanted])
  return theta[wanted], ritz, residuals, m


def _largest_magnitude(k):
  return lambda theta: np.argsort(-np.abs(theta), kind="stable")[:k]


def _smallest(theta):
  return np.argsort(theta, kind="stable")[:1]


# --- public eigensolvers ---------------------------------------------------------------------


def _eigenpairs(values, vectors, unravel, dtype, **record):
  return Eigenpairs(jnp.asarray(values, dtype), [unravel(v) for v in vectors], **record)


def top_eigenvalues(loss_fn: Callable, params, k: int = 1, max_iters: int = 100, tol: float = 1e-3,
                    rng: Optional[jax.Array] = None, method: str = "lanczos") -> Eigenpairs:
  """The ``k`` largest-magnitude Hessian eigenpairs, in decreasing |λ|.

  ``method="lanczos"``: at most ``max_iters`` Lanczos steps (HVPs), stopping when each
  of the k Ritz pairs has ‖Hv − λv‖ ≤ tol·|λ|; memory of max_iters + 1 parameter
  vectors.  ``method="power"``: PyHessian's ``eigenvalues(maxIter=max_iters, tol=tol,
  top_n=k)``, up to ``max_iters`` HVPs per eigenvalue.  Returns an :class:`Eigenpairs`
  ``(eigenvalues [k], eigenvectors)``; its ``residuals`` say how far each pair is from
  converged, whichever rule stopped it.
  """
  return top_and_min_eigenvalues(loss_fn, params, k, max_iters, tol, rng, method,
                                 negative=False)[0]


def min_eigenvalue(loss_fn: Callable, params, max_iters: int = 100, tol: float = 1e-3,
                   rng: Optional[jax.Array] = None, top: Optional[float] = None,
                   method: str = "lanczos") -> Eigenpairs:
  """The most negative (smallest) Hessian eigenvalue and its eigenvector.

  ``method="lanczos"``: Lanczos until the smallest Ritz pair has ‖Hv − λv‖ ≤ tol·|λ|.
  ``method="power"``: after the top eigenvalue λ₁ (``top`` reuses a known one), power
  iteration on ``H − |λ₁|·I``, whose spectrum lies in ``[λ_min − |λ₁|, 0]``, so its
  largest-magnitude eigenvalue is ``λ_min − |λ₁|``.  Returns an :class:`Eigenpairs` of
  a scalar and one pytree, ``(λ_min, eigenvector)``.
  """
  low = top_and_min_eigenvalues(loss_fn, params, 1, max_iters, tol, rng, method, top=False,
                                known_top=top)[1]
  return Eigenpairs(low.eigenvalues[0], low.eigenvectors[0], iterations=int(low.iterations[0]),
                    residuals=float(low.residuals[0]), hvps=low.hvps, method=method)


def top_and_min_eigenvalues(loss_fn: Callable, params, k: int = 1, max_iters: int = 100,
                            tol: float = 1e-3, rng: Optional[jax.Array] = None,
                            method: str = "lanczos", *, top: bool = True, negative: bool = True,
                            known_top: Optional[float] = None):
  """``(top-k eigenpairs, [λ_min] eigenpair)`` (either ``None`` when not asked for).

  With Lanczos both come from one Krylov space (its extremes converge together), so
  the most negative eigenvalue costs few HVPs beyond the top k; ``hvps`` of each is
  the shared count.  With power iteration, the minimum is a second run on
  ``H − |λ₁|·I`` (which converges at the rate (|λ₁| + λ_min)/(|λ₁| + λ_next) and is
  slow when |λ_min| ≪ λ₁); ``known_top`` skips the top run when only the minimum is asked for.
  """
  _check_args(k, max_iters, tol, method)
  flat, unravel = ravel_pytree(params)
  if k > flat.shape[0]:
    raise ValueError(f"k={k} exceeds the number of parameters ({flat.shape[0]}).")
  rng = jax.random.key(0) if rng is None else rng
  top_key, min_key = jax.random.split(rng)
  linear = linearized_hvp(loss_fn, params)
  record = functools.partial(_eigenpairs, unravel=unravel, dtype=flat.dtype, method=method)
  if method == "lanczos":
    largest, smallest = _largest_magnitude(k), _smallest
    select = lambda theta: np.unique(  # noqa: E731
        np.concatenate([largest(theta) if top else [], smallest(theta) if negative else []])
    ).astype(int)
    values, vectors, residuals, m = _lanczos_pairs(linear, params, flat, select,
                                                   (k if top else 0) + negative, max_iters,
                                                   tol, top_key)
    pick = lambda i: record(values[i], vectors[i], iterations=np.full(len(i), m),  # noqa: E731
                            residuals=residuals[i], hvps=m)
    return (pick(largest(values)) if top else None,
            pick(smallest(values)) if negative else None)
  top_pairs, hvps = None, 0
  if top or known_top is None:
    values, vectors, residuals, iterations = _power_top(linear, params, flat, k, max_iters, tol,
                                                        top_key)
    top_pairs = record(values, vectors, iterations=iterations, residuals=residuals,
                       hvps=int(iterations.sum()))
    known_top, hvps = float(values[0]), top_pairs.hvps
  if not negative:
    return top_pairs, None
  shift = abs(known_top)
  shifted, residual, vector, its = _power_iteration(
      linear, params, jax.random.normal(min_key, flat.shape, flat.dtype),
      jnp.zeros((1, flat.shape[0]), flat.dtype), shift, tol, max_iters)
  low = record([shifted + shift], vector[None], iterations=np.asarray([its]),
               residuals=np.asarray([residual]), hvps=hvps + its)
  return (top_pairs if top else None), low


# --- trace and density -----------------------------------------------------------------------


@jax.jit
def _hutchinson_probe(linear, params, key):
  flat, _ = ravel_pytree(params)
  v = jax.random.rademacher(key, flat.shape, flat.dtype)
  return jnp.vdot(v, _flat_matvec(linear, params)(v))


def hessian_trace(loss_fn: Callable,
                  params,
                  num_samples: int = 100,
                  rng: Optional[jax.Array] = None):
  """Hutchinson's estimator tr(H) ≈ mean_i vᵢᵀ H vᵢ with Rademacher vᵢ; returns
  ``(mean, samples)``."""
  linear = linearized_hvp(loss_fn, params)
  keys = jax.random.split(jax.random.key(0) if rng is None else rng, num_samples)
  samples = jnp.stack([_hutchinson_probe(linear, params, key) for key in keys])
  return jnp.mean(samples), samples


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
  linear = linearized_hvp(loss_fn, params)
  flat, _ = ravel_pytree(params)
  nodes, weights = [], []
  for key in jax.random.split(jax.random.key(0) if rng is None else rng, num_runs):
    alphas, betas, _ = _lanczos(linear, params, jax.random.rademacher(key, flat.shape, flat.dtype),
                                num_iters)
    theta, vectors = np.linalg.eigh(_tridiagonal(alphas, betas[:-1]))
    nodes.append(theta)
    weights.append(vectors[0] ** 2)
  return SpectralDensity(np.stack(nodes), np.stack(weights))
