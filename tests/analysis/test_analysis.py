"""smoothing_jax.analysis: Fourier Δlog-amplitude against an explicit DFT; spectra, feature
maps, landscapes, robustness, frequency noise, perturbations; lesions and token maps on a micro
ViT.  The Hessian solvers themselves: tests/analysis/test_hessian.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.tree_util import Partial

from smoothing_jax.analysis import delta_log_amplitude, top_eigenvalues
from smoothing_jax.analysis.features import feature_maps, feature_variance, fourier_by_depth
from smoothing_jax.analysis.frequency_noise import (
  accuracy_vs_frequency,
  band_limited_noise,
  frequency_band_mask,
)
from smoothing_jax.analysis.landscape import loss_surface, random_direction
from smoothing_jax.analysis.perturbation import (
  consistency,
  cross_entropy_consistency,
  load_cifar10_p,
  perturbation_metrics,
  relative_confidence,
  sequence_predictions,
  translate_sequences,
)
from smoothing_jax.analysis.robustness import ensemble_nll, fgsm, pgd
from smoothing_jax.analysis.spectrum import (
  max_eigenvalue_spectrum,
  spectrum_caption,
  spectrum_summary,
  training_loss,
)
from smoothing_jax.layers import Blur
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.models import get_model
from smoothing_jax.plots import plot_surface
from tests.helpers import (
  MICRO_VIT,
  abstract_variables,
  init_variables,
  model_options,
  small_net_problem,
)


def numpy_delta_log_amplitude(maps):
  """Explicit DFT matrices, centring by rolling half the size, half diagonal minus its DC value."""
  n = maps.shape[1]
  dft = np.exp(-2j * np.pi * np.outer(np.arange(n), np.arange(n)) / n)
  amplitude = np.zeros((n, n))
  for b in range(maps.shape[0]):
    for c in range(maps.shape[3]):
      amplitude += np.log(np.abs(dft @ maps[b, :, :, c] @ dft.T) + 1e-6)
  amplitude = np.roll(amplitude / (maps.shape[0] * maps.shape[3]), (n // 2, n // 2), axis=(0, 1))
  curve = np.array([amplitude[i, i] for i in range(n // 2, n)])
  return curve - curve[0]


@pytest.mark.parametrize("size", [8, 9])
def test_delta_log_amplitude_matches_explicit_dft(size):
  maps = np.random.default_rng(0).normal(size=(2, size, size, 3))
  got = delta_log_amplitude(jnp.asarray(maps, jnp.float32))
  assert got.shape == (size - size // 2,) and float(got[0]) == 0.0
  np.testing.assert_allclose(got, numpy_delta_log_amplitude(maps), rtol=1e-4, atol=1e-3)


def test_low_frequency_falls_high_frequency_rises_blur_lowers_high_frequency():
  i, j = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
  smooth = (2.0 + np.cos(2 * np.pi * i / 16) + 0.01 * np.sin(2 * np.pi * j / 16))[None, :, :, None]
  # Highest frequency on the half diagonal: (7/8)π in both axes (HV's "1.0π" point
  # for 16×16 maps).
  checker = (np.cos(2 * np.pi * 7 * i / 16) * np.cos(2 * np.pi * 7 * j / 16) + 0.01)[None, :, :,
                                                                                     None]
  assert float(delta_log_amplitude(smooth)[-1]) < -5
  assert float(delta_log_amplitude(checker)[-1]) > 2  # log(64) − log(2.56)
  noise = jax.random.normal(jax.random.key(0), (4, 16, 16, 8))
  blurred = Blur(3).apply({}, noise)
  assert float(delta_log_amplitude(blurred)[-1]) < float(delta_log_amplitude(noise)[-1]) - 1.0


def test_non_square_maps_are_rejected():
  with pytest.raises(ValueError, match="square NHWC"):
    delta_log_amplitude(jnp.zeros((1, 8, 6, 2)))


def test_spectrum_summary_hand_worked():
  summary = spectrum_summary(np.array([[3.0, -1.0], [-2.0, 1.0], [5.0, 2.0]]))
  assert summary["mean_positive_max_eigenvalue"] == pytest.approx(4.0)
  assert summary["negative_fraction"] == pytest.approx(2 / 6)


def test_max_eigenvalue_spectrum_on_8_devices_equals_each_batch_alone_on_one(tiny_mcdo, images):
  """Eight batches on the 8 simulated devices, one each, in one program per step: every batch's
  eigenvalues, residuals and HVPs are those ``top_eigenvalues`` gives the batch alone on one
  device."""
  from smoothing_jax.analysis.hessian import solvers
  from smoothing_jax.parallel import create_mesh
  model, variables = tiny_mcdo
  batches = [{"image": (-1)**i * (0.5 + i / 8) * images, "label": (jnp.arange(3) + i) % 5}
             for i in range(8)]
  mesh = create_mesh(8)
  compiled = [f._cache_size() for f in solvers._per_device(mesh, False)]
  result = max_eigenvalue_spectrum(model, variables, batches, k=2, max_iters=20,
                                   rng=jax.random.key(1), mesh=mesh)
  # One program each (linearisation, start, step) for all the devices and steps.
  assert [f._cache_size() for f in solvers._per_device(mesh, False)] == [c + 1 for c in compiled]
  assert result["eigenvalues"].shape == (8, 2) and result["method"] == "lanczos"
  assert result["relative_residuals"].shape == (8, 2) and result["hvps"].shape == (8,)
  # The same loss and keys through top_eigenvalues; one function whose batch is an argument
  # (Partial), so that the eight solves share one compilation.
  objective = functools.partial(training_loss, model, 5e-4)
  for i, batch in enumerate(batches):
    dropout_key, solver_key = jax.random.split(jax.random.fold_in(jax.random.key(1), i))
    loss = Partial(objective, variables["batch_stats"], dropout_key, batch["image"],
                   batch["label"])
    expected = top_eigenvalues(loss, variables["params"], 2, 20, 1e-3, solver_key)
    np.testing.assert_allclose(result["eigenvalues"][i], expected.eigenvalues, rtol=1e-4)
    np.testing.assert_allclose(result["relative_residuals"][i], expected.relative_residuals,
                               rtol=1e-2, atol=1e-6)
    assert result["hvps"][i] == expected.hvps
  caption = spectrum_caption({"a": result})
  assert caption.startswith("Lanczos; relative residuals")
  assert f"{np.max(result['relative_residuals']):.1e}" in caption


def test_feature_taps_follow_execution_order_and_smoothing_sizes(tiny_mcdo, images):
  model, variables = tiny_mcdo
  maps = feature_maps(model, variables, images)
  names = list(maps)
  assert names[:4] == ["stem", "layer1_0", "layer1_1", "smooth1_0"] and names[-1] == "smooth4_0"
  assert maps["layer1_1"].shape[1] == 16 and maps["smooth1_0"].shape[1] == 17
  curves = fourier_by_depth(model, variables, images)
  assert list(curves) == names and curves["smooth1_0"].shape == (17 - 17 // 2,)


def test_feature_variance_model_part_is_zero_without_dropout(images):
  model = get_model("resnet_dnn_smoothing_18", 5, width=4)
  variables = init_variables(model, images[:1])
  deterministic = feature_variance(model, variables, images, num_samples=3)
  assert all(v["model"] <= 1e-10 * v["data"] for v in deterministic.values())  # zero up to rounding
  x = np.asarray(feature_maps(model, variables, images)["layer2_0"])
  assert deterministic["layer2_0"]["data"] == pytest.approx(float(
      np.mean(np.var(x, axis=(1, 2), ddof=1))),
                                                            rel=1e-5)


def test_feature_variance_model_part_is_positive_with_mc_dropout(tiny_mcdo, images):
  model, variables = tiny_mcdo
  stochastic = feature_variance(model, variables, images, num_samples=3)
  assert all(v["model"] > 0 for v in stochastic.values())


@pytest.fixture(scope="module")
def small_net():
  return small_net_problem()


def test_filter_normalised_directions(small_net):
  _, params = small_net
  d = random_direction(params, jax.random.key(0), "filter")
  kernel, direction = np.asarray(params["Dense_0"]["kernel"]), np.asarray(d["Dense_0"]["kernel"])
  np.testing.assert_allclose(np.linalg.norm(direction, axis=0),
                             np.linalg.norm(kernel, axis=0),
                             rtol=1e-5)
  assert np.all(np.asarray(d["Dense_0"]["bias"]) == 0) and np.all(
      np.asarray(d["BatchNorm_0"]["scale"]) == 0)
  ref = random_direction(params, jax.random.key(0), "reference")
  direction = np.asarray(
      ref["Dense_0"]["kernel"])  # torch dim 0 = output axis: one norm per input row
  np.testing.assert_allclose(np.linalg.norm(direction, axis=1),
                             np.linalg.norm(kernel, axis=1),
                             rtol=1e-5)


@pytest.mark.parametrize("name,kwargs", [
    ("vit_ti", dict(hidden_dim=8, depth=1, num_heads=1, head_dim=8, mlp_dim=8, patch_size=4)),
    ("alternet_18",
     dict(width=4,
          stage_sizes=(1, 1, 1, 2),
          msa_blocks=(0, 0, 0, 1),
          num_heads=(1, 1, 1, 1),
          head_dim=4,
          window_size=2)),
])
def test_directions_leave_position_parameters_alone(name, kwargs):
  """HV ``create_bases(model, kws=["pos_embed", "relative_position"])``: zero directions there."""
  model = get_model(name, 3, **kwargs)
  shapes = abstract_variables(model, (1, 16, 16, 3))["params"]
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), shapes)
  d = random_direction(params, jax.random.key(0))
  flat = {"/".join(str(k.key) for k in path): np.asarray(v)
          for path, v in jax.tree_util.tree_flatten_with_path(d)[0]}
  position = [k for k in flat if "pos_embedding" in k or "relative_position" in k]
  assert position and all(np.all(flat[k] == 0) for k in position)
  assert any(np.any(v != 0) for k, v in flat.items() if k.endswith("kernel") and v.ndim > 1)


def test_loss_surface_centre_is_the_plain_loss(small_net, tmp_path):
  loss_fn, params = small_net
  d1 = random_direction(params, jax.random.key(1))
  d2 = random_direction(params, jax.random.key(2))
  surface = loss_surface(loss_fn, params, d1, d2, np.linspace(-1, 1, 5), np.linspace(-1, 1, 3),
                         weight_decay=0.1, chunk_size=4)
  assert surface["loss"].shape == (5, 3)
  assert surface["loss"][2, 1] == pytest.approx(float(loss_fn(params)), rel=1e-5)
  l2 = float(sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params)))
  assert surface["loss_l2"][2, 1] == pytest.approx(float(loss_fn(params)) + 0.05 * l2, rel=1e-5)
  shifted = jax.tree.map(lambda p, a: p + a, params, d1)
  assert surface["loss"][4, 1] == pytest.approx(float(loss_fn(shifted)), rel=1e-4)
  plot_surface(surface).savefig(tmp_path / "surface.png")


def test_fgsm_on_a_linear_model_matches_the_closed_form():
  rng = np.random.default_rng(0)
  w, b = rng.normal(size=(6, 3)), rng.normal(size=3)
  x, y = rng.uniform(0.2, 0.8, size=(4, 6)), np.array([0, 1, 2, 1])

  def loss(pixels, labels):
    logits = pixels @ w + b
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))
  # ∂/∂x of mean CE = (softmax(xW + b) − onehot(y)) Wᵀ / B.
  logits = x @ w + b
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  expected = np.clip(x + 0.1 * np.sign((p - np.eye(3)[y]) @ w.T), 0, 1)
  np.testing.assert_allclose(fgsm(loss, jnp.asarray(x), jnp.asarray(y), 0.1), expected, rtol=1e-6)


def test_pgd_stays_in_the_ball_and_raises_the_ensemble_loss(tiny_mcdo):
  model, variables = tiny_mcdo
  pixels = jax.random.uniform(jax.random.key(0), (3, 16, 16, 3))
  labels = jnp.array([0, 1, 2])
  method = MCDropout(model, num_samples=2)
  def loss(x, y):
    return ensemble_nll(method, variables, jax.random.key(1), lambda z: (z - 0.5) / 0.25, x, y)

  adversarial = pgd(loss, pixels, labels, eps=8 / 255, steps=3, rng=jax.random.key(2))
  assert float(jnp.max(jnp.abs(adversarial - pixels))) <= 8 / 255 + 1e-6
  assert float(adversarial.min()) >= 0.0 and float(adversarial.max()) <= 1.0
  assert float(loss(adversarial, labels)) > float(loss(pixels, labels))


@pytest.mark.parametrize("center", [0.0, 0.5, 1.0])
def test_band_limited_noise_lives_in_its_band(center):
  noise = np.asarray(band_limited_noise(jax.random.key(0), (2, 16, 16, 3), center))
  spectrum = np.abs(np.fft.fft2(noise, axes=(1, 2)))
  mask = frequency_band_mask(16, center)[None, :, :, None] > 0
  assert mask.any()
  assert spectrum[np.broadcast_to(~mask, spectrum.shape)].max() < 1e-4
  assert spectrum[np.broadcast_to(mask, spectrum.shape)].mean() > 0.1


def test_band_mask_by_hand():
  # size 4: |fftfreq|·2 = [0, .5, 1, .5]; L∞ radius 0.5 ± 0.05 selects the ring around DC,
  # not DC or π.
  mask = frequency_band_mask(4, 0.5)
  expected = np.array([[0, 1, 0, 1], [1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1]], np.float32)
  np.testing.assert_array_equal(mask, expected)


def test_accuracy_vs_frequency_with_a_fixed_classifier():
  images = jnp.concatenate([jnp.full((4, 8, 8, 1), -1.0), jnp.full((4, 8, 8, 1), 1.0)])
  labels = jnp.array([0] * 4 + [1] * 4)
  def predict(x):  # the sign of the mean pixel
    return jnp.stack([-x.mean((1, 2, 3)), x.mean((1, 2, 3))], -1)

  # Noise away from DC does not move the mean; strong DC noise does.
  assert list(accuracy_vs_frequency(predict, images, labels, [0.5, 1.0], std=10.0)) == [1.0, 1.0]
  assert accuracy_vs_frequency(predict, images, labels, [0.0], std=10.0)[0] < 1.0


def test_consistency_and_cec_hand_worked():
  # One sequence of 3 frames, 2 classes: argmax 0, 0, 1 -> consistency 1/2.
  p = np.array([[[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]]])
  assert consistency(p) == 0.5
  paper = -((0.9 * np.log(0.6) + 0.1 * np.log(0.4)) + (0.6 * np.log(0.2) + 0.4 * np.log(0.8))) / 2
  reference = -((0.6 * np.log(0.9) + 0.4 * np.log(0.1)) / 2 +
                (0.2 * np.log(0.6) + 0.8 * np.log(0.4)) / 2) / 2
  np.testing.assert_allclose(cross_entropy_consistency(p), paper, rtol=1e-12)
  np.testing.assert_allclose(cross_entropy_consistency(p, "reference"), reference, rtol=1e-12)
  with pytest.raises(ValueError, match="CEC variant"):
    cross_entropy_consistency(p, "sum")
  with pytest.raises(ValueError, match="T>=2"):
    consistency(p[:, :1])


def test_relative_confidence_is_one_iff_correct():
  p = np.array([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1]])
  np.testing.assert_allclose(relative_confidence(p, np.array([0, 1])), [1.0, 0.8])


def test_translated_sequences_shift_by_one_pixel_per_frame():
  rng = np.random.default_rng(0)
  images = rng.random((5, 12, 12, 3)).astype(np.float32)
  videos = translate_sequences(images, length=7, max_shift=3)
  assert videos.shape == (5, 7, 12, 12, 3)
  np.testing.assert_array_equal(videos[:, 3], images)  # the middle frame is unshifted
  for i in range(5):
    # Consecutive frames are one-pixel translations: their interiors agree after undoing the shift.
    matches = [
        np.array_equal(
            np.roll(videos[i, 3], (dy, dx), (0, 1))[3:-3, 3:-3], videos[i, 4, 3:-3, 3:-3])
        for dy in (-1, 0, 1)
        for dx in (-1, 0, 1)
        if (dy, dx) != (0, 0)
    ]
    assert sum(matches) == 1
  with pytest.raises(ValueError, match="max_shift"):
    translate_sequences(images, max_shift=12)


def test_perturbation_metrics_of_a_translation_invariant_classifier():
  images = np.random.default_rng(1).random((4, 8, 8, 1)).astype(np.float32)
  videos = translate_sequences(images, length=5, max_shift=2)
  def predict(x):
    return jax.nn.softmax(jnp.stack([jnp.sum(x, (1, 2, 3)) * 0, jnp.max(x, (1, 2, 3))], -1))

  probs = sequence_predictions(predict, videos, batch_size=3)
  assert probs.shape == (4, 5, 2)
  metrics = perturbation_metrics(probs, np.ones(4, int))
  assert metrics["consistency"] == 1.0  # the max pixel survives reflection-padded translation
  assert metrics["relative_confidence"] == 1.0


def test_missing_cifar10_p_file_names_the_way_out(tmp_path):
  with pytest.raises(FileNotFoundError, match="translate_sequences"):
    load_cifar10_p(str(tmp_path), "translate")
  with pytest.raises(ValueError, match="Unknown CIFAR-10-P perturbation"):
    load_cifar10_p(str(tmp_path), "shift")
  np.save(tmp_path / "translate.npy", np.zeros((2, 3, 8, 8, 3), np.uint8))
  assert load_cifar10_p(str(tmp_path), "translate").shape == (2, 3, 8, 8, 3)


# ----------------------------------------------------------------------------- on a micro ViT


def test_feature_taps_of_vit_are_token_maps_with_kinds(micro_vit):
  from smoothing_jax.analysis.features import block_kinds, feature_maps, feature_variance
  model, variables, x, _ = micro_vit
  maps = feature_maps(model, variables, x)
  assert list(maps) == ["patch_embedding", "block0_msa", "block0_mlp", "block1_msa", "block1_mlp"]
  assert all(m.shape == (6, 2, 2, 8) for m in maps.values())  # CLS dropped, 2×2 patch grid
  assert block_kinds(model, maps) == {"patch_embedding": "embedding", "block0_msa": "msa",
                                      "block0_mlp": "mlp", "block1_msa": "msa", "block1_mlp": "mlp"}
  # HV feature-map variance: spatial variance per (example, channel), averaged.
  _, state = model.apply(variables, x, capture_intermediates=True, mutable=["intermediates"])
  tokens = np.asarray(state["intermediates"]["block1_msa"]["__call__"][0])[:, 1:]
  expected = np.var(tokens, axis=1, ddof=1).mean()
  np.testing.assert_allclose(feature_variance(model, variables, x,
                                              num_samples=1)["block1_msa"]["data"],
                             expected,
                             rtol=1e-5)


def test_lesion_accuracy_drops_table_and_plot(micro_vit):
  import matplotlib
  matplotlib.use("Agg")
  from smoothing_jax.analysis.lesion import lesion_accuracy_drops, lesion_table
  from smoothing_jax.plots import plot_lesion
  model, variables, x, y = micro_vit
  params = jax.tree_util.tree_map_with_path(
      lambda path, v: jnp.zeros_like(v)
      if [p.key for p in path[:2]] == ["block1_mlp", "fc2"] else v, variables["params"])
  variables = {"params": params}
  batches = [{"image": x[:4], "label": y[:4]}, {"image": x[4:], "label": y[4:]}]
  result = lesion_accuracy_drops(model, variables, batches)
  logits = model.apply(variables, x)
  assert result["accuracy"] == pytest.approx(float(np.mean(np.argmax(logits, -1) == y)))
  rows = {r["name"]: r for r in result["units"]}
  assert rows["block1_mlp"]["drop"] == 0.0 and rows["block1_mlp"]["kind"] == "mlp"
  masked = model.apply(variables, x, block_mask=jnp.array([1.0, 0.0, 1.0, 1.0]))
  assert rows["block0_mlp"]["accuracy"] == pytest.approx(float(np.mean(np.argmax(masked, -1) == y)))
  assert "| 3 | block1_mlp | mlp |" in lesion_table(result)
  assert plot_lesion({"ViT": result}).axes[0].get_xlabel().startswith("unit index")
  with pytest.raises(ValueError, match="no residual units"):
    lesion_accuracy_drops(get_model("resnet_dnn_18", 3, width=4), {}, [])


def test_spectrum_with_negative_eigenvalues_matches_the_explicit_hessian(micro_vit):
  from jax.flatten_util import ravel_pytree

  from smoothing_jax.analysis.spectrum import max_eigenvalue_spectrum, training_loss
  model, variables, x, y = micro_vit
  result = max_eigenvalue_spectrum(model,
                                   variables, [{
                                       "image": x,
                                       "label": y
                                   }],
                                   k=1,
                                   weight_decay=0.0,
                                   max_iters=500,
                                   tol=1e-6,
                                   negative=True)
  flat, unravel = ravel_pytree(variables["params"])
  loss = lambda f: training_loss(model, 0.0, {}, jax.random.key(0), x, y, unravel(f))  # noqa: E731
  # One compiled program (op by op, the 1,363 directions took five times longer).
  eigenvalues = np.linalg.eigvalsh(np.asarray(jax.jit(jax.hessian(loss))(flat), np.float64))
  assert eigenvalues[0] < 0  # a ViT at initialisation is not convex
  top = eigenvalues[np.argmax(np.abs(eigenvalues))]
  np.testing.assert_allclose(result["max_eigenvalues"][0], top, rtol=2e-2)
  np.testing.assert_allclose(result["min_eigenvalues"][0], eigenvalues[0], rtol=5e-2, atol=1e-3)


def test_load_or_train_trains_an_empty_workdir_once_then_loads_it(tmp_path, monkeypatch):
  from pathlib import Path

  from smoothing_jax.analysis import trained
  from smoothing_jax.experiment.checkpoints import load_variables
  from smoothing_jax.parallel import create_mesh
  from tests.conftest import _quadrant_npz
  monkeypatch.chdir(Path(__file__).parents[2])  # config paths are relative to the current directory
  workdir = str(tmp_path / "run")
  config = f"configs/cifar_resnet.py:vit_ti,npz:{_quadrant_npz(tmp_path)}"
  tiny = {**model_options(**{**MICRO_VIT, "depth": 1}), "input.batch_size": 16,
          "num_train_steps": 1}
  with pytest.raises(ValueError, match="no checkpoint: give a config"):
    trained.load_or_train(workdir)
  with pytest.raises(ValueError, match="'model_kwargs.widht'.*keys there: .*hidden_dim"):
    trained.load_or_train(workdir, config, overrides={"model_kwargs.widht": 4})
  with pytest.raises(ValueError, match="'configs/nope.py' is not a config file"):
    trained.load_or_train(workdir, "configs/nope.py:runlocal")

  first = trained.load_or_train(workdir, config, overrides=tiny)
  step, variables = load_variables(workdir, create_mesh())
  assert first.step == step == 1 and first.config.model_kwargs.depth == 1
  assert first.config.input.dataset.startswith("npz:") and first.config.model == "vit_ti"
  recorded = (tmp_path / "run" / "config.json").read_text()
  # A workdir with a checkpoint is loaded as it is: another config trains nothing.
  again = trained.load_or_train(workdir, "configs/quickstart.py", overrides={"num_train_steps": 9})
  assert again.step == 1 and (tmp_path / "run" / "config.json").read_text() == recorded
  for tree in (variables, again.variables):
    jax.tree.map(np.testing.assert_array_equal, first.variables, tree)
  # init_from with num_train_steps 0: nothing is trained, the workdir stands for the source.
  evaluated = trained.load_or_train(str(tmp_path / "evaluated"), config,
                                    overrides={**tiny, "init_from": workdir, "num_train_steps": 0})
  assert evaluated.step == 0 and not (tmp_path / "evaluated" / "checkpoints").exists()
  jax.tree.map(np.testing.assert_array_equal, first.variables["params"],
               evaluated.variables["params"])
