"""BNN-VI's mean-field layers: their KL and Flipout draws against numpy and Monte Carlo over
explicitly sampled weights, and the models' sizes (the method: tests/methods/test_bnnvi.py); the
iBNN repository's own BNN-VI layers and models against their torch transcription
(``tests/torch_reference.py``: ``BayesianConv2d``, ``BayesianLinear``, ``BayesianVGG16``,
``BayesianWideResNet28x10`` of trungtrinh44/ibnn at 665ba40)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.layers.mean_field import (
  BayesianConv,
  BayesianDense,
  MeanFieldConv,
  MeanFieldDense,
  kl_divergence,
  mean_field_layers,
)
from smoothing_jax.models import get_model
from tests.helpers import abstract_variables, num_params


def _layer_params(shape, seed=0, std=(0.05, 0.3)):
  """μ ~ N(0, 0.3²) and ρ with σ ~ U(std) of a kernel of ``shape`` (numpy)."""
  rng = np.random.default_rng(seed)
  sigma = rng.uniform(*std, shape)
  return {"kernel": rng.normal(0, 0.3, shape).astype(np.float32),
          "kernel_rho": np.log(np.expm1(sigma)).astype(np.float32)}


@pytest.mark.parametrize("prior_mean", [None, 0.0, 0.2])
def test_kl_matches_the_closed_form_in_numpy_and_monte_carlo(prior_mean):
  layer = _layer_params((3, 3, 2, 3))
  params = {"block": {"conv": layer}, "other": {"kernel": np.ones((2, 2), np.float32)}}
  mu = layer["kernel"].astype(np.float64)
  sigma = np.log1p(np.exp(layer["kernel_rho"].astype(np.float64)))
  prior_std, m = 0.1, mu if prior_mean is None else prior_mean
  closed = np.sum(np.log(prior_std / sigma) + (sigma**2 + (mu - m)**2) / (2 * prior_std**2) - 0.5)
  ours = float(kl_divergence(params, prior_std, prior_mean))
  np.testing.assert_allclose(ours, closed, rtol=1e-5)
  # E_q[log q(w) − log p(w)] over 200,000 sampled weight tensors (the Gaussian log-density written
  # out: scipy.stats.norm.logpdf took 4.7 s of each case for the same numbers).
  w = mu + sigma * np.random.default_rng(1).standard_normal((200_000,) + mu.shape)

  def log_density(x, mean, std):
    return -0.5 * np.square((x - mean) / std) - np.log(std) - 0.5 * np.log(2 * np.pi)

  log_ratio = log_density(w, mu, sigma) - log_density(w, m, prior_std)
  estimate = log_ratio.reshape(len(w), -1).sum(1)
  assert abs(estimate.mean() - ours) < 4 * estimate.std() / np.sqrt(len(w))
  assert len(mean_field_layers(params)) == 1


def _flipout_samples(layer, params, x, num=4000):
  """``[num, B, ...]`` outputs of ``layer`` over ``num`` noise keys."""
  keys = jax.random.split(jax.random.key(3), num)
  return np.asarray(jax.jit(jax.vmap(lambda k: layer.apply(
      {"params": params}, x, rngs={"noise": k})))(keys), np.float64)


def test_flipout_dense_moments_match_explicitly_sampled_weight_matrices():
  layer = MeanFieldDense(features=3)
  params = {**_layer_params((5, 3)), "bias": np.array([0.1, -0.2, 0.3], np.float32)}
  x = np.random.default_rng(2).normal(size=(4, 5)).astype(np.float32)
  ours = _flipout_samples(layer, params, x)
  mu = params["kernel"].astype(np.float64)
  sigma = np.log1p(np.exp(params["kernel_rho"].astype(np.float64)))
  w = mu + sigma * np.random.default_rng(4).standard_normal((20_000,) + mu.shape)
  explicit = np.einsum("bi,sio->sbo", x, w) + params["bias"]
  scale = np.sqrt(explicit.var(0))
  np.testing.assert_allclose(ours.mean(0), explicit.mean(0), atol=0.1 * scale.max())
  np.testing.assert_allclose(ours.var(0), explicit.var(0), rtol=0.1)
  # One pass: examples draw their perturbations apart (Flipout), not one shared weight sample.
  assert abs(np.corrcoef(ours[:, 0, 0], ours[:, 1, 0])[0, 1]) < 0.1
  assert abs(np.corrcoef(explicit[:, 0, 0], explicit[:, 1, 0])[0, 1]) > 0.2


def test_flipout_conv_matches_one_sampled_kernel_per_example_including_over_positions():
  layer = MeanFieldConv(features=2, kernel_size=3, padding=1)
  params = _layer_params((3, 3, 2, 2), seed=5)
  x = np.random.default_rng(6).normal(size=(2, 4, 4, 2)).astype(np.float32)
  ours = _flipout_samples(layer, params, x)
  mu = params["kernel"].astype(np.float64)
  sigma = np.log1p(np.exp(params["kernel_rho"].astype(np.float64)))
  kernels = mu + sigma * np.random.default_rng(7).standard_normal((20_000,) + mu.shape)
  padded = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
  patches = np.stack([padded[:, i:i + 4, j:j + 4] for i in range(3) for j in range(3)], 1)
  explicit = np.einsum("bkhwi,skio->sbhwo", patches, kernels.reshape(len(kernels), 9, 2, 2))
  np.testing.assert_allclose(ours.var(0), explicit.var(0), rtol=0.12)
  np.testing.assert_allclose(ours.mean(0), explicit.mean(0),
                             atol=0.1 * np.sqrt(explicit.var(0)).max())
  # Two positions of one example share its kernel sample: their covariance is a sampled kernel's.
  def cov(samples):
    a, b = samples[:, 0, 1, 1, 0], samples[:, 0, 1, 2, 0]
    return np.mean((a - a.mean()) * (b - b.mean()))
  np.testing.assert_allclose(cov(ours), cov(explicit), atol=0.15 * np.sqrt(
      explicit[:, 0, 1, 1, 0].var() * explicit[:, 0, 1, 2, 0].var()))


def test_posterior_initialisation_is_uncertainty_baselines():
  variables = jax.jit(MeanFieldDense(features=400).init)(
      {"params": jax.random.key(0), "noise": jax.random.key(1)}, jnp.ones((1, 300)))["params"]
  sigma = jax.nn.softplus(variables["kernel_rho"])
  rho = np.asarray(variables["kernel_rho"])
  # ρ ~ TruncatedNormal(softplus⁻¹(1e-3), 0.1): mean softplus⁻¹(1e-3) = log(expm1(1e-3)).
  assert abs(rho.mean() - np.log(np.expm1(1e-3))) < 0.01
  assert np.abs(rho - np.log(np.expm1(1e-3))).max() <= 0.2 + 1e-6
  assert 0.7e-3 < float(sigma.mean()) < 1.3e-3
  # μ: Keras he_normal, a normal of std √(2 / fan_in) / 0.8796 truncated at two of its standard
  # deviations, so of std √(2 / fan_in).
  kernel = np.asarray(variables["kernel"])
  np.testing.assert_allclose(kernel.std(), np.sqrt(2 / 300), rtol=0.03)
  assert np.abs(kernel).max() <= 2 * np.sqrt(2 / 300) / 0.8796 + 1e-6


def test_model_sizes_are_twice_the_kernels_plus_the_deterministic_rest():
  # uncertainty-baselines' README: VI WRN-28-10 73M (a μ and a σ per kernel entry) against the
  # deterministic 36.5M: 36,454,832 conv and 6,400 dense kernel entries, 17,952 BatchNorm γ/β
  # and the head's 10 biases.
  kernels = 36_454_832 + 6_400
  assert num_params(get_model("wideresnet_bnnvi_28_10", 10)) == 2 * kernels + 17_952 + 10
  # The iBNN reference's VGG-16 (13 convs with biases, 512-512-10 head): 15,245,130 deterministic
  # parameters, of which 15,239,872 kernel entries.
  vgg = get_model("vgg_dnn_16", 10, batch_norm=False, classifier="mlp512")
  assert num_params(vgg) == 15_245_130
  assert num_params(get_model("vgg_bnnvi_16", 10)) == 15_245_130 + 15_239_872


# ------------------------------------------------- the iBNN repository's BNN-VI against torch

def test_ibnn_repository_counts_equal_its_torch_models():
  """Trainable parameters of the reference's ``BayesianVGG16`` and ``BayesianWideResNet28x10`` on
  CIFAR-10 (built on torch's meta device: shapes only; the prior's two ``requires_grad=False``
  tensors per layer are not trained) equal ours, counted from abstract shapes: every kernel and
  bias with its σ, the WRN's stem a plain conv."""
  torch = pytest.importorskip("torch")
  from tests import torch_reference as ref
  with torch.device("meta"):
    theirs = {"vgg_bayesian_16": ref.BayesianVGG16(10, 1.0, 0.5),
              "wideresnet_bayesian_28_10": ref.BayesianWideResNet28x10(10, 1.0, 0.5)}
  expected = {"vgg_bayesian_16": 30_490_260, "wideresnet_bayesian_28_10": 72_960_180}
  for name, module in theirs.items():
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    params = abstract_variables(get_model(name, 10))["params"]
    assert trainable == expected[name] == sum(p.size for p in jax.tree.leaves(params)), name
  assert set(params["conv1"]) == {"kernel", "bias"}  # the stem: ``conv3x3``, deterministic
  assert set(params["layer2_0"]["shortcut"]) == set(params["linear"]) == {
      "kernel", "kernel_rho", "bias", "bias_rho"}
  for options, match in (({"bnn_reference": "ibnn"}, "needs mean_field=True"),
                         ({"mean_field": True, "bnn_reference": "x"}, "Unknown bnn_reference")):
    with pytest.raises(ValueError, match=match):
      abstract_variables(get_model("vgg_dnn_16", 10, **options))


