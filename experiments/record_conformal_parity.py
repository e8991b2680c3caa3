"""Record a parity fixture for split-conformal classification sets from MAPIE 1.6.0 and
TorchUncertainty 0.13.0 (``tests/fixtures/conformal_parity.{npz,json}``).

Not part of the library and not run by its tests: it needs both peer libraries, which the repo
does not depend on. Run it in a scratch environment outside the repo, e.g.::

  python3.11 -m venv --system-site-packages /tmp/confenv
  /tmp/confenv/bin/pip install mapie==1.6.0 tqdm torch  # torch CPU wheel
  /tmp/confenv/bin/pip install --no-deps torch-uncertainty==0.13.0
  /tmp/confenv/bin/python experiments/record_conformal_parity.py

Inputs (numpy ``default_rng(0)``, in this order): calibration probabilities ``[500, 10]`` and test
probabilities ``[200, 10]`` from Dirichlet(0.5·1), stored as float32; every computation (both
libraries, the checks) uses ``p = float64(stored) / float64(stored).sum(-1)``. Labels are drawn
from each row's own ``p`` (one ``rng.random`` per row, inverse CDF). Then ``cal_uniforms [500]``
and ``test_uniforms [200, 10]`` (float64).

Uniforms reach the libraries without touching their code:

* MAPIE draws with ``check_random_state(self.random_state).uniform(size=...)``
  (``conformity_scores/sets/aps.py:155-156`` calibration, ``size=n_cal``, every APS/RAPS fit;
  ``aps.py:296-298`` test, ``size=(n_test, 1)``, only ``include_last_label="randomized"``). We
  pass ``random_state=`` a ``np.random.RandomState`` subclass whose ``uniform`` returns scripted
  arrays (checked against the requested size): calibration ``cal_uniforms`` (zeros for the
  ``*_ucal0`` variants; ``cal_uniforms[kept]`` for the RAPS split), test ``test_uniforms[:, :1]``.
* TorchUncertainty draws with ``torch.rand`` (``conformal/aps.py:93,105``,
  ``conformal/raps.py:105,122``): we patch ``torch.rand`` (``unittest.mock.patch.object``) for the
  duration of ``fit`` and ``conformal``: size ``(500,)`` → ``cal_uniforms``; size ``(200, 10)`` →
  ``test_uniforms`` (``randomized``; the noise is indexed by *sorted rank position*, not class) or
  ``test_uniforms[:, :1]`` broadcast (``randomized_rowU``: one uniform per row, as MAPIE).

TorchUncertainty applies ``softmax`` to the model output (``abstract.py:80``, ``aps.py:81``):
the model is ``nn.Identity`` fed ``log p``, so it sees ``softmax(log p) = p`` (to 1 ulp; the JSON
records the largest difference). ``enable_ts=False`` everywhere (no temperature scaling; THR and
APS default to ``True``). The calibration "dataloader" is one batch of all 500 rows.

Every recorded q̂ and set is also recomputed here from the written formulas
(``experiments/conformal_semantics.md``) in plain numpy, and must agree exactly.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import os
import platform
import sys
import types
from unittest import mock

import numpy as np

N_CAL, N_TEST, K = 500, 200, 10
ALPHAS = (0.1, 0.05)
RAPS_CONFIGS = ((0.01, 2), (0.1, 1))  # (λ, k_reg); (0.1, 1) is TorchUncertainty's default
EPS = 1e-8  # mapie._machine_precision.EPSILON

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_NPZ = os.path.join(ROOT, "tests", "fixtures", "conformal_parity.npz")
OUT_JSON = os.path.join(ROOT, "tests", "fixtures", "conformal_parity.json")


# ----------------------------------------------------------------------------- inputs
def make_inputs():
  rng = np.random.default_rng(0)
  cal32 = rng.dirichlet(np.full(K, 0.5), size=N_CAL).astype(np.float32)
  test32 = rng.dirichlet(np.full(K, 0.5), size=N_TEST).astype(np.float32)

  def draw(p):
    u = rng.random(len(p))
    return np.minimum((np.cumsum(p, axis=1) < u[:, None]).sum(axis=1), K - 1).astype(np.int64)

  p_cal, p_test = normalise(cal32), normalise(test32)
  cal_labels, test_labels = draw(p_cal), draw(p_test)
  cal_u = rng.uniform(size=N_CAL)
  test_u = rng.uniform(size=(N_TEST, K))
  return cal32, test32, cal_labels, test_labels, cal_u, test_u


def normalise(p32):
  p = p32.astype(np.float64)
  return p / p.sum(axis=1, keepdims=True)


# ----------------------------------------------------------------------------- MAPIE
def run_all_mapie(p_cal, p_test, cal_labels, cal_u, test_u):
  from mapie.classification import SplitConformalClassifier
  from mapie.conformity_scores import APSConformityScore, LACConformityScore, RAPSConformityScore
  from mapie.utils import _compute_classification_quantile
  from sklearn.base import BaseEstimator, ClassifierMixin
  from sklearn.utils.validation import _num_samples

  table = np.concatenate([p_cal, p_test])
  x_cal = np.arange(N_CAL)[:, None]
  x_test = N_CAL + np.arange(N_TEST)[:, None]

  class LookupClassifier(ClassifierMixin, BaseEstimator):
    """A 'prefit' classifier whose feature is a row index into the probability table."""

    def __init__(self, table=None):
      self.table = table

    def fit(self, X=None, y=None):
      self.classes_ = np.arange(K)
      self.n_features_in_ = 1
      return self

    def predict_proba(self, X):
      return self.table[np.asarray(X)[:, 0].astype(int)]

    def predict(self, X):
      return np.argmax(self.predict_proba(X), axis=1)

  class ScriptedUniforms(np.random.RandomState):
    """RandomState whose ``uniform`` returns the scripted arrays in order."""

    def __init__(self, seed, script):
      super().__init__(seed)
      self.script = list(script)

    def uniform(self, low=0.0, high=1.0, size=None):
      if not self.script:
        raise AssertionError(f"unexpected uniform(size={size})")
      arr = self.script.pop(0)
      arr = np.array(arr() if callable(arr) else arr, dtype=np.float64)
      want = (size,) if isinstance(size, int) else tuple(size)
      assert arr.shape == want, (arr.shape, want)
      return arr

  class FixedRAPS(RAPSConformityScore):
    """MAPIE's RAPS with λ and k_reg fixed: no held-out split (split_data is the identity), no
    search; every score and set still comes from MAPIE's own methods."""

    def __init__(self, lambda_, k_reg):
      super().__init__(size_raps=None)
      self.fixed_lambda, self.fixed_k = float(lambda_), int(k_reg)

    def split_data(self, X, y, y_enc, sample_weight=None, groups=None):
      self.n_samples_ = _num_samples(y_enc)
      return X, y, y_enc, sample_weight, groups

    def get_conformity_scores(self, y, y_pred, y_enc=None, **kwargs):
      kwargs.pop("predict_params", None)
      return APSConformityScore.get_conformity_scores(self, y, y_pred, y_enc=y_enc, **kwargs)

    def get_conformity_score_quantiles(self, conformity_scores, alpha_np, cv, **kwargs):
      self.k_star = np.full(len(alpha_np), float(self.fixed_k))
      self.lambda_star = self.fixed_lambda
      reg = self._regularize_conformity_score(self.k_star, self.lambda_star, conformity_scores,
                                              self.cutoff)
      return _compute_classification_quantile(reg, alpha_np)

  class RecordingRAPS(RAPSConformityScore):
    """MAPIE's own RAPS (data-driven k*, λ*), recording which calibration rows it kept."""

    def split_data(self, X, y, y_enc, sample_weight=None, groups=None):
      out = super().split_data(X, y, y_enc, sample_weight, groups)
      self.kept_index = np.asarray(out[0])[:, 0].astype(int)
      self.heldout_index = np.asarray(self.X_raps)[:, 0].astype(int)
      return out

  def run(score, alpha, ilr, cal_uniforms):
    script = [cal_uniforms] if cal_uniforms is not None else []
    if ilr == "randomized":
      script.append(test_u[:, :1])
    rs = ScriptedUniforms(0, script)
    est = LookupClassifier(table).fit()
    scc = SplitConformalClassifier(estimator=est, confidence_level=round(1 - alpha, 10),
                                   conformity_score=score, prefit=True, random_state=rs)
    scc.conformalize(x_cal, cal_labels)
    _, sets = scc.predict_set(x_test, conformity_score_params={"include_last_label": ilr})
    assert not rs.script, "scripted uniforms not consumed"
    q = np.asarray(scc._mapie_classifier.quantiles_, dtype=np.float64).ravel()
    assert q.shape == (1,) and sets.shape == (N_TEST, K, 1)
    return float(q[0]), sets[:, :, 0].astype(bool), scc

  out, meta = {}, {}
  ilrs = {"true": True, "false": False, "randomized": "randomized"}
  for alpha in ALPHAS:
    a = f"alpha{alpha}"
    q, s, _ = run(LACConformityScore(), alpha, True, None)
    out[f"mapie/lac/default/{a}"] = (q, s)
    meta["mapie/lac/default"] = "LACConformityScore(); score 1-p_y; no uniforms"
    for name, ilr in ilrs.items():
      q, s, _ = run(APSConformityScore(), alpha, ilr, cal_u)
      out[f"mapie/aps/{name}/{a}"] = (q, s)
      meta[f"mapie/aps/{name}"] = (f"APSConformityScore(), include_last_label={ilr!r}; "
                                   "calibration u = cal_uniforms (MAPIE always randomises the "
                                   "calibration score)" + ("; test u = test_uniforms[:, 0]"
                                                           if ilr == "randomized" else ""))
      if ilr != "randomized":
        q, s, _ = run(APSConformityScore(), alpha, ilr, np.zeros(N_CAL))
        out[f"mapie/aps/{name}_ucal0/{a}"] = (q, s)
        meta[f"mapie/aps/{name}_ucal0"] = (f"APSConformityScore(), include_last_label={ilr!r}; "
                                           "calibration uniform patched to 0 (deterministic "
                                           "score, as TorchUncertainty randomized=False)")
    for lam, k in RAPS_CONFIGS:
      sc = f"raps_lam{lam}_k{k}"
      for name, ilr in ilrs.items():
        q, s, _ = run(FixedRAPS(lam, k), alpha, ilr, cal_u)
        out[f"mapie/{sc}/{name}/{a}"] = (q, s)
        meta[f"mapie/{sc}/{name}"] = (
            f"RAPSConformityScore subclass with lambda_star={lam}, k_star={k} fixed, no split; "
            f"include_last_label={ilr!r}; calibration u = cal_uniforms"
            + ("; test u = test_uniforms[:, 0]" if ilr == "randomized" else ""))
        if ilr != "randomized":
          q, s, _ = run(FixedRAPS(lam, k), alpha, ilr, np.zeros(N_CAL))
          out[f"mapie/{sc}/{name}_ucal0/{a}"] = (q, s)
          meta[f"mapie/{sc}/{name}_ucal0"] = (
              f"as mapie/{sc}/{name} with the calibration uniform patched to 0")
    for name, ilr in ilrs.items():
      score = RecordingRAPS()
      q, s, scc = run(score, alpha, ilr, lambda score=score: cal_u[score.kept_index])
      out[f"mapie/raps_auto/{name}/{a}"] = (q, s)
      out[f"mapie/raps_auto/{name}/{a}/k_star"] = float(np.ravel(score.k_star)[0])
      out[f"mapie/raps_auto/{name}/{a}/lambda_star"] = float(np.ravel(score.lambda_star)[0])
      out[f"mapie/raps_auto/{name}/{a}/kept_index"] = np.sort(score.kept_index).astype(np.int16)
      meta[f"mapie/raps_auto/{name}"] = (
          "MAPIE's own RAPSConformityScore() (size_raps ignored: the v1 API resets it to None, "
          "so StratifiedShuffleSplit(test_size=None) holds out 10% = 50 rows, random_state = "
          "the scripted RandomState(0)); k*, λ* chosen on the held-out rows (recorded), q̂ on "
          f"the 450 kept rows (kept_index); include_last_label={ilr!r}; calibration u = "
          "cal_uniforms[kept row]" + ("; test u = test_uniforms[:, 0]"
                                      if ilr == "randomized" else ""))
  return out, meta


