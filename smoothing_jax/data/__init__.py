"""Datasets and input pipelines; importing the package imports no TensorFlow.

Modules: :mod:`~smoothing_jax.data.datasets` (dataset names, sources, normalisation),
:mod:`~smoothing_jax.data.pipeline` (:class:`Pipeline`, :func:`create_pipeline`, which picks the
path), :mod:`~smoothing_jax.data.resident` (device-resident splits, augmented inside the jitted
step: :mod:`~smoothing_jax.data.device_randaugment`), :mod:`~smoothing_jax.data.tfdata` (tf.data
on the host, for ImageNet and CamVid streamed from disk: :mod:`~smoothing_jax.data.augment`,
:mod:`~smoothing_jax.data.randaugment`), :mod:`~smoothing_jax.data.mixup` (on device, in the loss),
:mod:`~smoothing_jax.data.class_weights` (segmentation class balancing) and the TFDS builders
:mod:`~smoothing_jax.data.camvid` and :mod:`~smoothing_jax.data.cifar100_corrupted` (registered
when TFDS is first used).
"""
from smoothing_jax.data.class_weights import class_pixel_counts, median_frequency_weights
from smoothing_jax.data.datasets import (CORRUPTIONS, EXTRA_CORRUPTIONS, NORMALIZATION,
                                         NUM_CLASSES, DatasetSpec, DatasetUnavailableError,
                                         corruption_dataset, load_arrays, parse_dataset)
from smoothing_jax.data.pipeline import DATA_PIPELINES, Pipeline, create_pipeline

__all__ = ["CORRUPTIONS", "DATA_PIPELINES", "EXTRA_CORRUPTIONS", "NORMALIZATION", "NUM_CLASSES",
           "DatasetSpec", "corruption_dataset", "DatasetUnavailableError", "Pipeline",
           "create_pipeline", "load_arrays", "class_pixel_counts", "median_frequency_weights",
           "parse_dataset"]
