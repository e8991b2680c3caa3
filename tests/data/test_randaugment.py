"""smoothing_jax.data.randaugment: the operations against PIL, determinism in the seed."""
import numpy as np
import pytest
from PIL import Image, ImageEnhance, ImageOps

tf = pytest.importorskip("tensorflow")  # the tf.data path's RandAugment

from smoothing_jax.data import randaugment as ra  # noqa: E402  (imports TensorFlow)


@pytest.fixture(scope="module")
def image():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)
  x[..., 2] = rng.integers(40, 200, (16, 16))  # a channel that does not span [0, 255]
  return x


@pytest.mark.parametrize("op, reference", [
    ("AutoContrast", lambda im, m: ImageOps.autocontrast(im)),
    ("Equalize", lambda im, m: ImageOps.equalize(im)),
    ("Invert", lambda im, m: ImageOps.invert(im)),
    ("Posterize", lambda im, m: ImageOps.posterize(im, int(4 * m / 10))),
    ("Solarize", lambda im, m: ImageOps.solarize(im, int(256 * m / 10))),
    ("Color", lambda im, m: ImageEnhance.Color(im).enhance(0.1 + 1.8 * m / 10)),
    ("Contrast", lambda im, m: ImageEnhance.Contrast(im).enhance(0.1 + 1.8 * m / 10)),
    ("Brightness", lambda im, m: ImageEnhance.Brightness(im).enhance(0.1 + 1.8 * m / 10)),
    ("Sharpness", lambda im, m: ImageEnhance.Sharpness(im).enhance(0.1 + 1.8 * m / 10)),
    ("TranslateXRel", lambda im, m: im.transform(
        im.size, Image.AFFINE, (1, 0, 0.45 * m / 10 * 16, 0, 1, 0), fillcolor=(128,) * 3)),
])
def test_randaugment_ops_match_pil(op, reference, image):
  magnitude = 7.5 if op == "TranslateXRel" else 7.0  # 0.45·0.75·16 = 5.4 px
  ours = ra.apply_op(ra.OPS.index(op), tf.constant(image), tf.constant(magnitude),
                     tf.constant(1.0)).numpy()
  expected = np.asarray(reference(Image.fromarray(image), magnitude))
  if op == "TranslateXRel":  # sub-pixel shift: compare the interior, bilinear vs PIL's nearest
    ours, expected = ours[:, :10].astype(int), expected[:, :10].astype(int)
    assert np.mean(np.abs(ours - expected) > 40) < 0.6
    return
  np.testing.assert_array_equal(ours, expected)


def test_randaugment_geometry_matches_pil_away_from_the_border(image):
  pil = Image.fromarray(image)
  cases = [(ra.rotate(tf.constant(image),
                      20.0), pil.rotate(20.0, resample=Image.BILINEAR, fillcolor=(128,) * 3)),
           (ra.apply_op(11, tf.constant(image), tf.constant(5.0), tf.constant(-1.0)),
            pil.transform(pil.size,
                          Image.AFFINE, (1, -0.15, 0, 0, 1, 0),
                          resample=Image.BILINEAR,
                          fillcolor=(128,) * 3))]
  for ours, expected in cases:
    diff = np.abs(ours.numpy().astype(int) - np.asarray(expected).astype(int))[3:-3, 3:-3]
    assert np.mean(diff > 1) < 0.02, np.mean(diff > 1)


def test_randaugment_is_a_function_of_the_seed(image):
  out = [
      ra.randaugment(tf.constant(image), tf.constant([0, s], tf.int64), 2, 9.0, 1.0).numpy()
      for s in (1, 1, 2)
  ]
  np.testing.assert_array_equal(out[0], out[1])
  assert out[0].dtype == np.uint8 and out[0].shape == image.shape
  differs = [
      not np.array_equal(
          ra.randaugment(tf.constant(image), tf.constant([0, s], tf.int64), 2, 9.0, 1.0), image)
      for s in range(12)
  ]
  assert 3 <= sum(differs) <= 12  # P(no op applied) = 1/4 per image
