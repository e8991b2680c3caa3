"""RandAugment (Cubuk et al. 2020) in TF ops with stateless seeds, as timm's
``rand-m{M}-n{N}-mstd{S}``.

Per image: N operations drawn uniformly (with replacement) from the 15 below,
each applied with probability 0.5 at magnitude m ~ N(M, S²) clipped to [0, 10]
(S = 0: m = M).  Magnitude → argument (timm's non-"increasing" set):
rotate ±30°·m/10, shear ±0.3·m/10, translate ±0.45·m/10 of the side, colour /
contrast / brightness / sharpness factor 0.1 + 1.8·m/10, posterize to ⌊4·m/10⌋
bits, solarize above ⌊256·m/10⌋, solarize-add ⌊110·m/10⌋ below 128; auto-contrast,
equalize and invert take none.  Geometric ops fill with grey (128).  Input and
output are uint8 [H, W, 3]; every draw comes from ``seed``, so results are reproducible.
"""
from __future__ import annotations

import math

import tensorflow as tf

OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
       "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
       "TranslateYRel")
FILL = 128.0


def _blend(degenerate, image, factor):
  """PIL ``ImageEnhance``: degenerate + factor·(image − degenerate), clipped to uint8."""
  out = tf.cast(
      degenerate,
      tf.float32) + factor * (tf.cast(image, tf.float32) - tf.cast(degenerate, tf.float32))
  return tf.cast(tf.floor(tf.clip_by_value(out, 0.0, 255.0)), tf.uint8)  # PIL truncates


def _affine(image, matrix):
  """Warp with PIL's ``Image.transform(AFFINE, matrix)``: output (x, y) samples input
  (a0 x + a1 y + a2, b0 x + b1 y + b2), in PIL's continuous coordinates (pixel centres at +0.5)."""
  a0, a1, a2, b0, b1, b2 = tf.unstack(tf.cast(matrix, tf.float32))
  # Integer pixel coordinates (TF): shift the offsets by the half-pixel convention.
  matrix = tf.stack([a0, a1, a2 + 0.5 * (a0 + a1 - 1.0), b0, b1, b2 + 0.5 * (b0 + b1 - 1.0)])
  transforms = tf.concat([matrix, tf.zeros([2], tf.float32)], 0)[None]
  out = tf.raw_ops.ImageProjectiveTransformV3(images=tf.cast(image, tf.float32)[None],
                                              transforms=transforms,
                                              output_shape=tf.shape(image)[:2],
                                              fill_value=FILL,
                                              interpolation="BILINEAR",
                                              fill_mode="CONSTANT")[0]
  return tf.cast(tf.clip_by_value(tf.round(out), 0.0, 255.0), tf.uint8)


def rotate(image, degrees):
  """Rotate counter-clockwise about the centre by ``degrees`` (PIL ``Image.rotate``)."""
  h, w = tf.cast(tf.shape(image)[0], tf.float32), tf.cast(tf.shape(image)[1], tf.float32)
  cx, cy = w / 2, h / 2
  t = -degrees * math.pi / 180.0
  c, s = tf.cos(t), tf.sin(t)
  return _affine(image, tf.stack([c, s, cx - c * cx - s * cy, -s, c, cy + s * cx - c * cy]))


def auto_contrast(image):
  """Stretch each channel to [0, 255] (unchanged where the channel is constant); PIL's lut in
  float64."""
  x = tf.cast(image, tf.float64)
  lo, hi = tf.reduce_min(x, axis=(0, 1)), tf.reduce_max(x, axis=(0, 1))
  scale = tf.where(hi > lo, 255.0 / tf.maximum(hi - lo, 1.0), 1.0)
  offset = tf.where(hi > lo, -lo * scale, 0.0)
  return tf.cast(tf.floor(tf.clip_by_value(x * scale + offset, 0.0, 255.0)), tf.uint8)


