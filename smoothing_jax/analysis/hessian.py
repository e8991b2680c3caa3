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
"""
from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

METHODS = ("lanczos", "power")
REORTHOGONALIZATIONS = ("partial", "full")
_ROUNDING = 3.0  # one step's rounding in the orthogonality estimates, in units of ε‖H‖


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


# --- the operator's loss: a whole data set, a block of parameters ----------------------------


def _mean_over_batches(batch_loss, batches, params):
  return jnp.mean(jax.lax.map(lambda batch: jax.checkpoint(batch_loss)(batch, params), batches))


def dataset_loss(batch_loss: Callable, batches: Iterable, mesh: Mesh | None = None) -> Partial:
  """L(θ) = (1/B) Σ_b ``batch_loss(batch_b, θ)`` over B batches: a ``loss_fn`` for every solver
  here, whose Hessian is the mean of the batches' Hessians (PyHessian's ``dataloader=`` mode).

  ``batches``: pytrees of equal shapes (e.g. ``{"image": [n, …], "label": [n]}``), stacked here to
  ``[B, n, …]`` and, on ``mesh``, sharded over its ``data`` axis on ``n`` (n a multiple of the mesh
  size; pass ``params`` replicated on the mesh), so each HVP runs data-parallel (``jit`` inserts the
  cross-device sums).  The batches stay on the devices; the batch losses run one after another
  (``lax.map``), each under ``jax.checkpoint``: a linearised HVP keeps only the parameters and the
  batches, not B batches' activations, and recomputes each batch's forward and backward pass (the
  cost of one :func:`hvp` per batch per HVP).  Where ``batch_loss`` is a mean over equal batches, L
  is the loss of their concatenation.  ``batch_loss``: a module-level function or a ``Partial`` (the
  same one again reuses the compiled solvers).
  """
  leaves = [jax.tree.map(np.asarray, batch) for batch in batches]
  if not leaves:
    raise ValueError("dataset_loss needs at least one batch.")
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *leaves)
  if mesh is None:
    stacked = jax.tree.map(jnp.asarray, stacked)
  else:
    size = jax.tree.leaves(stacked)[0].shape[1]
    if size % mesh.shape["data"]:
      raise ValueError(f"A batch of {size} does not split over the mesh's "
                       f"{mesh.shape['data']} devices.")
    stacked = jax.device_put(stacked, NamedSharding(mesh, P(None, "data")))
  return Partial(_mean_over_batches, as_pytree(batch_loss), stacked)


def _select(tree, keep, prefix=()):
  """The leaves of the nested mapping ``tree`` whose path satisfies ``keep``, in nested dicts."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      value = _select(value, keep, (*prefix, key))
      if value:
        out[key] = value
    elif keep("/".join(map(str, (*prefix, key)))):
      out[key] = value
  return out


def _merge(tree, block):
  """``tree`` with the leaves of ``block`` (a sub-tree of nested dicts) put in."""
  return {key: (value if key not in block else
                _merge(value, block[key]) if isinstance(value, Mapping) else block[key])
          for key, value in tree.items()}


def _with_block(loss_fn, params, block):
  return loss_fn(_merge(params, block))


def _with_mask(loss_fn, anchor, mask, params):
  return loss_fn(jax.tree.map(lambda a, m, p: a + m * (p - a), anchor, mask, params))


def restricted_to(loss_fn: Callable, params, block: str | Callable[[str], bool], *,
                  masked: bool = False):
  """``(block_loss, block_params)``: the loss as a function of a subset of the parameters, the
  rest held at ``params``; its Hessian is the block H[S, S] of the full one, so every solver
  here takes it as it is: ``top_eigenvalues(*restricted_to(loss_fn, params, "layer3"))``.

  ``block``: a module path, which selects the parameters whose path ("layer3_0/conv1/kernel")
  starts with it followed by "/", "_" or nothing ("layer3": every block of a ResNet's stage 3;
  "block1_msa": a ViT's MSA block 1), or a predicate on that path.  ``params``: nested mappings
  (Flax's); ``block_params`` the selected leaves in nested dicts, as are the eigenvectors.

  ``masked=True`` returns ``(masked_loss, params)`` instead: every parameter stays an argument and a
  0/1 mask (data) freezes the others, so the Hessian is P H P (P the block's projection), whose
  nonzero eigenvalues are H[S, S]'s and whose other eigenvalues are 0.  Blocks of one model then
  share one compiled solver, where each block's own structure compiles it anew; the top
  eigenvalues are the block's as long as k does not exceed the block's nonzero ones.
  """
  def in_module(path):
    return path.startswith(block) and path[len(block):][:1] in ("", "/", "_")

  selected = _select(params, block if callable(block) else in_module)
  if not selected:
    raise ValueError(f"No parameter path matches {block!r}; the top-level names are "
                     f"{sorted(params)}.")
  if masked:
    mask = _merge(jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.ones_like, selected))
    return Partial(_with_mask, as_pytree(loss_fn), params, mask), params
  return Partial(_with_block, as_pytree(loss_fn), params), selected


