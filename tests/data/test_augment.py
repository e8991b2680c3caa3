"""smoothing_jax.data.augment: the CIFAR and ImageNet augmentation / preprocessing recipes."""
import numpy as np
import pytest

pytest.importorskip("tensorflow")  # the tf.data path's ops

from smoothing_jax.data.augment import (
  cifar_train_augment,
  imagenet_eval_preprocess,
  imagenet_train_augment,
)


def test_cifar_augmentation_is_a_padded_crop_maybe_flipped():
  rng = np.random.default_rng(1)
  image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
  padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
  crops = [padded[i:i + 32, j:j + 32] for i in range(9) for j in range(9)]
  candidates = [c for crop in crops for c in (crop, crop[:, ::-1])]
  outputs = []
  for seed in range(8):
    out = cifar_train_augment(image, np.array([seed, 7], np.int64)).numpy()
    assert any(np.array_equal(out, c) for c in candidates)
    outputs.append(out)
  assert len({o.tobytes() for o in outputs}) > 1


def test_imagenet_preprocessing_shapes():
  image = np.random.default_rng(3).integers(0, 256, (300, 400, 3), dtype=np.uint8)
  train = imagenet_train_augment(image, np.array([1, 2], np.int64)).numpy()
  assert train.shape == (224, 224, 3)
  evaluated = imagenet_eval_preprocess(image).numpy()
  assert evaluated.shape == (224, 224, 3)
  # Resize 256 on the short side (300 -> 256, 400 -> 341), then the centre 224×224.
  import tensorflow as tf
  resized = tf.image.resize(image, (256, 341), method="bilinear").numpy()
  np.testing.assert_allclose(evaluated, resized[16:240, 58:282], rtol=1e-5, atol=1e-3)


def test_imagenet_crop_from_jpeg_bytes_matches_decoding_then_cropping():
  """``decode_and_crop_jpeg`` decodes only the sampled window.  Without chroma subsampling it
  gives exactly the pixels of decoding the whole JPEG and slicing; with 4:2:0 chroma (most
  ImageNet files) the chroma upsampling at the window's edge lacks the outside neighbours, so
  edge pixels differ by a few levels."""
  import tensorflow as tf
  rng = np.random.default_rng(4)
  smooth = (np.cumsum(rng.integers(0, 9, (160, 208, 3)), axis=1) % 256).astype(np.uint8)
  for chroma_downsampling in (False, True):
    encoded = tf.io.encode_jpeg(smooth, quality=90, chroma_downsampling=chroma_downsampling)
    decoded = tf.io.decode_jpeg(encoded, channels=3)
    for seed in range(4):
      key = np.array([seed, 11], np.int64)
      from_bytes = imagenet_train_augment(encoded, key, image_size=64).numpy()
      from_pixels = imagenet_train_augment(decoded, key, image_size=64).numpy()
      assert from_bytes.shape == (64, 64, 3)
      if chroma_downsampling:
        assert np.mean(np.abs(from_bytes - from_pixels)) < 0.5
        assert np.max(np.abs(from_bytes - from_pixels)) < 8
      else:
        np.testing.assert_array_equal(from_bytes, from_pixels)
