"""Class balancing of segmentation losses: per-class pixel counts and median-frequency weights.

Label maps ``[N, H, W]``; labels outside ``[0, num_classes)`` are void and count as no
class.  The loss that uses the weights is :func:`smoothing_jax.methods.losses.cross_entropy`.
"""
from __future__ import annotations

import numpy as np


def class_pixel_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """``[2, C]``: pixels of each class, and pixels of the images in which it appears (void not a
  class)."""
  labels = np.asarray(labels).reshape(len(labels), -1)
  counts = np.stack([
      np.bincount(np.where((row >= 0) & (row < num_classes), row, num_classes),
                  minlength=num_classes + 1)[:num_classes]
      for row in labels])  # [N, C]
  return np.stack([counts.sum(0), np.sum((counts > 0) * labels.shape[1], axis=0)]).astype(np.int64)


def median_frequency_weights(labels: np.ndarray, num_classes: int,
                             counts: np.ndarray | None = None) -> np.ndarray:
  """Median-frequency class balancing (Eigen & Fergus 2015) from label maps ``[N, H, W]``.

  freq_c = (pixels of class c) / (pixels of the images in which c appears);
  weight_c = median_c(freq_c) / freq_c.  Void labels (outside ``[0, C)``) are not
  counted as any class; classes absent from ``labels`` get weight 0.  ``counts``
  (:func:`class_pixel_counts`, e.g. summed over processes) replaces ``labels``.
  """
  pixels, image_pixels = class_pixel_counts(labels, num_classes) if counts is None else counts
  present = image_pixels > 0
  freq = np.where(present, pixels / np.maximum(image_pixels, 1), 0.0)
  weights = np.zeros(num_classes)
  weights[present] = np.median(freq[present]) / freq[present]
  return weights.astype(np.float32)
