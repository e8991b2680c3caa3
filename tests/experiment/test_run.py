"""smoothing_jax.experiment.run: one Run per process — the data loaded once, the model built once,
one mesh and one checkpoint manager — and a trained run restored without its dataset."""
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from smoothing_jax import main
from smoothing_jax.experiment.run import Run
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh
from tests.helpers import small_npz, small_npz_config


class _Counter:
  """Counts the calls of ``function`` wherever a smoothing_jax module imported it by name."""

  def __init__(self, monkeypatch, function):
    self.calls = 0

    def counted(*args, **kwargs):
      self.calls += 1
      return function(*args, **kwargs)

    for name, module in list(sys.modules.items()):
      if name.startswith("smoothing_jax") and getattr(module, function.__name__, None) is function:
        monkeypatch.setattr(module, function.__name__, counted)


def test_a_trained_and_evaluated_run_makes_everything_once(tmp_path, monkeypatch, capsys):
  """``--mode=train`` of a quickstart-sized run: training, periodic evaluation, then the
  ``config.evals`` evaluator, on one Run."""
  from smoothing_jax.data import datasets, pipeline
  data = small_npz(tmp_path)
  # (Made first: a config's finalize builds the module to know its method's settings block.)
  config = small_npz_config(data, num_train_steps=2)  # evaluates at the last step too
  counts = {name: _Counter(monkeypatch, function) for name, function in (
      ("pipelines", pipeline.create_pipeline), ("splits read", datasets.load_arrays),
      ("models built", get_model), ("meshes", create_mesh))}
  managers = []
  original = ocp.CheckpointManager.__init__

  def counted_manager(self, *args, **kwargs):
    managers.append(args[0] if args else kwargs.get("directory"))
    original(self, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "__init__", counted_manager)
  workdir = str(tmp_path / "run")
  results = main.run(config, workdir, "train")
  # Two splits read (train + test); two models: the stand-in that checks the config before any
  # file is written (run.check_config, a module without variables) and the run's.
  assert {name: c.calls for name, c in counts.items()} == {
      "pipelines": 1, "splits read": 2, "models built": 2, "meshes": 1}
  assert len(managers) == 1
  assert [r["ensemble_size"] for r in results["ensemble_sizes"]] == [1]
  assert "ensemble size | NLL" in capsys.readouterr().out
  assert os.path.exists(os.path.join(workdir, "results", "ensemble_sizes.json"))


def test_a_restored_run_rebuilds_the_model_without_the_dataset(tmp_path, small_npz_run):
  source_data, source, final = small_npz_run
  data = shutil.copytree(source_data, tmp_path / "data")
  workdir = shutil.copytree(source, tmp_path / "run")
  config_path = os.path.join(workdir, "config.json")
  with open(config_path) as f:
    text = f.read().replace(f"npz:{source_data}", f"npz:{data}")
  with open(config_path, "w") as f:
    f.write(text)
  shutil.rmtree(data)  # the dataset is gone: the model is rebuilt from config.json alone
  run = Run.from_workdir(str(workdir))
  assert run.config.input.dataset == f"npz:{data}" and not os.path.exists(data)
  assert run.step == 4 and run.read_only
  spec = run.model_spec
  assert (spec.num_classes, spec.image_shape, spec.num_train_examples) == (4, (16, 16, 3), 32)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(run.variables), final)
  images = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
  expected = get_model("resnet_dnn_18", 4, width=4, stage_sizes=(1,)).apply(run.variables, images)
  np.testing.assert_array_equal(run.model.apply(run.variables, images), expected)
  # Overrides change evaluation settings; the model is the recorded one.
  given = Run.from_workdir(str(workdir), {"eval_batch_size": 32, "ensemble_sizes": (1, 2)})
  assert given.config.eval_batch_size == 32 and given.model.num_classes == 4
  assert jnp.shape(given.model.apply(given.variables, images)) == (2, 4)
  with pytest.raises(ValueError, match="Override 'eval_batch_sise': unknown config key"):
    Run.from_workdir(str(workdir), {"eval_batch_sise": 32})


def test_a_missing_run_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="No run in .*never_trained: .* does not exist"):
    Run.from_workdir(str(tmp_path / "never_trained"))


def test_predict_takes_uint8_and_float_pixels_alike_and_refuses_other_ranges(analysis_workdirs):
  """``Run.predict`` and ``Run.normalize`` take uint8 pixels in 0–255 and the same images as
  float in [0, 1] alike; 0–255 floats and images normalised already (which scored at chance
  before, silently) are refused in one line that says what is taken."""
  run = Run.from_workdir(analysis_workdirs["MC dropout"])
  pixels = run.pipeline.eval_images[:8]
  assert pixels.dtype == np.uint8 and pixels.max() > 1
  unit = pixels.astype(np.float32) / 255.0
  np.testing.assert_array_equal(run.predict(pixels), run.predict(unit))
  np.testing.assert_array_equal(run.normalize(pixels), run.normalize(jnp.asarray(unit)))
  for wrong in (pixels.astype(np.float32), np.asarray(run.normalize(pixels))):
    with pytest.raises(ValueError) as error:
      run.predict(wrong)
    message = str(error.value)
    assert message.startswith("Images must be uint8 images in 0–255 or float images in [0, 1]; "
                              "got float32 values in ["), message
    assert "\n" not in message


@pytest.mark.parametrize("images,expected", [
    (np.zeros((2, 3, 16, 16), np.uint8), "are channels-first; the model takes [B, H, W, C] = "
     "[B, 16, 16, 3]: np.moveaxis(images, 1, -1)"),
    (np.zeros((2, 16, 16), np.uint8), "Images are [B, H, W, C] (the model takes (16, 16, 3)), "
     "got shape (2, 16, 16): a grayscale batch needs its channel axis"),
    (np.zeros((0, 16, 16, 3), np.uint8), "No images to predict (an empty batch)."),
    (np.zeros((2, 28, 28, 3), np.uint8), "Images of shape (28, 28, 3); the model takes "
     "(16, 16, 3): bring them to its size first"),
    (np.zeros((2, 16, 16, 1), np.uint8), "Images of shape (16, 16, 1) have the model's size but "
     "not its channels: it takes (16, 16, 3): np.repeat(images, 3, axis=-1) for grayscale images."),
    (np.zeros((2, 16, 16, 4), np.uint8), "Images of shape (16, 16, 4) have the model's size but "
     "not its channels: it takes (16, 16, 3)."),
    (np.full((2, 16, 16, 3), np.nan, np.float32), "2 of the 2 images have non-finite pixels"),
])
def test_predict_refuses_what_the_model_cannot_take_in_one_line(analysis_workdirs, images,
                                                                 expected):
  run = Run.from_workdir(analysis_workdirs["MC dropout"])
  with pytest.raises(ValueError) as error:
    run.predict(images)
  message = str(error.value)
  assert expected in message and "\n" not in message, message
