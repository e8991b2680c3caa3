"""PyHessian's (Yao et al. 2020) power iteration with deflation, stopping when the eigenvalue
changes by less than ``tol`` relative (``method="power"``); the minimum is a power iteration on
H − |λ₁|·I that stops on the residual of the unshifted eigenvalue."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.analysis.hessian.eigenpairs import flat_matvec, normalize


@jax.jit
def _power_step(linear, params, v, basis, shift):
  """One power-iteration step on ``H − shift·I`` with the iterate deflated by the rows of
  ``basis`` (zero rows: no-op).

  Returns the Rayleigh quotient λ of the deflated unit iterate v, the residual
  ‖Hv − (λ + shift)v‖, v itself and the next iterate (H − shift·I)v / ‖·‖.
  """
  v = normalize(v - basis.T @ (basis @ v))
  hv = flat_matvec(linear, params)(v) - shift * v
  rayleigh = jnp.vdot(hv, v)
  return rayleigh, jnp.linalg.norm(hv - rayleigh * v), v, normalize(hv)


def power_iteration(linear, params, v0, basis, shift, tol, max_iters, stop="change"):
  """Largest-magnitude eigenpair of the deflated, shifted Hessian.

  ``stop``: ``"change"`` (PyHessian's rule: the eigenvalue of H − shift·I changes by less than
  ``tol`` relative) or ``"residual"`` (‖Hv − λv‖ ≤ tol·|λ| for the unshifted λ = value + shift;
  the residual is the same for H and H − shift·I).  A Python loop over a jitted step: XLA runs
  convolutions inside ``lax.while_loop`` bodies markedly slower on CPU, and one scalar per step
  is a negligible sync.  Returns ``(λ of H − shift·I, residual, unit vector, iterations)``.
  """
  nxt, eigenvalue = v0, None
  for iteration in range(1, max_iters + 1):  # noqa: B007  (returned: the iterations run)
    new, residual, vector, nxt = _power_step(linear, params, nxt, basis, shift)
    new = float(new)
    if stop == "residual":
      converged = float(residual) <= tol * abs(new + shift)
    else:
      converged = (eigenvalue is not None
                   and abs(new - eigenvalue) / (abs(eigenvalue) + 1e-6) < tol)
    eigenvalue = new
    if converged:
      break
  return eigenvalue, float(residual), vector, iteration


def power_top(linear, params, flat, k, max_iters, tol, rng):
  basis = jnp.zeros((k, flat.shape[0]), flat.dtype)
  eigenvalues, residuals, iterations = [], [], []
  for i, key in enumerate(jax.random.split(rng, k)):
    v0 = jax.random.normal(key, flat.shape, flat.dtype)
    eigenvalue, residual, vector, its = power_iteration(linear, params, v0, basis, 0.0, tol,
                                                         max_iters)
    basis = basis.at[i].set(vector)
    eigenvalues.append(eigenvalue)
    residuals.append(residual)
    iterations.append(its)
  return np.asarray(eigenvalues), basis, np.asarray(residuals), np.asarray(iterations)
