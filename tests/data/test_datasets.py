"""smoothing_jax.data.datasets: dataset names, sources (TFDS, digits, npz), missing data."""
import os

import numpy as np
import pytest

from smoothing_jax.data import (
  CORRUPTIONS,
  NORMALIZATION,
  DatasetUnavailableError,
  corruption_dataset,
  parse_dataset,
)
from smoothing_jax.data.sources.tfds import unreachable_download_host  # the real probe (conftest)
from tests.helpers import input_pipeline

tfds = pytest.importorskip("tensorflow_datasets")  # TFDS sources under mock data


def test_parse_dataset():
  assert parse_dataset("cifar100").base == "cifar100"
  spec = parse_dataset("cifar10_corrupted/gaussian_noise_3")
  assert (spec.base, spec.corruption) == ("cifar10", ("gaussian_noise", 3))
  assert parse_dataset("imagenet2012").geometry == "imagenet"
  assert parse_dataset("npz:/data/c10").source == "npz"
  for bad in ("cifar1000", "cifar10_corrupted/fog_6", "cifar10_corrupted/rain_1", "npz:"):
    with pytest.raises(ValueError, match="dataset"):
      parse_dataset(bad)


def test_tfds_cifar10_under_mock_data():
  with tfds.testing.mock_data(num_examples=24):
    pipeline = input_pipeline("cifar10", 8, seed=0)
    batch = next(pipeline.train_iterator())
  assert batch["image"].shape == (8, 32, 32, 3)
  assert pipeline.mean == NORMALIZATION["cifar10"][0]
  assert batch["label"].min() >= 0 and batch["label"].max() < 10


def test_check_available_opens_a_split_as_reading_it_would(tmp_path):
  from smoothing_jax.data.datasets import check_available
  with tfds.testing.mock_data(num_examples=8):  # readable (mocked), though never prepared
    check_available(parse_dataset("cifar100"), "test", download=True)
  with pytest.raises(DatasetUnavailableError, match="'cifar100' is not prepared in data_dir"):
    check_available(parse_dataset("cifar100"), "test", str(tmp_path), download=False)
  with pytest.raises(DatasetUnavailableError, match="missing/test.npz does not exist"):
    check_available(parse_dataset(f"npz:{tmp_path / 'missing'}"), "test")


def test_missing_tfds_dataset_is_one_clear_error(tmp_path):
  with pytest.raises(DatasetUnavailableError) as err:
    input_pipeline("cifar100", 8, seed=0, data_dir=str(tmp_path), download=False)
  message = str(err.value)
  assert "'cifar100'" in message and str(tmp_path) in message and "npz:" in message


@pytest.mark.parametrize("network", ["refuses", "hangs"])
def test_offline_a_missing_tfds_set_fails_at_once_and_writes_nothing(network, tmp_path,
                                                                     monkeypatch):
  """Offline, TFDS would retry the download for minutes (issue 43): its hosts are probed first,
  and one that refuses or does not answer within ``PROBE_TIMEOUT_S`` ends it in one line."""
  import socket
  import threading
  import time

  from smoothing_jax.data import datasets
  from smoothing_jax.data.sources import tfds as tfds_source
  released = threading.Event()

  def blocked(address, timeout=None):
    if network == "hangs":  # a resolver that never answers, released when the test ends
      released.wait(30)
    raise OSError(f"network blocked ({address[0]})")

  monkeypatch.setattr(tfds_source, "unreachable_download_host", unreachable_download_host)
  monkeypatch.setattr(socket, "create_connection", blocked)
  monkeypatch.setattr(tfds_source, "PROBE_TIMEOUT_S", 0.5)
  tfds_source.import_tfds("svhn_cropped")  # TensorFlow's import is not the download's time
  start = time.monotonic()
  try:
    with pytest.raises(DatasetUnavailableError) as err:
      datasets.load_arrays(parse_dataset("svhn_cropped"), "test", str(tmp_path), download=True)
  finally:
    released.set()
  assert time.monotonic() - start < 10
  message = str(err.value)
  why = "no answer within 0.5 s" if network == "hangs" else "network blocked"
  assert "\n" not in message and "'svhn_cropped'" in message and why in message
  assert all(part in message for part in ("ufldl.stanford.edu:80", "input.download",
                                          "--config.input.data_dir=<dir>", "npz:<dir>"))
  assert not list(tmp_path.iterdir())  # no incomplete.* nor downloads/ in the data_dir


def test_missing_npz_file_is_named(tmp_path):
  with pytest.raises(DatasetUnavailableError, match="train.npz does not exist"):
    input_pipeline(f"npz:{tmp_path}", 8, seed=0)


def test_create_pipeline_reads_a_config_input_block_and_names_unknown_keys():
  from configs import quickstart
  from smoothing_jax.data import create_pipeline
  pipeline = create_pipeline(quickstart.get_config().input, seed=5)
  assert (pipeline.dataset_spec.name, pipeline.global_batch_size, pipeline.seed) == (
      "digits", 64, 5)
  with pytest.raises(ValueError, match="Unknown input keys data_split_seed; known: dataset, "):
    input_pipeline("digits", 8, data_split_seed=0)


