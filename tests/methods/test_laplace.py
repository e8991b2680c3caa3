"""Last-layer Laplace against laplace-torch 0.3, run here (skipped without it): a tiny torch MLP
(4 → 8 → 3, float64, briefly trained on 64 examples) whose last Linear becomes the Dense kernel
and bias, fitted by laplace-torch (batches of 20) and by smoothing_jax.methods.laplace in float32
(jitted, batches of 24, the last padded and masked); for each structure the posterior precision,
the log marginal likelihood (scalar and per-parameter prior), the marglik-fitted prior precision,
the probit predictive and the MC samples from the same standard-normal draws agree to 1e-5."""
import importlib
import importlib.util
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.methods import laplace
from tests.helpers import _TorchvisionStub

D, C, N, PRIOR = 8, 3, 64, 0.7
TOL = 1e-5


def import_laplace_torch():
  """``(torch, laplace)``; skips where torch or laplace-torch is not installed.  laplace imports
  torchmetrics, which imports torchvision, whose CUDA-built wheel does not load with the CPU torch
  of requirements-test.txt: torchvision is stubbed as for timm (tests/helpers.import_timm)."""
  torch = pytest.importorskip("torch")
  if importlib.util.find_spec("laplace") is None:
    pytest.importorskip("laplace")
  if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
      del sys.modules[name]
    sys.meta_path.insert(0, _TorchvisionStub())
  return torch, importlib.import_module("laplace")


def jitted(name):
  return jax.jit(getattr(laplace, name), static_argnames="structure")


def assert_close(ours, theirs, tol=TOL):
  """Within ``tol`` of the largest magnitude of laplace-torch's value."""
  theirs = np.asarray(theirs, np.float64)
  np.testing.assert_allclose(np.asarray(ours, np.float64), theirs, rtol=0,
                             atol=tol * np.max(np.abs(theirs)))


@pytest.fixture(scope="module")
def problem():
  """The torch model, its data loader and test inputs, and the features φ, logits and labels."""
  torch, _ = import_laplace_torch()
  torch.manual_seed(0)
  x = torch.randn(N, 4, dtype=torch.float64)
  y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
  model = torch.nn.Sequential(torch.nn.Linear(4, D), torch.nn.Tanh(),
                              torch.nn.Linear(D, C)).double()
  optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
  for _ in range(100):
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
  x_test = torch.randn(10, 4, dtype=torch.float64)
  with torch.no_grad():
    phi, logits, phi_test = model[:-1](x), model(x), model[:-1](x_test)
  loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=20)

  def f32(tensor):
    return jnp.asarray(tensor.detach().numpy(), jnp.float32)

  return dict(model=model, loader=loader, x_test=x_test, phi=f32(phi), logits=f32(logits),
              labels=jnp.asarray(y.numpy()), phi_test=f32(phi_test),
              mean=laplace.flatten_last_layer(f32(model[-1].weight.T), f32(model[-1].bias)))


@pytest.fixture(scope="module", params=laplace.STRUCTURES)
def fitted(request, problem):
  """(structure, laplace-torch's fitted ``Laplace``, our curvature) of the same training set."""
  structure = request.param
  torch, lt = import_laplace_torch()
  la = lt.Laplace(problem["model"], "classification", subset_of_weights="last_layer",
                  hessian_structure=structure)
  la.fit(problem["loader"])
  accumulate = jitted("accumulate_curvature")
  state = laplace.init_curvature(structure, D, C)
  for start in range(0, N, 24):
    batch = [problem[k][start:start + 24] for k in ("phi", "logits", "labels")]
    pad = 24 - len(batch[0])
    batch = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in batch]
    state = accumulate(state, structure, *batch, mask=jnp.arange(24) < 24 - pad)
  assert float(state["count"]) == N
  return structure, la, jitted("finish_curvature")(state, structure)


def torch_precision(la, structure):
  precision = la.posterior_precision
  return (precision.to_matrix() if structure == "kron" else precision).numpy()


def test_posterior_precision(fitted):
  structure, la, curvature = fitted
  la.prior_precision = PRIOR
  ours = jitted("posterior_precision")(curvature, structure, PRIOR)
  assert ours.shape == ((C * (D + 1),) if structure == "diag" else (C * (D + 1),) * 2)
  assert_close(ours, torch_precision(la, structure))


