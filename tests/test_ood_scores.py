"""smoothing_jax.ood_scores against independent statements, on fixed numpy logits and features:
numpy transcriptions of OpenOOD's postprocessors (Jingkang50/OpenOOD at 3c35632, file and lines
named in each test), a finite-difference input gradient (ODIN), scikit-learn's
NearestNeighbors (KNN) and EmpiricalCovariance (MDS, RMDS), a numpy eigendecomposition
(ViM), and an explicit loop over pairs of draws (EPKL)."""
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.special import logsumexp, rel_entr, softmax
from sklearn.covariance import EmpiricalCovariance
from sklearn.neighbors import NearestNeighbors

from smoothing_jax import ood_scores as S

RNG = np.random.default_rng(0)
LOGITS = (3 * RNG.normal(size=(4, 20, 5))).astype(np.float32)    # N = 4 draws, B = 20, C = 5
TRAIN_FEATURES = RNG.normal(size=(300, 8)) + np.repeat(np.eye(3, 8) * 3, 100, axis=0)
TRAIN_LABELS = np.repeat(np.arange(3), 100)
TEST_FEATURES = np.r_[RNG.normal(size=(10, 8)) + np.eye(3, 8)[RNG.integers(0, 3, 10)] * 3,
                      2 * RNG.normal(size=(10, 8))]


def _close(actual, expected, rtol=1e-5, atol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol)


def test_logit_scores_match_openood_on_one_network_and_both_draw_conventions():
  one = LOGITS[:1]
  # base_postprocessor.py l. 20-22: softmax(output).max(1).
  _close(S.msp(one), softmax(one[0], axis=1).max(1))
  # maxlogit_postprocessor.py l. 18-19: output.max(1).
  _close(S.max_logit(one), one[0].max(1))
  # ebo_postprocessor.py l. 21-22: T * logsumexp(output / T), T = 1 (configs/.../ebo.yml l. 5).
  _close(S.energy(one), logsumexp(one[0], axis=1))
  _close(S.energy(one, temperature=2.0), 2.0 * logsumexp(one[0] / 2.0, axis=1))
  # Draws: the predictive's MSP and entropy; the others per convention.
  mean_probs = softmax(LOGITS, axis=-1).mean(0)
  _close(S.msp(LOGITS), mean_probs.max(-1))
  predictive_entropy = -(mean_probs * np.log(mean_probs)).sum(-1)
  _close(S.entropy(LOGITS), -predictive_entropy)
  member_entropy = -(softmax(LOGITS, -1) * np.log(softmax(LOGITS, -1))).sum(-1).mean(0)
  _close(S.mutual_information(LOGITS), -(predictive_entropy - member_entropy), atol=2e-5)
  assert np.all(np.asarray(S.mutual_information(one)) == 0)
  _close(S.max_logit(LOGITS), LOGITS.max(-1).mean(0))
  _close(S.max_logit(LOGITS, combine="mean"), LOGITS.mean(0).max(-1))
  _close(S.energy(LOGITS), logsumexp(LOGITS, axis=-1).mean(0))
  _close(S.energy(LOGITS, combine="mean"), logsumexp(LOGITS.mean(0), axis=-1))
  with pytest.raises(ValueError, match="combine must be one of"):
    S.energy(LOGITS, combine="median")


def test_expected_pairwise_kl_is_the_mean_kl_over_pairs_of_different_draws():
  probs = softmax(LOGITS.astype(np.float64), axis=-1)
  n = len(probs)
  pairs = [rel_entr(probs[i], probs[j]).sum(-1) for i in range(n) for j in range(n) if i != j]
  _close(S.expected_pairwise_kl(LOGITS), -np.mean(pairs, axis=0), rtol=1e-5, atol=1e-6)
  # Shifts-Project/shifts at f5d7a15, mswml/uncertainty.py l. 35-41 (expected entropy) and
  # l. 49-58 (epkl = −Σ p̄ · mean log p − expected entropy): the mean over all N² ordered pairs,
  # its zero diagonal included, so (N − 1)/N of ours.
  expected_entropy = -(probs * np.log(probs + 1e-10)).sum(-1).mean(0)
  shifts = -(probs.mean(0) * np.log(probs + 1e-10).mean(0)).sum(-1) - expected_entropy
  _close(S.expected_pairwise_kl(LOGITS), -shifts * n / (n - 1), rtol=1e-5, atol=1e-6)
  # Two draws by hand: p = (½, ½), q = (¾, ¼); EPKL = (KL(p‖q) + KL(q‖p)) / 2.
  two = np.log([[[0.5, 0.5]], [[0.75, 0.25]]]).astype(np.float32)
  by_hand = (0.5 * np.log(0.5 / 0.75) + 0.5 * np.log(0.5 / 0.25)
             + 0.75 * np.log(0.75 / 0.5) + 0.25 * np.log(0.25 / 0.5)) / 2
  _close(S.expected_pairwise_kl(two), [-by_hand], rtol=1e-6)
  assert np.all(np.asarray(S.expected_pairwise_kl(LOGITS[:1])) == 0)


