"""Record a parity fixture for SNGP layers from google/edward2's JAX code
(``tests/fixtures/sngp_edward2.{npz,json}``).

Not part of the library and not run by its tests. The reference is edward2 at commit
``ee025600cb3cf288230f34929d8a7110e719686b``; only four of its files are used, loaded as
modules directly (stub packages ``edward2``, ``edward2.jax``, ``edward2.jax.nn`` whose
``__path__`` points at the exported sources), so neither ``edward2/__init__.py`` nor TensorFlow
is imported:

* ``edward2/jax/nn/normalization.py``: ``SpectralNormalization``, ``SpectralNormalizationConv2D``
* ``edward2/jax/nn/random_feature.py``: ``RandomFeatureGaussianProcess`` (imports ``dense.py``)
* ``edward2/jax/nn/dense.py``: imported by ``random_feature.py`` (imports cleanly, unused here)
* ``edward2/jax/nn/utils.py``: ``mean_field_logits``

The files are used unmodified (no patches were needed with jax 0.10.2 / flax 0.12.8); their git
blob hashes are checked against the ones at that commit before anything runs. Exact command,
from the repo root, with the sources exported from a clone of google/edward2::

  mkdir -p /tmp/ed2
  git -C EDWARD2_CLONE archive ee025600cb3cf288230f34929d8a7110e719686b edward2/jax \\
    | tar -x -C /tmp/ed2
  .venv/bin/python experiments/record_sngp_parity.py  # --ed2 DIR; DIR defaults to /tmp/ed2

What is recorded (every array float32; the JSON side file lists each key with its shape and
meaning, the commit, the command and the jax/flax versions):

1. ``SpectralNormalization(nn.Dense(8), iteration=1, norm_multiplier=c)`` for c = 6.0 (prefix
   ``sn_dense_c6_``) and c = 0.95 (``sn_dense_c095_``), the Dense kernel initialised as 10 x
   lecun_normal so its spectral norm (14.7; the power-iteration estimates are
   12.9, 13.8, 14.0) is far above both bounds, bias ~ N(0, 0.1²).
   Initial params and spectral_stats u, v; then three ``training=True`` applies in sequence
   (``mutable=["spectral_stats", "intermediates"]``, state carried), each recording the sown
   normalised kernel ``w_hat``, u, v and the output; then one ``training=False`` apply.
2. The same for ``SpectralNormalizationConv2D(nn.Conv(6, (3, 3), padding="SAME"), iteration=1,
   norm_multiplier=6.0)`` on x [2, 8, 8, 3] (prefix ``sn_conv_``; u [8, 8, 6], v [8, 8, 3]).
3. ``RandomFeatureGaussianProcess(features=3, hidden_features=32, normalize_input=True,
   covmat_kwargs=dict(ridge_penalty=1.0, momentum=None))`` (prefix ``gp_``): random features,
   output layer, initial precision, five training batches (``mutable=["laplace_covariance"]``)
   and the precision after each, then eval logits / variances / full covariance / random
   features on x_test [6, 16]; and a ``momentum=0.999`` variant (prefix ``gp_m999_``).
4. ``mean_field_logits(gp_test_logits, gp_test_var, mean_field_factor=f)`` for f in
   (25.0, 3.14159265 / 8, -1) (prefix ``mf_``).

Every recorded quantity is also recomputed here from the written formulas in numpy (float64) and
must agree to float32 tolerance, which checks the semantics listed in the JSON file. Inputs come
from ``np.random.default_rng(0)``; parameter inits from fixed ``jax.random.PRNGKey`` seeds on CPU
(``JAX_PLATFORMS=cpu``). The npz is written with fixed zip timestamps, so two runs give
byte-identical files.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import io
import json
import os
import sys
import types
import zipfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import flax  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

COMMIT = "ee025600cb3cf288230f34929d8a7110e719686b"
COMMAND = ".venv/bin/python experiments/record_sngp_parity.py"  # repo root; --ed2 /tmp/ed2
# `git ls-tree <COMMIT> edward2/jax/nn/` blob hashes of the files loaded.
BLOBS = {
  "dense.py": "6d4f7c84b6864b6ff6b1e59bd83402e19105f01b",
  "normalization.py": "767ffeba55d4f9ef40346810024e8ad303611618",
  "random_feature.py": "09aa7709e54c32d23b9a053fcf9987768fa02089",
  "utils.py": "ab0e9cbe1f9471b361faedd89ca5b69785759675",
}
PATCHES: list[str] = []  # none needed with the jax/flax versions recorded in the JSON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_NPZ = os.path.join(ROOT, "tests", "fixtures", "sngp_edward2.npz")
OUT_JSON = os.path.join(ROOT, "tests", "fixtures", "sngp_edward2.json")

N_STEPS = 3  # training applies of the spectral-norm layers
N_BATCHES = 5  # GP "epoch"
MF_FACTORS = (("f25", 25.0), ("fpi8", 3.14159265 / 8), ("fneg1", -1.0))


# ----------------------------------------------------------------------------- loading
def git_blob_sha1(path):
  with open(path, "rb") as f:
    data = f.read()
  return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def load_edward2(src):
  """Imports edward2.jax.nn.{normalization,random_feature,utils} without edward2/__init__.py."""
  nn_dir = os.path.join(src, "edward2", "jax", "nn")
  for name, want in BLOBS.items():
    got = git_blob_sha1(os.path.join(nn_dir, name))
    if got != want:
      sys.exit(f"{nn_dir}/{name}: blob {got}, expected {want} (edward2 {COMMIT})")
  for name, sub in (("edward2", ""), ("edward2.jax", "jax"), ("edward2.jax.nn", "jax/nn")):
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(src, "edward2", sub)]
    sys.modules[name] = mod
  mods = {}
  for name in ("dense", "normalization", "random_feature", "utils"):
    mods[name] = importlib.import_module(f"edward2.jax.nn.{name}")
  return mods


# ----------------------------------------------------------------------------- helpers
def f32(x):
  return np.asarray(x, dtype=np.float32)


def scaled(init, factor):
  def f(key, shape, dtype=jnp.float32):
    return factor * init(key, shape, dtype)

  return f


def close(name, got, want, rtol=2e-5, atol=2e-5):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  if got.shape != want.shape or not np.allclose(got, want, rtol=rtol, atol=atol):
    err = np.max(np.abs(got - want)) if got.shape == want.shape else "shape"
    raise AssertionError(f"semantics check {name}: max abs err {err}")


class Recorder:
  def __init__(self):
    self.arrays, self.desc = {}, {}

  def add(self, key, value, desc):
    assert key not in self.arrays, key
    self.arrays[key] = f32(value)
    self.desc[key] = desc


def dense_op(kernel, v):
  return v @ kernel.reshape(-1, kernel.shape[-1])


def dense_op_t(kernel, u):
  return kernel.reshape(-1, kernel.shape[-1]) @ u


def conv_op(kernel, v):
  """The conv kernel_apply: stride 1, SAME padding, no bias, one unbatched [H, W, C] input."""
  k = jnp.asarray(kernel, jnp.float32)

  def f(x):
    return jax.lax.conv_general_dilated(
      x[None], k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=jax.lax.Precision.HIGHEST)[0]

  return f, jax.vjp(f, jnp.asarray(v, jnp.float32))


def l2n(x):
  return x / np.sqrt(max(np.square(x).sum(), 1e-12))


# ----------------------------------------------------------------------------- spectral norm
def record_spectral(rec, layer, x, prefix, layer_name, norm_multiplier, conv):
  variables = layer.init(jax.random.PRNGKey(0), x, training=True)
  assert set(variables) == {"params", "spectral_stats"}, set(variables)
  p = variables["params"][layer_name]
  kernel, bias = np.asarray(p["kernel"]), np.asarray(p["bias"])
  u, v = (np.asarray(variables["spectral_stats"][k]) for k in ("u", "v"))
  what = "Conv kernel [3, 3, 3, 6] (HWIO)" if conv else "Dense kernel [5, 8]"
  rec.add(prefix + "x", x, "input batch, used for every apply")
  rec.add(prefix + "kernel", kernel, f"initial params['{layer_name}']['kernel']: {what}")
  rec.add(prefix + "bias", bias, f"initial params['{layer_name}']['bias']")
  rec.add(prefix + "u0", u, "initial spectral_stats['u'] (N(0, 0.05²), not normalised)")
  rec.add(prefix + "v0", v, "initial spectral_stats['v'] (N(0, 0.05²), not normalised)")

  state = variables["spectral_stats"]
  seq = {"w_hat": [], "u": [], "v": [], "out": [], "divisor": []}
  for _ in range(N_STEPS):
    out, mut = layer.apply({"params": variables["params"], "spectral_stats": state}, x,
                           training=True, mutable=["spectral_stats", "intermediates"])
    (w_hat,) = mut["intermediates"]["w"]
    state = mut["spectral_stats"]
    w_hat = np.asarray(w_hat)
    u_new, v_new = np.asarray(state["u"]), np.asarray(state["v"])
    # Semantics check (float64 numpy / jax HIGHEST): v first, then u, sigma = <u, K v>.
    k64 = kernel.astype(np.float64)
    if conv:
      op, (_, op_t) = conv_op(kernel, v)
      v_ref = l2n(np.asarray(op_t(jnp.asarray(u, jnp.float32))[0], np.float64))
      ku = np.asarray(op(jnp.asarray(v_ref, jnp.float32)), np.float64)
    else:
      v_ref = l2n(dense_op_t(k64, u.astype(np.float64)))
      ku = dense_op(k64, v_ref)
    u_ref = l2n(ku)
    sigma = float(np.vdot(u_ref, ku))
    div = max(sigma / norm_multiplier, 1.0)
    close(prefix + "v", v_new, v_ref, rtol=1e-4, atol=1e-5)
    close(prefix + "u", u_new, u_ref, rtol=1e-4, atol=1e-5)
    close(prefix + "w_hat", w_hat, k64 / div, rtol=1e-4, atol=1e-5)
    assert div > 1.0, f"{prefix}: bound not active (sigma {sigma})"
    if not conv:
      close(prefix + "out", out, np.asarray(x, np.float64) @ (k64 / div) + bias, 1e-4, 1e-4)
    u, v = u_new, v_new
    for key, val in (("w_hat", w_hat), ("u", u), ("v", v), ("out", out)):
      seq[key].append(np.asarray(val))
    seq["divisor"].append(np.sum(k64 * w_hat) / np.sum(np.square(w_hat.astype(np.float64))))

  rec.add(prefix + "train_w_hat", np.stack(seq["w_hat"]),
          f"[{N_STEPS}, *kernel] sown intermediates['w'] of training apply t=1..{N_STEPS}")
  rec.add(prefix + "train_u", np.stack(seq["u"]), "spectral_stats['u'] after training apply t")
  rec.add(prefix + "train_v", np.stack(seq["v"]), "spectral_stats['v'] after training apply t")
  rec.add(prefix + "train_out", np.stack(seq["out"]), "layer output of training apply t")
  rec.add(prefix + "train_divisor", np.array(seq["divisor"]),
          "derived here: kernel / w_hat = max(sigma_t / norm_multiplier, 1) for apply t")

  out, mut = layer.apply({"params": variables["params"], "spectral_stats": state}, x,
                         training=False, mutable=["intermediates"])
  (w_hat,) = mut["intermediates"]["w"]
  # Eval: no update, sigma = <u_stored, K v_stored>.
  if conv:
    ku = np.asarray(conv_op(kernel, v)[0](jnp.asarray(v, jnp.float32)), np.float64)
  else:
    ku = dense_op(kernel.astype(np.float64), v.astype(np.float64))
  div = max(float(np.vdot(u, ku)) / norm_multiplier, 1.0)
  close(prefix + "eval_w_hat", w_hat, kernel.astype(np.float64) / div, rtol=1e-4, atol=1e-5)
  rec.add(prefix + "eval_out", out, f"output of the training=False apply after {N_STEPS} steps")
  rec.add(prefix + "eval_w_hat", w_hat, "sown w_hat of that eval apply (state not updated)")


# ----------------------------------------------------------------------------- GP
def gp_reference_features(x, kernel, bias):
  x = np.asarray(x, np.float64)
  mu = x.mean(-1, keepdims=True)
  var = np.maximum((x * x).mean(-1, keepdims=True) - mu * mu, 0.0)
  xn = (x - mu) / np.sqrt(var + 1e-6)
  return np.cos(xn @ kernel.astype(np.float64) + bias.astype(np.float64))


def run_gp(rf, x0, batches, x_test, momentum):
  gp = rf.RandomFeatureGaussianProcess(
    features=3, hidden_features=32, normalize_input=True,
    covmat_kwargs=dict(ridge_penalty=1.0, momentum=momentum))
  variables = gp.init(jax.random.PRNGKey(1), x0)
  init_prec = variables["laplace_covariance"]["covmat_layer"]["precision_matrix"]
  state = variables["laplace_covariance"]
  train_logits, precs = [], []
  for xb in batches:
    (logits, cov), mut = gp.apply({**variables, "laplace_covariance": state}, xb,
                                  mutable=["laplace_covariance"])
    assert cov is None
    state = mut["laplace_covariance"]
    train_logits.append(np.asarray(logits))
    precs.append(np.asarray(state["covmat_layer"]["precision_matrix"]))
  trained = {**variables, "laplace_covariance": state}
  logits, var = gp.apply(trained, x_test)
  logits_f, cov_full = gp.apply(trained, x_test, return_full_covmat=True)
  logits_r, var_r, feats = gp.apply(trained, x_test, return_random_features=True)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_f))
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits_r))
  np.testing.assert_array_equal(np.asarray(var), np.asarray(var_r))
  return dict(variables=variables, init_prec=np.asarray(init_prec), train_logits=train_logits,
              precs=precs, logits=np.asarray(logits), var=np.asarray(var),
              cov_full=np.asarray(cov_full), feats=np.asarray(feats))


def record_gp(rec, rf, rng):
  x0 = rng.standard_normal((4, 16)).astype(np.float32)
  batches = rng.standard_normal((N_BATCHES, 4, 16)).astype(np.float32)
  x_test = (1.5 * rng.standard_normal((6, 16))).astype(np.float32)
  r = run_gp(rf, x0, batches, x_test, momentum=None)
  rfv = r["variables"]["random_features"]["hidden_layer"]
  kernel, bias = np.asarray(rfv["kernel"]), np.asarray(rfv["bias"])
  out = r["variables"]["params"]["output_layer"]
  ok, ob = np.asarray(out["kernel"]), np.asarray(out["bias"])

  # Semantics checks (float64 numpy).
  eye = np.eye(32)
  close("gp_init_prec", r["init_prec"], eye, 0, 0)
  prec = eye.copy()
  for b, xb in enumerate(batches):
    phi = gp_reference_features(xb, kernel, bias)
    close(f"gp_train_logits{b}", r["train_logits"][b], phi @ ok + ob, 1e-4, 1e-4)
    prec = prec + phi.T @ phi
    close(f"gp_prec{b}", r["precs"][b], prec, 1e-4, 1e-4)
  phi_t = gp_reference_features(x_test, kernel, bias)
  close("gp_test_feats", r["feats"], phi_t, 1e-4, 1e-5)
  close("gp_test_logits", r["logits"], phi_t @ ok + ob, 1e-4, 1e-4)
  cov = 1.0 * phi_t @ np.linalg.solve(prec, phi_t.T)
  close("gp_test_cov_full", r["cov_full"], cov, 1e-3, 1e-5)
  close("gp_test_var", r["var"], np.diag(cov), 1e-3, 1e-5)

  rec.add("gp_x0", x0, "init input [4, 16] (gp.init(PRNGKey(1), gp_x0))")
  rec.add("gp_rff_kernel", kernel,
          "random_features/hidden_layer/kernel [16, 32] (PRNGKey(seed=0) split, 1st key; "
          "variance_scaling(2, fan_in, normal))")
  rec.add("gp_rff_bias", bias,
          "random_features/hidden_layer/bias [32] (2nd key; uniform [0, 2*pi))")
  rec.add("gp_out_kernel", ok, "params/output_layer/kernel [32, 3]")
  rec.add("gp_out_bias", ob, "params/output_layer/bias [3]")
  rec.add("gp_init_precision", r["init_prec"],
          "laplace_covariance/covmat_layer/precision_matrix after init = ridge_penalty * I")
  rec.add("gp_train_x", batches, f"[{N_BATCHES}, 4, 16] training batches, applied in order")
  rec.add("gp_train_logits", np.stack(r["train_logits"]),
          "logits returned by each training apply (covmat is None there)")
  rec.add("gp_train_precision", np.stack(r["precs"]),
          "precision matrix after each batch (momentum=None: P += Phi^T Phi)")
  rec.add("gp_precision", r["precs"][-1], f"precision matrix after the {N_BATCHES} batches")
  rec.add("gp_test_x", x_test, "eval input [6, 16]")
  rec.add("gp_test_logits", r["logits"], "eval GP logits [6, 3]")
  rec.add("gp_test_var", r["var"], "eval predictive variance (diagonal covmat) [6]")
  rec.add("gp_test_cov", r["cov_full"], "eval full covariance [6, 6] (return_full_covmat=True)")
  rec.add("gp_test_features", r["feats"],
          "random features of gp_test_x [6, 32] (return_random_features=True)")

  m = run_gp(rf, x0, batches, x_test, momentum=0.999)
  mrf = m["variables"]["random_features"]["hidden_layer"]
  np.testing.assert_array_equal(np.asarray(mrf["kernel"]), kernel)
  np.testing.assert_array_equal(np.asarray(mrf["bias"]), bias)
  np.testing.assert_array_equal(np.asarray(m["variables"]["params"]["output_layer"]["kernel"]),
                                ok)
  prec = eye.copy()
  for xb in batches:
    phi = gp_reference_features(xb, kernel, bias)
    prec = 0.999 * prec + (1 - 0.999) * phi.T @ phi / xb.shape[0]
  close("gp_m999_precision", m["precs"][-1], prec, 1e-4, 1e-6)
  cov = phi_t @ np.linalg.solve(prec, phi_t.T)
  close("gp_m999_test_var", m["var"], np.diag(cov), 1e-3, 1e-5)
  rec.add("gp_m999_train_precision", np.stack(m["precs"]),
          "momentum=0.999 variant (same random features/output layer): precision after each "
          "batch, P = 0.999 P + 0.001 Phi^T Phi / batch_size")
  rec.add("gp_m999_precision", m["precs"][-1], "momentum=0.999 precision after the 5 batches")
  rec.add("gp_m999_test_var", m["var"], "momentum=0.999 eval predictive variance [6]")
  rec.add("gp_m999_test_cov", m["cov_full"], "momentum=0.999 eval full covariance [6, 6]")
  return r["logits"], r["var"]


def record_mean_field(rec, utils, logits, var):
  for tag, f in MF_FACTORS:
    got = np.asarray(utils.mean_field_logits(jnp.asarray(logits), jnp.asarray(var),
                                             mean_field_factor=f))
    want = logits if f < 0 else logits / np.sqrt(1.0 + var.astype(np.float64) * f)[:, None]
    close(f"mf_{tag}", got, want, 1e-5, 1e-6)
    rec.add(f"mf_logits_{tag}", got,
            f"mean_field_logits(gp_test_logits, gp_test_var, mean_field_factor={f!r})")


# ----------------------------------------------------------------------------- output
def write_npz(path, arrays):
  """np.savez layout with a fixed zip timestamp, so the bytes depend only on the arrays."""
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
    for key in sorted(arrays):
      info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      arr_buf = io.BytesIO()
      np.lib.format.write_array(arr_buf, np.ascontiguousarray(arrays[key]), allow_pickle=False)
      zf.writestr(info, arr_buf.getvalue())
  with open(path, "wb") as f:
    f.write(buf.getvalue())


SEMANTICS = [
  "SpectralNormalization (training, not initialising): per iteration v = l2n(K^T u), then "
  "u = l2n(K v) (v first), l2n(x) = x * rsqrt(max(sum(x^2), 1e-12)); sigma = <u, K v> with the "
  "new u, v; w_hat = kernel / max(sigma / norm_multiplier, 1); u, v stored.",
  "SpectralNormalization (training=False): no update; sigma = <u_stored, K v_stored>.",
  "At init u, v ~ N(0, 0.05^2) unnormalised; no power iteration while initialising.",
  "Dense: K v = v @ kernel.reshape(-1, out); u [out], v [prod(kernel.shape[:-1])].",
  "Conv2D: K = the wrapped nn.Conv cloned with padding='SAME', feature_group_count=1, "
  "use_bias=False (other attributes, e.g. strides, kept) on one unbatched [H, W, C_in] input; "
  "v [H, W, C_in] (input spatial shape), u [H_out, W_out, C_out]; K^T via jax.vjp.",
  "The layer output is the wrapped layer applied with kernel replaced by w_hat (bias unchanged).",
  "GP: LayerNorm(use_bias=False, use_scale=False, epsilon=1e-6, flax defaults otherwise); "
  "Phi = 1.0 * cos(x_norm @ W + b) (feature_scale default 1.0, not sqrt(2/D)); W ~ "
  "N(0, 2/d_in), b ~ U[0, 2 pi), from PRNGKey(0) split into (kernel, bias) keys; "
  "logits = Dense(Phi).",
  "Precision: init ridge * I; momentum None: P += Phi^T Phi; momentum m: "
  "P = m P + (1 - m) Phi^T Phi / batch_size; updated only when laplace_covariance is mutable "
  "(and not initialising); covariance only computed when it is not mutable.",
  "Covariance = ridge * Phi L^-T L^-1 Phi^T = ridge * Phi P^-1 Phi^T (P = L L^T Cholesky); "
  "variance = its diagonal.",
  "mean_field_logits: f < 0 -> logits unchanged; else logits / sqrt(1 + f * var)[:, None].",
]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--ed2", default="/tmp/ed2",
                      help="directory holding the exported edward2/jax tree")
  args = parser.parse_args()
  mods = load_edward2(args.ed2)
  norm, rf, utils = mods["normalization"], mods["random_feature"], mods["utils"]

  rng = np.random.default_rng(0)
  rec = Recorder()
  kinit = scaled(nn.initializers.lecun_normal(), 10.0)
  binit = nn.initializers.normal(0.1)
  x_dense = rng.standard_normal((4, 5)).astype(np.float32)
  for prefix, c in (("sn_dense_c6_", 6.0), ("sn_dense_c095_", 0.95)):
    layer = norm.SpectralNormalization(nn.Dense(8, kernel_init=kinit, bias_init=binit),
                                       iteration=1, norm_multiplier=c)
    record_spectral(rec, layer, x_dense, prefix, "Dense", c, conv=False)
  x_conv = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
  layer = norm.SpectralNormalizationConv2D(
    nn.Conv(6, (3, 3), padding="SAME", kernel_init=kinit, bias_init=binit),
    iteration=1, norm_multiplier=6.0)
  record_spectral(rec, layer, x_conv, "sn_conv_", "Conv", 6.0, conv=True)
  logits, var = record_gp(rec, rf, rng)
  record_mean_field(rec, utils, logits, var)

  os.makedirs(os.path.dirname(OUT_NPZ), exist_ok=True)
  write_npz(OUT_NPZ, rec.arrays)
  side = {
    "source": "google/edward2",
    "commit": COMMIT,
    "files": {f"edward2/jax/nn/{k}": v for k, v in BLOBS.items()},
    "patches": PATCHES,
    "command": COMMAND,
    "ed2_dir": args.ed2,
    "script": "experiments/record_sngp_parity.py",
    "versions": {"jax": jax.__version__, "jaxlib": importlib.metadata.version("jaxlib"),
                 "flax": flax.__version__, "numpy": np.__version__,
                 "python": sys.version.split()[0], "backend": jax.default_backend()},
    "inputs": "np.random.default_rng(0): x_dense [4, 5], x_conv [2, 8, 8, 3], gp_x0 [4, 16], "
              "gp_train_x [5, 4, 16], gp_test_x = 1.5 * N(0, 1) [6, 16], all float32",
    "layers": {
      "sn_dense_c6_": "SpectralNormalization(nn.Dense(8, kernel_init=10*lecun_normal(), "
                      "bias_init=normal(0.1)), iteration=1, norm_multiplier=6.0); "
                      "init(PRNGKey(0), x, training=True)",
      "sn_dense_c095_": "same with norm_multiplier=0.95",
      "sn_conv_": "SpectralNormalizationConv2D(nn.Conv(6, (3, 3), padding='SAME', "
                  "kernel_init=10*lecun_normal(), bias_init=normal(0.1)), iteration=1, "
                  "norm_multiplier=6.0); init(PRNGKey(0), x, training=True)",
      "gp_": "RandomFeatureGaussianProcess(features=3, hidden_features=32, normalize_input=True, "
             "covmat_kwargs=dict(ridge_penalty=1.0, momentum=None)); init(PRNGKey(1), gp_x0)",
      "gp_m999_": "same with momentum=0.999, same init key",
    },
    "semantics": SEMANTICS,
    "keys": {k: {"shape": list(v.shape), "desc": rec.desc[k]} for k, v in rec.arrays.items()},
  }
  with open(OUT_JSON, "w") as f:
    json.dump(side, f, indent=1, ensure_ascii=False)
    f.write("\n")
  size = os.path.getsize(OUT_NPZ)
  print(f"wrote {OUT_NPZ} ({len(rec.arrays)} arrays, {size} bytes) and {OUT_JSON}")


if __name__ == "__main__":
  main()
