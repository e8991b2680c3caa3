"""Semantic segmentation: U-Net, temporal smoothing (VQ-BNN), per-pixel metrics, CamVid builder."""
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from smoothing_jax import temporal
from smoothing_jax.data import camvid, create_pipeline, median_frequency_weights
from smoothing_jax.inference import sample_rngs
from smoothing_jax.metrics import TemporalConsistency, UncertaintyMetrics, class_iou, label_mask
from smoothing_jax.models import get_model
from smoothing_jax.train import cross_entropy

TINY_UNET = dict(width=4, encoder_convs=(1, 1, 1), decoder_convs=(1, 1))


@pytest.fixture(scope="module")
def tiny_unet():
  model = get_model("unet_mcdo_smoothing", 5, **TINY_UNET)
  variables = jax.jit(model.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                  jnp.zeros((1, 12, 12, 3)))
  return model, variables


# ----------------------------------------------------------------------------- U-Net


@pytest.mark.parametrize("name",
                         ["unet_dnn", "unet_mcdo", "unet_mcdo_smoothing", "unet_dnn_smoothing"])
@pytest.mark.parametrize("size", [(13, 17), (9, 7)])
def test_unet_output_shape_equals_input_shape_for_odd_sizes(name, size):
  model = get_model(name, 11, **TINY_UNET)
  x = jnp.zeros((2,) + size + (3,))
  out = jax.eval_shape(lambda: model.init_with_output(
      {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)[0])
  assert out.shape == (2,) + size + (11,)


def _unet_parameter_count(width=64, encoder=(2, 2, 3, 3, 3), decoder=(3, 3, 3, 2), classes=11):
  """Trainable parameters of the reference layout, counted by hand (conv 3×3 with bias,
  BN γ/β)."""
  conv = lambda cin, cout, k=3: k * k * cin * cout + cout  # noqa: E731
  total, cin = 0, 3
  for level, n in enumerate(encoder):
    cout = width * 2 ** level
    for _ in range(n):
      total += conv(cin, cout) + 2 * cout
      cin = cout
  for level, n in zip(reversed(range(len(decoder))), decoder):
    cout = width * 2 ** level
    total += conv(cin, cout) + 2 * cout  # 3×3 transposed conv + BN
    for _ in range(n):
      total += conv(cout, cout) + 2 * cout
    cin = cout
  return total + conv(cin, classes, 1)


def test_unet_layout_is_the_reference_one():
  model = get_model("unet_mcdo", 11)
  variables = jax.eval_shape(
      lambda: model.init({
          "params": jax.random.key(0),
          "dropout": jax.random.key(1)
      }, jnp.zeros((1, 64, 64, 3))))
  count = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(variables["params"]))
  assert count == _unet_parameter_count() == 46_885_195
  assert model.stages_with_dropout() == (3, 4, 5, 6, 7, 8) and model.dropout_rate == 0.5
  assert get_model("unet_dnn", 11).dropout_rate == 0.0


def test_unet_dropout_follows_stages_3_to_8():
  from smoothing_jax.layers import MCDropout
  model = get_model("unet_mcdo", 5, width=2, encoder_convs=(1,) * 5, decoder_convs=(1,) * 4)
  x = jnp.ones((1, 16, 16, 3))
  variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
  _, inter = model.apply(variables,
                         x,
                         rngs={"dropout": jax.random.key(2)},
                         mutable=["intermediates"],
                         capture_intermediates=lambda m, _: isinstance(m, MCDropout))
  calls = [
      inter["intermediates"][f"MCDropout_{i}"]["__call__"][0].shape
      for i in range(len(inter["intermediates"]))
  ]
  # Stages 3, 4 (encoder levels at 4×4, 2×2), 5 (bottleneck 1×1), 6, 7, 8 (decoder at
  # 2×2, 4×4, 8×8).
  assert calls == [(1, 4, 4, 8), (1, 2, 2, 16), (1, 1, 1, 32), (1, 2, 2, 16), (1, 4, 4, 8),
                   (1, 8, 8, 4)]


