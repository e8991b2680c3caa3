"""Input pipelines (tf.data): :class:`Pipeline`, :func:`create_pipeline`, batching.

Owns the train/eval batches of one dataset for this process, the tf.data options and
keeping TensorFlow off the accelerators (:func:`hide_accelerators_from_tensorflow`).
Segmentation (CamVid, or ``npz:`` with label maps ``[N, H, W]``): labels outside
``[0, num_classes)`` are void (masked from losses and metrics).

Determinism: the example order of epoch ``e`` is a pure function of
``(seed, e, process_index)`` and augmentation uses stateless ops seeded by the
example's position in that order, so a run resumed at step ``s`` sees exactly
the batches an uninterrupted run would.  Each process reads only its shard.
Evaluation pads the last batch and returns a ``mask`` so every example counts once.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterator, Optional

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from smoothing_jax.data.augment import (_normalize, cifar_train_augment, imagenet_eval_preprocess,
                                        imagenet_train_augment, segmentation_train_augment)
from smoothing_jax.data.class_weights import class_pixel_counts, median_frequency_weights
from smoothing_jax.data.datasets import (NORMALIZATION, DatasetSpec, check_train_fraction,
                                         class_balanced_subset, load_arrays, normalization,
                                         parse_dataset, prepared_tfds_builder,
                                         tfds_builder, tfds_split)
from smoothing_jax.data.randaugment import randaugment


def hide_accelerators_from_tensorflow() -> None:
  """TensorFlow only feeds the host; keep it off GPUs/TPUs that JAX owns.

  Call before TensorFlow runs its first op.  Harmless to call again; once TensorFlow has
  initialised its devices they can no longer be changed, and this does nothing.
  """
  for device_type in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], device_type)
    except RuntimeError:  # "Visible devices cannot be modified after being initialized"
      pass


def _options(ds):
  options = tf.data.Options()
  options.deterministic = True
  options.threading.private_threadpool_size = max(1, os.cpu_count() or 1)
  return ds.with_options(options)


@dataclasses.dataclass
class Pipeline:
  """Train/eval batches of one dataset for this process.

  Attributes:
    spec: the parsed dataset.
    num_train: examples in the (global) training split (the ``train_fraction`` subset).
    num_eval: examples in the (global) evaluation split.
    local_batch_size / global_batch_size: per-process and global training batch.
  """
  spec: DatasetSpec
  global_batch_size: int
  seed: int
  mean: tuple
  std: tuple
  train_images: Optional[np.ndarray]
  train_labels: Optional[np.ndarray]
  eval_images: Optional[np.ndarray]
  eval_labels: Optional[np.ndarray]
  num_train: int
  num_eval: int
  data_dir: Optional[str] = None
  download: bool = False
  randaugment: Optional[tuple] = None  # (num_layers, magnitude, magnitude_std) after crop + flip
  crop_size: Optional[tuple] = None    # segmentation: random (h, w) training crop (None: whole)
  eval_cache: str = ""  # a file prefix: preprocessed evaluation images kept there ("": off)

  @property
  def is_segmentation(self) -> bool:
    """Label maps ``[H, W]`` per example (per-pixel classes) rather than one class per image."""
    labels = self.eval_labels if self.eval_labels is not None else self.train_labels
    return labels is not None and labels.ndim == 3

  def class_weights(self, num_classes: int) -> np.ndarray:
    """Median-frequency weights ``[C]`` of the training label maps of all processes
    (segmentation only; :mod:`smoothing_jax.data.class_weights`)."""
    if not self.is_segmentation:
      raise ValueError(f"Class balancing needs a segmentation dataset; {self.spec.name!r} has "
                       "one label per image.")
    counts = class_pixel_counts(self.train_labels, num_classes)  # the whole split
    return median_frequency_weights(None, num_classes, counts)

  def normalize(self, images: np.ndarray) -> np.ndarray:
    """uint8 images ``[..., 3]`` → the float32 inputs the model was trained on."""
    mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
    return (np.asarray(images, np.float32) / 255.0 - mean) / std

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
    if self.spec.geometry == "imagenet":
      return (224, 224, 3)
    return tuple(self.eval_images.shape[1:])

  def train_dataset(self, epoch: int, start_step: int = 0) -> tf.data.Dataset:
    """Batches of epoch ``epoch`` from step ``start_step`` on: ``{"image", "label"}``,
    normalised float32."""
    steps, batch = self.steps_per_epoch, self.local_batch_size
    if self.train_images is not None:
      # One global order of the whole split (the same on every process); process p takes its
      # slice of each global batch, so the global batches, and the augmentation of each example
      # (seeded by its global position), do not depend on the number of processes.
      order_seed = int(np.random.default_rng([self.seed, epoch, 0]).integers(2 ** 31))
      order = np.random.default_rng([self.seed, epoch, 0, 1]).permutation(len(self.train_images))
      mine = slice(jax.process_index() * batch, (jax.process_index() + 1) * batch)
      take = lambda x: x[:steps * self.global_batch_size].reshape(  # noqa: E731
          steps, self.global_batch_size)[start_step:, mine].reshape(-1)
      rows, positions = take(order), take(np.arange(steps * self.global_batch_size))
      ds = tf.data.Dataset.zip(tf.data.Dataset.from_tensor_slices(positions),
                               tf.data.Dataset.from_tensor_slices((self.train_images[rows],
                                                                   self.train_labels[rows])))
    else:  # streaming (ImageNet): seeded shuffle buffer, then skip what was already consumed
      epoch_seed = np.random.default_rng([self.seed, epoch, jax.process_index()])
      order_seed = int(epoch_seed.integers(2 ** 31))
      # JPEG bytes: imagenet_train_augment decodes only its random crop.
      ds = tfds_split(self.spec, "train", self.data_dir, self.download, encoded_images=True)
      ds = ds.map(lambda ex: (ex["image"], ex["label"]))
      ds = ds.shuffle(16 * 1024, seed=order_seed, reshuffle_each_iteration=False)
      ds = ds.take(steps * batch).skip(start_step * batch)
      ds = tf.data.Dataset.zip(tf.data.Dataset.range(start_step * batch, steps * batch), ds)
    augment = imagenet_train_augment if self.spec.geometry == "imagenet" else cifar_train_augment
    mean, std, rand_layers = self.mean, self.std, self.randaugment
    segmentation, crop_size = self.is_segmentation, self.crop_size

    def prepare(position, example):
      image, label = example
      seed = tf.stack([tf.constant(order_seed, tf.int64), position])
      if segmentation:
        image, label = segmentation_train_augment(image, label, seed, crop_size)
      else:
        image = augment(image, seed)
      if rand_layers:
        if image.dtype != tf.uint8:
          image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
        image = randaugment(image, seed + 2, *rand_layers)
      return {"image": _normalize(image, mean, std), "label": tf.cast(label, tf.int32)}

    ds = ds.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    return _options(ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

  def train_iterator(self, start_step: int = 0) -> Iterator[dict]:
    """Endless numpy batches starting at global step ``start_step``."""
    epoch, step_in_epoch = divmod(start_step, self.steps_per_epoch)
    while True:
      yield from tfds.as_numpy(self.train_dataset(epoch, step_in_epoch))
      epoch, step_in_epoch = epoch + 1, 0

  def eval_batches(self, batch_size: Optional[int] = None,
                   dataset: Optional[str] = None) -> Iterator[dict]:
    """Evaluation batches ``{"image", "label", "mask"}``; the last one is zero-padded, nothing
    is dropped.

    ``dataset`` (e.g. ``"cifar10_corrupted/fog_3"``) defaults to this dataset's
    evaluation split.  Every process yields the same number of batches (padding
    the shorter shards); ImageNet-sized sets are streamed, the others held in memory.
    """
    batch = (batch_size or self.global_batch_size) // jax.process_count()
    spec = self.spec if dataset is None else parse_dataset(dataset)
    if spec == self.spec and self.eval_images is not None:
      ds = tf.data.Dataset.from_tensor_slices((self.eval_images, self.eval_labels))
      num_global = self.num_eval
    elif spec.geometry == "imagenet":
      ds = tfds_split(spec, spec.eval_split, self.data_dir, self.download)
      ds = ds.map(lambda ex: (ex["image"], ex["label"]))
      splits = tfds_builder(spec, self.data_dir, False).info.splits
      num_global = splits[spec.eval_split].num_examples
    else:
      images, labels = load_arrays(spec, spec.eval_split, self.data_dir, self.download)
      ds = tf.data.Dataset.from_tensor_slices((images, labels))
      num_global = len(images) * jax.process_count()
    num_batches = -(-(-(-num_global // jax.process_count())) // batch)
    mean, std = self.mean, self.std
    preprocess = imagenet_eval_preprocess if self.spec.geometry == "imagenet" else (lambda x: x)
    ds = ds.map(lambda x, y: (_normalize(preprocess(x), mean, std), tf.cast(y, tf.int32)),
                num_parallel_calls=tf.data.AUTOTUNE)
    if self.eval_cache:  # decoded once (ImageNet JPEGs), then read back on later evaluations
      ds = ds.cache(f"{self.eval_cache}.{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}")
    iterator = iter(tfds.as_numpy(_options(ds.batch(batch).prefetch(tf.data.AUTOTUNE))))
    label_shape = tuple(self.eval_labels.shape[1:] if self.is_segmentation else ())
    for _ in range(num_batches):
      x, y = next(iterator, (None, None))
      n = 0 if x is None else len(x)
      out = {"image": np.zeros((batch,) + tuple(self.image_shape), np.float32),
             "label": np.zeros((batch,) + label_shape, np.int32),
             "mask": np.zeros((batch,), np.float32)}
      if n:
        out["image"][:n], out["label"][:n], out["mask"][:n] = x, y, 1.0
      yield out
    next(iterator, None)  # reach the end, so that a cache file is completed


def create_pipeline(dataset: str, global_batch_size: int, seed: int,
                    data_dir: Optional[str] = None, download: bool = False,
                    randaugment: Optional[tuple] = None,
                    crop_size: Optional[tuple] = None, eval_cache: str = "",
                    train_fraction: float = 1.0) -> Pipeline:
  """Load (or open, for ImageNet) ``dataset``; fail early with a clear message if it is missing.

  ``randaugment``: ``(num_layers, magnitude, magnitude_std)`` applied to training images
  after the crop and flip (None or num_layers 0: off).  ``crop_size``: (h, w) random
  training crop of segmentation datasets (None: whole images).  ``eval_cache``: a file
  prefix where the preprocessed evaluation images are kept after their first pass (for
  ImageNet, whose JPEGs are otherwise decoded at every evaluation).  ``train_fraction`` in
  (0, 1]: train on a fixed class-balanced subset of an in-memory training split, seeded by
  ``seed`` (:func:`~smoothing_jax.data.datasets.class_balanced_subset`); ``num_train`` and the
  steps per epoch follow it, the normalisation statistics stay those of the whole split; the
  streamed ImageNet split takes 1 only.  Keeps TensorFlow off the accelerators
  (:func:`hide_accelerators_from_tensorflow`) if it has not started yet.
  """
  hide_accelerators_from_tensorflow()
  if randaugment is not None and randaugment[0] < 0:
    raise ValueError(f"RandAugment num_layers must be >= 0, got {randaugment[0]}.")
  spec = parse_dataset(dataset)
  train_fraction = check_train_fraction(train_fraction)
  if spec.corruption:
    raise ValueError(f"{dataset!r} is an evaluation-only corruption set; train on {spec.base!r}.")
  if global_batch_size % jax.process_count():
    raise ValueError(f"Global batch size {global_batch_size} is not divisible by "
                     f"{jax.process_count()} processes.")
  if spec.base == "imagenet2012":
    if train_fraction < 1:
      raise ValueError(f"train_fraction {train_fraction} needs an in-memory training split "
                       "(CIFAR, npz:, digits); ImageNet's is streamed: prepare a subset as its "
                       "own dataset instead.")
    splits = prepared_tfds_builder(spec, data_dir, download).info.splits
    eval_images = eval_labels = None
    num_train, num_eval = splits["train"].num_examples, splits["validation"].num_examples
    mean, std = NORMALIZATION["imagenet2012"]
    train_images = train_labels = None
  else:
    # The whole training split on every process (global batches independent of the process
    # count); the evaluation split sharded.
    train_images, train_labels = load_arrays(spec, "train", data_dir, download, shard=False)
    eval_images, eval_labels = load_arrays(spec, spec.eval_split, data_dir, download)
    mean, std = normalization(spec, train_images)
    if train_fraction < 1:
      kept = class_balanced_subset(train_labels, train_fraction, seed)
      train_images, train_labels = train_images[kept], train_labels[kept]
    num_train = len(train_images)
    num_eval = len(eval_images) * jax.process_count()
  pipeline = Pipeline(spec, global_batch_size, seed, tuple(mean), tuple(std), train_images,
                      train_labels, eval_images, eval_labels, num_train, num_eval, data_dir,
                      download, tuple(randaugment) if randaugment and randaugment[0] > 0 else None,
                      tuple(crop_size) if crop_size else None, eval_cache)
  if pipeline.is_segmentation and pipeline.randaugment:
    raise ValueError("RandAugment is not supported for segmentation datasets (it would move "
                     "pixels off their labels).")
  if pipeline.crop_size is not None:
    if not pipeline.is_segmentation:
      raise ValueError(f"crop_size is for segmentation datasets; {dataset!r} has one label per "
                       "image.")
    height, width = train_images.shape[1:3]
    crop = pipeline.crop_size
    if len(crop) != 2 or not (0 < crop[0] <= height and 0 < crop[1] <= width):
      raise ValueError(f"crop_size {crop} must be (h, w) within the {height}×{width} training "
                       "images.")
  return pipeline