def _torch_layer_and_params(kind, seed=0):
  """A torch transcription of the reference's ``BayesianConv2d(2, 3, 3, padding=1)`` or
  ``BayesianLinear(5, 3)`` with prior N(1, 0.5²), μ and σ ~ U(0.05, 0.3) drawn here, and the same
  posterior as our parameters."""
  torch = pytest.importorskip("torch")
  from tests import torch_reference as ref
  torch.manual_seed(seed)
  layer = (ref.BayesianConv2d(2, 3, 3, 1.0, 0.5, padding=1) if kind == "conv"
           else ref.BayesianLinear(5, 3, True, 1.0, 0.5))
  rng = np.random.default_rng(seed)
  with torch.no_grad():
    for name in ("weight", "bias"):
      mean, std = getattr(layer, name), getattr(layer, f"{name}_std")
      mean.copy_(torch.tensor(rng.normal(0, 0.3, mean.shape), dtype=torch.float32))
      std.copy_(torch.tensor(np.log(np.expm1(rng.uniform(0.05, 0.3, std.shape))),
                             dtype=torch.float32))
  to_ours = ((lambda w: w.permute(2, 3, 1, 0)) if kind == "conv" else (lambda w: w.T))
  params = {"kernel": to_ours(layer.weight), "kernel_rho": to_ours(layer.weight_std),
            "bias": layer.bias, "bias_rho": layer.bias_std}
  return layer, {k: np.asarray(v.detach().numpy(), np.float32) for k, v in params.items()}


