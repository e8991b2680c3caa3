"""Block Lanczos (Golub & Underwood 1977) with partial (Simon 1984) or full reorthogonalisation
(``method="lanczos"``): the step, the Krylov basis, the orthogonality estimates, and the Ritz pairs
that stop on their residual ‖Hy − θy‖ ≤ tol·|θ|."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from smoothing_jax.analysis.hessian.eigenpairs import flat_matvec, normalize

ROUNDING = 3.0  # one step's rounding in the orthogonality estimates, in units of ε‖H‖


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
      restart = normalize(restart)
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


def lanczos_state(steps, b, dtype):
  """The running state of :func:`block_step`: ``scale``, the largest ‖Hx‖ so far (for the breakdown
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

  plus one step's rounding, modelled as 3ε·‖H‖ (``ROUNDING``; ``scale`` for ‖H‖) added in the
  direction that grows |Ω|.  With ε·‖H‖, 100 steps on a 300-parameter quadratic ended with
  max |XᵀX − I| = 6.2e-4 > √ε (float32: 3.5e-4); with 3ε·‖H‖, 2.1e-5.  ``a`` = A_j,
  ``coupling`` = B_{j−1}, ``r`` = B_j (upper triangular; a zero on its diagonal, a breakdown,
  gives non-finite estimates).  Rows k ≥ j of the result are meaningless."""
  omega, prev, a_k, b_k = state["omega"], state["omega_prev"], state["a"], state["b"]
  zero = jnp.zeros_like(omega[:1])
  below, above = jnp.concatenate([zero, omega[:-1]]), jnp.concatenate([omega[1:], zero])
  rhs = (jnp.concatenate([zero, b_k[:-1]]) @ below + a_k @ omega
         + jnp.swapaxes(b_k, 1, 2) @ above - omega @ a - prev @ coupling.T)
  rhs = rhs + jnp.where(rhs < 0, -1.0, 1.0) * ROUNDING * jnp.finfo(rhs.dtype).eps * state["scale"]
  eye = jnp.eye(r.shape[0], dtype=r.dtype)
  return rhs @ jax.scipy.linalg.solve_triangular(r, eye, lower=False)


def block_step(linear, params, x, x_prev, j, coupling, state, full=False):
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
  with ``full`` (X_{j+1} None).  ``state``: :func:`lanczos_state`.
  """
  b = coupling.shape[0]
  matvec = flat_matvec(linear, params)
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


def orthonormal_start(start):
  """X_0 [n, b]: the orthonormalised rows of ``start`` [b, n]."""
  return _orthonormal(start.T, 0.0)[0]


_lanczos_start = jax.jit(orthonormal_start)
jit_block_step = jax.jit(block_step, static_argnames="full")


def _placed_like(params, *arrays):
  """``arrays`` replicated on the mesh of ``params`` when they lie on one (a loaded Run's
  variables): the step's outputs take that mesh, so its first inputs need it too, or step 1
  compiles :func:`jit_block_step` a second time (the input types differ)."""
  sharding = getattr(jax.tree.leaves(params)[0], "sharding", None)
  if not isinstance(sharding, jax.sharding.NamedSharding):
    return arrays
  replicated = NamedSharding(sharding.mesh, P())
  return tuple(jax.device_put(a, replicated) for a in arrays)


def first_block(params, start, steps):
  """``(X_0, B_{−1}, state)`` for :func:`run_lanczos` of one problem of ``steps`` steps: X_0 the
  orthonormalised rows of ``start`` [b, n], the coupling zero and the state
  :func:`lanczos_state`'s."""
  b = start.shape[0]
  state, structure = jax.tree.flatten(lanczos_state(steps, b, start.dtype))
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


def block_steps(num_iters, b, n):
  """The whole blocks of up to ``num_iters`` HVPs: at least one, at most n HVPs."""
  return max(1, min(num_iters, n) // b)


def run_lanczos(step, start, coupling, state, steps, key, converged=None, count=1):
  """Block Lanczos of P problems in lockstep (P = 1: one problem; several: one per device of a
  mesh, the arrays stacked on a leading axis): ``steps`` calls ``step(X_j, X_{j−1}, j, coupling,
  state)`` (:func:`block_step`) of blocks of b columns from the orthonormal ``start`` X_0, or
  fewer once ``converged(θ, residuals)`` holds for every problem.  ``key``: the random restarts of
  breakdowns (one per problem).

  The residual of Ritz pair j (θⱼ, y = Xsⱼ) is ‖Hy − θⱼy‖ = ‖B sⱼ[−b:]‖ with B the last
  coupling (exact up to rounding while the basis is semi-orthogonal: :func:`block_step`).  The host
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


def by_magnitude(theta):
  return np.argsort(-np.abs(theta), kind="stable")


def ascending(theta):
  return np.argsort(theta, kind="stable")


def ritz_pairs(theta, vectors, coupling, basis, reorthogonalized, order, count, rank, record):
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


def ritz_converged(k, top, negative, tol):
  """``converged(θ, residuals)``: the wanted Ritz pairs (the k largest |θ| when ``top``, the
  smallest θ when ``negative``) all have ‖Hy − θy‖ ≤ tol·|θ|."""

  def converged(theta, residuals):
    wanted = np.concatenate([by_magnitude(theta)[:k] if top else [],
                             ascending(theta)[:1] if negative else []]).astype(int)
    return (len(theta) >= (k if top else 0) + negative
            and np.all(residuals[wanted] <= tol * np.abs(theta[wanted])))

  return converged
