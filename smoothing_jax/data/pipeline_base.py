"""The input pipeline's interface: :class:`Pipeline`, one dataset's train/eval batches for this
process, which :class:`~smoothing_jax.data.resident.ResidentPipeline` and
:class:`~smoothing_jax.data.tfdata.TFDataPipeline` implement
(:func:`~smoothing_jax.data.pipeline.create_pipeline` picks one)."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import jax
import numpy as np

from smoothing_jax.data.class_weights import class_pixel_counts, median_frequency_weights
from smoothing_jax.data.dataset_spec import DatasetSpec


class Batches:
  """Evaluation batches for one pass, as a generator gives them, that know how many they are
  (``len``) and how many examples they hold besides their padding (``examples``): what progress
  lines count against."""

  def __init__(self, count: int, batches: Iterator[dict], examples: int | None = None):
    self.count, self._batches, self.examples = count, batches, examples

  def __len__(self) -> int:
    return self.count

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    return next(self._batches)


@dataclasses.dataclass
class Pipeline:
  """Train/eval batches of one dataset for this process.

  Attributes:
    dataset_spec: the parsed dataset.
    num_train: examples in the (global) training split (the ``train_fraction`` subset).
    num_eval: examples in the (global) evaluation split.
    local_batch_size / global_batch_size: per-process and global training batch.
  """
  dataset_spec: DatasetSpec
  global_batch_size: int
  seed: int
  mean: tuple
  std: tuple
  train_images: np.ndarray | None
  train_labels: np.ndarray | None
  eval_images: np.ndarray | None
  eval_labels: np.ndarray | None
  num_train: int
  num_eval: int
  data_dir: str | None = None
  download: bool = False
  randaugment: tuple | None = None  # (num_layers, magnitude, magnitude_std) after crop + flip
  crop_size: tuple | None = None    # segmentation: random (h, w) training crop (None: whole)
  eval_cache: str = ""  # a file prefix: preprocessed evaluation images kept there ("": off)
  # The held-out part of the training split (``holdout_fraction``; not trained on): what
  # post-hoc recalibration fits on.
  holdout_images: np.ndarray | None = None
  holdout_labels: np.ndarray | None = None
  resident: ClassVar[bool] = False  # batches made on the devices inside the step

  @property
  def is_segmentation(self) -> bool:
    """Label maps ``[H, W]`` per example (per-pixel classes) rather than one class per image."""
    labels = self.eval_labels if self.eval_labels is not None else self.train_labels
    return labels is not None and labels.ndim == 3

  def class_weights(self, num_classes: int) -> np.ndarray:
    """Median-frequency weights ``[C]`` of the training label maps of all processes
    (segmentation only; :mod:`smoothing_jax.data.class_weights`)."""
    if not self.is_segmentation:
      raise ValueError("Class balancing needs a segmentation dataset; "
                       f"{self.dataset_spec.name!r} has one label per image.")
    counts = class_pixel_counts(self.train_labels, num_classes)  # the whole split
    return median_frequency_weights(None, num_classes, counts)

  def holdout_batches(self, batch_size: int | None = None):
    """Evaluation batches of the held-out training examples (``holdout_fraction``)."""
    raise ValueError("Held-out training examples are evaluated on the device-resident pipeline "
                     "only: use --config.input.data_pipeline=resident (or auto, for in-memory "
                     "sets).")

  @property
  def local_batch_size(self) -> int:
    return self.global_batch_size // jax.process_count()

  @property
  def steps_per_epoch(self) -> int:
    if self.train_images is not None:  # every process holds the split: global batches
      return self.num_train // self.global_batch_size
    return (self.num_train // jax.process_count()) // self.local_batch_size

  @property
  def image_shape(self):
    if self.dataset_spec.geometry == "imagenet":
      return (224, 224, 3)
    return tuple(self.eval_images.shape[1:])

  def epoch_order(self, epoch: int) -> np.ndarray:
    """int ``[steps_per_epoch, global_batch_size]``: the rows of the (in-memory) training split in
    each global batch of ``epoch``, a permutation of the split (its last partial batch dropped)
    that depends on ``(seed, epoch)`` alone (not on the process or device count)."""
    order = np.random.default_rng([self.seed, epoch, 0, 1]).permutation(len(self.train_images))
    steps = self.steps_per_epoch
    return order[:steps * self.global_batch_size].reshape(steps, self.global_batch_size)
