"""The Hessian's trace (Hutchinson's estimator) and its spectral density by stochastic Lanczos
quadrature (Ghorbani et al. 2019, as PyHessian's ``density``)."""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from smoothing_jax.analysis.hessian.eigenpairs import check_args, flat_matvec
from smoothing_jax.analysis.hessian.hvps import linearized_hvp
from smoothing_jax.analysis.hessian.lanczos import (
  block_steps,
  first_block,
  jit_block_step,
  run_lanczos,
)


@jax.jit
def _hutchinson_probe(linear, params, key):
  flat, _ = ravel_pytree(params)
  v = jax.random.rademacher(key, flat.shape, flat.dtype)
  return jnp.vdot(v, flat_matvec(linear, params)(v))


def hessian_trace(loss_fn: Callable,
                  params,
                  num_samples: int = 100,
                  rng: jax.Array | None = None):
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

  def kernel_variance(self, sigma_squared: float = 1e-5, overhead: float = 0.01) -> float:
    """PyHessian's (``density_generate``) Gaussian kernel variance: ``sigma_squared`` ×
    max(1, λmax − λmin), λmax / λmin the mean over runs of each run's extreme nodes ± overhead."""
    width = (np.mean(self.nodes.max(axis=-1)) - np.mean(self.nodes.min(axis=-1))) + 2 * overhead
    return sigma_squared * max(1.0, float(width))

  def on_grid(self, grid_size: int | None = None, sigma_squared: float = 1e-5,
              overhead: float = 0.01):
    """``(grid, density)``: PyHessian's Gaussian-smoothed density (``density_generate``: the
    kernel of :meth:`kernel_variance`, the mean over runs of Σ wᵢ·kernel), normalised to
    integrate to 1 on the grid.

    The grid spans every node ± (``overhead`` + 3 kernel widths).  ``grid_size`` None takes
    enough points that the kernel spans at least two grid steps (10,000 at least, PyHessian's
    ``num_bins``); a coarser ``grid_size`` warns: nodes between grid points would vanish and
    the rest turn into spikes.
    """
    variance = self.kernel_variance(sigma_squared, overhead)
    width = np.sqrt(variance)
    lo, hi = float(self.nodes.min()), float(self.nodes.max())
    pad = overhead + 3 * width
    needed = int(np.ceil((hi - lo + 2 * pad) / (width / 2))) + 1
    if grid_size is None:
      grid_size = max(10000, needed)
    elif grid_size < needed:
      warnings.warn(f"A {grid_size}-point grid does not resolve the density's kernel (std "
                    f"{width:.3g} over [{lo:.3g}, {hi:.3g}]): use at least {needed} points, "
                    "or grid_size=None.", stacklevel=2)
    grid = np.linspace(lo - pad, hi + pad, grid_size)
    kernel = np.exp(-(grid[None, None, :] - self.nodes[..., None]) ** 2 / (2 * variance))
    kernel /= np.sqrt(2 * np.pi * variance)
    density = np.mean(np.sum(self.weights[..., None] * kernel, axis=1), axis=0)
    return grid, density / (np.sum(density) * (grid[1] - grid[0]))


def eigenvalue_density(loss_fn: Callable, params, num_iters: int = 100, num_runs: int = 1,
                       rng: jax.Array | None = None,
                       reorthogonalization: str = "partial") -> SpectralDensity:
  """Stochastic Lanczos quadrature (Ghorbani et al. 2019): ``num_runs`` Lanczos runs of
  ``num_iters`` steps.

  Each run's tridiagonal matrix T has eigenvalues θ_j (nodes) and eigenvectors
  whose first components squared are the quadrature weights (they sum to 1).
  ``reorthogonalization``: as in :func:`top_eigenvalues`.
  """
  check_args(1, num_iters, 1.0, "lanczos", None, reorthogonalization)
  linear = linearized_hvp(loss_fn, params)
  flat, _ = ravel_pytree(params)
  steps = block_steps(num_iters, 1, flat.shape[0])
  nodes, weights = [], []
  for key in jax.random.split(jax.random.key(0) if rng is None else rng, num_runs):
    probe = jax.random.rademacher(key, (1, flat.shape[0]), flat.dtype)
    step = functools.partial(jit_block_step, linear, params, full=reorthogonalization == "full")
    [(theta, vectors, _)], _, _ = run_lanczos(step, *first_block(params, probe, steps), steps, key)
    nodes.append(theta)
    weights.append(vectors[0] ** 2)
  return SpectralDensity(np.stack(nodes), np.stack(weights))
