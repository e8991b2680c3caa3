"""Feature-map similarity by mini-batch linear CKA (HV Sec. 4.1: "feature map similarities show
the block structure of ResNet and Swin").

Mini-batch CKA (Nguyen, Raghu & Kornblith 2021, "Do wide and deep networks learn the same
things?", Eq. 2–3): for mini-batch i of n examples with flattened features X_i [n, p] and
Y_i [n, q], the linear Gram matrices K = X_i X_iᵀ and L = Y_i Y_iᵀ enter the unbiased HSIC
estimator of Song et al. (2012),

  HSIC₁(K, L) = [tr(K̃L̃) + 1ᵀK̃1 · 1ᵀL̃1 / ((n−1)(n−2)) − 2/(n−2) · 1ᵀK̃L̃1] / (n(n−3)),

K̃, L̃ = K, L with zeroed diagonals, and over k mini-batches

  CKA = Σᵢ HSIC₁(Kᵢ, Lᵢ) / sqrt(Σᵢ HSIC₁(Kᵢ, Kᵢ) · Σᵢ HSIC₁(Lᵢ, Lᵢ))

(the paper's 1/k means cancel).  HSIC₁ is a U-statistic over distinct example indices, so it
does not change when a constant vector is subtracted from every row of X (K ↦ K − a1ᵀ − 1aᵀ + c
only moves terms that cancel); the features are centred over the batch before their Gram
matrices are formed, which keeps float32 sums small.

Feature maps are the taps of :mod:`smoothing_jax.analysis.features` (block outputs in
execution order).  Per mini-batch: one compiled forward pass per model (the capture of
``features.feature_maps``) and one compiled call forming every block's Gram matrix and every
pairwise HSIC₁; the sums are accumulated in float64 on the host.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.analysis.features import block_kinds, feature_maps


def unbiased_hsic(grams_a: jax.Array, grams_b: jax.Array) -> jax.Array:
  """HSIC₁ (Song et al. 2012; module docstring) of every pair of symmetric Gram matrices.

  Args:
    grams_a: [A, n, n] symmetric Gram matrices of one mini-batch (n ≥ 4).
    grams_b: [B, n, n] the same for the other set of features.

  Returns:
    [A, B] HSIC₁(grams_a[a], grams_b[b]).
  """
  n = grams_a.shape[-1]
  off_diagonal = 1.0 - jnp.eye(n, dtype=grams_a.dtype)
  k_tilde, l_tilde = grams_a * off_diagonal, grams_b * off_diagonal
  trace = jnp.einsum("aij,bij->ab", k_tilde, l_tilde)  # tr(K̃L̃) = Σᵢⱼ K̃ᵢⱼ L̃ᵢⱼ for symmetric L̃
  rows_k, rows_l = k_tilde.sum(-1), l_tilde.sum(-1)  # K̃1 [A, n], L̃1 [B, n]
  totals = jnp.outer(rows_k.sum(-1), rows_l.sum(-1))  # 1ᵀK̃1 · 1ᵀL̃1
  cross_rows = rows_k @ rows_l.T  # 1ᵀK̃L̃1
  return (trace + totals / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * cross_rows) / (n * (n - 3))


def _centred_grams(features: Sequence[jax.Array]) -> jax.Array:
  """[A, n, n] linear Gram matrices of the features [n, ...] (each flattened, centred over n)."""
  flat = [f.reshape(f.shape[0], -1).astype(jnp.float32) for f in features]
  centred = [x - x.mean(0) for x in flat]
  return jnp.stack([x @ x.T for x in centred])


def _self_hsic(grams: jax.Array) -> jax.Array:
  """[A] HSIC₁ of each Gram matrix [A, n, n] with itself."""
  return jax.vmap(lambda g: unbiased_hsic(g[None], g[None])[0, 0])(grams)


@jax.jit
def _hsic_terms(features_a, features_b):
  grams_a = _centred_grams(features_a)
  if features_b is None:
    cross = unbiased_hsic(grams_a, grams_a)
    return cross, jnp.diagonal(cross), jnp.diagonal(cross)
  grams_b = _centred_grams(features_b)
  return unbiased_hsic(grams_a, grams_b), _self_hsic(grams_a), _self_hsic(grams_b)


def hsic_terms(features_a: Sequence[jax.Array],
               features_b: Sequence[jax.Array] | None = None) -> tuple:
  """The HSIC₁ terms of one mini-batch in one compiled call.

  Args:
    features_a: A arrays [n, ...] (any trailing shape, flattened), the same n examples.
    features_b: B arrays [n, ...] of the same examples; None: ``features_a`` again.

  Returns:
    ``(cross [A, B], self_a [A], self_b [B])``: HSIC₁ between feature a and feature b, and of
    each feature with itself.

  Raises:
    ValueError: no features, fewer than 4 examples, or features of different batch sizes.
  """
  features_a = tuple(features_a)
  features_b = None if features_b is None else tuple(features_b)
  if not features_a or features_b == ():
    raise ValueError("hsic_terms needs at least one feature array on each side.")
  sizes = {int(np.shape(f)[0]) for f in features_a + (features_b or ())}
  if len(sizes) != 1:
    raise ValueError(f"Features of one mini-batch must share the batch size; got sizes "
                     f"{sorted(sizes)}.")
  if sizes.pop() < 4:
    raise ValueError("The unbiased HSIC needs mini-batches of at least 4 examples (it divides "
                     "by n(n−3)).")
  return _hsic_terms(features_a, features_b)


def minibatch_cka(batches: Iterable[tuple]) -> np.ndarray:
  """Mini-batch linear CKA (module docstring) between every feature of A and every feature of B.

  Args:
    batches: per mini-batch, ``(features_a, features_b)`` as in :func:`hsic_terms`
      (``features_b`` None: A against itself).

  Returns:
    [A, B] float64 CKA; NaN where a feature's summed self-HSIC₁ is 0 (a constant feature).
  """
  sums = None
  for features_a, features_b in batches:
    terms = [np.asarray(t, np.float64) for t in hsic_terms(features_a, features_b)]
    sums = terms if sums is None else [s + t for s, t in zip(sums, terms, strict=True)]
  if sums is None:
    raise ValueError("minibatch_cka needs at least one mini-batch.")
  cross, self_a, self_b = sums
  with np.errstate(invalid="ignore", divide="ignore"):
    return cross / np.sqrt(np.outer(self_a, self_b))


def _block_axis(model, maps: dict, image_shape) -> dict:
  """Names, kinds, spatial sizes (h, w) and sub-sampling positions of the tapped blocks."""
  names = list(maps)
  kinds = block_kinds(model, names)
  sizes = [tuple(int(s) for s in m.shape[1:3]) for m in maps.values()]
  previous = [tuple(image_shape[1:3])] + sizes[:-1]
  return {
      "blocks": names,
      "kinds": [kinds[n] for n in names],
      "spatial_sizes": sizes,
      "resolution_changes": [
          i for i, (size, before) in enumerate(zip(sizes, previous, strict=True))
          if np.prod(size) < np.prod(before)
      ],
  }


def _batch_images(batch, num_models: int, index: int) -> list:
  """One image array [n, H, W, 3] per model from ``batch`` (an array, or one per model)."""
  images = [batch] * num_models if hasattr(batch, "shape") else list(batch)
  if len(images) != num_models or any(np.ndim(x) != 4 for x in images):
    expected = "an image array [n, H, W, 3]" + (" or a pair (images_a, images_b) of them"
                                                 if num_models > 1 else "")
    raise ValueError(f"Batch {index}: expected {expected}; got a {type(batch).__name__}.")
  return images


def _similarity(models: list, batches: Iterable, rng: jax.Array | None) -> dict:
  """CKA between the blocks of ``models[0]`` and ``models[-1]`` (``[(model, variables)]``, one
  or two); a batch is one image array, or one per model."""
  rng = jax.random.key(0) if rng is None else rng
  axes, seen = [], {"num_batches": 0, "num_examples": 0}

  def features():
    for i, batch in enumerate(batches):
      images = _batch_images(batch, len(models), i)
      maps = [
          feature_maps(model, variables, jnp.asarray(x), jax.random.fold_in(rng, i))
          for (model, variables), x in zip(models, images, strict=True)
      ]
      if not axes:
        axes.extend(_block_axis(model, m, np.shape(x))
                    for (model, _), m, x in zip(models, maps, images, strict=True))
      seen["num_batches"] += 1
      seen["num_examples"] += int(np.shape(images[0])[0])
      yield tuple(maps[0].values()), (tuple(maps[1].values()) if len(maps) > 1 else None)

  cka = minibatch_cka(features())
  return {"cka": cka, "rows": axes[0], "cols": axes[-1], **seen}


def feature_similarity(model,
                       variables,
                       batches: Iterable,
                       rng: jax.Array | None = None) -> dict:
  """Mini-batch linear CKA between every pair of tapped blocks of one model (eval mode; MC dropout
  models draw batch i's masks from ``fold_in(rng, i)``).

  Args:
    model, variables: the network and its variables.
    batches: normalised image batches [n, H, W, 3], n ≥ 4 (equal sizes avoid recompiling).
    rng: the dropout key (default ``key(0)``).

  Returns:
    ``{"cka": [A, A] float64, "rows": axis, "cols": axis, "num_batches", "num_examples"}``, with
    ``axis = {"blocks": names in execution order, "kinds": "stem"/"embedding"/"msa"/"mlp"/
    "conv"/"smooth"/"pool"/"merge" (features.block_kinds), "spatial_sizes": [(h, w)],
    "resolution_changes": indices of the blocks whose output is smaller than the previous
    block's (block 0: than the image) — the stem or patch embedding, pooling, patch merging and
    strided stage starts}``.
  """
  return _similarity([(model, variables)], batches, rng)


def cross_model_similarity(model_a,
                           variables_a,
                           model_b,
                           variables_b,
                           batches: Iterable,
                           rng: jax.Array | None = None) -> dict:
  """Mini-batch linear CKA between every block of model A (rows) and every block of model B
  (columns) on the same examples.

  Args:
    batches: per mini-batch, normalised images [n, H, W, 3] fed to both models, or a pair
      ``(images_a, images_b)`` of the same n examples prepared for each model.
    rng: the dropout key of both models (default ``key(0)``).

  Returns:
    As :func:`feature_similarity`, with ``cka`` [A, B], ``rows`` model A's blocks and ``cols``
    model B's.
  """
  return _similarity([(model_a, variables_a), (model_b, variables_b)], batches, rng)


def stage_block_structure(result: dict) -> dict:
  """Mean CKA between distinct blocks of the same stage and between blocks of different stages
  of a :func:`feature_similarity` result (stages split at ``resolution_changes``); HV's block
  structure is ``within_stage > across_stages``.

  Returns ``{"within_stage_mean_cka", "across_stages_mean_cka"}``, each only where such pairs of
  blocks exist (the second needs more than one stage).
  """
  axis = result["rows"]
  if axis["blocks"] != result["cols"]["blocks"]:
    raise ValueError("stage_block_structure needs the CKA of one model's blocks with themselves.")
  changes = set(axis["resolution_changes"]) - {0}
  stage = np.cumsum([i in changes for i in range(len(axis["blocks"]))])
  same = stage[:, None] == stage[None, :]
  cka = np.asarray(result["cka"])
  pairs = {"within_stage_mean_cka": cka[same & ~np.eye(len(stage), dtype=bool)],
           "across_stages_mean_cka": cka[~same]}
  return {key: float(np.mean(values)) for key, values in pairs.items() if values.size}