@pytest.mark.parametrize("kind", ["conv", "dense"])
def test_ibnn_layer_kl_equals_torch_kl_divergence(kind):
  """Σ KL over the kernel and the bias, against ``torch.distributions.kl_divergence`` of the same
  Normal posteriors and the fixed prior N(1, 0.5²) (the transcription's ``kl``)."""
  torch = pytest.importorskip("torch")
  layer, params = _torch_layer_and_params(kind)
  prior = torch.distributions.Normal(torch.tensor(1.0), torch.tensor(0.5))
  with torch.no_grad():
    expected = sum(float(torch.distributions.kl_divergence(d, prior).sum())
                   for d in layer.posterior())
    assert float(layer.kl()) == pytest.approx(expected, rel=1e-6)
  ours = float(kl_divergence({"layer": params}, 0.5, 1.0))
  np.testing.assert_allclose(ours, expected, rtol=1e-5)
  kernel_only = {"layer": {k: v for k, v in params.items() if not k.startswith("bias")}}
  assert float(kl_divergence(kernel_only, 0.5, 1.0)) < ours  # the biases' KL is part of it


def test_ibnn_layers_outputs_match_the_torch_forward_over_many_draws():
  """Mean and variance over 4,000 noise keys of our ``BayesianConv`` / ``BayesianDense`` against
  1,000 calls of the transcribed reference ``forward`` on the same posterior (a Python loop: the
  calls are what costs); in one pass two equal examples give equal outputs in both (one weight
  sample for the whole batch, no Flipout)."""
  torch = pytest.importorskip("torch")
  num, num_torch = 4000, 1000
  for kind, ours, shape in (("conv", BayesianConv(features=3, kernel_size=3, padding=1,
                                                  use_bias=True), (2, 4, 4, 2)),
                            ("dense", BayesianDense(features=3), (2, 5))):
    layer, params = _torch_layer_and_params(kind, seed=1)
    x = np.random.default_rng(2).normal(size=shape).astype(np.float32)
    x[1] = x[0]
    keys = jax.random.split(jax.random.key(3), num)
    samples = np.asarray(jax.jit(jax.vmap(lambda k, x=x, ours=ours, params=params: ours.apply(
        {"params": params}, x, rngs={"noise": k})))(keys), np.float64)
    torch.manual_seed(4)
    x_torch = torch.tensor(np.moveaxis(x, -1, 1) if kind == "conv" else x)
    with torch.no_grad():
      theirs = torch.stack([layer(x_torch) for _ in range(num_torch)]).double().numpy()
    if kind == "conv":
      theirs = np.moveaxis(theirs, 2, -1)
    scale = np.sqrt(theirs.var(0))
    np.testing.assert_allclose(samples.mean(0), theirs.mean(0), atol=0.15 * scale.max())
    np.testing.assert_allclose(samples.var(0), theirs.var(0), rtol=0.2)
    np.testing.assert_array_equal(samples[:, 0], samples[:, 1])
    np.testing.assert_array_equal(theirs[:, 0], theirs[:, 1])


def test_ibnn_posterior_initialisation_is_the_reference():
  """σ = softplus(ρ) of every kernel entry and bias ~ |N(0.015, 0.001²)|, as the transcribed
  ``BayesianLinear(300, 400)`` initialises them (``nn.init.normal_(·, 0.015, 0.001)`` then
  ``abs_().expm1_().log_()``)."""
  torch = pytest.importorskip("torch")
  from tests import torch_reference as ref
  torch.manual_seed(0)
  theirs = ref.BayesianLinear(300, 400)
  params = jax.jit(BayesianDense(features=400).init)(
      {"params": jax.random.key(0), "noise": jax.random.key(1)}, jnp.ones((1, 300)))["params"]
  for name in ("weight", "bias"):
    ours = np.asarray(jax.nn.softplus(params[f"{name.replace('weight', 'kernel')}_rho"]))
    reference = torch.nn.functional.softplus(getattr(theirs, f"{name}_std")).detach().numpy()
    for sigma in (ours, reference):
      assert abs(sigma.mean() - 0.015) < 4 * 0.001 / np.sqrt(sigma.size)
      assert sigma.std() == pytest.approx(0.001, rel=0.15)