# ----------------------------------------------------------------------------- TorchUncertainty
def import_tu():
  """The three conformal classes without running torch_uncertainty's package __init__s (which
  pull lightning, huggingface_hub, matplotlib...): stub packages with the real __path__."""
  spec = importlib.util.find_spec("torch_uncertainty")
  root = os.path.dirname(spec.origin)
  for sub in ("", "post_processing", "post_processing/calibration", "post_processing/conformal"):
    name = ".".join(["torch_uncertainty", *sub.split("/")]).rstrip(".")
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(root, sub)]
    sys.modules[name] = mod
  pp = sys.modules["torch_uncertainty.post_processing"]
  pp.PostProcessing = importlib.import_module(
      "torch_uncertainty.post_processing.abstract").PostProcessing
  pp.TemperatureScaler = importlib.import_module(
      "torch_uncertainty.post_processing.calibration.temperature_scaler").TemperatureScaler
  conf = "torch_uncertainty.post_processing.conformal."
  return (importlib.import_module(conf + "thr").ConformalClsTHR,
          importlib.import_module(conf + "aps").ConformalClsAPS,
          importlib.import_module(conf + "raps").ConformalClsRAPS)


def run_all_tu(p_cal, p_test, cal_labels, cal_u, test_u, mapie_q):
  import torch
  from torch import nn

  THR, APS, RAPS = import_tu()
  logp_cal = torch.from_numpy(np.log(p_cal))
  logp_test = torch.from_numpy(np.log(p_test))
  batches = [(logp_cal, torch.from_numpy(cal_labels))]  # = DataLoader(batch_size=500)
  softmax_err = max(float((logp_cal.softmax(-1) - torch.from_numpy(p_cal)).abs().max()),
                    float((logp_test.softmax(-1) - torch.from_numpy(p_test)).abs().max()))

  def fake_rand_for(test_noise):
    def fake_rand(*size, **kwargs):
      shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
      if shape == (N_CAL,):
        return torch.from_numpy(cal_u.copy())
      if shape == (N_TEST, K):
        return torch.from_numpy(np.ascontiguousarray(test_noise))
      raise AssertionError(f"unexpected torch.rand{shape}")
    return fake_rand

  noises = {"randomized": test_u, "randomized_rowU": np.repeat(test_u[:, :1], K, axis=1)}

  def run(obj, test_noise, q_override=None):
    with mock.patch.object(torch, "rand", fake_rand_for(test_noise)):
      obj.fit(batches)
      if q_override is not None:
        obj.q_hat = torch.tensor(q_override, dtype=torch.float64)
      probs = obj.conformal(logp_test)
    return float(obj.q_hat), (probs > 0).numpy()

  out, meta, swapped = {}, {}, {}
  for alpha in ALPHAS:
    a = f"alpha{alpha}"
    out[f"tu/thr/default/{a}"] = run(THR(alpha, model=nn.Identity(), enable_ts=False), None)
    meta["tu/thr/default"] = "ConformalClsTHR(enable_ts=False)"
    mref = f"mapie/lac/default/{a}"
    swapped[f"tu/thr/default/{a}"] = (mref, run(THR(alpha, model=nn.Identity(), enable_ts=False),
                                                None, mapie_q[mref])[1])
    variants = {"deterministic": (False, None), "randomized": (True, noises["randomized"]),
                "randomized_rowU": (True, noises["randomized_rowU"])}
    for name, (rnd, noise) in variants.items():
      mk = functools.partial(APS, alpha, model=nn.Identity(), randomized=rnd, enable_ts=False)
      out[f"tu/aps/{name}/{a}"] = run(mk(), noise)
      meta[f"tu/aps/{name}"] = (f"ConformalClsAPS(randomized={rnd}, enable_ts=False)" + (
          "; calibration noise cal_uniforms; test noise " + (
              "test_uniforms (by sorted rank position)" if name == "randomized"
              else "test_uniforms[:, 0] for every rank") if rnd else ""))
      mref = f"mapie/aps/{'randomized' if rnd else 'false_ucal0'}/{a}"
      swapped[f"tu/aps/{name}/{a}"] = (mref, run(mk(), noise, mapie_q[mref])[1])
      for lam, k in RAPS_CONFIGS:
        sc = f"raps_lam{lam}_k{k}"
        mk = functools.partial(RAPS, alpha, model=nn.Identity(), randomized=rnd, penalty=lam,
                               regularization_rank=k, enable_ts=False)
        out[f"tu/{sc}/{name}/{a}"] = run(mk(), noise)
        meta[f"tu/{sc}/{name}"] = (
            f"ConformalClsRAPS(randomized={rnd}, penalty={lam}, regularization_rank={k}, "
            "enable_ts=False)" + ("; noise as tu/aps/" + name if rnd else ""))
        mref = f"mapie/{sc}/{'randomized' if rnd else 'false_ucal0'}/{a}"
        swapped[f"tu/{sc}/{name}/{a}"] = (mref, run(mk(), noise, mapie_q[mref])[1])
  return out, meta, swapped, softmax_err


