"""Input pipelines (tf.data + TFDS) and the CIFAR-100-C and CamVid TFDS builders.

Modules: :mod:`~smoothing_jax.data.datasets` (dataset names, sources, normalisation),
:mod:`~smoothing_jax.data.augment` (augmentation recipes), :mod:`~smoothing_jax.data.pipeline`
(:class:`Pipeline`, batching), :mod:`~smoothing_jax.data.class_weights` (segmentation class
balancing), :mod:`~smoothing_jax.data.randaugment`, :mod:`~smoothing_jax.data.mixup` and the
TFDS builders :mod:`~smoothing_jax.data.camvid` and :mod:`~smoothing_jax.data.cifar100_corrupted`.
Importing the package leaves TensorFlow's devices alone; :func:`create_pipeline` (or
:func:`hide_accelerators_from_tensorflow`) keeps TensorFlow off the accelerators.
"""
from smoothing_jax.data.class_weights import class_pixel_counts, median_frequency_weights
from smoothing_jax.data.datasets import (CORRUPTIONS, EXTRA_CORRUPTIONS, NORMALIZATION,
                                         NUM_CLASSES, DatasetSpec, DatasetUnavailableError,
                                         corruption_dataset, load_arrays, parse_dataset)
from smoothing_jax.data.pipeline import (Pipeline, create_pipeline,
                                         hide_accelerators_from_tensorflow)

__all__ = ["CORRUPTIONS", "EXTRA_CORRUPTIONS", "NORMALIZATION", "NUM_CLASSES", "DatasetSpec",
           "corruption_dataset", "DatasetUnavailableError", "Pipeline", "create_pipeline",
           "hide_accelerators_from_tensorflow", "load_arrays", "class_pixel_counts",
           "median_frequency_weights", "parse_dataset"]
# Register the TFDS builders.
from smoothing_jax.data import camvid, cifar100_corrupted  # noqa: E402,F401
