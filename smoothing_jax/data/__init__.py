"""Input pipelines (tf.data + TFDS) and the CIFAR-100-C TFDS builder."""
from smoothing_jax.data.input_pipeline import (CORRUPTIONS, NORMALIZATION, NUM_CLASSES, DatasetSpec,
                                               DatasetUnavailableError, Pipeline, create_pipeline, load_arrays,
                                               parse_dataset)

__all__ = ["CORRUPTIONS", "NORMALIZATION", "NUM_CLASSES", "DatasetSpec", "DatasetUnavailableError", "Pipeline",
           "create_pipeline", "load_arrays", "parse_dataset"]
from smoothing_jax.data import cifar100_corrupted  # noqa: E402,F401  (registers the TFDS builder)
