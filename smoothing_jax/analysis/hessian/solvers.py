"""The public eigensolvers, ``top_eigenvalues``, ``min_eigenvalue`` and
``top_and_min_eigenvalues`` (power iteration or block Lanczos, ``method``), and
``top_and_min_eigenvalues_per_device``: one problem per device of a mesh (a batch each) in one
program per iteration."""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

from smoothing_jax.analysis.hessian.eigenpairs import Eigenpairs, check_args
from smoothing_jax.analysis.hessian.hvps import linearized_hvp
from smoothing_jax.analysis.hessian.lanczos import (
  ascending,
  block_step,
  block_steps,
  by_magnitude,
  first_block,
  jit_block_step,
  lanczos_state,
  orthonormal_start,
  ritz_converged,
  ritz_pairs,
  run_lanczos,
)
from smoothing_jax.analysis.hessian.power import power_iteration, power_top


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
  check_args(k, max_iters, tol, method, block_size, reorthogonalization)
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
    steps = block_steps(max_iters, block, flat.shape[0])
    step = functools.partial(jit_block_step, linear, params, full=reorthogonalization == "full")
    [(theta, vectors, coupling)], basis, [reorthogonalized] = run_lanczos(
        step, *first_block(params, start, steps), steps, step_key,
        ritz_converged(k, top, negative, tol), k if top else 1)
    pairs = functools.partial(ritz_pairs, theta, vectors, coupling, basis, reorthogonalized,
                              record=record)
    return (pairs(by_magnitude(theta), k, np.abs) if top else None,
            pairs(ascending(theta), 1, np.negative) if negative else None)
  top_pairs, hvps = None, 0
  if top or known_top is None:
    values, vectors, residuals, iterations = power_top(linear, params, flat, k, max_iters, tol,
                                                        top_key)
    top_pairs = record(values, vectors, iterations=iterations, residuals=residuals,
                       hvps=int(iterations.sum()))
    known_top, hvps = float(values[0]), top_pairs.hvps
  if not negative:
    return top_pairs, None
  shift = abs(known_top)
  shifted, residual, vector, its = power_iteration(
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
  """``(linearize, start, step)``: ``grad(L)`` linearised, :func:`orthonormal_start` and
  :func:`block_step` as programs over ``mesh`` in which each device runs them on its own
  problem.  Their stacked arguments (a leading axis of ``mesh.size``, sharded on ``data``) hold
  one problem per device; the parameters and the step index are replicated.  No device waits for
  another: there is no collective, so the devices' HVPs run side by side."""
  data, replicated = P("data"), P()

  def sharded(fn, in_specs):
    def body(*args):
      return _stacked(fn(*(_local(a) if spec == data else a
                           for a, spec in zip(args, in_specs, strict=True))))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=data,
                                 check_vma=False))

  linearize = sharded(lambda loss_fn, params: jax.linearize(jax.grad(loss_fn), params)[1],
                      (data, replicated))
  start = sharded(orthonormal_start, (data,))
  step = sharded(functools.partial(block_step, full=full),
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
  check_args(k, max_iters, tol, "lanczos", block_size, reorthogonalization)
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
  steps = block_steps(max_iters, block, n)
  count = mesh.size
  state = jax.tree.map(lambda x: jnp.stack([x] * count), lanczos_state(steps, block, flat.dtype))
  start, coupling, state, step_keys = jax.device_put(
      (start, jnp.zeros((count, block, block), flat.dtype), state, step_keys), stacked)
  linear = linearize(jax.device_put(loss_fns, stacked), params)
  results, _, reorthogonalized = run_lanczos(
      lambda x, x_prev, j, coupling, state: step(linear, params, x, x_prev, j, coupling, state),
      start_block(start), coupling, state, steps, step_keys, ritz_converged(k, True, negative, tol),
      k)
  record = functools.partial(_eigenpairs, unravel=unravel, dtype=flat.dtype, method="lanczos")
  return [(ritz_pairs(theta, vectors, coupling, None, count, by_magnitude(theta), k, np.abs,
                       record=record),
           ritz_pairs(theta, vectors, coupling, None, count, ascending(theta), 1, np.negative,
                       record=record) if negative else None)
          for (theta, vectors, coupling), count in zip(results, reorthogonalized, strict=True)]
