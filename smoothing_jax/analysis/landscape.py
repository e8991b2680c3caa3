"""Loss landscapes (Li et al. 2018; SS/HV reference): L(θ + α·d₁ + β·d₂) on a grid.

Directions are Gaussian, normalised per weight tensor so that the surface is
comparable across networks.  A kernel's *output units* are its trailing output axes
(:func:`output_axes`): the last axis of Dense [in, out], Conv [kh, kw, in, out] and the MSA
output projection [h, d, C]; the last three of the fused qkv projection [C, 3, h, d].  Any other
tensor of two or more axes (ViT's ``cls_token`` [1, 1, D]) has PyTorch's layout already, so its
first axis plays the output units' part, as dim 0 does in the references' code.

* ``"filter"`` (Li et al.): each output unit (filter) of d gets the norm of the same
  unit of θ: norms over the input axes;
* ``"reference"`` (SS/HV code, ``torch.norm(w, dim=0)`` on PyTorch's [out, in, ...] layout):
  normalised over the output axes, separately for every input position.

1-D tensors (biases, BatchNorm scale/offset) get zero direction in both, and so do
parameters whose path matches a pattern of ``ignore`` (default: HV's ``kws``, position
embeddings and relative-position tables, ``ops/loss_landscapes.ignore_kw``).
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.analysis.hessian import as_pytree
from smoothing_jax.analysis.spectrum import regularization

NORMALIZATIONS = ("filter", "reference")
# HV's loss-landscape ``kws``: regular expressions searched in each parameter's path.
IGNORED_PARAMETERS = ("pos_embed", "relative_position")
# Kernels whose output units span several trailing axes (a Flax ``DenseGeneral`` with a tuple of
# features), by a regular expression of their path: the fused qkv projection
# (``layers.attention``: [C, 3, heads, head_dim]).  Every other kernel has one output axis, last.
MULTI_AXIS_OUTPUTS = ((r"(^|/)qkv/kernel$", 3),)


def output_axes(name: str, w) -> tuple:
  """The axes of the output units of the parameter ``w`` at path ``name``: a kernel's trailing
  ones; the first axis of any other tensor (PyTorch's dim 0: Li et al. normalise each slice
  along it, so a [1, 1, D] token as a whole; HV's ``normalize_filter`` takes the norm over it, so
  that token element by element)."""
  if not re.search(r"(^|/)kernel$", name):
    return (0,)
  count = next((n for pattern, n in MULTI_AXIS_OUTPUTS if re.search(pattern, name)), 1)
  return tuple(range(w.ndim - count, w.ndim))


def _normalize_direction(d, w, normalization, outputs):
  if w.ndim <= 1:
    return jnp.zeros_like(d)
  if normalization == "filter":  # each output unit: norms over its inputs
    axes = tuple(a for a in range(w.ndim) if a not in outputs)
  else:  # reference: over the output axes, for every input position
    axes = outputs
  w_norm = jnp.sqrt(jnp.sum(w ** 2, axis=axes, keepdims=True))
  d_norm = jnp.sqrt(jnp.sum(d ** 2, axis=axes, keepdims=True))
  return d * w_norm / (d_norm + 1e-10)


def random_direction(params, rng, normalization: str = "filter",
                     ignore: Sequence[str] = IGNORED_PARAMETERS):
  """A Gaussian direction pytree shaped like ``params``, normalised as described above; zero on
  parameters whose ``/``-joined path matches a regular expression of ``ignore``."""
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"Unknown normalization {normalization!r}; choose one of {NORMALIZATIONS}.")
  paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(rng, len(paths_and_leaves))
  directions = []
  for k, (path, w) in zip(keys, paths_and_leaves, strict=True):
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    d = _normalize_direction(jax.random.normal(k, w.shape, w.dtype), w, normalization,
                             output_axes(name, w))
    directions.append(jnp.zeros_like(d) if any(re.search(p, name) for p in ignore) else d)
  return jax.tree.unflatten(treedef, directions)


def loss_surface(loss_fn: Callable, params, d1, d2, alphas, betas, *, weight_decay: float = 0.0,
                 regularizer: str = "half_squared_l2", chunk_size: int = 16) -> dict:
  """``loss_fn`` on the grid θ + α·d₁ + β·d₂, ``chunk_size`` grid points per vmapped call.

  Returns ``{"alphas", "betas", "loss" [len(alphas), len(betas)], "loss_l2", "regularizer"}``
  where ``loss_l2`` adds ``weight_decay · R(θ)`` at each point, R the ``regularizer`` of
  :func:`~smoothing_jax.analysis.spectrum.regularization` (½‖θ‖²: the training objective;
  Σᵢ‖θᵢ‖₂: HV's landscapes).
  """
  regularization(jnp.zeros(()), regularizer)  # an unknown name fails before any work
  alphas, betas = np.asarray(alphas, np.float32), np.asarray(betas, np.float32)
  grid = np.stack(np.meshgrid(alphas, betas, indexing="ij"), axis=-1).reshape(-1, 2)

  @jax.jit
  def evaluate(loss_fn, params, d1, d2,
               coords):  # arrays as arguments: no constant folding of the network
    def at(c):
      point = jax.tree.map(lambda p, a, b: p + c[0] * a + c[1] * b, params, d1, d2)
      return loss_fn(point), regularization(point, regularizer)
    return jax.vmap(at)(coords)

  losses, norms = [], []
  for start in range(0, len(grid), chunk_size):
    coords = grid[start:start + chunk_size]
    pad = chunk_size - len(coords)
    loss, norm = evaluate(as_pytree(loss_fn), params, d1, d2,
                          jnp.asarray(np.concatenate([coords, np.zeros((pad, 2), np.float32)])))
    losses.append(np.asarray(loss)[:len(coords)])
    norms.append(np.asarray(norm)[:len(coords)])
  loss = np.concatenate(losses).reshape(len(alphas), len(betas))
  l2 = np.concatenate(norms).reshape(len(alphas), len(betas))
  return {"alphas": alphas, "betas": betas, "loss": loss, "loss_l2": loss + weight_decay * l2,
          "regularizer": regularizer}
