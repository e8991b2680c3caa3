"""Feature-map probes by depth: Fourier Δlog-amplitude and feature-map variance (paper Fig. 5,
HV Fig. 2/9).

Feature maps are tapped with Flax ``capture_intermediates`` (no model copies):
by default the outputs of every block (residual, VGG, AlexNet, WRN blocks; ViT
MSA/MLP units; PiT MSA/MLP units and pooling layers; AlterNet Conv/MSA blocks; Swin MSA/MLP
units, NHWC maps already) and smoothing layer of the network, in execution order; stem
convolutions, BatchNorm layers and patch merging on their own are not taps.
ViT and PiT token outputs [B, N, D] become maps [B, h, w, D] (CLS token dropped), as in HV.
"""
from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.analysis.fourier import delta_log_amplitude
from smoothing_jax.inference import sample_rngs
from smoothing_jax.layers import Smooth
from smoothing_jax.models.alternet import AttentionBlock
from smoothing_jax.models.common import CNN
from smoothing_jax.models.pit import Pooling
from smoothing_jax.models.swin import SwinUnit
from smoothing_jax.models.vit import TransformerUnit, tokens_to_map

TAPPED = (CNN, Smooth, TransformerUnit, AttentionBlock, SwinUnit, Pooling)


def _is_block(module, method_name: str) -> bool:
  path = module.scope.path if module.scope is not None else ()
  return method_name == "__call__" and len(path) == 1 and isinstance(module, TAPPED)


def block_kinds(model, names) -> dict:
  """``{block: kind}``: "msa", "mlp" or "conv" from ``model.units()`` (ViT, AlterNet), "smooth" for
  smoothing layers, "conv" for the other CNN blocks (and PiT's pooling layers, depth-wise convs)."""
  units = dict(model.units()) if hasattr(model, "units") else {}
  return {n: units.get(n, "smooth" if n.startswith("smooth") else "conv") for n in names}


def _captured(model, filter_fn, variables, images, rng) -> dict:
  _, state = model.apply(variables,
                         images,
                         train=False,
                         rngs=sample_rngs(rng),
                         capture_intermediates=filter_fn,
                         mutable=["intermediates"])
  return {
      name: out["__call__"][0] for name, out in state["intermediates"].items() if "__call__" in out
  }


_captured_jit = jax.jit(_captured, static_argnums=(0, 1))
_ORDER: dict = {}


def _execution_order(model, filter_fn, variables, images, rng) -> list:
  """Tap names in execution order (jit returns dicts sorted by key), traced once per model and
  shape."""
  key = (model, filter_fn, images.shape)
  if key not in _ORDER:
    names = []

    def trace(v, x, r):
      maps = _captured(model, filter_fn, v, x, r)
      names.extend(maps)  # insertion order of capture_intermediates = execution order
      return maps
    jax.eval_shape(trace, variables, images, rng)
    _ORDER[key] = names
  return _ORDER[key]


def feature_maps(model, variables, images, rng=None, filter_fn: Callable = _is_block) -> dict:
  """``{block name: NHWC output}`` in execution order for one forward pass (eval mode, dropout key
  ``rng``)."""
  rng = jax.random.key(0) if rng is None else rng
  maps = _captured_jit(model, filter_fn, variables, images, rng)
  return {name: tokens_to_map(maps[name]) if maps[name].ndim == 3 else maps[name]
          for name in _execution_order(model, filter_fn, variables, images, rng)}


def fourier_by_depth(model, variables, images, rng=None) -> dict:
  """``{block: Δlog-amplitude curve}`` for every tapped block (square maps)."""
  return {
      name: np.asarray(delta_log_amplitude(x))
      for name, x in feature_maps(model, variables, images, rng).items()
  }


def feature_variance(model,
                     variables,
                     images,
                     *,
                     num_samples: int = 10,
                     rng: Optional[jax.Array] = None) -> dict:
  """Data and model uncertainty of feature maps by depth (paper Fig. 5).

  data: spatial variance of each map per sample and channel, averaged (over the
  first pass); model: variance over ``num_samples`` stochastic passes of every
  element, averaged.  Returns ``{block: {"data": float, "model": float}}``.
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