def test_digits_source_is_offline_and_split():
  pipeline = input_pipeline("digits", 32, seed=0)
  assert (pipeline.num_train, pipeline.num_eval) == (1797 - 360, 360)
  assert pipeline.train_images.shape[1:] == (32, 32, 3)
  assert set(np.unique(pipeline.eval_labels)) == set(range(10))


def test_class_balanced_subset_keeps_round_fraction_of_each_class_deterministically():
  from smoothing_jax.data.datasets import class_balanced_subset
  labels = np.random.default_rng(0).permutation(np.repeat([0, 1, 2], [10, 7, 3]))
  kept = class_balanced_subset(labels, 0.5, seed=0)
  # round(0.5 × 10, 7, 3) = 5, 4, 2 (halves rounded up); increasing, distinct indices.
  assert [np.sum(labels[kept] == c) for c in range(3)] == [5, 4, 2]
  assert np.all(np.diff(kept) > 0)
  np.testing.assert_array_equal(class_balanced_subset(labels, 0.5, seed=0), kept)
  assert not np.array_equal(class_balanced_subset(labels, 0.5, seed=1), kept)
  assert set(class_balanced_subset(labels, 0.2, seed=0)) < set(kept)  # nested in the fraction
  np.testing.assert_array_equal(class_balanced_subset(labels, 1.0, seed=5), np.arange(20))
  maps = np.zeros((8, 2, 2), np.int32)  # label maps: one group, a uniform subset
  assert len(class_balanced_subset(maps, 0.25, seed=0)) == 2


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan"), "0.5", True])
def test_class_balanced_subset_rejects_bad_fractions(fraction):
  from smoothing_jax.data.datasets import class_balanced_subset
  with pytest.raises(ValueError, match=r"train_fraction must be a number in \(0, 1\]"):
    class_balanced_subset(np.arange(4) % 2, fraction, seed=0)


def test_class_balanced_subset_rejects_a_fraction_that_empties_a_class():
  from smoothing_jax.data.datasets import class_balanced_subset
  with pytest.raises(ValueError, match="keeps none of the 2 training examples of class 1"):
    class_balanced_subset(np.array([0] * 10 + [1] * 2), 0.2, seed=0)


@pytest.mark.parametrize("base,builder", [("cifar10", "cifar10_corrupted"),
                                          ("cifar100", "cifar100_corrupted"),
                                          ("imagenet2012", "imagenet2012_corrupted")])
def test_every_requested_corruption_is_a_config_of_its_builder(base, builder):
  """TFDS calls CIFAR-10-C's glass blur ``frosted_glass_blur`` and its elastic ``elastic``."""
  pytest.importorskip("tensorflow_datasets")
  from smoothing_jax.data.sources.tfds import import_tfds
  tfds = import_tfds(base)  # registers cifar100_corrupted
  configs = {c.name for c in tfds.builder_cls(builder).BUILDER_CONFIGS}
  for corruption in CORRUPTIONS:
    for severity in range(1, 6):
      spec = parse_dataset(corruption_dataset(base, corruption, severity))
      name, _, config = spec.tfds_name.partition("/")
      assert name == builder and config in configs, (corruption, severity, spec.tfds_name)
      assert spec.corruption == (corruption, severity)
  assert parse_dataset("cifar10_corrupted/elastic_2").corruption == ("elastic_transform", 2)


def test_an_npz_file_is_a_test_split_and_grayscale_arrays_are_read(tmp_path):
  from smoothing_jax.data.datasets import check_available, load_arrays
  gray = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)  # MNIST's layout [N,28,28]
  np.savez(tmp_path / "gray.npz", images=gray, labels=np.array([7, 2]))
  for name in (str(tmp_path / "gray.npz"), f"npz:{tmp_path / 'gray.npz'}"):
    spec = parse_dataset(name)
    assert (spec.source, spec.name) == ("npz", f"npz:{tmp_path / 'gray.npz'}")
    images, labels = load_arrays(spec, "test", shard=False)
    np.testing.assert_array_equal(images[..., 0], gray)
    np.testing.assert_array_equal(labels, [7, 2])
  with pytest.raises(DatasetUnavailableError, match="is one file, read as a test split; its "
                     "train split needs npz:<dir> with train.npz"):
    load_arrays(spec, "train")
  with pytest.raises(DatasetUnavailableError, match="missing.npz does not exist"):
    check_available(parse_dataset(str(tmp_path / "missing.npz")), "test")


SHARED = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data")


@pytest.mark.skipif(not os.path.exists(os.path.join(SHARED, "mnist", "test.npz")),
                    reason="no ../shared/data")
def test_the_shared_near_and_far_sets_read_as_a_cifar_model_takes_them():
  from smoothing_jax.data.datasets import as_model_images, check_available, load_arrays
  check_available(parse_dataset(os.path.join(SHARED, "cifar100", "test_jpeg75.npz")), "test")
  images, labels = load_arrays(parse_dataset(os.path.join(SHARED, "mnist", "test.npz")), "test",
                               shard=False)
  assert images.shape == (10000, 28, 28, 1) and list(labels[:4]) == [7, 2, 1, 0]  # its README
  converted = as_model_images("mnist", images[:8], (32, 32, 3))
  assert converted.shape == (8, 32, 32, 3)
  assert np.all(converted[..., :1] == converted)  # the gray channel, repeated