def test_unet_dropout_and_smoothing_positions(tiny_unet):
  model, variables = tiny_unet
  x = jax.random.normal(jax.random.key(3), (1, 12, 12, 3))
  a = model.apply(variables, x, rngs={"dropout": jax.random.key(1)})
  b = model.apply(variables, x, rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(a, b)  # MC dropout stays on at evaluation
  det = get_model("unet_dnn_smoothing", 5, **TINY_UNET)
  np.testing.assert_array_equal(det.apply(variables, x), det.apply(variables, x))
  _, inter = det.apply(variables, x, capture_intermediates=lambda m, _: "smooth" in (m.name or ""),
                       mutable=["intermediates"])
  assert sorted(
      k for k in inter["intermediates"] if k.startswith("smooth")) == ["smooth1", "smooth2"]
  with pytest.raises(ValueError, match="dropout_stages"):
    get_model("unet_mcdo", 5, **TINY_UNET, dropout_stages=(9,)).init(
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)


# ----------------------------------------------------------------------------- temporal smoothing

def test_streaming_predictor_equals_explicit_weighted_average():
  # Hand-made sequence of 7 "predictions" over 2 classes for one pixel of 2 streams.
  rng = np.random.default_rng(0)
  seq = rng.dirichlet([1.0, 1.0], size=(7, 2)).astype(np.float32)  # [T, B, C]
  num_frames, decay = 3, 0.8
  state = temporal.init_stream((2, 2), num_frames)
  for t in range(7):
    state, smoothed = temporal.temporal_smoothing(state, jnp.asarray(seq[t]), decay)
    ages = range(min(t + 1, num_frames))  # 0 = current frame
    weights = np.array([np.exp(-decay * a) for a in ages])
    expected = sum(w * seq[t - a] for w, a in zip(weights, ages)) / weights.sum()
    np.testing.assert_allclose(smoothed, expected, rtol=1e-6)
  # Defaults of the paper: L = 5, e^{-0.8} per frame.
  w = temporal.temporal_weights(10, temporal.NUM_FRAMES)
  np.testing.assert_allclose(w[1:] / w[:-1], np.exp(-0.8), rtol=1e-6)
  assert temporal.NUM_FRAMES == 5 and np.isclose(float(w.sum()), 1.0)


def test_stream_state_carries_across_scan_and_chunks(tiny_unet):
  model, variables = tiny_unet
  frames = jax.random.normal(jax.random.key(4), (7, 2, 12, 12, 3))
  rng = jax.random.key(5)
  state, probs = temporal.vq_bnn_predict(model, variables, frames, rng=rng)
  assert probs.shape == (7, 2, 12, 12, 5) and int(state.frames_seen) == 7
  # Two chunks with the carried state = one scan over the whole video.
  s1, p1 = temporal.vq_bnn_predict(model, variables, frames[:3], rng=rng)
  s2, p2 = temporal.vq_bnn_predict(model, variables, frames[3:], rng=rng, state=s1)
  np.testing.assert_allclose(np.concatenate([p1, p2]), probs, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(s2, state, rtol=1e-5, atol=1e-6)
  # Frame by frame with the jitted step, too; and one stochastic pass per frame.
  s = temporal.init_stream(probs.shape[1:])
  singles = []
  for t in range(7):
    s, p = temporal.stream_predict(model, variables, s, frames[t], rng=rng)
    np.testing.assert_allclose(p, probs[t], rtol=1e-5, atol=1e-6)
    singles.append(s.history[0])
    logits = model.apply(variables, frames[t], rngs=sample_rngs(jax.random.fold_in(rng, t)))
    np.testing.assert_allclose(s.history[0], jax.nn.softmax(logits), rtol=1e-5, atol=1e-6)
  # The smoothed output at t = 6 is the explicit average of the last five single passes.
  weights = np.exp(-0.8 * np.arange(5))
  expected = sum(w * singles[6 - a] for a, w in enumerate(weights)) / weights.sum()
  np.testing.assert_allclose(probs[6], expected, rtol=1e-5, atol=1e-6)


def test_streaming_works_with_a_classifier(tiny_mcdo, images):
  model, variables = tiny_mcdo
  frames = jnp.stack([images, images + 0.1, images - 0.1])
  _, probs = temporal.vq_bnn_predict(model, variables, frames, rng=jax.random.key(0), num_frames=2)
  assert probs.shape == (3, 3, 5)
  np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)


def test_streaming_rejects_bad_input(tiny_unet):
  model, variables = tiny_unet
  with pytest.raises(ValueError, match="time, batch"):
    temporal.vq_bnn_predict(model, variables, jnp.zeros((2, 12, 12, 3)), rng=jax.random.key(0))
  with pytest.raises(ValueError, match="num_frames"):
    temporal.init_stream((1, 5), 0)
  with pytest.raises(ValueError, match="does not match"):
    temporal.temporal_smoothing(temporal.init_stream((1, 5)), jnp.zeros((1, 4)))


# ----------------------------------------------------------------------------- metrics

def test_pixel_metrics_with_void_match_hand_worked_example():
  # One 2×3 image, 3 classes; label 3 (and -1) = void.
  probs = np.array([[[0.95, 0.03, 0.02], [0.6, 0.3, 0.1], [0.1, 0.8, 0.1]],
                    [[0.2, 0.2, 0.6], [0.5, 0.25, 0.25], [0.05, 0.05, 0.9]]], np.float32)[None]
  labels = np.array([[[0, 1, 1], [2, 3, -1]]])
  mask = label_mask(labels, 3)
  np.testing.assert_array_equal(mask, [[[1, 1, 1], [1, 0, 0]]])
  m = UncertaintyMetrics.from_model_output(probs, labels, mask).compute()
  # Counted pixels: (0.95→0 ✓), (0.6→0, y=1 ✗), (0.8→1 ✓), (0.6→2 ✓).
  assert m["count"] == 4
  np.testing.assert_allclose(m["nll"],
                             -(np.log(0.95) + np.log(0.3) + np.log(0.8) + np.log(0.6)) / 4,
                             rtol=1e-6)
  np.testing.assert_allclose(m["acc"], 3 / 4)
  # ECE: bins (0.9,1]: conf .95 acc 1; (0.5,0.6]: confs .6,.6 acc 0,1; (0.7,0.8]: conf .8 acc 1.
  np.testing.assert_allclose(m["ece"], (0.05 + 2 * abs(0.6 - 0.5) + 0.2) / 4, rtol=1e-5)
  # Certain (> 0.9): only the first pixel, correct.
  np.testing.assert_allclose([m["acc90"], m["freq90"], m["unc90"]], [1.0, 1 / 4, 1.0])
  # Confusion (rows true): class0 TP1; class1: TP1 FN1 (predicted 0); class2: TP1.
  # IoU0 = 1/(1+1) (FP from the class-1 pixel), IoU1 = 1/2, IoU2 = 1/1.
  np.testing.assert_allclose(m["iou"], (0.5 + 0.5 + 1.0) / 3)
  # IoU-90 on the certain pixel only: class 0 = 1; classes 1, 2 have no certain support.
  np.testing.assert_allclose(m["iou90"], 1.0)
  stats = UncertaintyMetrics.from_model_output(probs, labels, mask)
  # Void labels never count, even without an explicit mask.
  assert UncertaintyMetrics.from_model_output(probs, labels).compute() == m
  np.testing.assert_allclose(class_iou(stats.confusion), [0.5, 0.5, 1.0])
  np.testing.assert_allclose(class_iou(stats.certain_confusion), [1.0, np.nan, np.nan])


def test_temporal_consistency_hand_worked():
  # argmax of frames: [[0, 1], [1, 1]] then [[0, 0], [1, 2]]; pixel (1,1) void.
  a = jax.nn.one_hot(jnp.array([[0, 1], [1, 1]]), 3)
  b = jax.nn.one_hot(jnp.array([[0, 0], [1, 2]]), 3)
  mask = label_mask(jnp.array([[0, 2], [1, 9]]), 3)
  assert TemporalConsistency.from_model_output(
      b, a, mask).compute()["consistency"] == pytest.approx(2 / 3)
  # A per-example mask [B] covers every pixel of its example (here B = W = 2).
  per_example = TemporalConsistency.from_model_output(jnp.stack([b, b]), jnp.stack([a, b]),
                                                      jnp.array([1.0, 0.0]))
  assert per_example.compute()["consistency"] == pytest.approx(2 / 4)
  seq = jnp.stack([a, b, b])[None]  # [N=1, T=3, 2, 2, C]
  assert TemporalConsistency.from_sequence(seq).compute()["consistency"] == pytest.approx(
      (2 + 4) / 8)


def test_weighted_pixel_cross_entropy_masks_void():
  logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]]))
  labels = jnp.array([[0, 1, 3]])
  w = jnp.array([2.0, 0.5, 1.0])
  expected = (2.0 * -np.log(0.7) + 0.5 * -np.log(0.6)) / 2.5
  np.testing.assert_allclose(cross_entropy(logits, labels, w), expected, rtol=1e-6)
  np.testing.assert_allclose(cross_entropy(logits, labels), (-np.log(0.7) - np.log(0.6)) / 2,
                             rtol=1e-6)


