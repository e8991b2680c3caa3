"""Input pipelines (tf.data + TFDS) and the CIFAR-100-C and CamVid TFDS builders."""
from smoothing_jax.data.input_pipeline import (CORRUPTIONS, NORMALIZATION, NUM_CLASSES, DatasetSpec,
                                               corruption_dataset,
                                               DatasetUnavailableError, Pipeline, create_pipeline, load_arrays,
                                               median_frequency_weights, parse_dataset)

__all__ = ["CORRUPTIONS", "NORMALIZATION", "NUM_CLASSES", "DatasetSpec", "corruption_dataset", "DatasetUnavailableError", "Pipeline",
           "create_pipeline", "load_arrays", "median_frequency_weights", "parse_dataset"]
from smoothing_jax.data import camvid, cifar100_corrupted  # noqa: E402,F401  (register the TFDS builders)
