"""The tf.data path: :class:`TFDataPipeline`, for datasets streamed from disk (ImageNet, CamVid)
or when ``data_pipeline="tfdata"`` asks for it.

Each batch is assembled and augmented on the host by tf.data (:mod:`~smoothing_jax.data.augment`,
:mod:`~smoothing_jax.data.randaugment`), then copied to the devices.  Segmentation (CamVid, or
``npz:`` with label maps ``[N, H, W]``): labels outside ``[0, num_classes)`` are void (masked from
losses and metrics).

Determinism: the example order of epoch ``e`` is :meth:`Pipeline.epoch_order` (in-memory splits)
or a shuffle seeded by ``(seed, e, process_index)`` (streamed), and augmentation uses stateless
ops seeded by the example's position in that order, so a run resumed at step ``s`` sees exactly
the batches an uninterrupted run would.  Each process reads only its shard.  Evaluation pads the
last batch and returns a ``mask`` so every example counts once.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterator

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from smoothing_jax.data.augment import (
  cifar_train_augment,
  imagenet_eval_preprocess,
  imagenet_train_augment,
  normalize,
  segmentation_train_augment,
)
from smoothing_jax.data.datasets import as_model_images, load_arrays, parse_dataset
from smoothing_jax.data.pipeline_base import Batches, Pipeline
from smoothing_jax.data.randaugment import randaugment
from smoothing_jax.data.sources.tfds import examples, tfds_builder


def _options(ds):
  options = tf.data.Options()
  options.deterministic = True
  options.threading.private_threadpool_size = max(1, os.cpu_count() or 1)
  return ds.with_options(options)


@dataclasses.dataclass
class TFDataPipeline(Pipeline):
  """:class:`Pipeline` whose batches tf.data assembles on the host (numpy)."""

  def train_dataset(self, epoch: int, start_step: int = 0) -> tf.data.Dataset:
    """Batches of epoch ``epoch`` from step ``start_step`` on: ``{"image", "label"}``,
    normalised float32."""
    steps, batch = self.steps_per_epoch, self.local_batch_size
    if self.train_images is not None:
      # One global order of the whole split (the same on every process); process p takes its
      # slice of each global batch, so the global batches, and the augmentation of each example
      # (seeded by its global position), do not depend on the number of processes.
      order_seed = int(np.random.default_rng([self.seed, epoch, 0]).integers(2 ** 31))
      mine = slice(jax.process_index() * batch, (jax.process_index() + 1) * batch)
      rows = self.epoch_order(epoch)[start_step:, mine].reshape(-1)
      positions = np.arange(steps * self.global_batch_size).reshape(
          steps, self.global_batch_size)[start_step:, mine].reshape(-1)
      ds = tf.data.Dataset.zip(tf.data.Dataset.from_tensor_slices(positions),
                               tf.data.Dataset.from_tensor_slices((self.train_images[rows],
                                                                   self.train_labels[rows])))
    else:  # streaming (ImageNet): seeded shuffle buffer, then skip what was already consumed
      epoch_seed = np.random.default_rng([self.seed, epoch, jax.process_index()])
      order_seed = int(epoch_seed.integers(2 ** 31))
      # JPEG bytes: imagenet_train_augment decodes only its random crop.
      ds = examples(self.dataset_spec, "train", self.data_dir, self.download,
                    encoded_images=True)
      ds = ds.shuffle(16 * 1024, seed=order_seed, reshuffle_each_iteration=False)
      ds = ds.take(steps * batch).skip(start_step * batch)
      ds = tf.data.Dataset.zip(tf.data.Dataset.range(start_step * batch, steps * batch), ds)
    imagenet = self.dataset_spec.geometry == "imagenet"
    augment = imagenet_train_augment if imagenet else cifar_train_augment
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
      return {"image": normalize(image, mean, std), "label": tf.cast(label, tf.int32)}

    ds = ds.map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    return _options(ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

  def train_iterator(self, start_step: int = 0) -> Iterator[dict]:
    """Endless numpy batches starting at global step ``start_step``."""
    epoch, step_in_epoch = divmod(start_step, self.steps_per_epoch)
    while True:
      yield from tfds.as_numpy(self.train_dataset(epoch, step_in_epoch))
      epoch, step_in_epoch = epoch + 1, 0

  def train_eval_batches(self, batch_size: int | None = None) -> Iterator[dict]:
    """Evaluation batches (no augmentation) of the training split: what post-hoc OOD scores
    fit on (a split held in memory: not ImageNet's)."""
    if self.train_images is None:
      raise ValueError(f"{self.dataset_spec.name!r} streams its training split; the OOD scores "
                       "fitted on training features (mds, rmds, knn, vim) need it in memory.")
    return self.eval_batches(batch_size, train=True)

  def eval_batches(self, batch_size: int | None = None, dataset: str | None = None,
                   train: bool = False) -> Batches:
    """Evaluation batches ``{"image", "label", "mask"}`` (:class:`Batches`: they know their
    count); the last one is zero-padded, nothing is dropped.

    ``dataset`` (e.g. ``"cifar10_corrupted/fog_3"``) defaults to this dataset's
    evaluation split.  Every process yields the same number of batches (padding
    the shorter shards); ImageNet-sized sets are streamed, the others held in memory.
    """
    batch = (batch_size or self.global_batch_size) // jax.process_count()
    spec = self.dataset_spec if dataset is None else parse_dataset(dataset)
    if train:  # every process holds the whole split: its share, as load_arrays shards
      process, count = jax.process_index(), jax.process_count()
      ds = tf.data.Dataset.from_tensor_slices((self.train_images[process::count],
                                               self.train_labels[process::count]))
      num_global = len(self.train_images)
    elif spec.name == self.dataset_spec.name and self.eval_images is not None:
      ds = tf.data.Dataset.from_tensor_slices((self.eval_images, self.eval_labels))
      num_global = self.num_eval
    elif spec.geometry == "imagenet":
      builder = tfds_builder(spec, self.data_dir, self.download)
      ds = examples(spec, spec.eval_split, self.data_dir, self.download, builder=builder)
      num_global = builder.info.splits[spec.eval_split].num_examples
    else:
      images, labels = load_arrays(spec, spec.eval_split, self.data_dir, self.download,
                                   size=None if self.is_segmentation else self.image_shape[:2])
      ds = tf.data.Dataset.from_tensor_slices(
          (as_model_images(spec.name, images, self.image_shape), labels))
      num_global = len(images) * jax.process_count()
    per_process = -(-num_global // jax.process_count())  # ceil
    num_batches = -(-per_process // batch)
    mean, std = self.mean, self.std
    imagenet = self.dataset_spec.geometry == "imagenet"
    preprocess = imagenet_eval_preprocess if imagenet else (lambda x: x)
    ds = ds.map(lambda x, y: (normalize(preprocess(x), mean, std), tf.cast(y, tf.int32)),
                num_parallel_calls=tf.data.AUTOTUNE)
    if self.eval_cache and not train:  # decoded once (ImageNet JPEGs), read back later
      ds = ds.cache(f"{self.eval_cache}.{re.sub(r'[^A-Za-z0-9_.-]', '_', spec.name)}")
    label_shape = tuple(self.eval_labels.shape[1:] if self.is_segmentation else ())

    def padded():
      iterator = iter(tfds.as_numpy(_options(ds.batch(batch).prefetch(tf.data.AUTOTUNE))))
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
    return Batches(num_batches, padded(), examples=num_global)
