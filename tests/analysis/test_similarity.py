"""Mini-batch linear CKA against the unbiased HSIC written as a sum over distinct index tuples."""
import itertools

import jax
import numpy as np
import pytest

from smoothing_jax.analysis.features import feature_maps
from smoothing_jax.analysis.similarity import (
  cross_model_similarity,
  feature_similarity,
  hsic_terms,
  minibatch_cka,
  stage_block_structure,
  unbiased_hsic,
)


def u_statistic_hsic(x, y) -> float:
  """Song et al. (2012) Thm. 2: HSIC₁ = 1/(n)₄ Σ over distinct (i, j, q, r) of
  K_ij L_ij + K_ij L_qr − 2 K_ij L_iq, linear kernels of the rows of x, y [n, ...] (float64)."""
  x, y = (np.asarray(a, np.float64).reshape(len(a), -1) for a in (x, y))
  gram_k, gram_l = x @ x.T, y @ y.T
  i, j, q, r = np.array(list(itertools.permutations(range(len(x)), 4))).T
  return float(np.mean(gram_k[i, j] * gram_l[i, j] + gram_k[i, j] * gram_l[q, r]
                       - 2 * gram_k[i, j] * gram_l[i, q]))


def reference_cka(batches_a, batches_b) -> np.ndarray:
  """[A, B] Σ_batches HSIC₁(a, b) / sqrt(Σ HSIC₁(a, a) · Σ HSIC₁(b, b)) by ``u_statistic_hsic``."""
  def summed(first, second):
    return np.array([[sum(u_statistic_hsic(fa[a], fb[b])
                          for fa, fb in zip(first, second, strict=True))
                      for b in range(len(second[0]))] for a in range(len(first[0]))])
  cross = summed(batches_a, batches_b)
  self_a, self_b = np.diag(summed(batches_a, batches_a)), np.diag(summed(batches_b, batches_b))
  return cross / np.sqrt(np.outer(self_a, self_b))


def random_features(rng, n, shapes, offset=3.0):
  """Features [n, *shape] with a non-zero mean (the estimator ignores it; centring must not)."""
  return [rng.normal(size=(n,) + shape).astype(np.float32) + offset for shape in shapes]


def test_hsic_terms_equal_the_u_statistic_over_distinct_tuples():
  rng = np.random.default_rng(0)
  features_a = random_features(rng, 12, [(5,), (2, 2, 3)])
  features_b = random_features(rng, 12, [(7,), (3, 1, 2), (4,)], offset=-1.0)
  features_b[2] = np.abs(features_b[2])**2  # a non-Gaussian, all-positive feature
  cross, self_a, self_b = hsic_terms(features_a, features_b)
  expected = [[u_statistic_hsic(a, b) for b in features_b] for a in features_a]
  np.testing.assert_allclose(cross, expected, rtol=2e-4)
  np.testing.assert_allclose(self_a, [u_statistic_hsic(a, a) for a in features_a], rtol=2e-4)
  np.testing.assert_allclose(self_b, [u_statistic_hsic(b, b) for b in features_b], rtol=2e-4)
  # The vectorised estimator on the raw (uncentred) Gram matrices, as written in the paper.
  def grams(fs):
    return np.stack([f.reshape(12, -1) @ f.reshape(12, -1).T for f in fs])

  np.testing.assert_allclose(unbiased_hsic(grams(features_a), grams(features_b)), expected,
                             rtol=2e-3)
  one_sided, diagonal, _ = hsic_terms(features_a)
  np.testing.assert_allclose(one_sided, [[u_statistic_hsic(a, b) for b in features_a]
                                         for a in features_a], rtol=2e-4)
  np.testing.assert_array_equal(diagonal, np.diagonal(one_sided))


def test_cka_is_one_on_itself_and_invariant_to_rotations_and_isotropic_scaling():
  rng = np.random.default_rng(1)
  rotation, _ = np.linalg.qr(rng.normal(size=(6, 6)))
  batches = [random_features(rng, 10, [(6,), (4,)]) for _ in range(3)]
  transformed = [(x, (2.5 * x @ rotation).astype(np.float32), y) for x, y in batches]
  cka = minibatch_cka([(features, None) for features in transformed])
  np.testing.assert_allclose(cka[0, 1], 1.0, rtol=1e-5)
  np.testing.assert_allclose(cka[0, 2], cka[1, 2], rtol=1e-5)
  np.testing.assert_array_equal(np.diagonal(cka), 1.0)
  assert 0.0 < cka[0, 2] < 0.95  # independent features: far from 1


def test_minibatch_cka_is_the_ratio_of_hsics_summed_over_batches():
  rng = np.random.default_rng(2)
  batches_a = [random_features(rng, n, [(4,), (3, 2)]) for n in (10, 12, 10)]
  batches_b = [[a[0] * 2 + rng.normal(size=a[0].shape).astype(np.float32), a[1][..., 0]**2]
               for a in batches_a]
  cka = minibatch_cka(zip(batches_a, batches_b, strict=True))
  np.testing.assert_allclose(cka, reference_cka(batches_a, batches_b), rtol=1e-4)
  # Not the average of per-batch CKAs: one batch of larger scale weighs more.
  scaled_a = [[10 * f for f in batches_a[0]]] + batches_a[1:]
  np.testing.assert_allclose(minibatch_cka(zip(scaled_a, batches_b, strict=True)),
                             reference_cka(scaled_a, batches_b), rtol=1e-4)