# ----------------------------------------------------------------------------- reference formulas
def ref_sorted(p):
  order = np.flip(np.argsort(p, axis=1), axis=1)
  ordered = np.take_along_axis(p, order, axis=1)
  rank = np.argsort(order, axis=1)  # 0-based rank of each class
  return order, ordered, np.cumsum(ordered, axis=1), rank


def tu_penalty(lam, m):
  """TorchUncertainty's λ·max(0, m): ``penalty * int64 tensor`` is float32 (the default dtype),
  then added to float64 mass (``raps.py:108-115``, ``126-129``)."""
  return np.maximum(np.float32(lam) * np.asarray(m, np.float32), np.float32(0)).astype(np.float64)


def ref_label_score(p, y, score, u, lam=0.0, k=1, f32_penalty=False):
  _, _, cums, rank = ref_sorted(p)
  r = np.take_along_axis(rank, y[:, None], axis=1)[:, 0]  # 0-based
  py = p[np.arange(len(y)), y]
  if score == "thr":
    return 1.0 - py
  s = cums[np.arange(len(y)), r] - u * py
  if score == "raps":
    s = s + (tu_penalty(lam, (r + 1) - k) if f32_penalty else np.maximum(lam * ((r + 1) - k), 0.0))
  return s


def ref_q_mapie(s, alpha):
  n = len(s)
  return np.sort(s)[math.ceil((n + 1) * (1 - alpha)) - 1]