def test_log_marginal_likelihood(fitted, problem):
  torch, _ = import_laplace_torch()
  structure, la, curvature = fitted
  lml = jitted("log_marginal_likelihood")
  priors = [PRIOR]
  if structure != "kron":  # laplace-torch's last-layer Kron takes a scalar prior only
    priors.append(np.random.default_rng(0).uniform(0.2, 3.0, C * (D + 1)))
  for prior in priors:
    theirs = la.log_marginal_likelihood(torch.as_tensor(prior, dtype=torch.float64)).item()
    ours = lml(curvature, structure, problem["mean"], jnp.asarray(prior, jnp.float32))
    assert abs(float(ours) - theirs) <= TOL * abs(theirs), (prior, float(ours), theirs)


def test_fitted_prior_precision(fitted, problem):
  structure, la, curvature = fitted
  with warnings.catch_warnings():  # that the predictive's link_approx defaults to probit
    warnings.simplefilter("ignore", UserWarning)
    la.optimize_prior_precision(method="marglik")
  theirs = la.prior_precision.item()
  ours = float(jax.jit(laplace.fit_prior_precision, static_argnames="structure")(
      curvature, structure, problem["mean"]))
  assert ours != pytest.approx(1.0, rel=0.05)  # moved away from the initial δ = 1
  assert ours == pytest.approx(theirs, rel=TOL)


def test_probit_predictive(fitted, problem):
  structure, la, curvature = fitted
  la.prior_precision = PRIOR
  theirs = la(problem["x_test"], pred_type="glm", link_approx="probit").numpy()
  posterior = jitted("build_posterior")(curvature, structure, problem["mean"], PRIOR)
  assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(posterior))
  mean, cov = jitted("logit_moments")(posterior, structure, problem["phi_test"])
  ours = laplace.probit_predictive(mean, cov)
  np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)
  # The GLM mean is the MAP network's logits, the variance visibly moves the probabilities.
  assert_close(mean, problem["model"](problem["x_test"]).detach().numpy())
  assert np.max(np.abs(ours - jax.nn.softmax(mean))) > 1e-3


def test_mc_samples(fitted, problem):
  torch, _ = import_laplace_torch()
  structure, la, curvature = fitted
  la.prior_precision = PRIOR
  theirs = la.predictive_samples(problem["x_test"], pred_type="nn", n_samples=4,
                                 generator=torch.Generator().manual_seed(1)).numpy()
  noise = torch.randn(4, C * (D + 1), dtype=torch.float64,
                      generator=torch.Generator().manual_seed(1)).numpy()
  posterior = laplace.build_posterior(curvature, structure, problem["mean"], PRIOR)
  logits = jitted("sample_logits")(posterior, structure, problem["phi_test"],
                                   jnp.asarray(noise, jnp.float32))
  assert logits.shape == (4, 10, C)
  np.testing.assert_allclose(jax.nn.softmax(logits), theirs, rtol=0, atol=TOL)


def test_flatten_round_trip_and_errors():
  kernel, bias = jnp.arange(D * C, dtype=jnp.float32).reshape(D, C), -jnp.arange(C) - 1.0
  theta = laplace.flatten_last_layer(kernel, bias)
  assert float(theta[1]) == float(kernel[1, 0])  # class 0's second feature: torch's weight[0, 1]
  for ours, original in zip(laplace.unflatten_last_layer(theta, D), (kernel, bias), strict=True):
    np.testing.assert_array_equal(ours, original)
  with pytest.raises(ValueError, match="none of"):
    laplace.init_curvature("lowrank", D, C)
  state = laplace.init_curvature("kron", D, C)
  state = dict(state, count=jnp.ones(()), inputs=jnp.eye(D), outputs=jnp.eye(C))
  curvature = laplace.finish_curvature(state, "kron")
  with pytest.raises(ValueError, match="kron prior precision is a scalar"):
    laplace.log_det_posterior_precision(curvature, "kron", jnp.ones(C * (D + 1)))
  with pytest.raises(ValueError, match="scalar or"):
    laplace.posterior_precision({"ggn": jnp.ones(5)}, "diag", jnp.ones(4))


# --- The method on a trained workdir: ``--mode=fit --config.method=laplace``, then every
# evaluator with ``--config.method=laplace``.

def _fit(workdir, *overrides):
  """``python -m smoothing_jax.main --workdir=<workdir> --mode=fit --config.method=laplace
  [--config.laplace.<key>=<value> ...]``, through ``main``; returns the config."""
  from smoothing_jax import main
  config = main.resolve_config("fit", workdir, None, [("method", "laplace"), *overrides])
  main.run(config, workdir, "fit")
  return config


