"""smoothing_jax.data.resident: crops and flips against numpy slicing, the order a permutation per
epoch, resume and device count that change nothing, padded evaluation, the memory refusal."""
import jax
import numpy as np
import pytest

from smoothing_jax.data import parse_dataset
from smoothing_jax.data.resident import (
  PADDING,
  ResidentPipeline,
  augment_example,
  check_fits_on_devices,
)
from smoothing_jax.parallel import create_mesh
from tests.helpers import input_pipeline, npz_dataset

RANDAUGMENT = {"num_layers": 2, "magnitude": 9.0, "magnitude_std": 0.5}


@pytest.fixture(scope="module")
def npz_dir(tmp_path_factory):
  return npz_dataset(tmp_path_factory.mktemp("npz"), 16)


@pytest.fixture(scope="module")
def pipeline(npz_dir):
  return input_pipeline(f"npz:{npz_dir}", 8, seed=3)


def _denormalize(pipeline, images):
  pixels = np.asarray(images) * np.asarray(pipeline.std) + np.asarray(pipeline.mean)
  return np.round(pixels * 255).astype(np.int64)


def _crop_offsets(source, crop):
  """Every (dy, dx, flipped) whose window of the zero-padded ``source`` equals ``crop``."""
  padded = np.pad(source, ((PADDING, PADDING), (PADDING, PADDING), (0, 0)))
  h, w = source.shape[:2]
  return [(dy, dx, f) for dy in range(2 * PADDING + 1) for dx in range(2 * PADDING + 1)
          for f in (0, 1)
          if np.array_equal(padded[dy:dy + h, dx:dx + w][:, ::-1] if f else
                            padded[dy:dy + h, dx:dx + w], crop)]


def test_auto_keeps_in_memory_sets_on_the_devices(pipeline):
  assert isinstance(pipeline, ResidentPipeline) and pipeline.resident
  assert pipeline.arrays["images"].dtype == np.uint8
  assert pipeline.arrays["images"].sharding.is_fully_replicated
  with pytest.raises(ValueError, match="'imagenet2012' is streamed from disk"):
    input_pipeline("imagenet2012", 8, seed=0, data_pipeline="resident")


def test_crop_and_flip_are_numpy_windows_of_the_padded_image(pipeline):
  """Each augmented example is exactly one window (dy, dx ∈ [0, 8]) of its zero-padded source,
  maybe mirrored; over the epoch every offset range and both flips occur."""
  order = pipeline.epoch_order(0)
  seen = set()
  for step, batch in zip(range(pipeline.steps_per_epoch), pipeline.train_iterator(), strict=False):
    images = _denormalize(pipeline, batch["image"])
    np.testing.assert_array_equal(np.asarray(batch["label"]), pipeline.train_labels[order[step]])
    for image, row in zip(images, order[step], strict=True):
      matches = _crop_offsets(pipeline.train_images[row].astype(np.int64), image)
      assert len(matches) == 1, matches
      seen.add(matches[0])
  assert {f for _, _, f in seen} == {0, 1}
  assert len({dy for dy, _, _ in seen}) > 4 and len({dx for _, dx, _ in seen}) > 4


def test_augmentation_is_a_function_of_the_key():
  image = np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8)
  fn = jax.jit(lambda key: augment_example(key, image, np.int32(0), (2, 9.0, 0.5))[0])
  a, b, c = (np.asarray(fn(jax.random.key(k))) for k in (0, 0, 1))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)


def test_order_is_a_permutation_per_epoch_that_depends_on_seed_and_epoch(pipeline, npz_dir):
  orders = [pipeline.epoch_order(e) for e in range(3)]
  for order in orders:
    assert order.shape == (5, 8) and len(np.unique(order)) == 40  # each example once
  assert not np.array_equal(orders[0], orders[1])
  again = input_pipeline(f"npz:{npz_dir}", 8, seed=3)
  np.testing.assert_array_equal(again.epoch_order(1), orders[1])
  other_seed = input_pipeline(f"npz:{npz_dir}", 8, seed=4)
  assert not np.array_equal(other_seed.epoch_order(0), orders[0])


