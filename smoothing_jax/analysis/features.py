"""Feature-map probes by depth: Fourier Δlog-amplitude and feature-map variance (paper Fig. 5,
HV Fig. 2/9).

Each model declares its taps, ``model.feature_taps() -> [(name, kind)]`` in execution order: at
depth 0 the stem ("stem") or patch embedding ("embedding") output, as HV's curves start there;
then every block ("conv", "msa", "mlp"), smoothing layer ("smooth"), PiT pooling ("pool") and
Swin patch merging ("merge").  A tap is the ``__call__`` output of the top-level submodule of that
name, or what the model sows into ``"intermediates"`` under it (stems and embeddings that are no
single submodule).  Both are read with Flax ``capture_intermediates`` (no model copies).
Token outputs [B, N, D] become maps [B, h, w, D] (CLS token dropped), as in HV.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.analysis.fourier import delta_log_amplitude
from smoothing_jax.methods import as_method
from smoothing_jax.passes import sample_rngs


def _taps(model) -> list:
  if not hasattr(model, "feature_taps"):
    raise TypeError(f"{type(model).__name__} declares no feature taps (feature_taps()).")
  return model.feature_taps()


def block_kinds(model, names) -> dict:
  """``{tap: kind}`` of the ``names`` from ``model.feature_taps()``: "stem" / "embedding" (depth
  0), "conv", "msa", "mlp", "smooth", "pool" (PiT) or "merge" (Swin)."""
  kinds = dict(_taps(model))
  unknown = [n for n in names if n not in kinds]
  if unknown:
    raise ValueError(f"{unknown} are not feature taps of {type(model).__name__}; its taps are "
                     f"{list(kinds)}.")
  return {n: kinds[n] for n in names}


def tokens_to_map(tokens):
  """``[B, N, D]`` tokens → ``[B, h, w, D]`` (drops a CLS token when N = h·w + 1; square
  grids)."""
  n = tokens.shape[1]
  side = math.isqrt(n)
  if side * side != n:
    tokens, side = tokens[:, 1:], math.isqrt(n - 1)
  return tokens.reshape(tokens.shape[0], side, side, tokens.shape[-1])


@functools.partial(jax.jit, static_argnames=("model",))
def _captured(model, variables, images, rng) -> dict:
  names = {name for name, _ in _taps(model)}

  def tapped(module, method_name: str) -> bool:
    path = module.scope.path if module.scope is not None else ()
    return method_name == "__call__" and len(path) == 1 and path[0] in names

  # One network's feature maps (a BatchEnsemble's: its first member's; Method.one_network).
  _, state = model.apply(variables,
                         images,
                         train=False,
                         rngs=sample_rngs(rng),
                         capture_intermediates=tapped,
                         mutable=["intermediates"],
                         **as_method(model).one_network(images.shape[0]))
  # A tapped submodule's entry is {"__call__": (output,), ...}; a sown tap's is (value,).
  return {
      name: out["__call__"][0] if isinstance(out, Mapping) else out[0]
      for name, out in state["intermediates"].items() if name in names
  }


def feature_maps(model, variables, images, rng=None) -> dict:
  """``{tap name: NHWC output}`` in execution order (``model.feature_taps()``) for one forward
  pass (eval mode, dropout key ``rng``)."""
  rng = jax.random.key(0) if rng is None else rng
  maps = _captured(model, variables, images, rng)
  names = [name for name, _ in _taps(model)]
  missing = [name for name in names if name not in maps]
  if missing:
    raise ValueError(f"{type(model).__name__}.feature_taps() declares {missing}, which the forward "
                     "pass did not produce.")
  return {name: tokens_to_map(maps[name]) if maps[name].ndim == 3 else maps[name]
          for name in names}


def fourier_by_depth(model, variables, images, rng=None) -> dict:
  """``{tap: Δlog-amplitude curve}`` for every tap (square maps)."""
  return {
      name: np.asarray(delta_log_amplitude(x))
      for name, x in feature_maps(model, variables, images, rng).items()
  }


def feature_variance(model,
                     variables,
                     images,
                     *,
                     num_samples: int = 10,
                     rng: jax.Array | None = None) -> dict:
  """Data and model uncertainty of feature maps by depth (paper Fig. 5).

  data: spatial variance of each map per sample and channel, averaged (over the
  first pass); model: variance over ``num_samples`` stochastic passes of every
  element, averaged.  Returns ``{tap: {"data": float, "model": float}}``.
  """
  rng = jax.random.key(0) if rng is None else rng
  passes = [
      feature_maps(model, variables, images, key) for key in jax.random.split(rng, num_samples)
  ]
  out = {}
  for name in passes[0]:
    stacked = jnp.stack([p[name] for p in passes])                      # [N, B, H, W, C]
    out[name] = {"data": float(jnp.mean(jnp.var(stacked[0], axis=(1, 2), ddof=1))),
                 "model": float(jnp.mean(jnp.var(stacked, axis=0)))}
  return out