@pytest.fixture(scope="module")
def laplace_workdir(small_npz_run, tmp_path_factory):
  """A copy of the small npz run (deterministic, 32 training images) with its KFAC Laplace fit
  (prior precision by marginal likelihood) and a diagonal one of prior precision 2."""
  import shutil
  _, workdir, _ = small_npz_run
  copy = str(tmp_path_factory.mktemp("laplace") / "run")
  shutil.copytree(workdir, copy)
  kron = _fit(copy)
  diag = _fit(copy, ("laplace.structure", "diag"), ("laplace.prior_precision", "2.0"))
  return copy, kron, diag


def test_the_fit_sums_the_ggn_over_the_training_split_alone(laplace_workdir):
  """The stored diagonal posterior: δ + Σ_n p_nc (1 − p_nc) φ̃_ni² over the 32 training images
  (their features φ and logits from one evaluation pass, φ̃ = [φ, 1]), in numpy, in torch's order
  (class-major kernel, then the bias); the mean is the trained last layer."""
  from smoothing_jax.experiment import fits
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.passes import pass_outputs
  workdir, _, diag = laplace_workdir
  run = Run.from_workdir(workdir, diag)
  assert run.method.fit_name == "laplace_diag_prior2"
  posterior = fits.load_fit(workdir, "laplace_diag_prior2", run.step, run.mesh)["laplace"]
  images = run.normalize(run.pipeline.train_images)
  outputs = jax.device_get(pass_outputs(run.model, run.variables, images))
  phi = np.concatenate([outputs["features"], np.ones((len(images), 1))], axis=1).astype(np.float64)
  probs = np.asarray(jax.nn.softmax(outputs["logits"].astype(np.float64)))
  assert len(images) == 32
  ggn = np.einsum("nc,ni->ci", probs * (1 - probs), phi ** 2)  # [C, D + 1]
  expected = 2.0 + np.concatenate([ggn[:, :-1].ravel(), ggn[:, -1]])
  np.testing.assert_allclose(posterior["precision"], expected, rtol=1e-4)
  kernel, bias = laplace.last_layer(run.model, run.variables["params"])
  np.testing.assert_array_equal(posterior["mean"], laplace.flatten_last_layer(kernel, bias))


def test_predict_and_the_evaluators_score_the_probit_predictive(laplace_workdir, tmp_path):
  from tests.methods.paths import assert_paths_agree, three_paths
  workdir, kron, _ = laplace_workdir
  paths = three_paths(workdir, tmp_path, overrides=kron)
  paths.pop("training")  # the training's evaluation scores the network before the fit
  assert_paths_agree(paths)


def test_evaluating_without_the_fit_says_how_to_make_it(laplace_workdir, tmp_path):
  from smoothing_jax.evaluators import ensemble_sizes
  from smoothing_jax.experiment.run import Run
  workdir, _, diag = laplace_workdir
  from tests.helpers import override
  config = override(diag.copy_and_resolve_references(), **{"laplace.structure": "full"})
  with pytest.raises(FileNotFoundError, match=r"holds no laplace_full_prior2 fit of step 4 .*: "
                     r"run `python -m smoothing_jax.main --workdir=.* --mode=fit` with the same "
                     r"--config.method and settings first\."):
    ensemble_sizes.evaluate(Run.from_workdir(workdir, config), tmp_path, sizes=(1,))


def test_a_fit_killed_midway_leaves_nothing_and_the_rerun_fits_the_same(laplace_workdir,
                                                                          tmp_path, monkeypatch):
  """The fit stopped while it is being stored (as a kill would: no result, no partial step), then
  rerun: the stored posterior equals the one fitted without interruption, bit for bit."""
  import shutil

  from smoothing_jax.experiment import fits
  from smoothing_jax.experiment.run import Run
  workdir, kron, _ = laplace_workdir
  copy = str(tmp_path / "run")
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("fits"))
  original = fits.save_fit

  def killed(*args):
    raise KeyboardInterrupt
  monkeypatch.setattr(fits, "save_fit", killed)
  with pytest.raises(KeyboardInterrupt):
    _fit(copy)
  run = Run.from_workdir(copy, kron)
  assert not fits.has_fit(copy, run.method.fit_name, run.step)
  monkeypatch.setattr(fits, "save_fit", original)
  _fit(copy)
  again = fits.load_fit(copy, run.method.fit_name, run.step, run.mesh)
  first = fits.load_fit(workdir, run.method.fit_name, run.step, run.mesh)
  jax.tree.map(np.testing.assert_array_equal, again, first)
