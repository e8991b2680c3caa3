"""Hessian analysis without materialising the Hessian: HVPs, top eigenpairs, SLQ density, trace.

``loss_fn`` maps a parameter pytree to a scalar with everything else held fixed
(BatchNorm in inference mode, fixed dropout/augmentation keys, a fixed batch),
so the Hessian H = ∇²L(θ) is a fixed symmetric operator.  ``hvp`` is
forward-over-reverse: ``jvp(grad(L), θ, v)``.  Iterative methods linearise
``grad(L)`` at θ once (``linearized_hvp``) and then apply only the tangent part,
like PyHessian keeps the gradient's graph; each iteration (a block's HVPs,
orthogonalisation, norms) is one jitted call, and the host reads back only what the stopping
rule needs.  :func:`top_and_min_eigenvalues_per_device` solves one problem per device of a mesh
(a batch each: the Hessian spectrum over a dataset) in one program per iteration.

Two eigensolvers (``method``):

* ``"lanczos"`` (default): block Lanczos (Golub & Underwood 1977) from b random vectors,
  b = k for the top k, with partial reorthogonalisation (Simon 1984: a block is
  reorthogonalised only when an estimate of its loss of orthogonality passes √ε; ``"full"``:
  every block); the wanted Ritz pairs (θ, y) stop when their residual ‖Hy − θy‖ ≤ tol·|θ|.
  A single start vector has one component in each eigenspace, so single-vector Lanczos returns
  a repeated eigenvalue once and, in a cluster, stops with small residuals at the wrong values
  (a residual only says θ is near *some* eigenvalue); a block of b resolves multiplicities up
  to b.  What a result certifies is in :class:`Eigenpairs`.
* ``"power"``: PyHessian's (Yao et al. 2020) power iteration with deflation,
  stopping when the eigenvalue changes by less than ``tol`` relative.  On a
  crowded spectrum (near-equal |λ| at the top) that rule stops early at an
  unconverged value; the reported residuals show it.  The minimum, a power iteration on
  H − |λ₁|·I, stops on the residual of the unshifted eigenvalue instead,
  ‖Hv − λv‖ ≤ tol·|λ| as Lanczos: the shifted value ≈ −|λ₁| barely changes while λ_min is
  still far off (PyHessian's rule returned +0.47 for a λ_min of −0.5 beside λ₁ = 50).

Two losses make other Hessians for the same solvers: ``dataset_loss`` the mean over many batches
(the full data set, sharded over a mesh's ``data`` axis), ``restricted_to`` a block of parameters.

One module per idea: :mod:`.hvps` (the products), :mod:`.restrictions` (the operator's loss),
:mod:`.eigenpairs` (what the solvers share and return), :mod:`.power` and :mod:`.lanczos` (the two
solvers), :mod:`.solvers` (the public eigensolvers, one problem per device) and :mod:`.density`
(trace and spectral density).
"""
from smoothing_jax.analysis.hessian.density import (
  SpectralDensity,
  eigenvalue_density,
  hessian_trace,
)
from smoothing_jax.analysis.hessian.eigenpairs import METHODS, REORTHOGONALIZATIONS, Eigenpairs
from smoothing_jax.analysis.hessian.hvps import as_pytree, hvp, linearized_hvp
from smoothing_jax.analysis.hessian.restrictions import dataset_loss, restricted_to, stages
from smoothing_jax.analysis.hessian.solvers import (
  min_eigenvalue,
  top_and_min_eigenvalues,
  top_and_min_eigenvalues_per_device,
  top_eigenvalues,
)

__all__ = [
    "METHODS", "REORTHOGONALIZATIONS", "Eigenpairs", "SpectralDensity", "as_pytree",
    "dataset_loss", "eigenvalue_density", "hessian_trace", "hvp", "linearized_hvp",
    "min_eigenvalue", "restricted_to", "stages", "top_and_min_eigenvalues",
    "top_and_min_eigenvalues_per_device", "top_eigenvalues",
]