def test_bad_minibatches_are_rejected():
  rng = np.random.default_rng(3)
  with pytest.raises(ValueError, match="at least 4 examples"):
    hsic_terms(random_features(rng, 3, [(2,)]))
  with pytest.raises(ValueError, match="share the batch size"):
    hsic_terms(random_features(rng, 6, [(2,)]), random_features(rng, 5, [(2,)]))
  with pytest.raises(ValueError, match="at least one mini-batch"):
    minibatch_cka([])


def test_feature_similarity_of_a_micro_vit_matches_the_tuple_sum(micro_vit):
  model, variables, x, _ = micro_vit
  batches = [x, jax.random.normal(jax.random.key(9), x.shape)]
  result = feature_similarity(model, variables, batches)
  names = [name for name, _ in model.units()]
  assert result["rows"] == result["cols"]
  assert result["rows"] == {"blocks": ["patch_embedding"] + names,
                            "kinds": ["embedding"] + ["msa", "mlp"] * 2,
                            "spatial_sizes": [(2, 2)] * 5, "resolution_changes": [0]}
  assert (result["num_batches"], result["num_examples"]) == (2, 12)
  cka = result["cka"]
  np.testing.assert_allclose(cka, cka.T, rtol=1e-6)
  np.testing.assert_array_equal(np.diagonal(cka), 1.0)
  maps = [list(feature_maps(model, variables, b).values()) for b in batches]
  np.testing.assert_allclose(cka, reference_cka(maps, maps), rtol=1e-3)
  # Across two models (here: the same ViT with perturbed weights), rows and columns differ.
  other = jax.tree.map(lambda p: p * 1.5 + 0.1, variables)
  cross = cross_model_similarity(model, variables, model, other, [(b, b) for b in batches])
  other_maps = [list(feature_maps(model, other, b).values()) for b in batches]
  np.testing.assert_allclose(cross["cka"], reference_cka(maps, other_maps), rtol=1e-3)
  with pytest.raises(ValueError, match="a pair"):
    cross_model_similarity(model, variables, model, other, [(x, x, x)])


def test_resolution_changes_of_a_smoothing_resnet_are_its_strided_stage_starts(tiny_mcdo):
  model, variables = tiny_mcdo
  batches = jax.random.normal(jax.random.key(3), (2, 4, 16, 16, 3))
  result = feature_similarity(model, variables, batches)
  axis = result["rows"]
  # Blur layers grow maps by one pixel (16 → 17); only sub-sampling counts as a change.
  assert axis["blocks"][3:5] == ["smooth1_0", "layer2_0"]
  assert axis["spatial_sizes"][:5] == [(16, 16)] * 3 + [(17, 17), (9, 9)]  # the stem keeps 16
  assert axis["resolution_changes"] == [4, 7, 10]
  assert axis["kinds"][:4] == ["stem", "conv", "conv", "smooth"]
  cka = result["cka"]
  np.testing.assert_allclose(cka, cka.T, rtol=1e-6)
  np.testing.assert_array_equal(np.diagonal(cka), 1.0)


def test_stage_block_structure_by_hand():
  axis = {"blocks": ["a", "b", "c", "d"], "kinds": ["conv"] * 4, "spatial_sizes": [],
          "resolution_changes": [0, 2]}
  cka = np.array([[1.0, 0.8, 0.2, 0.1], [0.8, 1.0, 0.3, 0.2], [0.2, 0.3, 1.0, 0.6],
                  [0.1, 0.2, 0.6, 1.0]])
  structure = stage_block_structure({"cka": cka, "rows": axis, "cols": axis})
  assert structure == pytest.approx({"within_stage_mean_cka": 0.7, "across_stages_mean_cka": 0.2})


def test_plot_similarity_marks_resolution_changes_and_msa_blocks():
  import matplotlib
  matplotlib.use("Agg")
  from smoothing_jax.plots import plot_similarity
  rows = {"blocks": list("abcde"), "kinds": ["conv", "conv", "msa", "conv", "msa"],
          "spatial_sizes": [(4, 4)] * 2 + [(2, 2)] * 3, "resolution_changes": [0, 2]}
  cols = {**rows, "kinds": ["conv"] * 4 + ["msa"], "resolution_changes": [3]}
  result = {"cka": np.random.default_rng(4).uniform(size=(5, 5)), "rows": rows, "cols": cols}
  fig = plot_similarity(result, "CKA")
  ax = fig.axes[0]
  vertical = sorted(line.get_xdata()[0] for line in ax.lines if line.get_xdata()[0] ==
                    line.get_xdata()[1])
  horizontal = sorted(line.get_ydata()[0] for line in ax.lines if line.get_ydata()[0] ==
                      line.get_ydata()[1])
  assert vertical == [2.5] and horizontal == [-0.5, 1.5]
  assert sorted(t.get_text() for t in ax.texts) == ["E", "P", "P"]
  assert len(ax.patches) == 3  # MSA bands: 2 rows + 1 column
  assert fig.axes[1].get_ylim() == (0.0, 1.0)  # the colour bar
