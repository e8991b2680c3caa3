"""smoothing_jax.data.tfdata (the host path, ``data_pipeline="tfdata"``): batches, deterministic
order, padding, TensorFlow's devices, RandAugment resumed exactly, segmentation crops and flips."""
import functools
import os
import subprocess
import sys

import numpy as np
import pytest

from smoothing_jax.data.sources.tfds import hide_accelerators_from_tensorflow
from tests.helpers import input_pipeline, npz_dataset

tf = pytest.importorskip("tensorflow")  # the tf.data path
tfds = pytest.importorskip("tensorflow_datasets")

from smoothing_jax.data.tfdata import TFDataPipeline  # noqa: E402  (imports TensorFlow)

create_pipeline = functools.partial(input_pipeline, data_pipeline="tfdata")


@pytest.fixture(scope="module")
def npz_dir(tmp_path_factory):
  return npz_dataset(tmp_path_factory.mktemp("npz"), 32)


def test_npz_source_batches_and_normalisation(npz_dir):
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=0)
  assert isinstance(pipeline, TFDataPipeline) and not pipeline.resident
  assert (pipeline.num_train, pipeline.num_eval, pipeline.steps_per_epoch) == (40, 13, 5)
  with np.load(f"{npz_dir}/train.npz") as d:
    pixels = d["images"].reshape(-1, 3) / 255.0
  np.testing.assert_allclose(pipeline.mean, pixels.mean(0), rtol=1e-6)
  batch = next(pipeline.train_iterator())
  assert batch["image"].shape == (8, 32, 32, 3) and batch["image"].dtype == np.float32
  assert batch["label"].dtype == np.int32


def test_eval_batches_pad_and_mask_every_example_once(npz_dir):
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=0)
  batches = list(pipeline.eval_batches(5))
  assert len(batches) == 3 and [b["mask"].sum() for b in batches] == [5, 5, 3]
  with np.load(f"{npz_dir}/test.npz") as d:
    images, labels = d["images"], d["labels"]
  mean, std = np.array(pipeline.mean), np.array(pipeline.std)
  got = np.concatenate([b["image"][b["mask"] > 0] for b in batches])
  np.testing.assert_allclose(got, (images / 255.0 - mean) / std, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.concatenate([b["label"][b["mask"] > 0] for b in batches]),
                                labels)
  assert np.all(batches[-1]["image"][3:] == 0)


def test_order_is_a_function_of_seed_and_epoch(npz_dir):
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=3)
  resident = input_pipeline(f"npz:{npz_dir}", 8, seed=3)
  np.testing.assert_array_equal(resident.epoch_order(1), pipeline.epoch_order(1))  # both paths
  epoch1 = list(tfds.as_numpy(pipeline.train_dataset(1)))
  again = list(tfds.as_numpy(create_pipeline(f"npz:{npz_dir}", 8, seed=3).train_dataset(1)))
  resumed = list(tfds.as_numpy(pipeline.train_dataset(1, start_step=2)))
  for a, b in zip(epoch1, again, strict=True):
    np.testing.assert_array_equal(a["image"], b["image"])
  for a, b in zip(epoch1[2:], resumed, strict=True):  # resuming mid-epoch sees the same batches
    np.testing.assert_array_equal(a["image"], b["image"])
  assert len(resumed) == 3
  epoch2 = next(iter(tfds.as_numpy(pipeline.train_dataset(2))))
  assert not np.array_equal(epoch1[0]["label"], epoch2["label"]) or not np.array_equal(
      epoch1[0]["image"], epoch2["image"])
  # The endless iterator crosses epochs: global step 5 is epoch 1, step 0.
  np.testing.assert_array_equal(next(pipeline.train_iterator(start_step=5))["image"],
                                epoch1[0]["image"])


