"""RandAugment (Cubuk et al. 2020) in ``jax.numpy``, as timm's ``rand-m{M}-n{N}-mstd{S}``: the
operations, arguments and results of :mod:`smoothing_jax.data.randaugment` (TF ops matched to
PIL), without TensorFlow, so that it runs inside a jitted step on the accelerator.

Per image: N operations drawn uniformly (with replacement) from the 15 below, each applied with
probability 0.5 at magnitude m ~ N(M, S²) clipped to [0, 10] (S = 0: m = M), with the TF module's
magnitude → argument map.  The integer and lut operations give the TF module's results exactly;
the blends and warps within float32 rounding (1 grey level on a few pixels, see
:func:`apply_op`).  Input and output are uint8 [H, W, 3]; every draw comes from a ``jax.random``
key, and :func:`apply_op` and :func:`randaugment` work under ``jit`` and ``vmap``.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# As in randaugment.py (importing them from there would import TensorFlow); a test asserts that
# they are equal.
OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
       "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
       "TranslateYRel")
FILL = 128.0


def _auto_contrast_rounded_down():
  """Sorted keys ``(lo·256 + hi)·256 + x`` (int32) of the uint8 x ∈ [lo, hi] where PIL's float64
  lut ⌊x·s − lo·s⌋, s = 255/(hi − lo), is one below the exact ⌊255 (x − lo)/(hi − lo)⌋.

  That happens only where 255 (x − lo)/(hi − lo) is an integer (elsewhere it is ≥ 1/255 from
  one, far beyond float64's error) and the rounding errors fall below it: 12,094 keys, e.g.
  (lo, hi) = (3, 254) maps 254 to 254.  The device computes in float32 (JAX's default; TPUs have
  no float64), which cannot reproduce them: hence this table (48 kB, made in ~10 ms).
  """
  keys = []
  for d in range(1, 256):  # d = hi − lo
    lo = np.arange(256 - d)[:, None]
    k = np.arange(0, d + 1, d // math.gcd(d, 255))  # the x − lo where 255 (x − lo)/d is an integer
    scale = 255.0 / d
    below = np.floor((lo + k) * scale + -lo * scale) < 255 * k // d  # PIL: x·scale + offset
    keys.append(((lo * 256 + lo + d) * 256 + lo + k)[below])
  return np.sort(np.concatenate(keys)).astype(np.int32)


_ROUNDED_DOWN = _auto_contrast_rounded_down()


def auto_contrast(image):
  """Stretch each channel of uint8 [H, W, 3] to [0, 255] (unchanged where it is constant), with
  PIL's float64 lut."""
  x = image.astype(jnp.int32)
  lo, hi = x.min(axis=(0, 1)), x.max(axis=(0, 1))
  key, table = (lo * 256 + hi) * 256 + x, jnp.asarray(_ROUNDED_DOWN)
  found = table[jnp.minimum(jnp.searchsorted(table, key), len(table) - 1)]
  stretched = (x - lo) * 255 // jnp.maximum(hi - lo, 1) - (found == key)
  return jnp.where(hi > lo, stretched, x).astype(jnp.uint8)


def _equalize_channel(channel):
  """PIL ``ImageOps.equalize`` of one uint8 channel [H, W]."""
  x = channel.astype(jnp.int32)
  hist = jnp.zeros(256, jnp.int32).at[x.ravel()].add(1)
  step = (x.size - hist[x.max()]) // 255  # PIL leaves out the count of the largest value
  lut = jnp.minimum((jnp.cumsum(hist) - hist + step // 2) // jnp.maximum(step, 1), 255)
  return jnp.where(step == 0, x, lut[x]).astype(jnp.uint8)


def equalize(image):
  """PIL ``ImageOps.equalize`` of uint8 [H, W, 3], channel by channel."""
  return jax.vmap(_equalize_channel, in_axes=2, out_axes=2)(image)


def grayscale(image):
  """ITU-R 601-2 luma (PIL "L") of uint8 [H, W, 3], as float [H, W, 1]."""
  x = image.astype(jnp.float32)
  return jnp.round(x[..., :1] * 0.299 + x[..., 1:2] * 0.587 + x[..., 2:] * 0.114)


def sharpness_degenerate(image):
  """PIL ``SMOOTH`` filter (3×3 kernel [1 1 1; 1 5 1; 1 1 1]/13) of uint8 [H, W, 3] inside,
  original pixels on the border; int32 [H, W, 3]."""
  x = image.astype(jnp.int32)
  h, w = x.shape[:2]
  window = sum(x[i:h - 2 + i, j:w - 2 + j] for i in range(3) for j in range(3))  # 3×3 sums
  # Rounded in integers: a sum over 13 is never a half, so this is the float filter's rounding.
  return x.at[1:-1, 1:-1].set((window + 4 * x[1:-1, 1:-1] + 6) // 13)


def _blend(degenerate, image, factor):
  """PIL ``ImageEnhance``: degenerate + factor·(image − degenerate), clipped to uint8."""
  degenerate = degenerate.astype(jnp.float32)
  out = degenerate + factor * (image.astype(jnp.float32) - degenerate)
  return jnp.floor(jnp.clip(out, 0.0, 255.0)).astype(jnp.uint8)  # PIL truncates


def _affine(image, matrix):
  """Warp uint8 [H, W, 3] as PIL's ``Image.transform(AFFINE, matrix)``: output (x, y) samples
  input (a0 x + a1 y + a2, b0 x + b1 y + b2) in PIL's coordinates (pixel centres at +0.5).

  Bilinear, as TF's ``ImageProjectiveTransformV3`` with constant fill: each of the 4 neighbours
  is the pixel or, outside the image, ``FILL``, so the border blends with the fill as in TF and
  PIL.  (dm-pix's ``affine_transform(mode="constant")`` returns the fill for any sample point
  outside the image instead, hence this one.)
  """
  a0, a1, a2, b0, b1, b2 = matrix
  # Integer pixel coordinates: shift the offsets by the half-pixel convention (as the TF module).
  a2 = a2 + 0.5 * (a0 + a1 - 1.0)
  b2 = b2 + 0.5 * (b0 + b1 - 1.0)
  h, w = image.shape[:2]
  out_y, out_x = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32),
                              jnp.arange(w, dtype=jnp.float32),
                              indexing="ij")
  x, y = a0 * out_x + a1 * out_y + a2, b0 * out_x + b1 * out_y + b2
  x0, y0 = jnp.floor(x), jnp.floor(y)
  x1, y1 = x0 + 1, y0 + 1
  pixels = image.astype(jnp.float32)

  def read(row, col):
    inside = (row >= 0) & (row < h) & (col >= 0) & (col < w)
    value = pixels[jnp.clip(row, 0, h - 1).astype(jnp.int32),
                   jnp.clip(col, 0, w - 1).astype(jnp.int32)]
    return jnp.where(inside[..., None], value, FILL)

  wx0, wx1, wy0, wy1 = (v[..., None] for v in (x1 - x, x - x0, y1 - y, y - y0))
  top = wx0 * read(y0, x0) + wx1 * read(y0, x1)
  bottom = wx0 * read(y1, x0) + wx1 * read(y1, x1)
  out = wy0 * top + wy1 * bottom
  return jnp.clip(jnp.round(out), 0.0, 255.0).astype(jnp.uint8)


def rotate(image, degrees):
  """Rotate uint8 [H, W, 3] counter-clockwise about the centre by ``degrees`` (PIL
  ``Image.rotate``)."""
  h, w = image.shape[:2]
  cx, cy = w / 2, h / 2
  t = degrees * (-math.pi / 180.0)
  c, s = jnp.cos(t), jnp.sin(t)
  return _affine(image, (c, s, cx - c * cx - s * cy, -s, c, cy + s * cx - c * cy))


def apply_op(index, image, magnitude, sign):
  """Operation ``OPS[index]`` on uint8 [H, W, 3] at ``magnitude`` ∈ [0, 10]; ``sign`` ±1 for the
  symmetric ones.  The scalars may be traced (``jax.lax.switch``).

  The TF module's operations and arguments in float32, as there; but XLA fuses multiply-adds and
  the arguments round once (below), so the blends and warps may differ from it by 1 grey level
  where float32 rounding decides (≤ 0.4% of pixels in ``tests/data/test_device_randaugment.py``).
  """
  m = jnp.asarray(magnitude, jnp.float32)
  sign = jnp.asarray(sign, jnp.float32)
  # Each argument is m times one constant (the TF module's c·(m/10)): XLA turns m/10 into
  # m·fl(0.1) and folds constant chains, so 0.1 + 1.8·(m/10) would give 0.99999994 at m = 5 (every
  # pixel one darker), depending on the optimisation level.  With one rounding the thresholds
  # are the TF module's, and the blend factors and geometry within float32 rounding of its.
  enhance = 0.1 + m * 0.18
  h, w = image.shape[:2]
  x = image.astype(jnp.int32)
  dropped_bits = 8 - (m * 0.4).astype(jnp.int32)  # posterize keeps ⌊4·m/10⌋ bits
  branches = [
      lambda: auto_contrast(image),
      lambda: equalize(image),
      lambda: 255 - image,
      lambda: rotate(image, sign * m * 3.0),
      lambda: jnp.left_shift(jnp.right_shift(x, dropped_bits), dropped_bits).astype(jnp.uint8),
      lambda: jnp.where(x >= (m * 25.6).astype(jnp.int32), 255 - image, image),
      lambda: jnp.where(x < 128,
                        jnp.minimum(x + (m * 11.0).astype(jnp.int32), 255).astype(jnp.uint8),
                        image),
      lambda: _blend(jnp.tile(grayscale(image), (1, 1, 3)), image, enhance),
      lambda: _blend(jnp.full(image.shape, jnp.round(jnp.mean(grayscale(image)))), image,
                     enhance),
      lambda: _blend(jnp.zeros_like(image), image, enhance),
      lambda: _blend(sharpness_degenerate(image), image, enhance),
      lambda: _affine(image, (1.0, sign * m * 0.03, 0.0, 0.0, 1.0, 0.0)),
      lambda: _affine(image, (1.0, 0.0, 0.0, sign * m * 0.03, 1.0, 0.0)),
      lambda: _affine(image, (1.0, 0.0, sign * m * (0.045 * w), 0.0, 1.0, 0.0)),
      lambda: _affine(image, (1.0, 0.0, 0.0, 0.0, 1.0, sign * m * (0.045 * h))),
  ]
  return jax.lax.switch(index, branches)


def randaugment(key,
                image,
                num_layers: int = 2,
                magnitude: float = 9.0,
                magnitude_std: float = 0.0,
                prob: float = 0.5):
  """RandAugment of one uint8 image [H, W, 3], a pure function of the ``jax.random`` key:
  ``num_layers`` operations, each applied with probability ``prob`` (Python numbers)."""
  for layer_key in jax.random.split(key, num_layers):
    op_key, apply_key, magnitude_key, sign_key = jax.random.split(layer_key, 4)
    index = jax.random.randint(op_key, (), 0, len(OPS))
    noise = jax.random.normal(magnitude_key) if magnitude_std > 0 else 0.0
    m = jnp.clip(magnitude + magnitude_std * noise, 0.0, 10.0)
    sign = jnp.where(jax.random.uniform(sign_key) < 0.5, -1.0, 1.0)
    image = jax.lax.cond(
        jax.random.uniform(apply_key) < prob,
        lambda im, index=index, m=m, sign=sign: apply_op(index, im, m, sign), lambda im: im, image)
  return image