def ref_sets_mapie(p, q, score, ilr, u_row=None, lam=0.0, k=1):
  if score == "thr":
    return (1.0 - p) - q <= EPS
  n = len(p)
  order, ordered, cums, rank = ref_sorted(p)
  pen = lam * np.maximum(0.0, np.arange(1, K + 1) - k) if score == "raps" else 0.0
  e = cums + pen  # penalised cumulative mass by sorted position
  if ilr in (True, "randomized"):
    j = np.argmax(e - q >= -EPS, axis=1)  # first position reaching q̂
  else:
    thr = np.maximum(q, e[:, 0])
    j = np.where(e - thr[:, None] <= EPS, np.arange(K), -1).max(axis=1)
  last = order[np.arange(n), j]
  p_last = p[np.arange(n), last]
  tiny = p_last <= EPS  # MAPIE: a last probability <= EPS becomes the row's smallest one >= EPS
  p_last[tiny] = np.where(p >= EPS, p, np.inf).min(axis=1)[tiny]
  sets = p - p_last[:, None] >= -EPS
  if ilr == "randomized":
    v_den = p_last.copy()
    if score == "raps":
      size = sets.sum(axis=1)
      v_den = p_last - lam * np.maximum(0, size - k) + lam * (size > k)
    v = (e[np.arange(n), j] - q) / v_den
    sets[np.arange(n), last] = v - u_row <= EPS
  return sets


