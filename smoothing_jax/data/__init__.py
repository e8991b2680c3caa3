"""Datasets and input pipelines; importing the package imports no TensorFlow.

Modules: :mod:`~smoothing_jax.data.datasets` (dataset names, sources, normalisation; the
corruption types in :mod:`~smoothing_jax.data.corruption_names`),
:mod:`~smoothing_jax.data.pipeline` (:func:`create_pipeline`, which picks the path and builds a
:class:`Pipeline`, the interface of :mod:`~smoothing_jax.data.pipeline_base`),
:mod:`~smoothing_jax.data.resident` (device-resident splits, augmented inside the jitted step:
:mod:`~smoothing_jax.data.device_randaugment`), :mod:`~smoothing_jax.data.tfdata` (tf.data on
the host, for ImageNet and CamVid streamed from disk: :mod:`~smoothing_jax.data.augment`,
:mod:`~smoothing_jax.data.randaugment`), :mod:`~smoothing_jax.data.mixup` (on device, in the loss),
:mod:`~smoothing_jax.data.class_weights` (segmentation class balancing) and the TFDS builders
:mod:`~smoothing_jax.data.camvid` and :mod:`~smoothing_jax.data.cifar100_corrupted` (registered
when TFDS is first used).
"""
from smoothing_jax.data.class_weights import class_pixel_counts, median_frequency_weights
from smoothing_jax.data.corruption_names import CORRUPTIONS, EXTRA_CORRUPTIONS
from smoothing_jax.data.dataset_spec import (
  NORMALIZATION,
  NUM_CLASSES,
  DatasetSpec,
  DatasetUnavailableError,
  corruption_dataset,
)
from smoothing_jax.data.datasets import load_arrays, parse_dataset
from smoothing_jax.data.pipeline import DATA_PIPELINES, create_pipeline
from smoothing_jax.data.pipeline_base import Pipeline

__all__ = ["CORRUPTIONS", "DATA_PIPELINES", "EXTRA_CORRUPTIONS", "NORMALIZATION", "NUM_CLASSES",
           "DatasetSpec", "corruption_dataset", "DatasetUnavailableError", "Pipeline",
           "create_pipeline", "load_arrays", "class_pixel_counts", "median_frequency_weights",
           "parse_dataset"]