def test_resuming_mid_stream_gives_the_same_batches(pipeline, npz_dir):
  """Steps 3..7 (across the epoch boundary at 5) from a fresh pipeline started at step 3 equal
  those of an uninterrupted one, bit for bit, with RandAugment on."""
  make = lambda: input_pipeline(f"npz:{npz_dir}", 8, seed=3, randaugment=RANDAUGMENT)  # noqa: E731
  uninterrupted = [b["image"] for _, b in zip(range(8), make().train_iterator(), strict=False)]
  resumed = [b["image"]
             for _, b in zip(range(5), make().train_iterator(start_step=3), strict=False)]
  for a, b in zip(uninterrupted[3:], resumed, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  plain = next(pipeline.train_iterator())["image"]
  assert not np.array_equal(np.asarray(plain), np.asarray(uninterrupted[0]))


def test_one_device_gives_the_batches_of_eight(npz_dir):
  assert jax.device_count() == 8
  batches = []
  for devices in (1, 8):
    p = input_pipeline(f"npz:{npz_dir}", 8, seed=3, randaugment=RANDAUGMENT,
                       mesh=create_mesh(devices))
    batch = next(p.train_iterator(start_step=2))
    assert len(batch["image"].sharding.device_set) == devices
    batches.append(np.asarray(batch["image"]))
  np.testing.assert_array_equal(*batches)


def test_eval_batches_pad_and_mask_every_example_once(pipeline, npz_dir):
  batches = list(pipeline.eval_batches(8))
  assert [float(b["mask"].sum()) for b in batches] == [8, 5]
  with np.load(f"{npz_dir}/test.npz") as d:
    images, labels = d["images"], d["labels"]
  got = np.concatenate([np.asarray(b["image"])[np.asarray(b["mask"]) > 0] for b in batches])
  expected = (images / 255.0 - np.asarray(pipeline.mean)) / np.asarray(pipeline.std)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(
      np.concatenate([np.asarray(b["label"])[np.asarray(b["mask"]) > 0] for b in batches]), labels)
  assert np.all(np.asarray(batches[-1]["image"])[5:] == 0)
  assert batches[0]["image"].sharding.spec[0] == "data"


def test_segmentation_crop_and_flip_keep_labels_on_their_pixels(tmp_path):
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 6, (6, 20, 24))
  images = np.stack([40 * labels, rng.integers(0, 255, labels.shape),
                     rng.integers(0, 255, labels.shape)], -1).astype(np.uint8)
  for split in ("train", "test"):
    np.savez(tmp_path / f"{split}.npz", images=images, labels=labels)
  pipeline = input_pipeline(f"npz:{tmp_path}", 2, 0, crop_size=(8, 12))
  assert pipeline.resident and pipeline.is_segmentation
  flips = set()
  for _, batch in zip(range(6), pipeline.train_iterator(), strict=False):
    pixels, crops = _denormalize(pipeline, batch["image"]), np.asarray(batch["label"])
    np.testing.assert_array_equal(pixels[..., 0], 40 * crops)
    for crop in crops:  # a window of one training map, maybe mirrored
      found = {f for lab in labels for y in range(13) for x in range(13) for f in (0, 1)
               if np.array_equal(lab[y:y + 8, x:x + 12][:, ::-1] if f else lab[y:y + 8, x:x + 12],
                                 crop)}
      assert found
      flips |= found
  assert flips == {0, 1}


class _Device:
  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return {"bytes_limit": self.limit}


def test_a_set_too_large_for_the_devices_is_refused_in_one_line():
  cifar100 = 60_000 * 32 * 32 * 3 + 60_000 * 4  # uint8 images, int32 labels: 184 MB per device
  check_fits_on_devices("cifar100", cifar100, [_Device(80 * 2**30)])  # an H100: 0.2%
  with pytest.raises(ValueError) as error:
    check_fits_on_devices("cifar100", cifar100, [_Device(80 * 2**30), _Device(512 * 2**20)])
  message = str(error.value)
  assert "\n" not in message and "176 MiB" in message and "data_pipeline=tfdata" in message
  check_fits_on_devices("cifar100", cifar100, [jax.devices()[0]])  # the CPU reports no limit


def test_synthetic_dataset_for_benchmarks():
  spec = parse_dataset("synthetic:50x8x8x3:7")
  assert spec.num_classes == 7
  pipeline = input_pipeline("synthetic:50x8x8x3:7", 10, seed=0)
  assert (pipeline.num_train, pipeline.num_eval, pipeline.image_shape) == (50, 10, (8, 8, 3))
  assert pipeline.train_labels.max() < 7
  np.testing.assert_array_equal(pipeline.train_images,
                                input_pipeline("synthetic:50x8x8x3:7", 5, 1).train_images)
  for bad in ("synthetic:50x8x8:7", "synthetic:0x8x8x3:7"):
    with pytest.raises(ValueError, match="synthetic:<N>x<H>x<W>x<C>:<classes>"):
      parse_dataset(bad)
