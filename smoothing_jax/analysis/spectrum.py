"""Hessian max-eigenvalue spectrum (paper Appendix A.3, Algorithm 1; HV slides).

For each training mini-batch (as augmented for training), the top-k eigenvalues
of the Hessian of the training objective NLL + weight_decay · R(θ) — R the coupled L2 the
optimiser uses, ½‖θ‖², or HV's Σᵢ‖θᵢ‖₂ (:func:`regularization`) — with BatchNorm in inference
mode and a fixed
dropout key, so each batch defines a fixed symmetric operator.  Eigenvalues of
all batches are pooled into a histogram; the slides' criteria are the mean of
the positive max eigenvalues and the proportion of negative ones.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.tree_util import Partial

from smoothing_jax.analysis.hessian import (
  top_and_min_eigenvalues,
  top_and_min_eigenvalues_per_device,
)
from smoothing_jax.methods import as_method
from smoothing_jax.parallel import create_mesh
from smoothing_jax.passes import sample_rngs

REGULARIZERS = ("half_squared_l2", "sum_of_l2_norms")


def regularization(params, regularizer: str = "half_squared_l2"):
  """The weight-decay term R(θ) that multiplies ``weight_decay`` in the objective:

  * ``"half_squared_l2"``: ½‖θ‖², whose gradient is the coupled weight decay of PyTorch's SGD
    that the papers (and our optimiser) train with;
  * ``"sum_of_l2_norms"``: Σᵢ‖θᵢ‖₂, the sum of each parameter tensor's (unsquared) L2 norm, the
    term HV adds to the NLL in its loss landscapes (``ops/norm.l2`` over
    ``model.parameters()``, ``losslandscape.ipynb``).
  """
  if regularizer == "half_squared_l2":
    return 0.5 * optax.tree_utils.tree_l2_norm(params, squared=True)
  if regularizer == "sum_of_l2_norms":
    return sum(jnp.sqrt(jnp.sum(jnp.square(p.astype(jnp.float32))))
               for p in jax.tree.leaves(params))
  raise ValueError(f"Unknown regularizer {regularizer!r}; choose one of {REGULARIZERS}.")


def training_loss(model, weight_decay, batch_stats, dropout_key, images, labels, params,
                  regularizer: str = "half_squared_l2"):
  """NLL + weight_decay · R(θ) (:func:`regularization`) of one batch, BatchNorm with running
  statistics, fixed dropout key, on the batch as the model's method trains on it
  (``Method.tile``: a BatchEnsemble's, every member on the batch).  ``model``: a Flax module or
  its method."""
  method = as_method(model)
  model = method.model
  images, labels = method.tile(images, labels)
  logits = model.apply({"params": params, "batch_stats": batch_stats}, images, train=False,
                       rngs=sample_rngs(dropout_key))
  nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).mean()
  return nll + weight_decay * regularization(params, regularizer)


def max_eigenvalue_spectrum(model,
                            variables,
                            batches: Iterable[dict],
                            *,
                            k: int = 5,
                            weight_decay: float = 5e-4,
                            max_iters: int = 100,
                            tol: float = 1e-3,
                            rng: jax.Array | None = None,
                            negative: bool = False,
                            method: str = "lanczos",
                            regularizer: str = "half_squared_l2",
                            mesh: Mesh | None = None) -> dict:
  """Top-``k`` (largest-magnitude) eigenvalues for every batch ``{"image", "label"}``; the
  linearisation and the solver step compile once for all batches.

  With Lanczos (the default) the batches are spread over the devices of ``mesh`` (default: every
  device, :func:`smoothing_jax.parallel.create_mesh`): each device linearises and solves its own
  batch, ``mesh.size`` batches at a time in one program per Lanczos step
  (:func:`~smoothing_jax.analysis.hessian.top_and_min_eigenvalues_per_device`), and every batch
  gets the eigenvalues it would get alone on one device.  A group of batches ends at a batch of
  another shape; a group short of ``mesh.size`` batches (the last) runs on its first devices,
  compiled once more.  ``method="power"`` solves one batch after another.

  Returns ``{"eigenvalues": [num_batches, k], "max_eigenvalues": [num_batches],
  "relative_residuals": [num_batches, k], "hvps": [num_batches], "method", **summary}``
  (residuals ‖Hv − λv‖/|λ|; with the default Lanczos each is ≤ ``tol`` unless
  ``max_iters`` ran out).  ``negative=True`` adds ``"min_eigenvalues"`` and
  ``"min_relative_residuals"`` [num_batches], the most negative eigenvalue of each batch
  (with Lanczos from the same Krylov space), for the negative side of HV's spectra.
  ``regularizer``: the weight-decay term R of the objective (:func:`regularization`).
  """
  rng = jax.random.key(0) if rng is None else rng
  regularization(jnp.zeros(()), regularizer)  # an unknown name fails before any work
  static_loss = functools.partial(training_loss, model, weight_decay,  # compiled once
                                  regularizer=regularizer)

  def problems():
    for i, batch in enumerate(batches):
      dropout_key, solver_key = jax.random.split(jax.random.fold_in(rng, i))
      yield Partial(static_loss, variables.get("batch_stats", {}), dropout_key,
                    jnp.asarray(batch["image"]), jnp.asarray(batch["label"])), solver_key

  if method == "lanczos":
    mesh = create_mesh() if mesh is None else mesh
    pairs = _per_device_groups(problems(), variables["params"], mesh, k, max_iters, tol,
                               negative)
  else:
    pairs = [top_and_min_eigenvalues(loss_fn, variables["params"], k, max_iters, tol, key, method,
                                     negative=negative) for loss_fn, key in problems()]
  top, low = [p for p, _ in pairs], [lowest for _, lowest in pairs]
  eigenvalues = np.stack([np.asarray(p.eigenvalues) for p in top])
  out = {
      "eigenvalues": eigenvalues,
      "max_eigenvalues": eigenvalues[:, 0],
      "relative_residuals": np.stack([p.relative_residuals for p in top]),
      "hvps": np.asarray([p.hvps for p in top]),
      "method": method,
      **spectrum_summary(eigenvalues)
  }
  if negative:
    lowest = np.asarray([float(p.eigenvalues[0]) for p in low])
    out.update(min_eigenvalues=lowest, mean_min_eigenvalue=float(np.mean(lowest)),
               min_relative_residuals=np.asarray([p.relative_residuals[0] for p in low]))
    if method == "power":
      out["hvps"] = np.asarray([p.hvps for p in low])
  return out


def _per_device_groups(problems, params, mesh, k, max_iters, tol, negative) -> list:
  """``top_and_min_eigenvalues_per_device`` over ``(loss_fn, key)`` problems in groups of
  ``mesh.size`` of one shape (stacked bound arrays), a shorter group on its first devices."""
  results, group = [], []

  def signature(loss_fn):
    return [(x.shape, x.dtype) for x in jax.tree.leaves(loss_fn)]

  def solve():
    # A short group on as many devices: no copies to compute (simulated CPU devices share the
    # cores), at one more compilation for the remainder of a spectrum.
    devices = mesh if len(group) == mesh.size else Mesh(mesh.devices.ravel()[:len(group)],
                                                        ("data",))
    loss_fns = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(f for f, _ in group))
    keys = jnp.stack([key for _, key in group])
    results.extend(top_and_min_eigenvalues_per_device(loss_fns, params, devices, keys, k,
                                                      max_iters, tol, negative=negative))
    group.clear()

  for problem in problems:
    if group and signature(problem[0]) != signature(group[0][0]):
      solve()
    group.append(problem)
    if len(group) == mesh.size:
      solve()
  if group:
    solve()
  return results


def spectrum_caption(spectra: dict) -> str:
  """Which solver produced the spectra ``{label: max_eigenvalue_spectrum result}`` and how far
  from converged its eigenpairs are, e.g. ``"Lanczos; relative residuals ≤ 8.1e-04"``."""
  results = list(spectra.values())
  methods = sorted({r["method"] for r in results})
  worst = max(
      float(np.max(np.concatenate([np.ravel(r["relative_residuals"]),
                                   np.ravel(r.get("min_relative_residuals", []))])))
      for r in results)
  names = " / ".join("Lanczos" if m == "lanczos" else "power iteration" for m in methods)
  return f"{names}; relative residuals ‖Hv − λv‖/|λ| ≤ {worst:.1e}"


def spectrum_summary(eigenvalues) -> dict:
  """Mean of the positive max eigenvalues and the proportion of negative eigenvalues (pooled)."""
  eigenvalues = np.asarray(eigenvalues)
  top = eigenvalues[:, 0] if eigenvalues.ndim == 2 else eigenvalues
  positive = top[top > 0]
  return {"mean_positive_max_eigenvalue": float(positive.mean()) if positive.size else float("nan"),
          "negative_fraction": float(np.mean(eigenvalues < 0))}
