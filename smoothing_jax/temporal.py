"""Temporal smoothing (VQ-BNN, Park et al. 2021) for data streams such as video.

VQ-BNN runs the network once per frame (one stochastic pass of the run's method,
``Method.frame_probs``: an MC dropout, BNN-VI or iBNN sample, a BatchEnsemble's members, or the
deterministic net = "VQ-DNN"; a deep ensemble refuses) and complements the new
prediction with the memorised predictions of the previous frames:

    p(y | x_0) ≈ Σ_{t=0}^{L-1} π_t p(y | x_t, w_t),   π_t ∝ exp(−λ·t),

where t = 0 is the current frame, t = 1 the previous one, and so on (paper
Sec. 1.1, Eq. 3; Appendix A.2: L = 5 predictions, λ = 0.8, i.e. each older frame
weighs e^{-0.8} ≈ 45% of the next newer one).  At the start of a stream, while
fewer than L frames have been seen, π is normalised over the frames present.

Everything is a pure function of a carried :class:`StreamState`, so a whole
video is one ``lax.scan`` (:func:`vq_bnn_predict`) and a long stream can be
processed in chunks, carrying the state from one call to the next, with the
same result.  Works with any registered model (or its method, ``methods.as_method``):
predictions are ``[B, C]`` for classifiers and ``[B, H, W, C]`` for segmentation models.

:func:`stream_predictions` and :func:`stream_statistics` compare one pass per
frame, MC dropout and temporal smoothing on clips (paper Table E.4); :func:`translate_sequences`
makes such clips from still images.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.methods import Method, as_method
from smoothing_jax.metrics import TemporalConsistency, UncertaintyMetrics, label_mask
from smoothing_jax.models.cnn import check_images
from smoothing_jax.passes import check_rng

NUM_FRAMES = 5      # L: predictions kept (the current one included)
DECAY_RATE = 0.8    # λ: importance e^{-λ t} of the frame t steps back


class StreamState(NamedTuple):
  """What a stream carries between frames.

  ``history``: ``[L, *prediction_shape]`` the last L predictive distributions, newest
  first (slots not yet filled are zero); ``frames_seen``: int32 scalar, frames
  processed so far (it also numbers the frames for their sampling keys).
  """
  history: jax.Array
  frames_seen: jax.Array


def init_stream(prediction_shape, num_frames: int = NUM_FRAMES, dtype=jnp.float32) -> StreamState:
  """An empty stream for predictions of shape ``prediction_shape`` (e.g. ``(B, H, W, C)``)."""
  if not isinstance(num_frames, int) or num_frames < 1:
    raise ValueError(f"num_frames (L) must be a positive integer, got {num_frames!r}.")
  return StreamState(jnp.zeros((num_frames,) + tuple(prediction_shape), dtype),
                     jnp.zeros((), jnp.int32))


def temporal_weights(frames_seen, num_frames: int, decay_rate=DECAY_RATE):
  """π ``[L]``: ∝ exp(−λ t) for the ``min(frames_seen, L)`` frames present, 0 for empty slots;
  sums to 1."""
  t = jnp.arange(num_frames)
  weights = jnp.where(t < frames_seen, jnp.exp(-decay_rate * t.astype(jnp.float32)), 0.0)
  return weights / jnp.maximum(jnp.sum(weights), jnp.finfo(jnp.float32).tiny)


def temporal_smoothing(state: StreamState, probs, decay_rate=DECAY_RATE):
  """Push the newest prediction ``probs`` into the stream; return ``(new_state, Σ_t π_t p_t)``.

  ``probs`` must have the stream's prediction shape.  Pure (no side effects), so
  it can be the body of a ``lax.scan``.
  """
  if probs.shape != state.history.shape[1:]:
    raise ValueError(
        f"Prediction shape {probs.shape} does not match the stream's {state.history.shape[1:]}.")
  history = jnp.concatenate([probs[None].astype(state.history.dtype), state.history[:-1]])
  frames_seen = state.frames_seen + 1
  weights = temporal_weights(frames_seen, history.shape[0], decay_rate)
  smoothed = jnp.tensordot(weights.astype(history.dtype), history, axes=1)
  return StreamState(history, frames_seen), smoothed


def _stream_step(method: Method, variables, rng, decay_rate, state, frame):
  # Frame number n uses key fold_in(rng, n): chunked and whole-video runs draw the same samples.
  probs = method.frame_probs(variables, frame, jax.random.fold_in(rng, state.frames_seen))
  return temporal_smoothing(state, probs, decay_rate)


@functools.partial(jax.jit, static_argnames=("method",))
def _jit_stream_step(method, variables, state, frame, rng, decay_rate):
  return _stream_step(method, variables, rng, decay_rate, state, frame)


@functools.partial(jax.jit, static_argnames=("method", "num_frames"))
def _jit_scan(method, variables, state, frames, rng, decay_rate, num_frames):
  if state is None:  # a new stream: its shape is found while tracing, not on every call
    state = init_stream(prediction_shape(method, variables, frames.shape[1:]), num_frames)
  return jax.lax.scan(functools.partial(_stream_step, method, variables, rng, decay_rate), state,
                      frames)


def prediction_shape(model: nn.Module | Method, variables, frame_shape) -> tuple:
  """Shape of one frame's prediction (``[B, C]`` or ``[B, H, W, C]``), from ``jax.eval_shape``."""
  method = as_method(model)
  frame = jax.ShapeDtypeStruct(tuple(frame_shape), jnp.float32)
  out = jax.eval_shape(lambda v, x: method.frame_probs(v, x, jax.random.key(0)), variables, frame)
  return tuple(out.shape)


