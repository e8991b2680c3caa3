"""smoothing_jax.conformal: hand-worked cases, and every conformal quantile and prediction set
equal to MAPIE 1.6.0's and TorchUncertainty 0.13.0's on the recorded parity case
(``tests/fixtures/conformal_parity.npz``, made by ``experiments/record_conformal_parity.py``)."""
import pathlib

import numpy as np
import pytest

from smoothing_jax import conformal

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "conformal_parity.npz"
PROBS = np.array([[0.5, 0.3, 0.2]])


def test_quantile_is_the_split_conformal_order_statistic_or_the_linear_quantile():
  scores = np.arange(1, 10) / 10  # n = 9
  assert conformal.conformal_quantile(scores, 0.1) == pytest.approx(0.9)  # ⌈10·0.9⌉ = 9th
  assert conformal.conformal_quantile(scores, 0.2) == pytest.approx(0.8)  # ⌈10·0.8⌉ = 8th
  # torch.quantile: position 0.9·8 = 7.2 between 0.8 and 0.9.
  assert conformal.conformal_quantile(scores, 0.1, "torch_uncertainty") == pytest.approx(0.82)
  with pytest.raises(ValueError, match="at least 19 calibration examples"):
    conformal.conformal_quantile(scores, 0.05)


def test_label_scores_by_hand():
  label = np.array([1])  # p = 0.3, second most probable; mass down to it 0.8
  assert conformal.label_scores(PROBS, label, "thr")[0] == pytest.approx(0.7)
  assert conformal.label_scores(PROBS, label, "aps")[0] == pytest.approx(0.8)
  assert conformal.label_scores(PROBS, label, "aps", uniforms=[0.5])[0] == pytest.approx(0.65)
  assert conformal.label_scores(PROBS, label, "raps", uniforms=[0.5], penalty=0.1,
                                rank=1)[0] == pytest.approx(0.75)  # + 0.1·(2 − 1)


@pytest.mark.parametrize("convention, qhat, randomized, uniforms, expected", [
    # MAPIE: down to the first class whose mass (0.5, 0.8, 1.0) reaches q̂ = 0.6, that one in;
    ("mapie", 0.6, False, None, [True, True, False]),
    # randomised, V = (0.8 − 0.6)/0.3 = 2/3: dropped for u = 0.5, kept for u = 0.9.
    ("mapie", 0.6, True, [0.5], [True, False, False]),
    ("mapie", 0.6, True, [0.9], [True, True, False]),
    # TorchUncertainty: each class's own score against q̂; the lowest where none passes.
    ("torch_uncertainty", 0.6, False, None, [True, False, False]),
    ("torch_uncertainty", 0.4, False, None, [True, False, False]),
    ("torch_uncertainty", 0.6, True, [[0.0, 0.9, 0.0]], [True, True, False]),  # 0.8 − 0.27
])
def test_aps_sets_by_hand(convention, qhat, randomized, uniforms, expected):
  sets = conformal.prediction_sets(PROBS, qhat, "aps", convention=convention,
                                   randomized=randomized, uniforms=uniforms)
  np.testing.assert_array_equal(sets[0], expected)


def test_thr_sets_by_hand():
  np.testing.assert_array_equal(conformal.prediction_sets(PROBS, 0.6, "thr")[0],
                                [True, False, False])
  assert not conformal.prediction_sets(PROBS, 0.45, "thr").any()  # MAPIE's may be empty
  np.testing.assert_array_equal(  # TorchUncertainty's always holds the top class
      conformal.prediction_sets(PROBS, 0.45, "thr", convention="torch_uncertainty")[0],
      [True, False, False])


def test_set_metrics_by_hand():
  sets = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]], bool)
  labels = np.array([0, 2, 1, 1])
  m = conformal.set_metrics(sets, labels, alpha=0.5)
  assert m["coverage"] == 0.5 and m["mean_size"] == 1.5 and m["empty"] == 0.25
  # Strata by size: {0, 1} covers 1 of 2, {2, 3} 1 of 2: both |0.5 − 0.5| = 0.
  assert m["size_stratified_violation"] == 0.0
  # Classes: 0 covered 1/1, 1 covered 1/2, 2 covered 0/1: mean |c − 0.5| = (0.5 + 0 + 0.5)/3.
  assert m["class_coverage_gap"] == pytest.approx(1 / 3)


def _parity_cases():
  """``(fixture key, convention, score, randomized, penalty, rank, test uniforms)`` of every
  recorded variant our conventions make: MAPIE's ``include_last_label`` True (not randomised) and
  "randomized" (one u per row: column 0), with λ and k_reg fixed (MAPIE's own search of them on a
  split of the calibration data is left out, as in ours); TorchUncertainty's deterministic and
  randomised (a u per rank position, and one per row repeated across it)."""
  cases = [("mapie/lac/default", "mapie", "thr", False, 0.0, 1, None),
           ("tu/thr/default", "torch_uncertainty", "thr", False, 0.0, 1, None)]
  for score, penalty, rank in (("aps", 0.0, 1), ("raps_lam0.01_k2", 0.01, 2),
                               ("raps_lam0.1_k1", 0.1, 1)):
    ours = score[:4]
    cases += [(f"mapie/{score}/true", "mapie", ours, False, penalty, rank, None),
              (f"mapie/{score}/randomized", "mapie", ours, True, penalty, rank, "column"),
              (f"tu/{score}/deterministic", "torch_uncertainty", ours, False, penalty, rank, None),
              (f"tu/{score}/randomized", "torch_uncertainty", ours, True, penalty, rank, "all"),
              (f"tu/{score}/randomized_rowU", "torch_uncertainty", ours, True, penalty, rank,
               "row")]
  return [(f"{key}/alpha{alpha}", alpha, *case) for case in cases for key in case[:1]
          for alpha in (0.1, 0.05)]


@pytest.mark.parametrize("key, alpha, _, convention, score, randomized, penalty, rank, draws",
                         _parity_cases())
def test_quantiles_and_sets_equal_the_peer_libraries(key, alpha, _, convention, score,
                                                     randomized, penalty, rank, draws):
  data = np.load(FIXTURE)
  # As both libraries were given them: float64, each row divided by its sum.
  cal, test = (np.asarray(data[k], np.float64) for k in ("cal_probs", "test_probs"))
  cal, test = cal / cal.sum(-1, keepdims=True), test / test.sum(-1, keepdims=True)
  options = {"penalty": penalty, "rank": rank}
  cal_draws = randomized or (convention == "mapie" and score != "thr")  # MAPIE draws u always
  scores = conformal.label_scores(cal, data["cal_labels"].astype(int), score,
                                  uniforms=data["cal_uniforms"] if cal_draws else None, **options)
  qhat = conformal.conformal_quantile(scores, alpha, convention)
  assert qhat == pytest.approx(float(data[f"{key}/qhat"]), abs=1e-7)
  u = data["test_uniforms"]
  uniforms = {None: None, "column": u[:, 0], "all": u, "row": np.repeat(u[:, :1], 10, 1)}[draws]
  sets = conformal.prediction_sets(test, qhat, score, convention=convention,
                                   randomized=randomized, uniforms=uniforms, **options)
  np.testing.assert_array_equal(sets, data[f"{key}/sets"])