def stages(params) -> list[str]:
  """The numbered top-level modules of ``params`` (nested mappings), each a module path for
  :func:`restricted_to`: the names' word-and-number prefixes ("layer3_1" → "layer3"), in order of
  word, then number; unnumbered modules (a classifier, an embedding) are not stages.

  A ResNet's or AlterNet's ``["layer0", …, "layer4"]`` ("layer0" the stem), a Swin's or PiT's
  ``["stage1", …, "stage4"]`` (a stage's down-sampling with it), a ViT's ``["block0", …]``
  (one stage: its blocks).
  """
  numbered = (re.match(r"([A-Za-z]+)(\d+)(?:_|$)", name) for name in params)
  found = {(m[1], int(m[2])) for m in numbered if m}
  return [f"{word}{number}" for word, number in sorted(found)]


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


def _check_args(k, max_iters, tol, method, block_size, reorthogonalization="partial"):
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


def _power_iteration(linear, params, v0, basis, shift, tol, max_iters, stop="change"):
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


# --- block Lanczos with partial or full reorthogonalisation ---------------------------------
#
# Blocks are stored as the algebra writes them, X_j [..., n, b] (P problems stacked on a leading
# axis): on XLA:CPU the products that reduce over the n parameters run near memory bandwidth
# with n leading and are 8× slower with n trailing ([5, n]·[n, 5] at 11.2M parameters: 0.25 s
# against 0.03 s).  The Krylov basis is the list of the step's own blocks (no copy, nothing
# allocated ahead), which only the rare reorthogonalisation and the Ritz vectors read, a block
# per call; the step never sees it, so its program is the same at every j.


def _inner(x, y):
  """Xᵀ Y [..., b, r] of ``x`` [..., n, b] and ``y`` [..., n, r]."""
  return jnp.einsum("...nb,...nr->...br", x, y)


def _times(x, m):
  """``x`` [..., n, b] @ ``m`` [..., b, r] for small b and r: a sum of b broadcast products,
  which XLA fuses into one pass over ``x``; XLA:CPU's dot runs this shape 5× slower (b = r = 5,
  11.2M rows: 0.24 s against 0.04 s)."""
  return sum(x[..., :, k:k + 1] * m[..., k:k + 1, :] for k in range(m.shape[-2]))


@functools.partial(jax.jit, donate_argnames="w")
def _minus_projection(w, block):
  """``w`` [..., n, r] minus its projection on the orthonormal columns of ``block`` [..., n, b]
  (in place): one classical Gram–Schmidt pass."""
  return w - _times(block, _inner(block, w))


@functools.partial(jax.jit, donate_argnames="total")
def _plus_combination(total, block, coefficients):
  """``total`` [n, r] + ``block`` [n, b] @ ``coefficients`` [b, r] (in place)."""
  return total + _times(block, coefficients)


