"""``digits``: scikit-learn's bundled 8×8 digits (1,797 images), upsampled to 32×32 RGB, 360 held
out as the test split; no network needed (the quickstart's data)."""
from __future__ import annotations

import jax
import numpy as np

from smoothing_jax.data.dataset_spec import DatasetSpec
from smoothing_jax.data.sources.base import Source, stack_images


class Digits(Source):
  forms = ("digits (scikit-learn's 8x8 digits at 32x32)",)
  built_in = ("digits",)

  def built_in_spec(self, name: str) -> DatasetSpec | None:
    return DatasetSpec(name, "digits", "digits") if name == "digits" else None

  def load(self, spec, split, data_dir, download, size):
    from sklearn.datasets import load_digits  # small; ships its data
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
    images = np.repeat(images, 3, axis=-1).astype(np.float32)
    # Bilinear with half-pixel centres: equal to tf.image.resize(..., "bilinear") for upsampling.
    images = np.asarray(jax.image.resize(images, (len(images), 32, 32, 3), method="linear"))
    images = np.clip(np.round(images), 0, 255).astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(images))
    held_out = order[:360]  # fixed held-out test split
    idx = np.sort(held_out if split == "test" else order[360:])
    images, labels = images[idx], digits.target[idx].astype(np.int32)
    if size is not None and tuple(size) != (32, 32):
      images = stack_images(spec.name, images, size)
    return images, labels