def stream_predict(model: nn.Module | Method, variables, state: StreamState, frame, *, rng,
                   decay_rate=DECAY_RATE):
  """One jitted VQ-BNN step: predict ``frame [B, H, W, 3]`` once and smooth it with the
  stream's past.

  Frame n of the stream uses dropout/noise key ``fold_in(rng, n)``; keep ``rng``
  fixed along a stream.  Returns ``(new_state, probs)`` with ``probs`` of the
  model's prediction shape (``[B, C]`` or ``[B, H, W, C]``).
  """
  check_images(frame)
  return _jit_stream_step(as_method(model), variables, state, frame, check_rng(rng),
                          jnp.float32(decay_rate))


def vq_bnn_predict(model: nn.Module | Method, variables, frames, *, rng,
                   num_frames: int = NUM_FRAMES,
                   decay_rate=DECAY_RATE, state: StreamState | None = None):
  """VQ-BNN over a video ``frames [T, B, H, W, 3]`` (B parallel streams) in one ``lax.scan``.

  Args:
    model, variables: any registered model (or its method) and its variables.
    frames: ``[T, B, H, W, 3]`` normalised float frames, time first.
    rng: PRNG key of the stream (frame n uses ``fold_in(rng, n)``).
    num_frames: L, predictions kept (ignored when ``state`` is given).
    decay_rate: λ of π_t ∝ exp(−λ t).
    state: the state returned by the previous chunk of the same stream (None: a new stream).

  Returns:
    ``(state, probs [T, B, ..., C])``: the smoothed predictive of every frame.
  """
  if not hasattr(frames, "ndim") or frames.ndim != 5:
    raise ValueError(
        "frames must be [time, batch, height, width, 3], got shape "
        f"{getattr(frames, 'shape', None)}."
    )
  check_images(frames[0])
  if not isinstance(num_frames, int) or num_frames < 1:
    raise ValueError(f"num_frames (L) must be a positive integer, got {num_frames!r}.")
  return _jit_scan(as_method(model), variables, state, frames, check_rng(rng),
                   jnp.float32(decay_rate), num_frames)