def ref_sets_tu(p, q, score, noise=None, lam=0.0, k=1):
  n = len(p)
  if score == "thr":
    sets = p >= 1.0 - q
    sets[np.arange(n), np.argmax(p, axis=1)] = True
    return sets
  order, ordered, cums, rank = ref_sorted(p)
  noise = np.zeros_like(p) if noise is None else noise
  s_sorted = cums - ordered * noise
  if score == "raps":
    s_sorted = s_sorted + tu_penalty(lam, np.arange(1, K + 1) - k)
  s = np.take_along_axis(s_sorted, rank, axis=1)  # back to class order
  sets = s <= q
  empty = ~sets.any(axis=1)
  sets[np.arange(n)[empty], np.argmin(s, axis=1)[empty]] = True
  return sets


def check_references(results, p_cal, p_test, cal_labels, cal_u, test_u):
  """Recompute every recorded q̂ and set from the written formulas; returns #checks."""
  checks = 0
  for key, val in results.items():
    if not isinstance(val, tuple):
      continue
    lib, score, variant, a = key.split("/")
    alpha = float(a[len("alpha"):])
    lam, k = 0.0, 1
    if score.startswith("raps_lam"):
      lam, k = float(score.split("_")[1][3:]), int(score.split("_")[2][1:])
    base = "thr" if score in ("lac", "thr") else ("raps" if score.startswith("raps") else "aps")
    q, sets = val
    if lib == "mapie":
      if score == "raps_auto":
        lam = results[f"{key}/lambda_star"]
        k = results[f"{key}/k_star"]
        kept = results[f"{key}/kept_index"].astype(int)
        pc, yc, uc = p_cal[kept], cal_labels[kept], cal_u[kept]
      else:
        pc, yc, uc = p_cal, cal_labels, (np.zeros(N_CAL) if variant.endswith("ucal0") else cal_u)
      if base == "thr":
        uc = 0.0
      q_ref = ref_q_mapie(ref_label_score(pc, yc, base, uc, lam, k), alpha)
      ilr = {"true": True, "false": False, "randomized": "randomized",
             "default": True}[variant.replace("_ucal0", "")]
      sets_ref = ref_sets_mapie(p_test, q_ref, base, ilr, test_u[:, 0], lam, k)
    else:
      rnd = variant.startswith("randomized")
      uc = cal_u if rnd else np.zeros(N_CAL)
      s = ref_label_score(p_cal, cal_labels, base, 0.0 if base == "thr" else uc, lam, k, True)
      q_ref = float(np.quantile(s, 1 - alpha))  # linear interpolation = torch.quantile
      noise = None
      if rnd:
        noise = test_u if variant == "randomized" else np.repeat(test_u[:, :1], K, axis=1)
      sets_ref = ref_sets_tu(p_test, q_ref, base, noise, lam, k)
    assert abs(q - q_ref) <= 1e-12, (key, q, q_ref)
    assert np.array_equal(sets, sets_ref), (key, int((sets != sets_ref).sum()))
    checks += 1
  return checks


