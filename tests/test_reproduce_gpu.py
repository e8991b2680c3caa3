"""``experiments/reproduce_gpu.py --smoke`` end to end on the CPU, on a tiny folder of JPEGs laid
out as ``cifar10_jpeg`` (``train.npz`` / ``test.npz``: ``jpeg``, ``offsets``, ``labels``)."""
import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from experiments import reproduce_gpu


def write_jpeg_split(path, count: int, seed: int):
  """``count`` 32×32 JPEGs (quality 75, as the real copy) of smooth random colour patterns, the
  labels cycling through the 10 classes."""
  rng = np.random.default_rng(seed)
  blobs = []
  for _ in range(count):
    coarse = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    image = Image.fromarray(coarse).resize((32, 32), Image.BILINEAR)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=75)
    blobs.append(np.frombuffer(buffer.getvalue(), np.uint8))
  offsets = np.concatenate([[0], np.cumsum([len(b) for b in blobs])]).astype(np.int64)
  np.savez(path, jpeg=np.concatenate(blobs), offsets=offsets,
           labels=np.arange(count, dtype=np.int64) % 10)


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp("cifar10_jpeg")
  write_jpeg_split(folder / "train.npz", 128, 0)
  write_jpeg_split(folder / "test.npz", 40, 1)
  return folder


def test_decoding_gives_the_images_and_labels_back(jpeg_folder, tmp_path):
  images, labels = reproduce_gpu.read_jpeg_split(str(jpeg_folder / "test.npz"), limit=7)
  assert images.shape == (7, 32, 32, 3) and images.dtype == np.uint8
  assert labels.tolist() == [0, 1, 2, 3, 4, 5, 6]
  with np.load(jpeg_folder / "test.npz") as data:
    blob, offsets = data["jpeg"], data["offsets"]
  first = np.asarray(Image.open(io.BytesIO(blob[offsets[0]:offsets[1]].tobytes())).convert("RGB"))
  np.testing.assert_array_equal(images[0], first)
  with pytest.raises(FileNotFoundError, match="cifar10_jpeg folder"):
    reproduce_gpu.prepare_data(str(tmp_path), str(tmp_path / "cache"), 1, 1, 1)


def test_smoke_run_writes_the_json_with_finite_metrics(jpeg_folder, tmp_path, capsys):
  result = reproduce_gpu.main([
      "resnet_mcdo_18", "--smoke", "--data", str(jpeg_folder), "--out", str(tmp_path),
      "--width", "2", "--git-commit", "abc123"])
  path = tmp_path / "reproduce_gpu_resnet_mcdo_18_smoke.json"
  written = json.loads(path.read_text())
  assert written["status"] == "complete" and written["mode"] == "smoke"
  assert {"model", "date", "git_commit", "environment", "recipe", "data", "reference", "curve",
          "final", "versus_reference", "wall_seconds", "images_per_s",
          "projection_h200"} <= set(written)
  assert written["git_commit"] == "abc123"
  assert written["environment"]["device_kind"] and written["environment"]["jax"]
  recipe = written["recipe"]
  assert recipe["half_precision"] and recipe["data_pipeline"] == "resident"
  assert (recipe["epochs"], recipe["batch_size"], recipe["steps_per_epoch"]) == (2, 128, 1)
  assert recipe["lr_milestones"] == [60, 130, 160] and recipe["weight_decay"] == 5e-4
  assert (written["data"]["train_images"], written["data"]["test_images"]) == (128, 40)
  assert written["reference"]["ensemble_size"] == 50 and written["reference"]["nll"] == 0.157
  assert [row["epoch"] for row in written["curve"]] == [1, 2]
  for row in written["curve"]:
    for key in ("train_loss", "eval_nll", "eval_acc", "eval_ece", "images_per_s"):
      assert math.isfinite(row[key]), (key, row)
  for size in ("n1", "n50"):
    metrics = written["final"][size]
    assert metrics["count"] == 40
    assert all(math.isfinite(metrics[k]) for k in ("nll", "acc", "ece"))
  versus = written["versus_reference"]
  assert versus["ensemble_size"] == 50 and math.isfinite(versus["nll_ours_minus_reference"])
  wall = written["wall_seconds"]
  assert wall["total"] >= wall["training"] + wall["evaluation"] > 0
  projection = written["projection_h200"]
  assert projection["training_images"] == 201 * 390 * 128
  assert 0 < projection["total_minutes"]["optimistic"] < projection["total_minutes"]["pessimistic"]
  assert written["trained_steps"] == 2 and result["final"] == written["final"]
  assert "N=50 NLL" in capsys.readouterr().out


def test_deterministic_models_have_no_n50_row():
  final = reproduce_gpu.final_metrics([{"ensemble_size": 1, "count": 5, "nll": 0.2, "acc": 0.9,
                                        "ece": 0.02}])
  assert final["n50"] is None
  assert reproduce_gpu.versus_reference("resnet_dnn_18", final)["ensemble_size"] == 1
  assert reproduce_gpu.versus_reference("resnet_mcdo_18", final) is None
