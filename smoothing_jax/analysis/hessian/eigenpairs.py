"""What the eigensolvers share: their names, the checks of their arguments, the operator on the
flattened parameter vector, and their result, :class:`Eigenpairs` (values, vectors and what the
solver certifies)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

METHODS = ("lanczos", "power")
REORTHOGONALIZATIONS = ("partial", "full")


def flat_matvec(linear, params):
  """``v ↦ H v`` on the flattened parameter vector."""
  _, unravel = ravel_pytree(params)
  return lambda v: ravel_pytree(linear(unravel(v)))[0]


def normalize(v):
  return v / (jnp.linalg.norm(v) + 1e-30)


class Eigenpairs(tuple):
  """``(eigenvalues, eigenvectors)`` with the solver's record as attributes.

  ``eigenvalues`` [k] (a scalar from :func:`min_eigenvalue`), ``eigenvectors`` a list
  of k unit-norm parameter pytrees (one pytree from :func:`min_eigenvalue`);
  ``residuals`` ‖Hv − λv‖ per pair, ``relative_residuals`` the same over |λ|;
  ``iterations`` the iterations behind each pair (power: its own loop; Lanczos: the
  shared Krylov dimension); ``hvps`` the Hessian-vector products used in total;
  ``method`` the solver; ``reorthogonalized`` (Lanczos) the blocks of the basis that were
  reorthogonalised against all before them.

  What Lanczos certifies (these attributes are ``None`` for power iteration):

  * each λⱼ is within ``residuals[j]`` of an eigenvalue of H, and the k together are within
    ``residual_bound`` = ‖HV − VΛ‖₂ of k eigenvalues counted with multiplicity (Kahan 1967;
    Parlett, *The Symmetric Eigenvalue Problem*, Thm 11.5.2): a value returned twice is a
    double eigenvalue, not one eigenvalue found twice;
  * Ritz values interlace: the j-th largest is at most H's j-th largest, the j-th smallest
    at least H's j-th smallest, so |λ| is never overestimated at either end;
  * ``next_eigenvalue`` is the (k+1)-th Ritz value in the same order, within ``next_residual``
    of an eigenvalue, and ``gap`` = |λ_k| − |λ_{k+1}| (for the minimum λ₂ − λ₁) separates it
    from the k returned.  With η = gap − next_residual > residual_bound the errors are at
    most about residual_bound²/η (quadratic residual bound, Mathias 1998), provided no
    eigenvalue outside the Krylov space lies in the gap: no Krylov method can certify that,
    and a random start block of ``block_size`` ≥ a cluster's multiplicity makes it unlikely.
  """

  def __new__(cls, eigenvalues, eigenvectors, *, iterations, residuals, hvps, method,
              block_size=None, residual_bound=None, next_eigenvalue=None, next_residual=None,
              gap=None, reorthogonalized=None):
    self = super().__new__(cls, (eigenvalues, eigenvectors))
    self.reorthogonalized = reorthogonalized
    self.iterations, self.residuals, self.hvps, self.method = iterations, residuals, hvps, method
    self.block_size, self.residual_bound, self.gap = block_size, residual_bound, gap
    self.next_eigenvalue, self.next_residual = next_eigenvalue, next_residual
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


def check_args(k, max_iters, tol, method, block_size, reorthogonalization="partial"):
  if not isinstance(k, int) or k < 1:
    raise ValueError(f"k must be a positive integer, got {k!r}.")
  if not isinstance(max_iters, int) or max_iters < 1:
    raise ValueError(f"max_iters must be a positive integer, got {max_iters!r}.")
  if not tol > 0:
    raise ValueError(f"tol must be > 0, got {tol!r}.")
  if method not in METHODS:
    raise ValueError(f"Unknown eigensolver method {method!r}; choose one of {METHODS}.")
  if reorthogonalization not in REORTHOGONALIZATIONS:
    raise ValueError(f"Unknown reorthogonalization {reorthogonalization!r}; choose one of "
                     f"{REORTHOGONALIZATIONS}.")
  if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
    raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
