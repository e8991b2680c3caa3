"""smoothing_jax.data.device_randaugment: every operation against the TF module, randaugment as a
function of the key under jit and vmap, and no TensorFlow import.

Tolerances, measured on 12×16 images (three: random with a channel in [40, 200), constant, and
narrow channels whose AutoContrast needs PIL's float64 rule) at magnitudes 0, 2.5, 3, 5, 7, 9 and
10 with both signs:

* AutoContrast, Equalize, Invert, Posterize, Solarize and SolarizeAdd (integers and luts) equal
  TF's exactly.
* Color, Contrast, Brightness, Sharpness and the warps compute in float32 like TF, but XLA fuses
  multiply-adds and the magnitude → argument map rounds once (m·0.18 instead of 1.8·(m/10)).
  They differ by at most 1 grey level, only on pixels that float32 rounding decides (TF's own
  value there changes when the magnitude moves by ±1e-5, about 10 ulps of m = 10), and on at
  most 0.5% of each operation's pixels (measured: none for Brightness and TranslateXRel, up to
  0.36% for ShearY, at XLA's default optimisation level and at the tests' level 0 alike).
"""
import functools
import subprocess
import sys

import jax
import numpy as np
import pytest

from smoothing_jax.data import device_randaugment as dra

EXACT = ("AutoContrast", "Equalize", "Invert", "Posterize", "Solarize", "SolarizeAdd")
MAGNITUDES = (0.0, 2.5, 3.0, 5.0, 7.0, 9.0, 10.0)
apply_ops = jax.jit(jax.vmap(dra.apply_op))  # one compiled program for all the cases


@pytest.fixture(scope="module")
def images():
  """Three uint8 images [12, 16, 3] (not square, so that x and y cannot be swapped)."""
  rng = np.random.default_rng(0)
  full = rng.integers(0, 256, (12, 16, 3))
  full[..., 2] = rng.integers(40, 200, (12, 16))  # a channel that does not span [0, 255]
  narrow = np.stack([
      rng.integers(3, 255, (12, 16)),
      rng.integers(100, 130, (12, 16)),
      np.full((12, 16), 9)  # a constant channel
  ], -1)
  narrow[0, 0, :2], narrow[0, 1, :2] = (3, 100), (254, 129)  # ranges [3, 254] and [100, 129]
  return np.stack([full, np.full((12, 16, 3), 77), narrow]).astype(np.uint8)


@pytest.fixture(scope="module")
def tf_randaugment():
  """``(tensorflow, smoothing_jax.data.randaugment)``: the comparisons skip without TensorFlow."""
  tf = pytest.importorskip("tensorflow")
  from smoothing_jax.data import randaugment
  return tf, randaugment


@pytest.fixture(scope="module")
def cases(images, tf_randaugment):
  """(op index, image, magnitude, sign) of every case, ours and TF's outputs, and where TF's
  output changes when the magnitude moves by ±1e-5."""
  grid = np.meshgrid(np.arange(len(dra.OPS)), np.arange(len(images)), MAGNITUDES, (-1.0, 1.0),
                     indexing="ij")
  index, image, magnitude, sign = (g.ravel() for g in grid)
  index, magnitude, sign = (index.astype(np.int32), magnitude.astype(np.float32),
                            sign.astype(np.float32))
  ours = np.asarray(apply_ops(index, images[image], magnitude, sign))
  tf, ra = tf_randaugment
  tf_apply = tf.function(ra.apply_op)

  def theirs(magnitudes):
    return np.stack([
        tf_apply(tf.constant(i), tf.constant(images[n]), tf.constant(m), tf.constant(s)).numpy()
        for i, n, m, s in zip(index, image, magnitudes, sign, strict=True)
    ])

  reference = theirs(magnitude)
  rounding = ((theirs(magnitude - np.float32(1e-5)) != reference) |
              (theirs(magnitude + np.float32(1e-5)) != reference))
  return index, image, ours.astype(int), reference.astype(int), rounding