def test_train_fraction_trains_on_a_balanced_subset_with_the_whole_split_statistics(npz_dir):
  full = create_pipeline(f"npz:{npz_dir}", 8, seed=0)
  half = create_pipeline(f"npz:{npz_dir}", 8, seed=0, train_fraction=0.5)
  _, counts = np.unique(full.train_labels, return_counts=True)
  expected = np.floor(0.5 * counts + 0.5)
  np.testing.assert_array_equal(np.unique(half.train_labels, return_counts=True)[1], expected)
  assert (half.num_train, half.steps_per_epoch) == (expected.sum(), int(expected.sum()) // 8)
  assert half.mean == full.mean and half.std == full.std  # normalisation of the whole split
  rows = [np.flatnonzero((full.train_images == image).all(axis=(1, 2, 3)))[0]
          for image in half.train_images]  # the subset's images are the split's, in its order
  np.testing.assert_array_equal(full.train_labels[rows], half.train_labels)
  assert np.all(np.diff(rows) > 0)
  again = create_pipeline(f"npz:{npz_dir}", 8, seed=0, train_fraction=0.5)  # e.g. on resume
  np.testing.assert_array_equal(again.train_images, half.train_images)
  with pytest.raises(ValueError, match="train_fraction must be a number in"):
    create_pipeline(f"npz:{npz_dir}", 8, seed=0, train_fraction=0.0)
  with pytest.raises(ValueError, match="train_fraction 0.5 needs an in-memory training split"):
    create_pipeline("imagenet2012", 8, seed=0, train_fraction=0.5)


def test_class_weights_need_label_maps(npz_dir):
  with pytest.raises(ValueError, match="segmentation"):
    create_pipeline(f"npz:{npz_dir}", 8, seed=0).class_weights(10)


def test_create_pipeline_hides_accelerators_from_tensorflow(npz_dir, monkeypatch):
  calls = []
  monkeypatch.setattr(tf.config, "set_visible_devices", lambda *args: calls.append(args))
  create_pipeline(f"npz:{npz_dir}", 8, seed=0)
  assert calls == [([], "GPU"), ([], "TPU")]


def test_hiding_accelerators_twice_or_too_late_is_harmless(monkeypatch):
  tf.constant(1.0).numpy()  # TensorFlow's devices are initialised from here on
  hide_accelerators_from_tensorflow()
  hide_accelerators_from_tensorflow()
  assert tf.config.get_visible_devices("GPU") == []

  def too_late(devices, device_type):
    raise RuntimeError("Visible devices cannot be modified after being initialized")
  monkeypatch.setattr(tf.config, "set_visible_devices", too_late)
  hide_accelerators_from_tensorflow()


def test_importing_the_data_package_leaves_tensorflow_devices_alone():
  code = ("import tensorflow as tf\n"
          "calls = []\n"
          "tf.config.set_visible_devices = lambda *args: calls.append(args)\n"
          "import smoothing_jax.data, smoothing_jax.data.tfdata\n"
          "assert calls == [], calls\n")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]


def test_pipeline_with_randaugment_resumes_exactly(tmp_path):
  rng = np.random.default_rng(0)
  for split, n in (("train", 32), ("test", 8)):
    np.savez(tmp_path / f"{split}.npz", images=rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
             labels=rng.integers(0, 10, n))
  make = lambda ra: create_pipeline(f"npz:{tmp_path}", 8, seed=1, randaugment=ra)  # noqa: E731
  randaugment = {"num_layers": 2, "magnitude": 9.0, "magnitude_std": 1.0}
  epoch = list(tfds.as_numpy(make(randaugment).train_dataset(0)))
  resumed = list(tfds.as_numpy(make(randaugment).train_dataset(0, start_step=2)))
  for a, b in zip(epoch[2:], resumed, strict=True):
    np.testing.assert_array_equal(a["image"], b["image"])
  plain = list(tfds.as_numpy(make(None).train_dataset(0)))
  assert not np.allclose(plain[0]["image"], epoch[0]["image"])
  np.testing.assert_array_equal(plain[0]["label"], epoch[0]["label"])


