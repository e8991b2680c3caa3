"""Test-time augmentation: the predictive is the base's on each view (views built here in numpy),
draw s·A + a the base's draw s on view a; it composes with a deep ensemble through the configs;
and a trained workdir scored with it reports N = 1 and A."""
import jax
import numpy as np
import pytest

from smoothing_jax import methods
from smoothing_jax.evaluators import ensemble_sizes
from smoothing_jax.experiment.run import Run
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.methods.tta import TestTimeAugmentation, check_augmentation
from smoothing_jax.models import get_model
from smoothing_jax.passes import log_probs, stack_variables
from tests.helpers import init_variables, override, small_npz_config


def numpy_view(images, name):
  """The view ``name`` of ``images [B, H, W, C]``: flipped columns, then moved by (dy, dx) with
  zeros coming in."""
  x = np.asarray(images)
  if name.startswith("flip"):
    x = x[:, :, ::-1]
  if "shift:" in name:
    dy, dx = (int(v) for v in name.split("shift:")[1].split(","))
    out = np.zeros_like(x)
    h, w = x.shape[1:3]
    for i in range(h):
      for j in range(w):
        if 0 <= i + dy < h and 0 <= j + dx < w:
          out[:, i, j] = x[:, i + dy, j + dx]
    x = out
  return x


VIEWS = ("flip", "shift:2,-1", "flip+shift:-3,0")


def test_the_predictive_is_the_base_on_every_view(tiny_mcdo, images):
  model, variables = tiny_mcdo
  method = TestTimeAugmentation.wrap(MCDropout(model, num_samples=2), augmentations=VIEWS)
  assert method.num_draws == 8 and method.stochastic
  rng = jax.random.key(3)
  out = np.asarray(method.sample_log_probs(variables, images, rng))
  keys = jax.random.split(rng, 2)
  one_pass = jax.jit(lambda v, x, key: log_probs(model, v, x, key))  # one compile for 8 passes
  for s in range(2):
    for a, name in enumerate(("identity",) + VIEWS):
      view = images if name == "identity" else numpy_view(images, name)
      np.testing.assert_allclose(out[s * 4 + a], one_pass(variables, view, keys[s]),
                                 rtol=1e-5, atol=1e-5)
  assert method.nested((1, 2))[1] == (1, 4, 8)


def test_a_deep_ensemble_of_it_through_the_config(images):
  model = get_model("resnet_dnn_18", 5, width=4, stage_sizes=(1,))
  config = override(small_npz_config("/nowhere"), **{"tta.augmentations": ("flip",),
                                                      "deep_ensemble.members": 2})
  method = methods.resolve(config, model)
  assert isinstance(method, methods.DeepEnsemble) and isinstance(method.base, TestTimeAugmentation)
  assert isinstance(method.base.base, Deterministic) and method.num_draws == 4
  members = [init_variables(model, (1, 16, 16, 3), seed=m) for m in range(2)]
  out = np.asarray(method.sample_log_probs(stack_variables(members), images, jax.random.key(0)))
  for m in range(2):  # sample-major: draw a·M + m is member m on view a
    for a, view in enumerate((images, numpy_view(images, "flip"))):
      np.testing.assert_allclose(out[a * 2 + m], log_probs(model, members[m], view),
                                 rtol=1e-5, atol=1e-5)


def test_a_trained_run_scored_with_it(small_npz_run, tmp_path):
  _, workdir, variables = small_npz_run
  run = Run.from_workdir(workdir, {"tta.augmentations": ("flip",)})
  assert run.method.describe() == "deterministic with test-time augmentation (2 views)"
  rows = ensemble_sizes.evaluate(run, tmp_path, sizes=(1,))
  assert [r["ensemble_size"] for r in rows] == [1, 2]
  pixels = run.pipeline.eval_images
  probs = run.predict(pixels, rng=jax.random.key(0))
  images = np.asarray(run.normalize(pixels))
  views = [log_probs(run.model, variables, v) for v in (images, numpy_view(images, "flip"))]
  np.testing.assert_allclose(probs, np.mean(np.exp(views), axis=0), rtol=1e-5, atol=1e-6)
  labels = run.pipeline.eval_labels
  assert rows[1]["acc"] == pytest.approx(np.mean(probs.argmax(-1) == labels))


def test_a_view_it_does_not_know_is_one_line():
  with pytest.raises(ValueError, match=r"^Unknown test-time augmentation 'rotate'"):
    check_augmentation("rotate")