# ODIN on a model whose input gradient numpy can state: draw n is tanh(x · A_n) · W_n.
INPUTS = RNG.normal(size=(6, 2, 2, 3)).astype(np.float32)
A = RNG.normal(size=(3, 12, 7)) / 2
W = RNG.normal(size=(3, 7, 5)) * 2
STD = np.array([0.2470, 0.2435, 0.2616])  # openood/preprocessors/transform.py l. 4 (CIFAR-10)


def _draw_logits(x, n, xp=np):
  return xp.tanh(x.reshape(x.shape[0], -1) @ A[n]) @ W[n]


def _logits_fn(x):  # [N, B, ...] → [N, B, C], draw n on x[n]
  return jnp.stack([_draw_logits(x[n], n, jnp) for n in range(x.shape[0])])


def _odin_numpy(x, n, temperature, noise, eps=1e-4):
  """odin_postprocessor.py l. 24-61 for draw n, the input gradient by central differences."""
  x = x.astype(np.float64)

  def loss(z):  # l. 30-37: mean cross-entropy of output / T at the untempered argmax
    out = _draw_logits(z, n)
    labels = _draw_logits(x, n).argmax(1)
    log_probs = out / temperature - logsumexp(out / temperature, axis=1, keepdims=True)
    return -log_probs[np.arange(len(z)), labels].mean()

  gradient = np.zeros_like(x)
  for index in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[index] = eps
    gradient[index] = (loss(x + step) - loss(x - step)) / (2 * eps)
  sign = (np.greater_equal(gradient, 0).astype(np.float64) - 0.5) * 2      # l. 41-42
  moved = x - noise * sign / STD                                            # l. 45-50
  return softmax(_draw_logits(moved, n) / temperature, axis=1).max(1)      # l. 51-59


@pytest.mark.parametrize("temperature,noise", [(1000.0, 0.0014), (1.0, 0.05)])
def test_odin_matches_openood_with_a_finite_difference_input_gradient(temperature, noise):
  expected = [_odin_numpy(INPUTS, n, temperature, noise) for n in range(3)]
  one = S.odin(lambda x: _logits_fn(x)[:1], INPUTS, num_draws=1, input_std=STD,
               temperature=temperature, noise=noise)
  _close(one, expected[0], rtol=1e-5, atol=1e-7)
  # Draws, "score_mean": each draw on its own step, the scores averaged.
  _close(S.odin(_logits_fn, INPUTS, num_draws=3, input_std=STD, temperature=temperature,
                noise=noise), np.mean(expected, axis=0), rtol=1e-5, atol=1e-7)


def test_odin_of_the_mean_predictive_steps_by_its_own_gradient():
  temperature, noise = 10.0, 0.05
  x = INPUTS.astype(np.float64)

  def mean_probs(z, t):
    return np.mean([softmax(_draw_logits(z, n) / t, axis=1) for n in range(3)], axis=0)

  labels = mean_probs(x, 1.0).argmax(1)

  def loss(z):
    return -np.log(mean_probs(z, temperature)[np.arange(len(z)), labels]).mean()

  gradient = np.zeros_like(x)
  for index in np.ndindex(x.shape):
    step = np.zeros_like(x)
    step[index] = 1e-4
    gradient[index] = (loss(x + step) - loss(x - step)) / 2e-4
  moved = x - noise * np.where(gradient >= 0, 1.0, -1.0) / STD
  _close(S.odin(_logits_fn, INPUTS, num_draws=3, input_std=STD, temperature=temperature,
                noise=noise, combine="mean"), mean_probs(moved, temperature).max(1),
         rtol=1e-5, atol=1e-7)


def _openood_class_statistics(features, labels, num_classes):
  """mds_postprocessor.py l. 46-62 (rmds_postprocessor.py l. 46-62): class means, and the
  precision of EmpiricalCovariance(assume_centered=False) fitted on the class-centred float32
  features."""
  means = np.stack([features[labels == c].mean(0) for c in range(num_classes)])
  centered = np.concatenate([features[labels == c] - means[c] for c in range(num_classes)])
  precision = EmpiricalCovariance(assume_centered=False).fit(
      centered.astype(np.float32)).precision_
  return means, precision.astype(np.float64)


