"""smoothing_jax.data.sources: ``folder:`` (a folder of PNGs made here), ``tfds:<any name>``
(under ``tfds.testing.mock_data``), the size rule, and the message naming every source."""
import os

import numpy as np
import pytest
from PIL import Image

from smoothing_jax.data import DatasetUnavailableError, load_arrays, parse_dataset
from smoothing_jax.data.sources import REGISTRY
from smoothing_jax.data.sources.base import fit_to_size
from tests.helpers import input_pipeline, override, small_npz_config

CLASSES = ("dog", "cat", "bird", "ant")  # folder order; the labels follow the sorted names


def write_folder(root, sizes=((16, 16),), per_class=3, splits=("train", "test")) -> str:
  """``root/<split>/<class>/<i>.png`` (``<i>.jpg`` for odd i): smooth random colour images, the
  i-th of each class at ``sizes[i % len(sizes)]``; returns ``str(root)``."""
  rng = np.random.default_rng(0)
  for split in splits:
    for name in CLASSES:
      os.makedirs(os.path.join(root, split, name))
      for i in range(per_class):
        height, width = sizes[i % len(sizes)]
        coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.BILINEAR)
        image.save(os.path.join(root, split, name, f"{i}.{'jpg' if i % 2 else 'png'}"))
  return str(root)


def test_an_unknown_name_lists_every_source_and_built_in_name():
  with pytest.raises(ValueError) as err:
    parse_dataset("tfds-oxford_flowers102")
  message = str(err.value)
  assert "\n" not in message
  for part in ("tfds:<name>[:<split>]", "folder:<dir>", "npz:<dir>",
               "synthetic:<N>x<H>x<W>x<C>:<classes>", "digits", "cifar10", "imagenet2012",
               "svhn_cropped", "<base>_corrupted/<type>_<1-5>"):
    assert part in message, part
  with pytest.raises(ValueError, match="write tfds:<name>"):
    parse_dataset("tfds:Not A Name")
  built_in = [name for source in REGISTRY.values() for name in source.built_in]
  assert len(built_in) == len(set(built_in))  # one source at most claims a name


def test_a_folder_reads_sorted_classes_and_decodes_once(tmp_path, monkeypatch):
  root = write_folder(tmp_path / "pets")
  spec = parse_dataset(f"folder:{root}")
  assert (spec.source, spec.class_names, spec.num_classes) == (
      "folder", ("ant", "bird", "cat", "dog"), 4)
  images, labels = load_arrays(spec, "train", shard=False)
  assert images.shape == (12, 16, 16, 3) and images.dtype == np.uint8
  assert labels.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3  # ant, bird, cat, dog
  with Image.open(os.path.join(root, "train", "ant", "0.png")) as first:
    np.testing.assert_array_equal(images[0], np.asarray(first.convert("RGB")))
  cached = os.listdir(os.path.join(root, ".smoothing_jax_cache"))
  assert len(cached) == 1 and cached[0].startswith("train-") and cached[0].endswith(".npz")
  from smoothing_jax.data.sources import folder
  monkeypatch.setattr(folder, "decode", lambda *a: pytest.fail("decoded again"))
  again, _ = load_arrays(spec, "train", shard=False)
  np.testing.assert_array_equal(again, images)
  os.remove(os.path.join(root, "train", "dog", "2.png"))  # a changed folder is decoded anew
  monkeypatch.undo()
  assert load_arrays(spec, "train", shard=False)[0].shape[0] == 11


def test_a_folder_of_several_sizes_needs_image_size_and_unknown_test_classes_are_named(tmp_path):
  root = write_folder(tmp_path / "mixed", sizes=((16, 16), (20, 28)))
  spec = parse_dataset(f"folder:{root}")
  with pytest.raises(ValueError, match=r"has images of 2 sizes \(16×16, 20×28, \.\.\.\): set "
                     r"--config\.input\.image_size=<S>"):
    load_arrays(spec, "train", shard=False)
  images, _ = load_arrays(spec, "train", shard=False, size=(16, 16))
  assert images.shape == (12, 16, 16, 3)
  with Image.open(os.path.join(root, "train", "ant", "1.jpg")) as big:
    np.testing.assert_array_equal(images[1], fit_to_size(np.asarray(big.convert("RGB")), (16, 16)))
  os.makedirs(os.path.join(root, "test", "zebra"))
  with pytest.raises(ValueError, match="test/ has classes the training split lacks: zebra"):
    load_arrays(spec, "test")
  with pytest.raises(DatasetUnavailableError, match="does not exist"):
    load_arrays(parse_dataset(f"folder:{tmp_path / 'absent'}"), "test")