def test_ops_and_fill_are_the_tf_modules(tf_randaugment):
  _, ra = tf_randaugment
  assert dra.OPS == ra.OPS and dra.FILL == ra.FILL


@pytest.mark.parametrize("op", dra.OPS)
def test_apply_op_matches_tf(op, cases):
  index, _, ours, theirs, rounding = cases
  selected = index == dra.OPS.index(op)
  ours, theirs, rounding = ours[selected], theirs[selected], rounding[selected]
  if op in EXACT:
    np.testing.assert_array_equal(ours, theirs)
    return
  differs = ours != theirs
  assert np.abs(ours - theirs).max() <= 1
  assert not np.any(differs & ~rounding), "a difference that float32 rounding does not explain"
  assert differs.mean() <= 0.005, differs.mean()


def test_auto_contrast_uses_pils_float64_lut(images, cases):
  """PIL's float64 lut maps the top of the ranges [3, 254] and [100, 129] to 254, not 255 (as
  float32 or exact arithmetic would); the constant channel is unchanged."""
  index, image, ours, _, _ = cases
  out = ours[(index == dra.OPS.index("AutoContrast")) & (image == 2)][0]
  np.testing.assert_array_equal(out[0, :2], [[0, 0, 9], [254, 254, 9]])
  np.testing.assert_array_equal(out[..., 2], 9)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _randaugment(key, image, num_layers, magnitude, magnitude_std, prob):
  return dra.randaugment(key, image, num_layers, magnitude, magnitude_std, prob)


def test_randaugment_is_a_function_of_the_key(images):
  image, keys = images[0], jax.random.split(jax.random.key(0), 12)
  out = [np.asarray(_randaugment(k, image, 2, 9.0, 1.0, 0.5)) for k in keys]
  np.testing.assert_array_equal(out[0], np.asarray(_randaugment(keys[0], image, 2, 9.0, 1.0, 0.5)))
  assert out[0].dtype == np.uint8 and out[0].shape == image.shape
  assert len({o.tobytes() for o in out}) >= 6  # an image is left unchanged with P = 1/4
  # jit(vmap) over a batch gives each image's own result.
  batch = jax.jit(jax.vmap(functools.partial(dra.randaugment, magnitude_std=1.0)))(
      keys[:3], images)
  np.testing.assert_array_equal(
      batch,
      [_randaugment(k, im, 2, 9.0, 1.0, 0.5) for k, im in zip(keys[:3], images, strict=True)])


def test_randaugment_magnitude_and_identity(images):
  image, keys = images[0], jax.random.split(jax.random.key(1), 8)
  # One layer always applied at a fixed magnitude: one of the operations at exactly M = 7.
  n = 2 * len(dra.OPS)
  candidates = np.asarray(
      apply_ops(np.arange(n, dtype=np.int32) % len(dra.OPS), np.broadcast_to(image, (n, 12, 16, 3)),
                np.full(n, 7.0, np.float32), np.repeat(np.float32([-1.0, 1.0]), len(dra.OPS))))
  fixed = [np.asarray(_randaugment(k, image, 1, 7.0, 0.0, 1.0)) for k in keys]
  assert all(np.any(np.all(candidates == f, axis=(1, 2, 3))) for f in fixed)
  spread = [np.asarray(_randaugment(k, image, 1, 7.0, 2.0, 1.0)) for k in keys]
  assert not all(np.any(np.all(candidates == s, axis=(1, 2, 3))) for s in spread)
  for num_layers, prob in ((0, 0.5), (2, 0.0)):
    np.testing.assert_array_equal(_randaugment(keys[0], image, num_layers, 9.0, 0.0, prob), image)


def test_module_does_not_import_tensorflow():
  """Loaded from its file (the package's __init__ imports the TF pipeline) in a fresh
  interpreter."""
  code = ("import importlib.util, sys\n"
          f"spec = importlib.util.spec_from_file_location('device_randaugment', {dra.__file__!r})\n"
          "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
          "assert 'tensorflow' not in sys.modules, sorted(sys.modules)\n")
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
