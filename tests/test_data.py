"""Input pipelines: sources, deterministic order, augmentation, padding, missing data, CIFAR-100-C builder."""
import numpy as np
import pytest
import tensorflow_datasets as tfds

from smoothing_jax.data import DatasetUnavailableError, NORMALIZATION, create_pipeline, parse_dataset
from smoothing_jax.data.cifar100_corrupted import Cifar100Corrupted
from smoothing_jax.data.input_pipeline import cifar_train_augment


@pytest.fixture(scope="module")
def npz_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("npz")
  rng = np.random.default_rng(0)
  for split, n in (("train", 40), ("test", 13)):
    np.savez(root / f"{split}.npz", images=rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8),
             labels=rng.integers(0, 10, n))
  return str(root)


def test_parse_dataset():
  assert parse_dataset("cifar100").base == "cifar100"
  spec = parse_dataset("cifar10_corrupted/gaussian_noise_3")
  assert (spec.base, spec.corruption) == ("cifar10", ("gaussian_noise", 3))
  assert parse_dataset("imagenet2012").geometry == "imagenet"
  assert parse_dataset("npz:/data/c10").source == "npz"
  for bad in ("cifar1000", "cifar10_corrupted/fog_6", "cifar10_corrupted/rain_1", "npz:"):
    with pytest.raises(ValueError, match="dataset"):
      parse_dataset(bad)


def test_npz_source_batches_and_normalisation(npz_dir):
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=0)
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
  np.testing.assert_array_equal(np.concatenate([b["label"][b["mask"] > 0] for b in batches]), labels)
  assert np.all(batches[-1]["image"][3:] == 0)


def test_order_is_a_function_of_seed_and_epoch(npz_dir):
  pipeline = create_pipeline(f"npz:{npz_dir}", 8, seed=3)
  epoch1 = list(tfds.as_numpy(pipeline.train_dataset(1)))
  again = list(tfds.as_numpy(create_pipeline(f"npz:{npz_dir}", 8, seed=3).train_dataset(1)))
  resumed = list(tfds.as_numpy(pipeline.train_dataset(1, start_step=2)))
  for a, b in zip(epoch1, again):
    np.testing.assert_array_equal(a["image"], b["image"])
  for a, b in zip(epoch1[2:], resumed):  # resuming mid-epoch sees the same batches
    np.testing.assert_array_equal(a["image"], b["image"])
  assert len(resumed) == 3
  epoch2 = next(iter(tfds.as_numpy(pipeline.train_dataset(2))))
  assert not np.array_equal(epoch1[0]["label"], epoch2["label"]) or not np.array_equal(
      epoch1[0]["image"], epoch2["image"])
  # The endless iterator crosses epochs: global step 5 is epoch 1, step 0.
  np.testing.assert_array_equal(next(pipeline.train_iterator(start_step=5))["image"], epoch1[0]["image"])


def test_cifar_augmentation_is_a_padded_crop_maybe_flipped():
  rng = np.random.default_rng(1)
  image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
  padded = np.pad(image, ((4, 4), (4, 4), (0, 0)))
  candidates = [c for i in range(9) for j in range(9) for c in (padded[i:i + 32, j:j + 32],
                                                                padded[i:i + 32, j:j + 32][:, ::-1])]
  outputs = []
  for seed in range(8):
    out = cifar_train_augment(image, np.array([seed, 7], np.int64)).numpy()
    assert any(np.array_equal(out, c) for c in candidates)
    outputs.append(out)
  assert len({o.tobytes() for o in outputs}) > 1


def test_tfds_cifar10_under_mock_data():
  with tfds.testing.mock_data(num_examples=24):
    pipeline = create_pipeline("cifar10", 8, seed=0)
    batch = next(pipeline.train_iterator())
  assert batch["image"].shape == (8, 32, 32, 3)
  assert pipeline.mean == NORMALIZATION["cifar10"][0]
  assert batch["label"].min() >= 0 and batch["label"].max() < 10


def test_missing_tfds_dataset_is_one_clear_error(tmp_path):
  with pytest.raises(DatasetUnavailableError) as err:
    create_pipeline("cifar100", 8, seed=0, data_dir=str(tmp_path), download=False)
  message = str(err.value)
  assert "'cifar100'" in message and str(tmp_path) in message and "npz:" in message


def test_missing_npz_file_is_named(tmp_path):
  with pytest.raises(DatasetUnavailableError, match="train.npz does not exist"):
    create_pipeline(f"npz:{tmp_path}", 8, seed=0)


def test_cifar100_corrupted_builder_reads_a_fake_release(tmp_path):
  manual = tmp_path / "CIFAR-100-C"
  manual.mkdir()
  rng = np.random.default_rng(2)
  images = rng.integers(0, 256, (5 * 4, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 100, 5 * 4)
  np.save(manual / "fog.npy", images)
  np.save(manual / "labels.npy", labels)
  builder = Cifar100Corrupted(config="fog_3", data_dir=str(tmp_path / "tfds"))
  builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=str(tmp_path)))
  examples = sorted(tfds.as_numpy(builder.as_dataset(split="test")), key=lambda ex: int(ex["label"]) * 0)
  got_images = np.stack([ex["image"] for ex in examples])
  # Severity 3 is the third block of 4; compare as sets (TFDS may reorder examples).
  expected = {img.tobytes(): int(lab) for img, lab in zip(images[8:12], labels[8:12])}
  assert {img.tobytes(): int(ex["label"]) for img, ex in zip(got_images, examples)} == expected


def test_digits_source_is_offline_and_split():
  pipeline = create_pipeline("digits", 32, seed=0)
  assert (pipeline.num_train, pipeline.num_eval) == (1797 - 360, 360)
  assert pipeline.train_images.shape[1:] == (32, 32, 3)
  assert set(np.unique(pipeline.eval_labels)) == set(range(10))


def test_imagenet_preprocessing_shapes():
  from smoothing_jax.data.input_pipeline import imagenet_eval_preprocess, imagenet_train_augment
  image = np.random.default_rng(3).integers(0, 256, (300, 400, 3), dtype=np.uint8)
  train = imagenet_train_augment(image, np.array([1, 2], np.int64)).numpy()
  assert train.shape == (224, 224, 3)
  evaluated = imagenet_eval_preprocess(image).numpy()
  assert evaluated.shape == (224, 224, 3)
  # Resize 256 on the short side (300 -> 256, 400 -> 341), then the centre 224×224.
  import tensorflow as tf
  resized = tf.image.resize(image, (256, 341), method="bilinear").numpy()
  np.testing.assert_allclose(evaluated, resized[16:240, 58:282], rtol=1e-5, atol=1e-3)