class _Basis:
  """The Krylov basis X_0, X_1, … of blocks [..., n, b], and the last two, which the next step
  needs."""

  def __init__(self, start):
    self.blocks = []
    self.append(start)

  def append(self, q):
    self.blocks.append(q)

  @property
  def last(self):
    return self.blocks[-2:]

  def project_out(self, w):
    """``w`` minus its projection on every block so far, in ``w``'s buffer (``w`` is consumed)."""
    for block in self.blocks:
      w = _minus_projection(w, block)
    return w

  def combination(self, coefficients):
    """``coefficients`` [r, m] @ the first m columns of the basis, as rows [r, n]."""
    b = self.blocks[0].shape[-1]
    total = jnp.zeros((self.blocks[0].shape[-2], coefficients.shape[0]), self.blocks[0].dtype)
    for i in range(coefficients.shape[1] // b):
      total = _plus_combination(total, self.blocks[i],
                                jnp.asarray(coefficients[:, i * b:(i + 1) * b].T, total.dtype))
    return total.T


def _orthonormal_block(w, scale, fresh=None):
  """Gram–Schmidt (classical, twice) of the b columns of ``w`` [n, b] (already orthogonal to the
  basis) among themselves → ``(q [n, b], r [b, b], broken [b])``: the QR factors w = qr, r upper
  triangular.

  A column whose remainder is at most 1e-6·``scale`` is ``broken`` (a block breakdown: the Krylov
  space has become invariant in that direction): r's diagonal 0 there, and q's column the
  normalised remainder of ``fresh``'s column (random vectors orthogonal to the basis) after the
  columns before it, so the recurrence goes on exactly (a single-vector Lanczos restarts the
  same way); zero without ``fresh``.
  """
  b = w.shape[1]
  columns, r, broken = [], jnp.zeros((b, b), w.dtype), []
  for i in range(b):
    x, coefficients = w[:, i], jnp.zeros(b, w.dtype)
    if i:  # no columns before the first (for b = 1 the QR is a normalisation)
      q = jnp.stack(columns, axis=1)
      coefficients = x @ q
      x = x - _times(q, coefficients[:, None])[:, 0]
      correction = x @ q  # twice is enough
      x, coefficients = x - _times(q, correction[:, None])[:, 0], coefficients + correction
      coefficients = jnp.zeros(b, w.dtype).at[:i].set(coefficients)
    norm = jnp.linalg.norm(x)
    broken.append(norm <= 1e-6 * scale)
    restart = jnp.zeros_like(x)
    if fresh is not None:
      restart = fresh[:, i]
      for _ in range(2):
        if columns:
          restart = restart - _times(q, (restart @ q)[:, None])[:, 0]
      restart = _normalize(restart)
    columns.append(jnp.where(broken[i], restart, x / jnp.where(broken[i], 1.0, norm)))
    column = coefficients.at[i].set(jnp.where(broken[i], 0.0, norm))
    # All of wᵢ at the rounding level (e.g. the whole space invariant): no coupling at all.
    r = r.at[:, i].set(jnp.where(jnp.linalg.norm(w[:, i]) <= 1e-6 * scale, 0.0, column))
  return jnp.stack(columns, axis=1), r, jnp.stack(broken)


def _cholesky_qr(w, scale):
  """CholeskyQR2 of ``w`` [n, b] → ``(q, r, ok)``: twice, R = chol(wᵀw)ᵀ and w ← wR⁻¹, so
  w = q·(R₂R₁) (Fukaya et al. 2014).  Two Gram matrices and two products over n, where
  :func:`_orthonormal_block` makes 4(b − 1) passes of a column at a time (b = 5, 11.2M
  parameters on XLA:CPU: 0.20 s against 0.63 s).

  Exact when w is well conditioned: the first pass's q is then orthogonal to O(κ(w)²ε) and the
  second's to O(ε).  ``ok`` is False where that fails (a non-finite factor, the first pass's q
  off orthogonal by more than 0.1) or a column's remainder (R₁'s diagonal) is near the
  breakdown level 1e-5·``scale``: Gram–Schmidt with restarts (:func:`_reorthogonalized`) then
  replaces the result.
  """
  b = w.shape[1]
  eye = jnp.eye(b, dtype=w.dtype)
  factors = []
  for _ in range(2):
    gram = _inner(w, w)  # the second: of the first pass's q
    lower = jnp.linalg.cholesky((gram + gram.T) / 2)
    w = _times(w, jax.scipy.linalg.solve_triangular(lower, eye, lower=True).T)
    factors.append(lower.T)
  r = factors[1] @ factors[0]
  ok = (jnp.all(jnp.isfinite(r)) & jnp.all(jnp.abs(gram - eye) <= 0.1)
        & jnp.all(jnp.diag(factors[0]) > 1e-5 * scale))
  return w, r, ok


def _orthonormal(w, scale, fresh=None):
  """:func:`_cholesky_qr` where it is exact, else :func:`_orthonormal_block`: the latter's
  ``(q, r, broken)``."""
  q, r, ok = _cholesky_qr(w, scale)
  return jax.lax.cond(ok, lambda: (q, r, jnp.zeros(w.shape[-1], bool)),
                      lambda: _orthonormal_block(w, scale, fresh))


@jax.jit
def _qr(w, scale, fresh=None):
  """:func:`_orthonormal` of one problem, or of each of P stacked on a leading axis."""
  qr = _orthonormal
  for _ in range(w.ndim - 2):
    qr = jax.vmap(qr)
  return qr(w, scale, fresh)


@jax.jit
def _random_columns(key, j, like):
  """Random columns shaped like ``like``, from ``key`` folded with step j (a key per problem
  when ``like`` is stacked)."""
  def draw(key):
    return jax.random.normal(jax.random.fold_in(key, j), like.shape[-2:], like.dtype)

  for _ in range(like.ndim - 2):
    draw = jax.vmap(draw)
  return draw(key)


def _reorthogonalized(basis, w, scale, key, j):
  """``(q, r)``: the QR factors of ``w`` after projecting out every block of the ``basis``, a
  broken column (:func:`_orthonormal_block`) restarted from a random vector projected out
  twice."""
  w = basis.project_out(w)
  q, r, broken = _qr(w, scale)
  if np.any(np.asarray(broken)):
    fresh = basis.project_out(basis.project_out(_random_columns(key, j, w)))
    q, r, _ = _qr(w, scale, fresh)
  return q, r


@jax.jit
def _accept(needed, q_new, r_new, q, r, state, j):
  """The reorthogonalised ``(q_new, r_new)`` of step j where ``needed`` (per problem), the
  step's own ``(q, r)`` elsewhere (``q`` None: nowhere), and B_j in the state (``b``) to
  match."""
  keep = needed[..., None, None]
  q, r = q_new if q is None else jnp.where(keep, q_new, q), jnp.where(keep, r_new, r)
  return q, r, {**state, "b": state["b"].at[..., j, :, :].set(r)}


def _orthogonality(steps, b, dtype):
  """The running state of :func:`_step`: ``scale``, the largest ‖Hx‖ so far (for the breakdown
  test and the rounding model); ``omega`` [steps + 1, b, b], the estimates of Ω_k = X_kᵀX_j of the
  current block against each block so far (Ω_j = I), and ``omega_prev`` the same for X_{j−1};
  ``a`` and ``b``, T's blocks A_k and B_k so far; ``again``, whether the next block is
  reorthogonalised whatever its estimate; ``count``, the blocks reorthogonalised."""
  blocks = jnp.zeros((steps + 1, b, b), dtype)
  return {"scale": jnp.zeros((), dtype), "omega": blocks.at[0].set(jnp.eye(b, dtype=dtype)),
          "omega_prev": blocks, "a": blocks, "b": blocks, "again": jnp.zeros((), bool),
          "count": jnp.zeros((), jnp.int32)}


def _estimated_orthogonality(state, a, coupling, r):
  """Ω_k = X_kᵀX_{j+1} for the blocks k < j, from the estimates for X_j and X_{j−1} alone:
  H's symmetry applied to H X_k = X_{k−1}B_{k−1}ᵀ + X_k A_k + X_{k+1}B_k and to the same for j
  gives (the block form of Simon 1984's ω-recurrence)

    Ω_{k,j+1} B_j = B_{k−1}Ω_{k−1,j} + A_k Ω_{k,j} + B_kᵀΩ_{k+1,j} − Ω_{k,j}A_j − Ω_{k,j−1}B_{j−1}ᵀ

  plus one step's rounding, modelled as 3ε·‖H‖ (``_ROUNDING``; ``scale`` for ‖H‖) added in the
  direction that grows |Ω|.  With ε·‖H‖, 100 steps on a 300-parameter quadratic ended with
  max |XᵀX − I| = 6.2e-4 > √ε (float32: 3.5e-4); with 3ε·‖H‖, 2.1e-5.  ``a`` = A_j,
  ``coupling`` = B_{j−1}, ``r`` = B_j (upper triangular; a zero on its diagonal, a breakdown,
  gives non-finite estimates).  Rows k ≥ j of the result are meaningless."""
  omega, prev, a_k, b_k = state["omega"], state["omega_prev"], state["a"], state["b"]
  zero = jnp.zeros_like(omega[:1])
  below, above = jnp.concatenate([zero, omega[:-1]]), jnp.concatenate([omega[1:], zero])
  rhs = (jnp.concatenate([zero, b_k[:-1]]) @ below + a_k @ omega
         + jnp.swapaxes(b_k, 1, 2) @ above - omega @ a - prev @ coupling.T)
  rhs = rhs + jnp.where(rhs < 0, -1.0, 1.0) * _ROUNDING * jnp.finfo(rhs.dtype).eps * state["scale"]
  eye = jnp.eye(r.shape[0], dtype=r.dtype)
  return rhs @ jax.scipy.linalg.solve_triangular(r, eye, lower=False)


def _step(linear, params, x, x_prev, j, coupling, state, full=False):
  """Block Lanczos step j with blocks of b columns: ``x`` = X_j [n, b], ``x_prev`` = X_{j−1}.

  W = H X_j − X_{j−1} B_{j−1}ᵀ (``coupling`` = B_{j−1}, zero at j = 0), A_j = X_jᵀ W, and the QR
  factors X_{j+1} B_j of W − X_j A_j (:func:`_cholesky_qr`) give the next block.  The b HVPs
  are unrolled, each as fast as one alone: vmapped (b = 5, ResNet-18 on CPU) they compiled in a
  third of the time but ran 1.8× as long, and a ``lax.map`` far longer.

  Reorthogonalisation, W against all of X_0..X_j, reads the whole basis twice: with 11.2M
  parameters, at step 12 on two CPU cores, 1.80 s a step against 1.58 s without it (one HVP
  1.52 s), the difference growing with j.  ``full``: every step.  Otherwise partial
  reorthogonalisation (Simon 1984, "The Lanczos algorithm with partial reorthogonalization"):
  each step updates the estimates Ω_k ≈ X_kᵀX_{j+1} (:func:`_estimated_orthogonality`), and
  only when one exceeds √ε (or the block broke down) is W reorthogonalised, and the next block
  too, the estimates then reset to the rounding level.  A semi-orthogonal basis,
  |X_kᵀX_l| ≤ √ε, keeps T the projection of H on the basis's span up to rounding (Simon), so
  the Ritz values and the residuals ‖B sⱼ[−b:]‖ are as accurate as with full
  reorthogonalisation.

  The step does not see the basis: it returns ``(W, A_j, X_{j+1}, B_j, needed, state)`` with
  X_{j+1}, B_j the QR factors of W as it is, and ``needed`` whether they must be replaced by
  those of W reorthogonalised (:func:`_reorthogonalized`, :func:`_accept`): where the estimates
  say so, where CholeskyQR2 was not exact (``ok``: an ill-conditioned W, a breakdown), and always
  with ``full`` (X_{j+1} None).  ``state``: :func:`_orthogonality`.
  """
  b = coupling.shape[0]
  matvec = _flat_matvec(linear, params)
  hx = jnp.stack([matvec(x[:, i]) for i in range(b)], axis=1)
  state = {**state, "scale": jnp.maximum(state["scale"], jnp.max(jnp.linalg.norm(hx, axis=0)))}
  w = hx - _times(x_prev, coupling.T)
  a = _inner(x, w)
  a = (a + a.T) / 2
  w = w - _times(x, a)
  if full:  # the estimates go unused
    state = {**state, "a": state["a"].at[j].set(a), "count": state["count"] + 1}
    return w, a, None, coupling, jnp.ones((), bool), state
  q, r, ok = _cholesky_qr(w, state["scale"])
  omega = _estimated_orthogonality(state, a, coupling, r)
  k = jnp.arange(omega.shape[0])[:, None, None]
  eps = jnp.finfo(omega.dtype).eps
  # Non-finite (a breakdown) also fails the test.
  needed = (state["again"] | ~ok
            | ~jnp.all(jnp.where(k < j, jnp.abs(omega), 0.0) <= jnp.sqrt(eps)))
  omega = jnp.where((k < j) & ~needed, omega, jnp.where(k <= j, eps * jnp.sqrt(b), 0.0))
  omega = jnp.where(k == j + 1, jnp.eye(b, dtype=omega.dtype), omega)
  state = {**state, "omega": omega, "omega_prev": state["omega"],
           "a": state["a"].at[j].set(a), "b": state["b"].at[j].set(r),
           "again": needed & ~state["again"], "count": state["count"] + needed.astype(jnp.int32)}
  return w, a, q, r, needed, state


def _start_block(start):
  """X_0 [n, b]: the orthonormalised rows of ``start`` [b, n]."""
  return _orthonormal(start.T, 0.0)[0]


_lanczos_start = jax.jit(_start_block)
_lanczos_step = jax.jit(_step, static_argnames="full")


def _placed_like(params, *arrays):
  """``arrays`` replicated on the mesh of ``params`` when they lie on one (a loaded Run's
  variables): the step's outputs take that mesh, so its first inputs need it too, or step 1
  compiles :func:`_lanczos_step` a second time (the input types differ)."""
  sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return arrays
  replicated = NamedSharding(sharding.mesh, P())
  return tuple(jax.device_put(a, replicated) for a in arrays)


def _first_block(params, start, steps):
  """``(X_0, B_{−1}, state)`` for :func:`_lanczos` of one problem of ``steps`` steps: X_0 the
  orthonormalised rows of ``start`` [b, n], the coupling zero and the state
  :func:`_orthogonality`'s."""
  b = start.shape[0]
  state, structure = jax.tree.flatten(_orthogonality(steps, b, start.dtype))
  start, coupling, *state = _placed_like(params, start, jnp.zeros((b, b), start.dtype), *state)
  return _lanczos_start(start), coupling, jax.tree.unflatten(structure, state)


def _add_block(band, j, a, coupling):
  """Writes step j's blocks into ``band``, T = XᵀHX in LAPACK's lower band storage (band[i − l, l]
  = T[i, l] for 0 ≤ i − l ≤ b): A_j on the diagonal and B_{j−1} (``coupling``, upper triangular:
  the R of a QR) below it, B_{j−1}ᵀ above."""
  b = a.shape[0]
  rows, cols = np.tril_indices(b)
  band[rows - cols, j * b + cols] = a[rows, cols]
  if j > 0:
    rows, cols = np.triu_indices(b)
    band[b + rows - cols, (j - 1) * b + cols] = coupling[rows, cols]


def _dense(band, m):
  """The symmetric [m, m] matrix of the first m columns of a lower ``band``."""
  t = np.zeros((m, m))
  for d in range(band.shape[0]):
    t += np.diag(band[d, :m - d], -d) + (np.diag(band[d, :m - d], d) if d else 0)
  return t


def _ends(band, m, count, coupling):
  """The Ritz values at both ends of T's spectrum, the ``count`` smallest and the ``count``
  largest (among them the ``count`` of largest magnitude), and their residuals: T's selected
  eigenpairs only (LAPACK sbevx: bisection and inverse iteration), O(m²·b) for the hundreds of
  steps a tolerance near float32's rounding needs, where a full eigh per step is O(m³)."""
  b = coupling.shape[0]
  ranges = [(0, count - 1), (m - count, m - 1)] if 2 * count < m else [(0, m - 1)]
  pairs = [scipy.linalg.eig_banded(band[:, :m], lower=True, select="i", select_range=r)
           for r in ranges]
  theta = np.concatenate([values for values, _ in pairs])
  vectors = np.concatenate([vectors for _, vectors in pairs], axis=1)
  return theta, np.linalg.norm(coupling @ vectors[-b:], axis=0)


def _steps(num_iters, b, n):
  """The whole blocks of up to ``num_iters`` HVPs: at least one, at most n HVPs."""
  return max(1, min(num_iters, n) // b)


def _lanczos(step, start, coupling, state, steps, key, converged=None, count=1):
  """Block Lanczos of P problems in lockstep (P = 1: one problem; several: one per device of a
  mesh, the arrays stacked on a leading axis): ``steps`` calls ``step(X_j, X_{j−1}, j, coupling,
  state)`` (:func:`_step`) of blocks of b columns from the orthonormal ``start`` X_0, or fewer once
  ``converged(θ, residuals)`` holds for every problem.  ``key``: the random restarts of
  breakdowns (one per problem).

  The residual of Ritz pair j (θⱼ, y = Xsⱼ) is ‖Hy − θⱼy‖ = ‖B sⱼ[−b:]‖ with B the last
  coupling (exact up to rounding while the basis is semi-orthogonal: :func:`_step`).  The host
  reads whether the step needs reorthogonalising, and checks each problem, after each step,
  where the device must wait for it anyway: a few b×b numbers come back, and
  ``converged`` sees the ``count`` Ritz pairs at each end of the spectrum (:func:`_ends`, which
  hold the wanted ones), then, once they pass, every pair of T's full eigh (float64), which
  decides.  A problem that has converged keeps its step's T while the others go on.  Returns a
  list of ``(θ [m], S [m, m], B [b, b])`` per problem, the eigenpairs of its T and its last
  coupling as float64 numpy arrays, the :class:`_Basis` (X its first m columns) and the blocks
  reorthogonalised per problem ([P] numpy).
  """
  b = coupling.shape[-1]
  basis, bands, done, last = _Basis(start), None, None, None
  for j in range(steps):
    w, a, q, coupling, needed, state = step(basis.last[-1], basis.last[0], j, coupling, state)
    if np.any(np.asarray(needed)):
      q, coupling, state = _accept(needed, *_reorthogonalized(basis, w, state["scale"], key, j),
                                   q, coupling, state, j)
    basis.append(q)
    # [P, b, b]: P problems (one unstacked problem is P = 1)
    a, c = (np.asarray(x, np.float64).reshape(-1, b, b) for x in (a, coupling))
    if bands is None:
      bands, done = np.zeros((len(a), b + 1, steps * b)), [None] * len(a)
    for p in range(len(a)):
      _add_block(bands[p], j, a[p], last[p] if j else None)
    last, m = c, (j + 1) * b
    if converged is None and j < steps - 1:
      continue
    for p, result in enumerate(done):
      if result is not None or (j < steps - 1 and not converged(*_ends(bands[p], m, count,
                                                                         last[p]))):
        continue
      theta, vectors = np.linalg.eigh(_dense(bands[p], m))
      if j == steps - 1 or converged(theta, np.linalg.norm(last[p] @ vectors[-b:], axis=0)):
        done[p] = theta, vectors, last[p]
    if all(result is not None for result in done):
      break
  return done, basis, np.asarray(state["count"]).reshape(-1)


def _by_magnitude(theta):
  return np.argsort(-np.abs(theta), kind="stable")


def _ascending(theta):
  return np.argsort(theta, kind="stable")


def _ritz_pairs(theta, vectors, coupling, basis, reorthogonalized, order, count, rank, record):
  """The Eigenpairs of the first ``count`` Ritz values in ``order``, with the certificate:
  residual matrix norm, the next Ritz value in ``order`` and the gap ``rank``(θ_count) −
  ``rank``(θ_next) to it (``rank``: |θ| for the top, −θ for the minimum).  ``basis`` None:
  without the Ritz vectors (``eigenvectors`` None)."""
  chosen, after = order[:count], order[count:count + 1]
  b, m = coupling.shape[0], len(theta)
  ritz = None
  if basis is not None:
    ritz = basis.combination(vectors[:, chosen].T)
  tails = coupling @ vectors[-b:]  # column j: Hyⱼ − θⱼyⱼ in the next block's coordinates
  residuals = np.linalg.norm(tails, axis=0)
  following = {"next_eigenvalue": float("nan"), "next_residual": float("nan"), "gap": float("nan")}
  if after.size:
    following = {"next_eigenvalue": float(theta[after[0]]),
                 "next_residual": float(residuals[after[0]]),
                 "gap": float(rank(theta[chosen[-1]]) - rank(theta[after[0]]))}
  return record(theta[chosen], ritz, iterations=np.full(len(chosen), m),
                residuals=residuals[chosen], hvps=m, block_size=b,
                residual_bound=float(np.linalg.norm(tails[:, chosen], 2)),
                reorthogonalized=int(reorthogonalized), **following)


def _converged(k, top, negative, tol):
  """``converged(θ, residuals)``: the wanted Ritz pairs (the k largest |θ| when ``top``, the
  smallest θ when ``negative``) all have ‖Hy − θy‖ ≤ tol·|θ|."""

  def converged(theta, residuals):
    wanted = np.concatenate([_by_magnitude(theta)[:k] if top else [],
                             _ascending(theta)[:1] if negative else []]).astype(int)
    return (len(theta) >= (k if top else 0) + negative
            and np.all(residuals[wanted] <= tol * np.abs(theta[wanted])))

  return converged


# --- public eigensolvers ---------------------------------------------------------------------


def _eigenpairs(values, vectors, unravel, dtype, **record):
  return Eigenpairs(jnp.asarray(values, dtype),
                    None if vectors is None else [unravel(v) for v in vectors], **record)


def top_eigenvalues(loss_fn: Callable, params, k: int = 1, max_iters: int = 100, tol: float = 1e-3,
                    rng: jax.Array | None = None, method: str = "lanczos",
                    block_size: int | None = None,
                    reorthogonalization: str = "partial") -> Eigenpairs:
  """The ``k`` largest-magnitude Hessian eigenpairs, in decreasing |λ|.

  ``method="lanczos"``: block Lanczos from ``block_size`` random vectors (default k: any
  multiplicity within the top k is resolved; k = 1 is single-vector Lanczos), at most
  ``max_iters`` HVPs in whole blocks (at least one), stopping when each of the k Ritz pairs
  has ‖Hv − λv‖ ≤ tol·|λ|; memory of about the HVPs taken + 3·block_size parameter vectors
  (the basis grows with the HVPs).
  ``reorthogonalization``: ``"partial"`` (default) keeps the Krylov basis semi-orthogonal,
  reorthogonalising a block only when Simon's estimate of its loss of orthogonality passes √ε;
  ``"full"`` reorthogonalises every block, which reads the whole basis twice per step.
  ``method="power"``: PyHessian's ``eigenvalues(maxIter=max_iters, tol=tol, top_n=k)``, up
  to ``max_iters`` HVPs per eigenvalue.  Returns an :class:`Eigenpairs` ``(eigenvalues [k],
  eigenvectors)``; its ``residuals`` say how far each pair is from converged, whichever rule
  stopped it, and with Lanczos its certificate says what else is guaranteed.
  """
  return top_and_min_eigenvalues(loss_fn, params, k, max_iters, tol, rng, method,
                                 negative=False, block_size=block_size,
                                 reorthogonalization=reorthogonalization)[0]


def min_eigenvalue(loss_fn: Callable, params, max_iters: int = 100, tol: float = 1e-3,
                   rng: jax.Array | None = None, top: float | None = None,
                   method: str = "lanczos", reorthogonalization: str = "partial") -> Eigenpairs:
  """The most negative (smallest) Hessian eigenvalue and its eigenvector.

  ``method="lanczos"``: Lanczos until the smallest Ritz pair has ‖Hv − λv‖ ≤ tol·|λ|.
  ``method="power"``: after the top eigenvalue λ₁ (``top`` reuses a known one), power
  iteration on ``H − |λ₁|·I``, whose spectrum lies in ``[λ_min − |λ₁|, 0]``, so its
  largest-magnitude eigenvalue is ``λ_min − |λ₁|``, until ‖Hv − λv‖ ≤ tol·|λ| (slow when
  |λ_min| ≪ λ₁: give it the iterations; the returned residual says how far it got).  Returns an
  :class:`Eigenpairs` of a scalar and one pytree, ``(λ_min, eigenvector)``.
  """
  low = top_and_min_eigenvalues(loss_fn, params, 1, max_iters, tol, rng, method, top=False,
                                known_top=top, reorthogonalization=reorthogonalization)[1]
  return Eigenpairs(low.eigenvalues[0], low.eigenvectors[0], iterations=int(low.iterations[0]),
                    residuals=float(low.residuals[0]), hvps=low.hvps, method=method,
                    block_size=low.block_size, residual_bound=low.residual_bound, gap=low.gap,
                    next_eigenvalue=low.next_eigenvalue, next_residual=low.next_residual,
                    reorthogonalized=low.reorthogonalized)


def top_and_min_eigenvalues(loss_fn: Callable, params, k: int = 1, max_iters: int = 100,
                            tol: float = 1e-3, rng: jax.Array | None = None,
                            method: str = "lanczos", *, top: bool = True, negative: bool = True,
                            known_top: float | None = None,
                            block_size: int | None = None,
                            reorthogonalization: str = "partial"):
  """``(top-k eigenpairs, [λ_min] eigenpair)`` (either ``None`` when not asked for).

  With Lanczos both come from one Krylov space (its extremes converge together), so
  the most negative eigenvalue costs few HVPs beyond the top k; ``hvps`` of each is
  the shared count.  ``block_size`` defaults to k (1 for the minimum alone).  With power
  iteration, the minimum is a second run on ``H − |λ₁|·I`` (which converges at the rate
  (|λ₁| + λ_min)/(|λ₁| + λ_next) and is slow when |λ_min| ≪ λ₁); ``known_top`` skips the
  top run when only the minimum is asked for.  ``reorthogonalization``: as in
  :func:`top_eigenvalues`.
  """
  _check_args(k, max_iters, tol, method, block_size, reorthogonalization)
  flat, unravel = ravel_pytree(params)
  block = (k if top else 1) if block_size is None else block_size
  for name, value in (("k", k), ("block_size", block)):
    if value > flat.shape[0]:
      raise ValueError(f"{name}={value} exceeds the number of parameters ({flat.shape[0]}).")
  rng = jax.random.key(0) if rng is None else rng
  top_key, min_key = jax.random.split(rng)
  linear = linearized_hvp(loss_fn, params)
  record = functools.partial(_eigenpairs, unravel=unravel, dtype=flat.dtype, method=method)
  if method == "lanczos":
    start_key, step_key = jax.random.split(top_key)
    start = jax.random.normal(start_key, (block, flat.shape[0]), flat.dtype)
    steps = _steps(max_iters, block, flat.shape[0])
    step = functools.partial(_lanczos_step, linear, params, full=reorthogonalization == "full")
    [(theta, vectors, coupling)], basis, [reorthogonalized] = _lanczos(
        step, *_first_block(params, start, steps), steps, step_key,
        _converged(k, top, negative, tol), k if top else 1)
    pairs = functools.partial(_ritz_pairs, theta, vectors, coupling, basis, reorthogonalized,
                              record=record)
    return (pairs(_by_magnitude(theta), k, np.abs) if top else None,
            pairs(_ascending(theta), 1, np.negative) if negative else None)
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
      jnp.zeros((1, flat.shape[0]), flat.dtype), shift, tol, max_iters, stop="residual")
  low = record([shifted + shift], vector[None], iterations=np.asarray([its]),
               residuals=np.asarray([residual]), hvps=hvps + its)
  return (top_pairs if top else None), low


# --- one problem per device of a mesh --------------------------------------------------------


def _local(tree):
  return jax.tree.map(lambda x: x[0], tree)


def _stacked(tree):
  return jax.tree.map(lambda x: x[None], tree)


@functools.lru_cache(maxsize=16)
def _per_device(mesh: Mesh, full: bool):
  """``(linearize, start, step)``: :func:`_linearize`, :func:`_start_block` and :func:`_step`
  as programs over ``mesh`` in which each device runs them on its own problem.  Their stacked
  arguments (a leading axis of ``mesh.size``, sharded on ``data``) hold one problem per device;
  the parameters and the step index are replicated.  No device waits for another: there is no
  collective, so the devices' HVPs run side by side."""
  data, replicated = P("data"), P()

  def sharded(fn, in_specs):
    def body(*args):
      return _stacked(fn(*(_local(a) if spec == data else a
                           for a, spec in zip(args, in_specs, strict=True))))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=data,
                                 check_vma=False))

  linearize = sharded(lambda loss_fn, params: jax.linearize(jax.grad(loss_fn), params)[1],
                      (data, replicated))
  start = sharded(_start_block, (data,))
  step = sharded(functools.partial(_step, full=full),
                 (data, replicated, data, data, replicated, data, data))
  return linearize, start, step