def test_segmentation_crop_and_flip_keep_labels_on_their_pixels(tmp_path):
  # Red channel = 40 · label, so image and label map must move together.
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 6, (6, 20, 24))  # 5 classes + void (5)
  images = np.stack(
      [40 * labels,
       rng.integers(0, 255, labels.shape),
       rng.integers(0, 255, labels.shape)], -1)
  for split in ("train", "test"):
    np.savez(tmp_path / f"{split}.npz", images=images.astype(np.uint8), labels=labels)
  pipeline = create_pipeline(f"npz:{tmp_path}", 2, 0, crop_size=(8, 12))
  assert pipeline.is_segmentation
  flips = set()
  for _, batch in zip(range(6), pipeline.train_iterator(), strict=False):
    red = batch["image"][..., 0] * pipeline.std[0] + pipeline.mean[0]
    np.testing.assert_allclose(red * 255, 40 * batch["label"], atol=1e-3)
    for crop in batch["label"]:  # a window of one training map, maybe mirrored
      found = {
          f for lab in labels for y in range(13) for x in range(13) for f in (0, 1)
          if np.array_equal(lab[y:y + 8, x:x + 12][:, ::-1] if f else lab[y:y + 8, x:x + 12], crop)
      }
      assert found
      flips |= found
  assert flips == {0, 1}
  with pytest.raises(ValueError, match="segmentation"):
    create_pipeline(f"npz:{tmp_path}", 2, 0, randaugment={"num_layers": 2, "magnitude": 9.0,
                                                          "magnitude_std": 0.0})
  # Void is a label value, so the number of classes must be given for npz label maps.
  from configs import camvid_unet
  from smoothing_jax.experiment.spec import build_model, check_model_fits, model_spec

  def create_model(config, pipeline):  # as Run.from_config
    model = build_model(config, model_spec(config, pipeline))
    check_model_fits(config, model, pipeline)
    return model
  config = camvid_unet.get_config(f"unet_dnn,npz:{tmp_path},runlocal")
  with pytest.raises(ValueError, match="num_classes"):
    create_model(config, pipeline)
  config.num_classes = 5
  assert create_model(config, pipeline).num_classes == 5
  from configs import cifar_resnet
  classifier = cifar_resnet.get_config(f"resnet_dnn_18,npz:{tmp_path},runlocal")
  classifier.num_classes = 5
  with pytest.raises(ValueError, match="does not fit dataset"):
    create_model(classifier, pipeline)


def test_eval_cache_keeps_the_preprocessed_images_and_gives_the_same_batches(npz_dir, tmp_path):
  prefix = str(tmp_path / "eval_cache")
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=0, eval_cache=prefix)
  first = list(pipeline.eval_batches(5))
  cached = [f for f in os.listdir(tmp_path) if f.startswith("eval_cache.npz_")]
  assert any(f.endswith(".index") for f in cached), cached  # a completed TF cache file
  again = list(pipeline.eval_batches(5))
  plain = list(create_pipeline(f"npz:{npz_dir}", 8, seed=0).eval_batches(5))
  for a, b, c in zip(first, again, plain, strict=True):
    for key in ("image", "label", "mask"):
      np.testing.assert_array_equal(a[key], b[key])
      np.testing.assert_array_equal(a[key], c[key])


def test_train_eval_batches_are_the_training_split_unaugmented(npz_dir):
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=0)
  batches = list(pipeline.train_eval_batches(16))
  with np.load(f"{npz_dir}/train.npz") as d:
    images = d["images"]
  got = np.concatenate([b["image"][b["mask"] > 0] for b in batches])
  mean, std = np.array(pipeline.mean), np.array(pipeline.std)
  np.testing.assert_allclose(got, (images / 255.0 - mean) / std, rtol=1e-5, atol=1e-5)
