"""smoothing_jax.data.cifar100_corrupted: the CIFAR-100-C TFDS builder."""
import numpy as np
import pytest

tfds = pytest.importorskip("tensorflow_datasets")  # a TFDS builder

from smoothing_jax.data.cifar100_corrupted import Cifar100Corrupted  # noqa: E402  (imports TFDS)


def test_cifar100_corrupted_builder_reads_a_fake_release(tmp_path):
  manual = tmp_path / "CIFAR-100-C"
  manual.mkdir()
  rng = np.random.default_rng(2)
  images = rng.integers(0, 256, (5 * 4, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 100, 5 * 4)
  np.save(manual / "fog.npy", images)
  np.save(manual / "labels.npy", labels)
  builder = Cifar100Corrupted(config="fog_3", data_dir=str(tmp_path / "tfds"))
  builder.download_and_prepare(
      download_config=tfds.download.DownloadConfig(manual_dir=str(tmp_path)))
  examples = sorted(tfds.as_numpy(builder.as_dataset(split="test")),
                    key=lambda ex: int(ex["label"]) * 0)
  got_images = np.stack([ex["image"] for ex in examples])
  # Severity 3 is the third block of 4; compare as sets (TFDS may reorder examples).
  expected = {img.tobytes(): int(lab) for img, lab in zip(images[8:12], labels[8:12], strict=True)}
  got = {img.tobytes(): int(ex["label"]) for img, ex in zip(got_images, examples, strict=True)}
  assert got == expected