# ----------------------------------------------------------------------------- CamVid builder

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
  pipeline = create_pipeline("camvid", 1, 0, data_dir=data_dir, crop_size=(64, 96))
  assert pipeline.is_segmentation and pipeline.image_shape == (360, 480, 3)
  batch = next(pipeline.train_iterator())
  assert batch["image"].shape == (1, 64, 96, 3) and batch["label"].shape == (1, 64, 96)
  eval_batch = next(pipeline.eval_batches(2))
  assert eval_batch["label"].shape == (2, 360, 480) and eval_batch["mask"].tolist() == [1.0, 0.0]
  weights = pipeline.class_weights(11)
  np.testing.assert_allclose(weights, median_frequency_weights(pipeline.train_labels, 11))
  with pytest.raises(ValueError, match="crop_size"):
    create_pipeline("camvid", 1, 0, data_dir=data_dir, crop_size=(400, 480))


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
  for step, batch in zip(range(6), pipeline.train_iterator()):
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
    create_pipeline(f"npz:{tmp_path}", 2, 0, randaugment=(2, 9.0, 0.0))
  # Void is a label value, so the number of classes must be given for npz label maps.
  from configs import camvid_unet
  from smoothing_jax.train import create_model
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


@pytest.mark.slow
def test_camvid_recipe_trains_and_evaluates_streams(fake_camvid, tmp_path):
  from configs import camvid_unet
  from smoothing_jax import evaluate, train
  _, data_dir = fake_camvid
  config = camvid_unet.get_config("unet_mcdo_smoothing,camvid,runlocal")
  config.unlock()
  config.data_dir, config.num_devices, config.batch_size, config.base_batch_size = data_dir, 1, 1, 1
  config.crop_size, config.num_train_steps, config.eval_batch_size = (32, 48), 2, 1
  config.ensemble_sizes = (1, 3)
  assert (config.optimizer, config.learning_rate, config.lr_milestones, config.class_balancing) == (
      "adam", 1e-3, (100,), "median_frequency")
  workdir = str(tmp_path / "unet")
  state = train.train_and_evaluate(config, workdir)
  assert int(state.step) == 2
  rows = evaluate.evaluate_ensemble_sizes([workdir], str(tmp_path / "results"), config)
  assert [r["ensemble_size"] for r in rows] == [1, 3]
  assert rows[0]["count"] == np.sum(camvid.load_clips("test", data_dir)[1]
                                    < camvid.VOID)  # void pixels dropped
  rows = evaluate.evaluate_streams(workdir, str(tmp_path / "results"), config, num_samples=3)
  assert [r["method"] for r in rows] == ["single", "mc", "temporal"]
  assert [r["passes_per_frame"] for r in rows] == [1, 3, 1]
  for r in rows:
    assert 0 <= r["consistency"] <= 1 and np.isfinite(r["nll"]) and r["count"] == rows[0]["count"]
  with open(tmp_path / "results" / "streams.json") as f:
    assert json.load(f) == rows
  with open(tmp_path / "results" / "streams_class_iou.json") as f:
    assert list(json.load(f)["temporal"]) == list(camvid.CLASSES)
  for name in ("streams.png", "stream_examples.png", "ensemble_sizes.png"):
    assert os.path.getsize(tmp_path / "results" / name) > 0
