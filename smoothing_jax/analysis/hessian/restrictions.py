"""The operator's loss, for other Hessians under the same solvers: ``dataset_loss`` the mean over
many batches (the full data set, sharded over a mesh's ``data`` axis), ``restricted_to`` one block
of parameters (a stage, a layer), ``stages`` the blocks a model's parameters name."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

from smoothing_jax.analysis.hessian.hvps import as_pytree


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