def stream_predictions(model: nn.Module | Method,
                       variables,
                       frames,
                       *,
                       rng,
                       num_samples: int,
                       num_frames: int = NUM_FRAMES,
                       decay_rate: float = DECAY_RATE) -> dict:
  """Predictions of the last two frames of clips ``frames [T, B, H, W, 3]`` by each inference
  method.

  Returns ``{method: probs [2, B, ..., C]}`` with methods ``"single"`` (one
  forward pass per frame, ``Method.frame_probs``: the deterministic net, one MC dropout, BNN-VI
  or iBNN sample, or a BatchEnsemble's members' mean), ``"mc"`` (the method's predictive with
  ``num_samples`` draws, ``Method.with_samples``; stochastic methods only) and ``"temporal"``
  (VQ-BNN: one pass per frame, smoothed over the last ``num_frames`` frames with
  π_t ∝ exp(−λ t); the clip must hold ≥ num_frames + 1 frames for both outputs to be fully
  smoothed).
  """
  method = as_method(model)
  keys = jax.random.split(rng, 3)
  last_two = frames[-2:].reshape((-1,) + frames.shape[2:])
  shape = (2, frames.shape[1])
  probs = method.frame_probs(variables, last_two, keys[0])
  out = {"single": probs.reshape(shape + probs.shape[1:])}
  # Branch on the method: the MC row exists only where two draws differ (an MC average of one
  # deterministic pass would repeat the "single" row under another name).
  if method.stochastic and num_samples > 1:
    pred = method.with_samples(num_samples).predict(variables, last_two, rng=keys[1])
    out["mc"] = pred.mean_probs.reshape(shape + pred.mean_probs.shape[1:])
  _, smoothed = vq_bnn_predict(method,
                               variables,
                               frames,
                               rng=keys[2],
                               num_frames=num_frames,
                               decay_rate=decay_rate)
  out["temporal"] = smoothed[-2:]
  return out


def stream_statistics(predictions: dict, labels, mask=None, num_bins: int = 10) -> dict:
  """``{method: (UncertaintyMetrics of the labelled last frame,
  TemporalConsistency of the last pair)}``.

  ``labels [B, H, W]`` belong to the last frame; void pixels (outside ``[0, C)``)
  are masked from every metric, the consistency included (the previous frame is
  1/30 s earlier, so the labelled frame's void mask stands for both).
  """
  stats = {}
  for method, probs in predictions.items():
    weights = label_mask(labels, probs.shape[-1], mask)
    stats[method] = (UncertaintyMetrics.from_model_output(probs[-1],
                                                          labels,
                                                          weights,
                                                          num_bins=num_bins),
                     TemporalConsistency.from_model_output(probs[-1], probs[-2], weights))
  return stats


def statistics_rows(totals: dict, num_samples: int) -> list:
  """One row per method, in the order single, mc, temporal: ``method``, ``passes_per_frame``, every
  :class:`UncertaintyMetrics` value and ``consistency``."""
  rows = []
  for method, passes in (("single", 1), ("mc", num_samples), ("temporal", 1)):
    if method in totals:  # (jitted outputs come back with sorted keys: the order is set here)
      metrics, consistency = totals[method]
      rows.append({
          "method": method,
          "passes_per_frame": passes,
          **metrics.compute(),
          **consistency.compute()
      })
  return rows


def translate_sequences(images: np.ndarray,
                        length: int = 31,
                        max_shift: int = 3,
                        seed: int = 0) -> np.ndarray:
  """Shift-translated sequences ``[N, length, H, W, C]`` from images ``[N, H, W, C]``.

  Frame t shifts its image by s_t pixels, s_t going linearly from −max_shift to
  +max_shift, along a direction drawn per image from the 8 compass directions;
  borders are filled by reflection (CIFAR-10-P ``translate`` shifts up to a few
  pixels per video the same way).  Integer shifts make consecutive frames
  differ by at most one pixel of translation.
  """
  images = np.asarray(images)
  if images.ndim != 4:
    raise ValueError(f"translate_sequences expects images [N, H, W, C], got shape {images.shape}.")
  if length < 2:
    raise ValueError(f"A sequence needs at least 2 frames, got length={length}.")
  n, h, w, _ = images.shape
  if not 0 < max_shift < min(h, w):
    raise ValueError(f"max_shift must lie in (0, {min(h, w)}), got {max_shift}.")
  directions = np.array([(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if (dy, dx) != (0, 0)])
  direction = directions[np.random.default_rng(seed).integers(len(directions), size=n)]
  shifts = np.rint(np.linspace(-max_shift, max_shift, length)).astype(int)
  p = max_shift
  padded = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0)), mode="reflect")
  frames = np.empty((n, length, h, w, images.shape[-1]), images.dtype)
  for t, s in enumerate(shifts):
    for i in range(n):
      dy, dx = direction[i] * s
      frames[i, t] = padded[i, p - dy:p - dy + h, p - dx:p - dx + w]
  return frames