# ----------------------------------------------------------------------------- comparisons
PAIRS = [("mapie/lac/default", "tu/thr/default")]
for _sc in ["aps"] + [f"raps_lam{lam}_k{k}" for lam, k in RAPS_CONFIGS]:
  PAIRS += [(f"mapie/{_sc}/false_ucal0", f"tu/{_sc}/deterministic"),
            (f"mapie/{_sc}/true_ucal0", f"tu/{_sc}/deterministic"),
            (f"mapie/{_sc}/false", f"tu/{_sc}/deterministic"),
            (f"mapie/{_sc}/randomized", f"tu/{_sc}/randomized_rowU"),
            (f"mapie/{_sc}/randomized", f"tu/{_sc}/randomized"),
            (f"tu/{_sc}/randomized_rowU", f"tu/{_sc}/randomized")]


def summarise(sets, labels):
  return {"mean_size": round(float(sets.sum(1).mean()), 4), "empty": int((sets.sum(1) == 0).sum()),
          "coverage": round(float(sets[np.arange(len(labels)), labels].mean()), 4)}


def compare(results, swapped, test_labels):
  rows = []
  for m, t in PAIRS:
    for alpha in ALPHAS:
      a = f"alpha{alpha}"
      (qm, sm), (qt, st) = results[f"{m}/{a}"], results[f"{t}/{a}"]
      diff = sm != st
      row = {"a": m, "b": t, "alpha": alpha, "qhat_a": qm, "qhat_b": qt,
             "rows_differ": int(diff.any(1).sum()), "cells_differ": int(diff.sum()),
             "a_only": int((sm & ~st).sum()), "b_only": int((st & ~sm).sum()),
             "a_stats": summarise(sm, test_labels), "b_stats": summarise(st, test_labels)}
      if f"{t}/{a}" in swapped and swapped[f"{t}/{a}"][0] == f"{m}/{a}":
        sw = swapped[f"{t}/{a}"][1]  # b's rule run by b's library with a's q̂
        row["b_with_a_qhat_rows_differ"] = int((sw != sm).any(1).sum())
        row["b_with_a_qhat_cells_differ"] = int((sw != sm).sum())
      rows.append(row)
  return rows