def test_mds_and_rmds_match_openood_with_sklearn_empirical_covariance():
  means, precision = _openood_class_statistics(TRAIN_FEATURES, TRAIN_LABELS, 3)
  # mds_postprocessor.py l. 72-78: max over classes of −(x − μ_c)ᵀ Σ⁻¹ (x − μ_c).
  class_scores = np.stack([-np.einsum("bd,de,be->b", TEST_FEATURES - m, precision,
                                      TEST_FEATURES - m) for m in means], axis=1)
  stats = S.fit_mds(TRAIN_FEATURES, TRAIN_LABELS, 3)
  _close(stats["means"], means, atol=1e-9)
  _close(S.mds(TEST_FEATURES, stats), class_scores.max(1), rtol=1e-4, atol=1e-4)
  # rmds_postprocessor.py l. 64-70 (background fit) and l. 80-91 (class score − background).
  whole_mean = TRAIN_FEATURES.mean(0)
  whole_precision = EmpiricalCovariance(assume_centered=False).fit(
      (TRAIN_FEATURES - whole_mean).astype(np.float32)).precision_.astype(np.float64)
  background = -np.einsum("bd,de,be->b", TEST_FEATURES - whole_mean, whole_precision,
                          TEST_FEATURES - whole_mean)
  expected = (class_scores - background[:, None]).max(1)
  _close(S.rmds(TEST_FEATURES, S.fit_rmds(TRAIN_FEATURES, TRAIN_LABELS, 3)), expected,
         rtol=1e-4, atol=1e-4)
  with pytest.raises(ValueError, match=r"classes \[3\] have none"):
    S.fit_mds(TRAIN_FEATURES, TRAIN_LABELS, 4)


def test_knn_matches_openood_with_sklearn_nearest_neighbors():
  # knn_postprocessor.py l. 11 (normalizer: x / ‖x‖ + 1e-10), l. 36-41 (IndexFlatL2 of the
  # normalised training features), l. 49-54 (score −D[:, -1], faiss's squared distance).
  normalize = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True) + 1e-10  # noqa: E731
  index = NearestNeighbors(n_neighbors=50).fit(normalize(TRAIN_FEATURES))
  distances, _ = index.kneighbors(normalize(TEST_FEATURES))
  stats = S.fit_knn(TRAIN_FEATURES)
  _close(S.knn(TEST_FEATURES, stats), -distances[:, -1] ** 2, atol=1e-5)
  # Chunks of the training features give the same neighbours.
  _close(S.knn(TEST_FEATURES, stats, k=7, chunk=64), -distances[:, 6] ** 2, atol=1e-5)
  with pytest.raises(ValueError, match="K = 50 needs at least 50 training features, got 30"):
    S.knn(TEST_FEATURES, S.fit_knn(TRAIN_FEATURES[:30]))


def test_vim_matches_openood_with_a_numpy_eigendecomposition():
  kernel, bias = RNG.normal(size=(8, 3)), RNG.normal(size=3)
  dim = 4
  # vim_postprocessor.py l. 39-44 (w: OpenOOD's fc weight [C, D]; u = −pinv(w) b; the
  # covariance of features − u with assume_centered=True; np.linalg.eig), l. 56-64 (NS: the
  # eigenvectors past the dim largest; α), l. 71-76 (score: energy − α‖(x − u) NS‖).
  w = kernel.T
  logit_train = TRAIN_FEATURES @ w.T + bias
  u = -np.matmul(np.linalg.pinv(w), bias)
  covariance = EmpiricalCovariance(assume_centered=True).fit(TRAIN_FEATURES - u).covariance_
  eig_vals, eigen_vectors = np.linalg.eig(covariance)
  ns = np.ascontiguousarray((eigen_vectors.T[np.argsort(eig_vals * -1)[dim:]]).T)
  alpha = logit_train.max(-1).mean() / np.linalg.norm((TRAIN_FEATURES - u) @ ns, axis=-1).mean()
  expected = (logsumexp(TEST_FEATURES @ w.T + bias, axis=-1)
              - np.linalg.norm((TEST_FEATURES - u) @ ns, axis=-1) * alpha)
  stats = S.fit_vim(TRAIN_FEATURES, kernel, bias, dim)
  _close(stats["alpha"], alpha, rtol=1e-9)
  _close(S.vim(TEST_FEATURES, stats), expected, rtol=1e-4, atol=1e-4)
  # The head read back from training features and logits is the model's.
  read_kernel, read_bias = S.affine_head(TRAIN_FEATURES, logit_train)
  _close(read_kernel, kernel, atol=1e-9)
  _close(read_bias, bias, atol=1e-9)
  assert (S.vim_dim(512), S.vim_dim(128), S.vim_dim(257)) == (256, 64, 256)
  with pytest.raises(ValueError, match=r"ViM's dim must be in \(0, 8\)"):
    S.fit_vim(TRAIN_FEATURES, kernel, bias, 8)
