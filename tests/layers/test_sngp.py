"""SNGP's layers equal edward2's JAX layers (ee02560) on their recorded outputs
(``tests/fixtures/sngp_edward2.npz``, made by ``experiments/record_sngp_parity.py``): the
normalised kernel, the singular vectors and the output after each power iteration and at
evaluation, for a dense and a conv layer; the GP's logits, its precision after an epoch of
batches, the predictive variance and covariance; and the mean-field logits."""
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.layers.sngp import (
  RandomFeatureGP,
  SpectralNormConv,
  SpectralNormDense,
  mean_field_logits,
  predictive_covariance,
)

FIXTURE = np.load(pathlib.Path(__file__).parents[1] / "fixtures" / "sngp_edward2.npz")
TOL = dict(rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("prefix, layer", [
    ("sn_dense_c6_", SpectralNormDense(8, bound=6.0)),
    ("sn_dense_c095_", SpectralNormDense(8, bound=0.95)),
    ("sn_conv_", SpectralNormConv(6, 3, padding=1, bound=6.0, use_bias=True)),
])
def test_spectral_normalisation_equals_edward2(prefix, layer):
  f = {k[len(prefix):]: FIXTURE[k] for k in FIXTURE if k.startswith(prefix)}
  variables = {"params": {"kernel": f["kernel"], "bias": f["bias"]},
               "batch_stats": {"sn_u": f["u0"], "sn_v": f["v0"]}}
  for step in range(3):  # one power iteration per training pass, from the stored u and v
    out, state = layer.apply(variables, f["x"], mutable=["batch_stats", "spectral_norm"])
    variables = {**variables, "batch_stats": state["batch_stats"]}
    np.testing.assert_allclose(state["spectral_norm"]["kernel"][0], f["train_w_hat"][step], **TOL)
    np.testing.assert_allclose(state["batch_stats"]["sn_u"], f["train_u"][step], **TOL)
    np.testing.assert_allclose(state["batch_stats"]["sn_v"], f["train_v"][step], **TOL)
    np.testing.assert_allclose(out, f["train_out"][step], **TOL)
  out, state = layer.apply(variables, f["x"], mutable=["spectral_norm"])  # evaluation: no update
  np.testing.assert_allclose(state["spectral_norm"]["kernel"][0], f["eval_w_hat"], **TOL)
  np.testing.assert_allclose(out, f["eval_out"], **TOL)


def test_the_gp_layer_equals_edward2():
  f = {k[3:]: FIXTURE[k] for k in FIXTURE if k.startswith("gp_") and not k.startswith("gp_m999")}
  layer = RandomFeatureGP(3, hidden_features=32, ridge=1.0)
  variables = {"params": {"output": {"kernel": f["out_kernel"], "bias": f["out_bias"]}},
               "batch_stats": {"rff_kernel": f["rff_kernel"], "rff_bias": f["rff_bias"],
                               "precision": f["init_precision"]}}
  for b, x in enumerate(f["train_x"]):  # an epoch of batches: P = s I + Σ φφᵀ
    logits, state = layer.apply(variables, x, mutable=["batch_stats"])
    variables = {**variables, "batch_stats": state["batch_stats"]}
    np.testing.assert_allclose(logits, f["train_logits"][b], **TOL)
    np.testing.assert_allclose(state["batch_stats"]["precision"], f["train_precision"][b],
                               rtol=2e-5, atol=2e-5)
  logits, state = layer.apply(variables, f["test_x"], mutable=["intermediates"])
  np.testing.assert_allclose(logits, f["test_logits"], **TOL)
  np.testing.assert_allclose(state["intermediates"]["gp_variance"][0], f["test_var"],
                             rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(
      predictive_covariance(jnp.asarray(f["test_features"]), variables["batch_stats"]["precision"],
                            1.0), f["test_cov"], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("key, factor", [("mf_logits_f25", 25.0),
                                         ("mf_logits_fpi8", 3.14159265 / 8),
                                         ("mf_logits_fneg1", -1.0)])
def test_mean_field_logits_equal_edward2(key, factor):
  np.testing.assert_allclose(
      mean_field_logits(FIXTURE["gp_test_logits"], FIXTURE["gp_test_var"], factor), FIXTURE[key],
      **TOL)