def _equalize_channel(channel):
  """PIL ``ImageOps.equalize`` of one uint8 channel [H, W]."""
  hist = tf.math.bincount(tf.cast(tf.reshape(channel, [-1]), tf.int32),
                          minlength=256,
                          maxlength=256)
  last = tf.gather(hist, tf.reduce_max(tf.where(hist > 0)[:, 0]))
  step = (tf.reduce_sum(hist) - last) // 255
  lut = (tf.cumsum(hist, exclusive=True) + step // 2) // tf.maximum(step, 1)
  lut = tf.clip_by_value(lut, 0, 255)
  equalized = tf.gather(lut, tf.cast(channel, tf.int32))
  return tf.cast(tf.where(step == 0, tf.cast(channel, tf.int32), equalized), tf.uint8)


def equalize(image):
  return tf.stack([_equalize_channel(image[..., c]) for c in range(3)], -1)


def grayscale(image):
  """ITU-R 601-2 luma (PIL "L"), as float [H, W, 1]."""
  x = tf.cast(image, tf.float32)
  return tf.round(x[..., :1] * 0.299 + x[..., 1:2] * 0.587 + x[..., 2:] * 0.114)


def sharpness_degenerate(image):
  """PIL ``SMOOTH`` filter (3×3 kernel [1 1 1; 1 5 1; 1 1 1]/13) inside, original pixels on
  the border."""
  x = tf.cast(image, tf.float32)[None]
  kernel = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13.0
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, 3, 1])
  smooth = tf.round(tf.nn.depthwise_conv2d(x, kernel, [1, 1, 1, 1], "VALID"))[0]
  return tf.pad(smooth, [[1, 1], [1, 1], [0, 0]]) + x[0] * tf.pad(
      tf.zeros_like(smooth), [[1, 1], [1, 1], [0, 0]], constant_values=1.0)


def apply_op(index, image, magnitude, sign):
  """Operation ``OPS[index]`` at ``magnitude`` ∈ [0, 10]; ``sign`` ±1 for the symmetric ones."""
  level = magnitude / 10.0
  enhance = 0.1 + 1.8 * level
  h, w = tf.cast(tf.shape(image)[0], tf.float32), tf.cast(tf.shape(image)[1], tf.float32)
  x = tf.cast(image, tf.int32)
  dropped_bits = 8 - tf.cast(4 * level, tf.int32)  # posterize keeps ⌊4·m/10⌋ bits
  branches = [
      lambda: auto_contrast(image),
      lambda: equalize(image),
      lambda: 255 - image,
      lambda: rotate(image, sign * 30.0 * level),
      lambda: tf.cast(tf.bitwise.left_shift(tf.bitwise.right_shift(x, dropped_bits), dropped_bits),
                      tf.uint8),
      lambda: tf.where(x >= tf.cast(256 * level, tf.int32), 255 - image, image),
      lambda: tf.where(
          x < 128, tf.cast(tf.minimum(x + tf.cast(110 * level, tf.int32), 255), tf.uint8), image),
      lambda: _blend(tf.tile(grayscale(image), [1, 1, 3]), image, enhance),
      lambda: _blend(tf.fill(tf.shape(image), tf.round(tf.reduce_mean(grayscale(image)))), image,
                     enhance),
      lambda: _blend(tf.zeros_like(image), image, enhance),
      lambda: _blend(sharpness_degenerate(image), image, enhance),
      lambda: _affine(image, tf.stack([1.0, sign * 0.3 * level, 0.0, 0.0, 1.0, 0.0])),
      lambda: _affine(image, tf.stack([1.0, 0.0, 0.0, sign * 0.3 * level, 1.0, 0.0])),
      lambda: _affine(image, tf.stack([1.0, 0.0, sign * 0.45 * level * w, 0.0, 1.0, 0.0])),
      lambda: _affine(image, tf.stack([1.0, 0.0, 0.0, 0.0, 1.0, sign * 0.45 * level * h])),
  ]
  out = tf.switch_case(tf.cast(index, tf.int32), branches)
  return tf.ensure_shape(out, image.shape)


def randaugment(image,
                seed,
                num_layers: int = 2,
                magnitude: float = 9.0,
                magnitude_std: float = 0.0,
                prob: float = 0.5):
  """RandAugment of one uint8 image [H, W, 3] with the stateless ``seed`` (int [2])."""
  seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 4 * num_layers)
  for i in range(num_layers):
    op_seed, apply_seed, magnitude_seed, sign_seed = (seeds[4 * i + j] for j in range(4))
    index = tf.random.stateless_uniform([], op_seed, 0, len(OPS), dtype=tf.int32)
    m = magnitude + magnitude_std * tf.random.stateless_normal(
        [], magnitude_seed) if magnitude_std > 0 else (tf.constant(magnitude, tf.float32))
    m = tf.clip_by_value(m, 0.0, 10.0)
    sign = tf.where(tf.random.stateless_uniform([], sign_seed) < 0.5, -1.0, 1.0)
    augmented = apply_op(index, image, m, sign)
    image = tf.cond(tf.random.stateless_uniform([], apply_seed) < prob,
                    lambda augmented=augmented: augmented, lambda image=image: image)
  return image