def test_the_size_rule_is_torchvision_resize_then_centre_crop():
  """Resize(16) of a 20×28 image: 16×22 (28·16/20 = 22.4, truncated), then the centre 16×16
  (left (22 − 16) / 2 = 3), by Pillow's bilinear resize, written out by hand."""
  image = np.random.default_rng(1).integers(0, 256, (20, 28, 3), dtype=np.uint8)
  resized = np.asarray(Image.fromarray(image).resize((22, 16), Image.BILINEAR))
  np.testing.assert_array_equal(fit_to_size(image, (16, 16)), resized[:, 3:19])
  assert fit_to_size(image[..., :1], (16, 16)).shape == (16, 16, 1)
  assert fit_to_size(image, (20, 28)) is image


def test_a_folder_trains_evaluates_and_serves_as_an_ood_set_with_a_tfds_one(tmp_path):
  """``folder:`` end to end through ``train.train_from_config`` (its evaluation included), the
  class names in ``config.json``; then the OOD evaluator on a ``folder:`` set of another size and
  on ``tfds:mnist`` (grayscale 28×28, under mock data), both brought to the model's 16×16."""
  tfds = pytest.importorskip("tensorflow_datasets")
  import json

  from smoothing_jax.evaluators import ood
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.training import train
  root = write_folder(tmp_path / "pets", per_class=4)
  config = override(small_npz_config(root), **{"input.dataset": f"folder:{root}",
                                               "num_train_steps": 2})
  train.train_from_config(config, str(tmp_path / "run"))
  record = json.loads((tmp_path / "run" / "config.json").read_text())
  assert record["model_spec"]["class_names"] == ["ant", "bird", "cat", "dog"]
  run = Run.from_workdir(str(tmp_path / "run"))
  far = write_folder(tmp_path / "far", sizes=((24, 30),), splits=("test",))
  with tfds.testing.mock_data(num_examples=5):
    rows = ood.evaluate(run, tmp_path / "ood", datasets=(f"folder:{far}", "tfds:mnist"),
                        scores=("msp",), sizes=(1,))
  counts = {r["ood_dataset"]: r["count_out"] for r in rows}
  assert counts[f"folder:{far}"] == 12 and counts["tfds:mnist"] == 5
  assert all(0.0 <= r["auroc"] <= 1.0 for r in rows)


def test_any_tfds_set_reads_its_own_keys_at_the_size_asked_under_mock_data():
  tfds = pytest.importorskip("tensorflow_datasets")
  with tfds.testing.mock_data(num_examples=16):
    spec = parse_dataset("tfds:oxford_flowers102:validation")
    assert (spec.base, spec.eval_split) == ("oxford_flowers102", "validation")
    with pytest.raises(ValueError, match="image_size"):
      input_pipeline("tfds:oxford_flowers102", 8)
    pipeline = input_pipeline("tfds:oxford_flowers102:validation", 8, image_size=16)
    batch = next(pipeline.train_iterator())
  assert batch["image"].shape == (8, 16, 16, 3) and pipeline.eval_images.shape[1:] == (16, 16, 3)
  assert not pipeline.dataset_spec.streamed and pipeline.resident
  from smoothing_jax.data.sources.tfds import feature_keys
  features = tfds.features.FeaturesDict({"image": tfds.features.Image(),
                                         "caption": tfds.features.Text()})
  with pytest.raises(ValueError, match="not an image-classification set: its features "
                     r"\(caption: Text, image: Image\) need one Image and one ClassLabel"):
    feature_keys(parse_dataset("tfds:captions"), features)