def top_and_min_eigenvalues_per_device(loss_fns: Partial, params, mesh: Mesh, rngs: jax.Array,
                                       k: int = 1, max_iters: int = 100, tol: float = 1e-3, *,
                                       negative: bool = True, block_size: int | None = None,
                                       reorthogonalization: str = "partial"):
  """:func:`top_and_min_eigenvalues` by Lanczos of ``mesh.size`` problems at once, problem i on
  device i: ``loss_fns`` is a ``Partial`` whose bound arrays are stacked on a leading axis of
  ``mesh.size`` (problem i binds the arrays ``[i]``; e.g. one batch per device), ``rngs`` [P]
  their keys.  Each device linearises its own loss and runs its own Krylov space; the host
  checks every problem after each step and stops when all have converged.

  Returns one ``(top-k eigenpairs, [λ_min] eigenpair or None)`` per problem, without the
  eigenvectors (``eigenvectors`` None), each equal to ``top_and_min_eigenvalues(loss_fn_i,
  params, k, max_iters, tol, rngs[i], negative=negative)`` up to rounding.
  """
  _check_args(k, max_iters, tol, "lanczos", block_size, reorthogonalization)
  flat, unravel = ravel_pytree(params)
  n, block = flat.shape[0], k if block_size is None else block_size
  if max(k, block) > n:
    raise ValueError(f"k={k} or block_size={block} exceeds the number of parameters ({n}).")
  linearize, start_block, step = _per_device(mesh, reorthogonalization == "full")
  stacked, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  params = jax.device_put(params, replicated)
  # Each problem's start block and step key as top_and_min_eigenvalues draws them.
  keys = [jax.random.split(jax.random.split(rng)[0]) for rng in rngs]
  start = jnp.stack([jax.random.normal(start_key, (block, n), flat.dtype)
                     for start_key, _ in keys])
  step_keys = jnp.stack([step_key for _, step_key in keys])
  steps = _steps(max_iters, block, n)
  count = mesh.size
  state = jax.tree.map(lambda x: jnp.stack([x] * count), _orthogonality(steps, block, flat.dtype))
  start, coupling, state, step_keys = jax.device_put(
      (start, jnp.zeros((count, block, block), flat.dtype), state, step_keys), stacked)
  linear = linearize(jax.device_put(loss_fns, stacked), params)
  results, _, reorthogonalized = _lanczos(
      lambda x, x_prev, j, coupling, state: step(linear, params, x, x_prev, j, coupling, state),
      start_block(start), coupling, state, steps, step_keys, _converged(k, True, negative, tol),
      k)
  record = functools.partial(_eigenpairs, unravel=unravel, dtype=flat.dtype, method="lanczos")
  return [(_ritz_pairs(theta, vectors, coupling, None, count, _by_magnitude(theta), k, np.abs,
                       record=record),
           _ritz_pairs(theta, vectors, coupling, None, count, _ascending(theta), 1, np.negative,
                       record=record) if negative else None)
          for (theta, vectors, coupling), count in zip(results, reorthogonalized, strict=True)]


# --- trace and density -----------------------------------------------------------------------


@jax.jit
def _hutchinson_probe(linear, params, key):
  flat, _ = ravel_pytree(params)
  v = jax.random.rademacher(key, flat.shape, flat.dtype)
  return jnp.vdot(v, _flat_matvec(linear, params)(v))


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
  _check_args(1, num_iters, 1.0, "lanczos", None, reorthogonalization)
  linear = linearized_hvp(loss_fn, params)
  flat, _ = ravel_pytree(params)
  steps = _steps(num_iters, 1, flat.shape[0])
  nodes, weights = [], []
  for key in jax.random.split(jax.random.key(0) if rng is None else rng, num_runs):
    probe = jax.random.rademacher(key, (1, flat.shape[0]), flat.dtype)
    step = functools.partial(_lanczos_step, linear, params, full=reorthogonalization == "full")
    [(theta, vectors, _)], _, _ = _lanczos(step, *_first_block(params, probe, steps), steps, key)
    nodes.append(theta)
    weights.append(vectors[0] ** 2)
  return SpectralDensity(np.stack(nodes), np.stack(weights))
