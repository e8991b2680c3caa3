"""Per-example preprocessing (tf ops): the paper's augmentation recipes and normalisation.

Paper Appendix A recipes: CIFAR training = random 32×32 crop of the 4-pixel
zero-padded image + horizontal flip; ImageNet training = random-resized crop 224
+ flip, evaluation = resize 256 / centre crop 224; per-dataset normalisation.
Segmentation: a random ``crop_size`` crop of image and label map together + flip.
Random ops are stateless, seeded by the caller (``seed``: int64 ``[2]``).
RandAugment and Mixup/CutMix live in :mod:`smoothing_jax.data.randaugment` and
:mod:`smoothing_jax.data.mixup`.
"""
from __future__ import annotations

import tensorflow as tf


def normalize(image, mean, std):
  """``image`` (uint8 or float in [0, 255]) → float32 ``(image / 255 - mean) / std``."""
  mean, std = tf.constant(mean, tf.float32), tf.constant(std, tf.float32)
  return (tf.cast(image, tf.float32) / 255.0 - mean) / std


def cifar_train_augment(image, seed, padding: int = 4):
  """Random crop of the zero-padded image back to its size (32×32 for CIFAR), then a random
  horizontal flip."""
  shape = tf.shape(image)
  image = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]])
  image = tf.image.stateless_random_crop(image, shape, seed=seed)
  return tf.image.stateless_random_flip_left_right(image, seed=seed + 1)


def segmentation_train_augment(image, labels, seed, crop_size):
  """The same random ``crop_size`` (h, w) crop (None: no crop) and horizontal flip of an image
  ``[H, W, 3]`` and its label map ``[H, W]``."""
  both = tf.concat([tf.cast(image, tf.int32), tf.cast(labels, tf.int32)[..., None]], axis=-1)
  if crop_size is not None:
    both = tf.image.stateless_random_crop(both, (crop_size[0], crop_size[1], 4), seed=seed)
  both = tf.image.stateless_random_flip_left_right(both, seed=seed + 1)
  return tf.cast(both[..., :3], tf.uint8), both[..., 3]


def imagenet_train_augment(image, seed, image_size: int = 224):
  """Random-resized crop (scale 0.08–1, ratio 3/4–4/3) to ``image_size``, then a random flip.

  ``image``: decoded ``[H, W, 3]`` pixels, or the encoded JPEG bytes (a string scalar), which
  are decoded inside the crop window only (``tf.image.decode_and_crop_jpeg``): the same pixels
  as decoding the whole image and slicing, for a fraction of the decoding work.
  """
  image = tf.convert_to_tensor(image)
  encoded = image.dtype == tf.string
  shape = tf.image.extract_jpeg_shape(image) if encoded else tf.shape(image)
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, tf.zeros((1, 0, 4)), seed=seed, area_range=(0.08, 1.0),
      aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10, use_image_if_no_bounding_boxes=True)
  if encoded:
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = tf.image.decode_and_crop_jpeg(image, window, channels=3)
  else:
    image = tf.slice(image, begin, size)
  image = tf.image.resize(image, (image_size, image_size), method="bilinear")
  return tf.image.stateless_random_flip_left_right(image, seed=seed + 1)


def imagenet_eval_preprocess(image, image_size: int = 224, resize: int = 256):
  """Resize the shorter side to ``resize``, centre crop ``image_size``."""
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  scale = resize / tf.reduce_min(shape)
  image = tf.image.resize(image, tf.cast(tf.round(shape * scale), tf.int32), method="bilinear")
  return tf.image.resize_with_crop_or_pad(image, image_size, image_size)