# ----------------------------------------------------------------------------- main
def main():
  from importlib.metadata import version

  import mapie
  import sklearn
  import torch

  cal32, test32, cal_labels, test_labels, cal_u, test_u = make_inputs()
  p_cal, p_test = normalise(cal32), normalise(test32)

  mapie_out, mapie_meta = run_all_mapie(p_cal, p_test, cal_labels, cal_u, test_u)
  mapie_q = {k: v[0] for k, v in mapie_out.items() if isinstance(v, tuple)}
  tu_out, tu_meta, swapped, softmax_err = run_all_tu(p_cal, p_test, cal_labels, cal_u, test_u,
                                                     mapie_q)
  results = {**mapie_out, **tu_out}
  n_checks = check_references(results, p_cal, p_test, cal_labels, cal_u, test_u)

  arrays = {"cal_probs": cal32, "cal_labels": cal_labels.astype(np.int8),
            "test_probs": test32, "test_labels": test_labels.astype(np.int8),
            "cal_uniforms": cal_u, "test_uniforms": test_u}
  for key, val in results.items():
    if isinstance(val, tuple):
      arrays[f"{key}/qhat"] = np.float64(val[0])
      arrays[f"{key}/sets"] = np.asarray(val[1], dtype=bool)
    else:
      arrays[key] = np.asarray(val)
  os.makedirs(os.path.dirname(OUT_NPZ), exist_ok=True)
  np.savez_compressed(OUT_NPZ, **arrays)

  comparisons = compare(results, swapped, test_labels)
  side = {
      "versions": {"mapie": mapie.__version__, "torch_uncertainty": version("torch_uncertainty"),
                   "torch": torch.__version__, "numpy": np.__version__,
                   "scikit-learn": sklearn.__version__, "python": platform.python_version()},
      "command": "/tmp/confenv/bin/python experiments/record_conformal_parity.py",
      "inputs": {
          "rng": "np.random.default_rng(0): dirichlet(0.5*ones(10), 500) -> cal, "
                 "dirichlet(.., 200) -> test (cast float32), labels (cal then test: "
                 "u=rng.random(n); min(sum(cumsum(p) < u), 9)), uniform(500) -> cal_uniforms, "
                 "uniform((200, 10)) -> test_uniforms",
          "probabilities_used": "p = probs.astype(float64); p /= p.sum(1, keepdims=True)",
          "torch_uncertainty_input": "nn.Identity() model fed log(p); softmax(log p) - p max abs "
                                     f"= {softmax_err:.3g}",
          "mapie_uniforms": "calibration: cal_uniforms [500] (raps_auto: cal_uniforms[kept]); "
                            "test (include_last_label='randomized' only): test_uniforms[:, :1]",
          "tu_uniforms": "calibration: cal_uniforms [500]; test: 'randomized' test_uniforms "
                         "[200, 10] indexed [row, sorted rank position]; 'randomized_rowU' "
                         "test_uniforms[:, :1] broadcast to [200, 10]",
          "alphas": list(ALPHAS), "raps_configs_lambda_kreg": [list(c) for c in RAPS_CONFIGS]},
      "keys": "<library>/<score>/<variant>/alpha<α>/{qhat,sets}; sets bool [200, 10] "
              "(class order); mapie/raps_auto/... also k_star, lambda_star, kept_index",
      "variants": {**mapie_meta, **tu_meta},
      "reference_check": f"{n_checks} recorded (q̂, sets) recomputed from the formulas in "
                         "experiments/conformal_semantics.md: all equal",
      "comparisons": comparisons,
  }
  with open(OUT_JSON, "w") as f:
    json.dump(side, f, indent=1, ensure_ascii=False)
  print(f"wrote {OUT_NPZ} ({os.path.getsize(OUT_NPZ)} bytes, {len(arrays)} arrays), {OUT_JSON}; "
        f"{n_checks} reference checks passed")
  for row in comparisons:
    extra = ""
    if "b_with_a_qhat_rows_differ" in row:
      extra = f" | b with a's q̂: {row['b_with_a_qhat_rows_differ']} rows"
    print(f"{row['a']:34s} vs {row['b']:34s} α={row['alpha']:<4} q̂ {row['qhat_a']:.6f} "
          f"{row['qhat_b']:.6f}  rows {row['rows_differ']:3d} cells {row['cells_differ']:3d} "
          f"(+a {row['a_only']}, +b {row['b_only']}) empty {row['a_stats']['empty']}/"
          f"{row['b_stats']['empty']}{extra}")


if __name__ == "__main__":
  main()
