"""smoothing_jax.data.camvid: the SegNet split rule, the TFDS builder on a fake release (stills,
label maps, video clips), the CamVid pipeline and the recipe end to end."""
import json
import os

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("tensorflow_datasets")  # a TFDS builder

from smoothing_jax.data import camvid, median_frequency_weights
from tests.helpers import input_pipeline

FAKE_SIZE = (720, 960)
# Stills of each split (SegNet rule) and a colour layout per still: 2×2-constant blocks.
FAKE_STILLS = {"0001TP_006690": "train", "0016E5_07961": "validation", "Seq05VD_f00002": "test"}
COLOURS = [(128, 128, 128), (64, 192, 0), (128, 64, 128), (0, 0, 0), (10, 20, 30), (192, 0, 192)]
COLOUR_CLASSES = [0, 1, 3, camvid.VOID, camvid.VOID,
                  10]  # Sky, Wall→building, Road, Void, unknown, Motorcycle


def _smooth_image(seed):
  yy, xx = np.mgrid[0:FAKE_SIZE[0], 0:FAKE_SIZE[1]]
  return np.stack([(yy * 255 // FAKE_SIZE[0] + 37 * seed) % 256,
                   (xx * 255 // FAKE_SIZE[1] + 11 * seed) % 256, ((yy + xx) // 7 + seed) % 256],
                  -1).astype(np.uint8)


def _block_labels(seed):
  """Class-colour indices constant over 2×2 blocks (so nearest and block averages agree)."""
  small = np.random.default_rng(seed).integers(0, len(COLOURS),
                                               (FAKE_SIZE[0] // 2, FAKE_SIZE[1] // 2))
  return np.repeat(np.repeat(small, 2, 0), 2, 1)


@pytest.fixture(scope="module")
def fake_camvid(tmp_path_factory):
  """A tiny CamVid release (3 stills at 720×960, their label maps and the ≤ 5 video frames
  before each), prepared.

  The test still is frame 2 of its video, so its clip starts with the video's first frame repeated.
  """
  root = tmp_path_factory.mktemp("camvid_release")
  for sub in (camvid.STILLS_DIR, camvid.LABELS_DIR, camvid.SEQUENCES_DIR + "/nested"):
    os.makedirs(root / sub)
  for i, stem in enumerate(FAKE_STILLS):
    Image.fromarray(_smooth_image(i)).save(root / camvid.STILLS_DIR / f"{stem}.png")
    Image.fromarray(np.asarray(COLOURS, np.uint8)[_block_labels(i)]).save(root / camvid.LABELS_DIR /
                                                                          f"{stem}_L.png")
    sequence, frame, text = camvid.parse_name(stem + ".png")
    for back in range(1, min(5, frame) + 1):
      number = f"{'f' if text.startswith('f') else ''}{frame - back:0{len(text.lstrip('f'))}d}"
      Image.fromarray(_smooth_image(10 * i + back)).save(root / camvid.SEQUENCES_DIR / "nested" /
                                                         f"{sequence}_{number}.png")
  data_dir = str(tmp_path_factory.mktemp("tfds"))
  camvid.prepare(str(root), data_dir)
  return root, data_dir


def test_camvid_split_rule_and_names():
  assert [camvid.split_of(*camvid.parse_name(n + ".png")[:2]) for n in FAKE_STILLS
         ] == list(FAKE_STILLS.values())
  assert camvid.split_of("0001TP", 8520) == "train" and camvid.split_of("0016E5", 8190) == "train"
  assert camvid.parse_name("0006R0_f00930_L.png") == ("0006R0", 930, "f00930")
  with pytest.raises(ValueError, match="CamVid frame name"):
    camvid.parse_name("frame.png")
  assert sum(len(g) for g in camvid.CLASS_GROUPS.values()) == 31  # + Void = the 32 CamVid classes


def test_camvid_builder_on_fake_release(fake_camvid):
  import tensorflow_datasets as tfds
  root, data_dir = fake_camvid
  for config in ("labeled", "clips"):
    builder = tfds.builder(f"camvid/{config}", data_dir=data_dir)
    assert {s: builder.info.splits[s].num_examples for s in ("train", "validation", "test")} == {
        "train": 1, "validation": 1, "test": 1}
  for i, (stem, split) in enumerate(FAKE_STILLS.items()):
    ex = next(
        iter(tfds.as_numpy(tfds.builder("camvid/clips",
                                        data_dir=data_dir).as_dataset(split=split))))
    assert ex["name"].decode() == stem
    assert ex["image"].shape == (360, 480, 3) and ex["label"].shape == (360, 480, 1)
    # Bilinear halving = the mean of each 2×2 block (half-pixel centres).
    src = _smooth_image(i).astype(np.float64)
    block_mean = src.reshape(360, 2, 480, 2, 3).mean((1, 3))
    assert np.abs(ex["image"] - block_mean).max() <= 1.0
    expected = np.asarray(COLOUR_CLASSES)[_block_labels(i)[::2, ::2]]
    np.testing.assert_array_equal(ex["label"][..., 0], expected)
    assert ex["frames"].shape == (6, 360, 480, 3)
    np.testing.assert_array_equal(ex["frames"][-1], ex["image"])
    back = [5, 4, 3, 2, 1] if split != "test" else [2, 2, 2, 2, 1
                                                   ]  # Seq05VD_f00002: frames 0, 0, 0, 0, 1
    for t, b in enumerate(back):
      older = _smooth_image(10 * i + b).astype(np.float64).reshape(360, 2, 480, 2, 3).mean((1, 3))
      assert np.abs(ex["frames"][t] - older).max() <= 1.0
  frames, labels, names = camvid.load_clips("test", data_dir)
  assert frames.shape == (1, 6, 360, 480,
                          3) and labels.shape == (1, 360, 480) and names == ["Seq05VD_f00002"]


def test_camvid_builder_names_a_missing_video_frame(fake_camvid, tmp_path):
  import shutil

  import tensorflow_datasets as tfds
  root, _ = fake_camvid
  release = tmp_path / "release"
  shutil.copytree(root, release)
  os.remove(release / camvid.SEQUENCES_DIR / "nested" / "0016E5_07958.png")
  with pytest.raises(FileNotFoundError, match="Video frame 7958 of sequence 0016E5"):
    tfds.builder("camvid/clips", data_dir=str(tmp_path / "tfds")).download_and_prepare(
        download_config=tfds.download.DownloadConfig(manual_dir=str(release)))


def test_camvid_pipeline(fake_camvid):
  _, data_dir = fake_camvid
  pipeline = input_pipeline("camvid", 1, 0, data_dir=data_dir, crop_size=(64, 96))
  assert pipeline.is_segmentation and pipeline.image_shape == (360, 480, 3)
  batch = next(pipeline.train_iterator())
  assert batch["image"].shape == (1, 64, 96, 3) and batch["label"].shape == (1, 64, 96)
  eval_batch = next(pipeline.eval_batches(2))
  assert eval_batch["label"].shape == (2, 360, 480) and eval_batch["mask"].tolist() == [1.0, 0.0]
  weights = pipeline.class_weights(11)
  np.testing.assert_allclose(weights, median_frequency_weights(pipeline.train_labels, 11))
  with pytest.raises(ValueError, match="crop_size"):
    input_pipeline("camvid", 1, 0, data_dir=data_dir, crop_size=(400, 480))


@pytest.mark.slow
def test_camvid_recipe_trains_and_evaluates_streams(fake_camvid, tmp_path):
  from configs import camvid_unet
  from smoothing_jax.training import train
  from tests.helpers import evaluate_workdir
  _, data_dir = fake_camvid
  config = camvid_unet.get_config("unet_mcdo_smoothing,camvid,runlocal")
  config.unlock()
  config.input.data_dir, config.input.batch_size, config.input.crop_size = data_dir, 1, (32, 48)
  config.num_devices, config.base_batch_size, config.num_train_steps = 1, 1, 2
  config.eval_batch_size = 1
  config.ensemble_sizes = (1, 2)  # (each sample is a pass over whole 360×480 frames)
  assert (config.optimizer, config.learning_rate, config.lr_milestones, config.class_balancing) == (
      "adam", 1e-3, (100,), "median_frequency")
  workdir = str(tmp_path / "unet")
  state = train.train_from_config(config, workdir)
  assert int(state.step) == 2
  rows = evaluate_workdir("ensemble_sizes", workdir, str(tmp_path / "results"), config)
  assert [r["ensemble_size"] for r in rows] == [1, 2]
  assert rows[0]["count"] == np.sum(camvid.load_clips("test", data_dir)[1]
                                    < camvid.VOID)  # void pixels dropped
  rows = evaluate_workdir("streams", workdir, str(tmp_path / "results"), config, num_samples=2)
  assert [r["method"] for r in rows] == ["single", "mc", "temporal"]
  assert [r["passes_per_frame"] for r in rows] == [1, 2, 1]
  for r in rows:
    assert 0 <= r["consistency"] <= 1 and np.isfinite(r["nll"]) and r["count"] == rows[0]["count"]
  with open(tmp_path / "results" / "streams.json") as f:
    assert json.load(f) == rows
  with open(tmp_path / "results" / "streams_class_iou.json") as f:
    assert list(json.load(f)["temporal"]) == list(camvid.CLASSES)
  for name in ("streams.png", "stream_examples.png", "ensemble_sizes.png"):
    assert os.path.getsize(tmp_path / "results" / name) > 0
