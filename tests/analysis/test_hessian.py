"""smoothing_jax.analysis.hessian against an explicit Hessian (``jax.hessian`` + ``eigh``).

Two operators: a 115-parameter net with BatchNorm at a non-convex point, and a
crowded, indefinite one (the same kind of net plus a quadratic that puts eight
eigenvalues of alternating sign at |λ| ≈ 10 within 2% of each other), where
PyHessian's power iteration with deflation stops early and Lanczos does not.  Then
50-parameter quadratics with clustered and repeated top eigenvalues (issue 24.1), where
single-vector Lanczos stops converged-looking at the wrong values and block Lanczos does not,
and a tiny MLP.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from jax.tree_util import Partial

from smoothing_jax.analysis import (
  dataset_loss,
  eigenvalue_density,
  hessian_trace,
  hvp,
  min_eigenvalue,
  restricted_to,
  top_eigenvalues,
)
from smoothing_jax.analysis.hessian import linearized_hvp, stages, top_and_min_eigenvalues
from tests.helpers import SmallNet, small_net_batches, small_net_problem


def cross_entropy(logits, labels):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def explicit_hessian(loss_fn, params):
  flat, unravel = ravel_pytree(params)
  hessian = np.asarray(jax.jit(jax.hessian(lambda f: loss_fn(unravel(f))))(flat), np.float64)
  return (hessian + hessian.T) / 2


@pytest.fixture(scope="module")
def problem():
  """Cross-entropy of a 115-parameter net with BatchNorm (inference mode) on a fixed batch."""
  loss_fn, params = small_net_problem()
  hessian = explicit_hessian(loss_fn, params)
  assert hessian.shape[0] >= 100
  return loss_fn, params, ravel_pytree(params)[1], hessian


CROWDED_TOP = np.array([10.0, -9.98, 9.96, -9.94, 9.92, -9.90, 9.88, -9.86])


@pytest.fixture(scope="module")
def crowded():
  """Cross-entropy of a 99-parameter net plus ½ Σᵢ dᵢ (qᵢ·(θ − θ₀))² with d = CROWDED_TOP and
  random orthonormal qᵢ: the top of the spectrum is eight near-equal |λ| of both signs."""
  model = SmallNet(batch_norm=False)
  x = jax.random.normal(jax.random.key(0), (32, 8))
  y = jnp.arange(32) % 3
  params = model.init(jax.random.key(1), x)["params"]
  flat, unravel = ravel_pytree(params)
  directions, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(flat.shape[0], 8)))
  directions = jnp.asarray(directions, jnp.float32)

  def loss_fn(p):
    z = directions.T @ (ravel_pytree(p)[0] - flat)
    return cross_entropy(model.apply({"params": p}, x), y) + 0.5 * jnp.sum(CROWDED_TOP * z**2)

  hessian = explicit_hessian(loss_fn, params)
  values = np.linalg.eigvalsh(hessian)
  top = values[np.argsort(-np.abs(values))]
  assert np.abs(top[4]) > 0.98 * np.abs(top[0]) and np.any(top[:5] < 0)  # crowded, indefinite
  return loss_fn, params, hessian, top


def explicit_residual(hessian, value, vector):
  v = np.asarray(ravel_pytree(vector)[0], np.float64)
  return np.linalg.norm(hessian @ v - float(value) * v)


def test_hvp_and_linearized_hvp_equal_the_explicit_hessian_product(problem):
  loss_fn, params, unravel, hessian = problem
  v = jax.random.normal(jax.random.key(4), (hessian.shape[0],))
  expected = hessian @ np.asarray(v)
  np.testing.assert_allclose(ravel_pytree(hvp(loss_fn, params, unravel(v)))[0], expected,
                             rtol=1e-4, atol=1e-5)
  linear = linearized_hvp(loss_fn, params)
  np.testing.assert_allclose(ravel_pytree(linear(unravel(v)))[0], expected, rtol=1e-4, atol=1e-5)


def test_hvp_and_lanczos_on_an_eight_device_mesh(problem):
  """The batch sharded over a ``data`` mesh axis (parameters replicated) gives the same operator."""
  from jax.sharding import Mesh, NamedSharding
  from jax.sharding import PartitionSpec as P
  _, params, unravel, hessian = problem
  mesh = Mesh(np.asarray(jax.devices()[:8]), ("data",))
  model = SmallNet()
  x = jax.random.normal(jax.random.key(0), (32, 8))
  y = jnp.arange(32) % 3
  stats = jax.tree.map(lambda s: s + 0.3 * jnp.abs(jax.random.normal(jax.random.key(2), s.shape)),
                       model.init(jax.random.key(1), x)["batch_stats"])

  def batch_loss(images, labels, p):
    return cross_entropy(model.apply({"params": p, "batch_stats": stats}, images), labels)

  sharded = jax.device_put((x, y), NamedSharding(mesh, P("data")))
  assert len(sharded[0].sharding.device_set) == 8
  loss_fn = Partial(batch_loss, *sharded)
  replicated = jax.device_put(params, NamedSharding(mesh, P()))
  v = jax.random.normal(jax.random.key(4), (hessian.shape[0],))
  got = ravel_pytree(hvp(loss_fn, replicated, unravel(v)))[0]
  np.testing.assert_allclose(got, hessian @ np.asarray(v), rtol=1e-4, atol=1e-5)
  top = top_eigenvalues(loss_fn, replicated, k=1, tol=1e-5, rng=jax.random.key(5))
  true_values = np.linalg.eigvalsh(hessian)
  np.testing.assert_allclose(top.eigenvalues[0], true_values[np.argmax(np.abs(true_values))],
                             rtol=1e-4)


def test_dataset_hvp_is_the_mean_of_the_batch_hvps_and_the_concatenated_batch_s(problem):
  """Four batches of 8 with a mean loss: the mean of their HVPs is the HVP of the batch of 32."""
  _, params, unravel, hessian = problem
  batch_loss, batches = small_net_batches(4)
  v = unravel(jax.random.normal(jax.random.key(4), (hessian.shape[0],)))
  expected = hessian @ np.asarray(ravel_pytree(v)[0])
  mean = np.mean([ravel_pytree(hvp(Partial(batch_loss, b), params, v))[0] for b in batches], 0)
  np.testing.assert_allclose(mean, expected, rtol=1e-4, atol=1e-5)
  loss_fn = dataset_loss(batch_loss, batches)
  linear = linearized_hvp(loss_fn, params)
  np.testing.assert_allclose(ravel_pytree(linear(v))[0], expected, rtol=1e-4, atol=1e-5)
  # Under jax.checkpoint the linearisation keeps its inputs (parameters, batches, statistics),
  # not the batches' activations (3072 numbers here without it).
  inputs = sum(x.size for x in jax.tree.leaves((loss_fn, params)))
  assert sum(x.size for x in jax.tree.leaves(linear)) <= inputs + 8


def lanczos_nodes(hessian, probe, steps):
  """Ritz values of ``steps`` Lanczos steps from ``probe`` with full reorthogonalisation, in
  float64 on the explicit Hessian: the nodes :func:`eigenvalue_density` should find."""
  basis = [probe / np.linalg.norm(probe)]
  diagonal, off = [], []
  for _ in range(steps):
    w = hessian @ basis[-1]
    diagonal.append(basis[-1] @ w)
    for _ in range(2):
      w = w - np.stack(basis).T @ (np.stack(basis) @ w)
    off.append(np.linalg.norm(w))
    basis.append(w / off[-1])
  return np.linalg.eigvalsh(np.diag(diagonal) + np.diag(off[:-1], 1) + np.diag(off[:-1], -1))


def test_dataset_hessian_on_eight_devices_equals_one_device(problem):
  """Top-1, Hutchinson samples and SLQ nodes of the mean over 2 batches, each batch sharded
  over 8 devices, against the explicit Hessian of the concatenated batch on 1 device (the same
  probes)."""
  from smoothing_jax.parallel import create_mesh, shardings
  _, params, _, hessian = problem
  batch_loss, batches = small_net_batches(2)
  mesh = create_mesh(8)
  loss_fn = dataset_loss(batch_loss, batches, mesh)
  assert len(jax.tree.leaves(loss_fn.args[-1])[0].sharding.device_set) == 8
  params = jax.device_put(params, shardings(mesh)[0])
  key, n = jax.random.key(5), hessian.shape[0]
  true_values = np.linalg.eigvalsh(hessian)
  top = top_eigenvalues(loss_fn, params, max_iters=20, tol=1e-5, rng=key)
  np.testing.assert_allclose(top.eigenvalues, true_values[np.argmax(np.abs(true_values))],
                             rtol=1e-4)
  probes = np.stack([jax.random.rademacher(k, (n,)) for k in jax.random.split(key, 2)])
  np.testing.assert_allclose(hessian_trace(loss_fn, params, num_samples=2, rng=key)[1],
                             np.einsum("si,ij,sj->s", probes, hessian, probes), rtol=1e-4)
  probe = np.asarray(jax.random.rademacher(jax.random.split(key, 1)[0], (n,)), np.float64)
  nodes = eigenvalue_density(loss_fn, params, num_iters=20, rng=key).nodes[0]
  np.testing.assert_allclose(nodes, lanczos_nodes(hessian, probe, 20),
                             atol=1e-4 * np.abs(true_values).max())


def block_mask(params, keep):
  """Which entries of ``ravel_pytree(params)`` belong to the leaves whose path ``keep`` takes."""
  return np.asarray(ravel_pytree(jax.tree_util.tree_map_with_path(
      lambda path, x: jnp.full(x.shape, keep("/".join(k.key for k in path))), params))[0], bool)


def test_restricted_hessian_is_the_block_of_the_explicit_hessian(problem):
  """The Hessian restricted to ``Dense_1`` (27 of 115 parameters): the SLQ nodes over the whole
  27-dimensional space are ``eigh`` of that block, and so is its top eigenvalue, also by a
  predicate (the solvers' programs compiled once: one size of Krylov basis)."""
  loss_fn, params, _, hessian = problem
  mask = block_mask(params, lambda path: path.startswith("Dense_1/"))
  assert mask.sum() == 27
  values = np.linalg.eigvalsh(hessian[np.ix_(mask, mask)])
  block_loss, block = restricted_to(loss_fn, params, "Dense_1")
  assert list(block) == ["Dense_1"] and set(block["Dense_1"]) == {"kernel", "bias"}
  nodes = eigenvalue_density(block_loss, block, num_iters=27, rng=jax.random.key(6)).nodes[0]
  np.testing.assert_allclose(np.sort(nodes), values, atol=1e-4 * np.abs(values).max())
  top = values[np.argmax(np.abs(values))]
  for by in ("Dense_1", lambda path: path.startswith("Dense_1/")):
    result = top_eigenvalues(*restricted_to(loss_fn, params, by), max_iters=27, tol=1e-6)
    np.testing.assert_allclose(result.eigenvalues, [top], rtol=1e-4)
  # Masked (all 115 parameters, the other 88 frozen by data): the same top-2 eigenvalues.
  masked_loss, same = restricted_to(loss_fn, params, "Dense_1", masked=True)
  assert same is params
  top2 = values[np.argsort(-np.abs(values))[:2]]
  result = top_eigenvalues(masked_loss, params, k=2, max_iters=40, tol=1e-6)
  np.testing.assert_allclose(result.eigenvalues, top2, rtol=1e-4)
  # A path matches up to "/" or "_" (as "layer3" a ResNet's stage), not inside a name.
  assert set(restricted_to(loss_fn, params, "Dense")[1]) == {"Dense_0", "Dense_1"}
  with pytest.raises(ValueError, match="No parameter path matches 'Dens'"):
    restricted_to(loss_fn, params, "Dens")


def test_stages_are_the_numbered_modules_and_select_their_blocks():
  """A ResNet's stages are its ``layer{s}`` (the stem ``layer0``; not the classifier), in depth
  order (``layer10`` after ``layer2``), and each selects all of its blocks in ``restricted_to``;
  Swin's are its ``stage{s}`` (down-sampling included), a ViT's its blocks."""
  leaf = {"kernel": np.zeros(2)}
  resnet = {name: leaf for name in ("classifier_0", "layer0_0", "layer0_1", "layer10_0", "layer1_0",
                                    "layer2_0", "layer2_1", "smooth1_0")}
  assert stages(resnet) == ["layer0", "layer1", "layer2", "layer10", "smooth1"]
  for stage, blocks in (("layer0", {"layer0_0", "layer0_1"}), ("layer1", {"layer1_0"}),
                        ("layer2", {"layer2_0", "layer2_1"})):
    assert set(restricted_to(jnp.sum, resnet, stage)[1]) == blocks
  swin = {name: leaf for name in ("embedding", "head", "stage1_block0_msa", "stage1_block0_mlp",
                                  "stage2_merge", "stage2_block0_msa")}
  assert stages(swin) == ["stage1", "stage2"]
  assert set(restricted_to(jnp.sum, swin, "stage2")[1]) == {"stage2_merge", "stage2_block0_msa"}
  vit = {name: leaf for name in ("block0_msa", "block0_mlp", "block1_msa", "cls_token",
                                 "pos_embedding")}
  assert stages(vit) == ["block0", "block1"]


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_top3_eigenpairs_match_eigh(problem, method):
  loss_fn, params, _, hessian = problem
  true_values, true_vectors = np.linalg.eigh(hessian)
  order = np.argsort(-np.abs(true_values))
  result = top_eigenvalues(loss_fn, params, k=3, max_iters=1000, tol=1e-6, rng=jax.random.key(5),
                           method=method)
  np.testing.assert_allclose(result.eigenvalues, true_values[order[:3]], rtol=1e-3)
  for _, vector, index in zip(result.eigenvalues, result.eigenvectors, order[:3], strict=True):
    assert abs(np.dot(ravel_pytree(vector)[0], true_vectors[:, index])) > 0.99
  # Lanczos: one shared Krylov space; power iteration: a run per eigenvalue.
  hvps = int(result.iterations[0]) if method == "lanczos" else int(np.sum(result.iterations))
  assert result.method == method and result.hvps == hvps


def test_power_method_keeps_pyhessian_semantics_and_reports_its_residual(problem):
  loss_fn, params, _, hessian = problem
  result = top_eigenvalues(loss_fn, params, method="power")  # PyHessian: 100 iters, tol 1e-3
  assert 1 <= int(result.iterations[0]) <= 100 and result.hvps == int(result.iterations[0])
  top = np.max(np.abs(np.linalg.eigvalsh(hessian)))
  assert abs(float(result.eigenvalues[0])) == pytest.approx(top, rel=2e-2)
  vector = result.eigenvectors[0]
  np.testing.assert_allclose(result.residuals[0],
                             explicit_residual(hessian, result.eigenvalues[0], vector), rtol=1e-3,
                             atol=1e-5)
  v = ravel_pytree(vector)[0]  # the eigenvalue is the Rayleigh quotient of the returned vector
  assert float(result.eigenvalues[0]) == pytest.approx(float(v @ (hessian @ v)), rel=1e-4)


def test_power_minimum_stops_on_the_unshifted_residual():
  # Spectrum [50, 10, −0.5, 0.2, 0.1]: PyHessian's change-of-value rule on H − 50·I stopped
  # after 7–9 HVPs at +0.47 (the shifted value −49.5… barely moves); the residual rule does not.
  spectrum = jnp.array([50.0, 10.0, -0.5, 0.2, 0.1])
  rotation = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (5, 5)))[0]
  hessian = rotation @ jnp.diag(spectrum) @ rotation.T

  def loss_fn(theta):
    return 0.5 * theta @ hessian @ theta

  result = min_eigenvalue(loss_fn, jnp.zeros(5), max_iters=3000, tol=1e-3,
                          rng=jax.random.key(1), top=50.0, method="power")
  assert float(result.eigenvalues) == pytest.approx(-0.5, abs=0.02)
  assert float(result.residuals) <= 1e-3 * 0.5 * 1.01
  assert int(result.iterations) > 9


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_min_eigenvalue_matches_eigh(problem, method):
  loss_fn, params, _, hessian = problem
  true_values = np.linalg.eigvalsh(hessian)
  assert true_values[0] < 0  # a non-convex point: not a by-product of the top eigenvalue
  value, _ = min_eigenvalue(loss_fn, params, max_iters=2000, tol=1e-7, rng=jax.random.key(6),
                            method=method)
  assert float(value) == pytest.approx(true_values[0],
                                       abs=1e-2 * (true_values[-1] - true_values[0]))


def test_crowded_spectrum_power_iteration_stops_off_and_lanczos_converges(crowded):
  """Top-5 of eight near-equal |λ| of both signs, both methods at tol 1e-3 (max_iters 100).

  Measured: power iteration with deflation uses 318 HVPs and is off by 19–184%
  (its iterate mixes +10 and −9.98 and the estimate barely moves between steps);
  Lanczos (block 5) uses 25 HVPs and is within 1e-6.  The assertions leave margin on both.
  """
  loss_fn, params, hessian, true_top = crowded
  power = top_eigenvalues(loss_fn, params, k=5, tol=1e-3, rng=jax.random.key(3), method="power")
  lanczos = top_eigenvalues(loss_fn, params, k=5, tol=1e-3, rng=jax.random.key(3))
  power_error = np.abs(np.asarray(power.eigenvalues) - true_top[:5]) / np.abs(true_top[:5])
  lanczos_error = np.abs(np.asarray(lanczos.eigenvalues) - true_top[:5]) / np.abs(true_top[:5])
  assert np.max(power_error) > 0.05, (power.eigenvalues, power.hvps)
  assert np.max(lanczos_error) < 1e-3, (lanczos.eigenvalues, lanczos.hvps)
  assert lanczos.hvps < power.hvps and lanczos.hvps <= 40, (lanczos.hvps, power.hvps)
  # The residuals tell the two apart: converged pairs vs a stop that only looked converged.
  assert np.all(lanczos.relative_residuals <= 1e-3)
  assert np.max(power.relative_residuals) > 0.05
  for value, vector, residual in zip(lanczos.eigenvalues, lanczos.eigenvectors, lanczos.residuals,
                                     strict=True):
    np.testing.assert_allclose(residual, explicit_residual(hessian, value, vector), rtol=0.05,
                               atol=1e-4)


def test_top_and_min_share_one_krylov_space(crowded):
  loss_fn, params, hessian, true_top = crowded
  top, low = top_and_min_eigenvalues(loss_fn, params, k=3, tol=1e-4, rng=jax.random.key(1))
  np.testing.assert_allclose(top.eigenvalues, true_top[:3], rtol=1e-4)
  np.testing.assert_allclose(low.eigenvalues[0], np.linalg.eigvalsh(hessian)[0], rtol=1e-4)
  assert low.hvps == top.hvps  # one Lanczos run gave both
  alone = min_eigenvalue(loss_fn, params, tol=1e-4, rng=jax.random.key(1))
  assert float(alone.eigenvalues) == pytest.approx(float(low.eigenvalues[0]), rel=1e-4)
  assert alone.residuals <= 1e-4 * abs(float(alone.eigenvalues))


@pytest.mark.parametrize("block_size, max_hvps", [(1, 5), (None, 10)])
def test_lanczos_breakdown_in_a_low_rank_hessian_continues_in_a_fresh_direction(block_size,
                                                                                  max_hvps):
  """H = Q diag(3, −2, 1) Qᵀ on 20 parameters: the Krylov space of one start vector has
  dimension ≤ 4, so single-vector Lanczos must restart to return five pairs (two of them
  λ = 0), after 5 HVPs; a block of 5 (the default for k = 5) spans an invariant space after two
  blocks (10 HVPs) and replaces the rows that broke down."""
  directions, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(20, 3)))
  directions = jnp.asarray(directions, jnp.float32)
  scales = jnp.array([3.0, -2.0, 1.0])

  def loss_fn(p):
    return 0.5 * jnp.sum(scales * (directions.T @ p["w"])**2)

  result = top_eigenvalues(loss_fn, {"w": jnp.zeros(20)}, k=5, rng=jax.random.key(0),
                           block_size=block_size)
  np.testing.assert_allclose(result.eigenvalues, [3.0, -2.0, 1.0, 0.0, 0.0], atol=1e-5)
  vectors = np.stack([np.asarray(v["w"]) for v in result.eigenvectors])
  np.testing.assert_allclose(vectors @ vectors.T, np.eye(5), atol=1e-5)
  assert result.hvps <= max_hvps and result.block_size == (block_size or 5)


def quadratic(eigenvalues, seed):
  """½ θᵀHθ on len(eigenvalues) parameters, H = Q diag(eigenvalues) Qᵀ with Q a random
  orthogonal basis: ``(loss_fn, params, the eigenvalues in decreasing order)``."""
  n = len(eigenvalues)
  basis, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))
  hessian = jnp.asarray((basis * eigenvalues) @ basis.T, jnp.float32)

  def loss_fn(p):
    return 0.5 * p["w"] @ (hessian @ p["w"])

  return loss_fn, {"w": jnp.zeros(n)}, np.sort(eigenvalues)[::-1]


def below(top, seed):
  """``top`` and the rest of 50 eigenvalues uniform in [0, 9]."""
  return np.concatenate([top, np.random.default_rng(seed).uniform(0, 9, 50 - len(top))])


# Ten clusters of five eigenvalues each 1e-5 wide, at 10, 7, 4, 1 and six in [0, 1e-3].
TEN_CLUSTERS = np.concatenate([c + np.linspace(0, 1e-5, 5)
                               for c in np.concatenate([[10, 7, 4, 1], np.linspace(1e-3, 0, 6)])])
CLUSTERED = {
    # name: (eigenvalues, k, seed, HVPs at most: measured + a block).  Single-vector Lanczos
    # (the previous default) at tol 1e-3 stopped on each with every residual ≤ tol·|λ|:
    # 32 HVPs, [9.99991, 9.99, 9.9, 9.8, 9.7] (9.999 and 9.95 missed, 2% off at rank 5);
    "near_equal": (below([10, 9.999, 9.99, 9.95, 9.9, 9.8, 9.7], 14), 5, 14, 50),
    # 34 HVPs, [10, 10, 8.857];
    "triple": (below([10, 10, 10], 4), 3, 4, 42),
    # 5 HVPs, [10, 7, 4].
    "ten_clusters": (TEN_CLUSTERS, 3, 0, 18),
}


@pytest.mark.parametrize("name", list(CLUSTERED))
def test_top_k_of_clustered_and_repeated_eigenvalues_at_default_settings(name):
  """Issue 24.1: block Lanczos (block k) returns the true top k within 1e-4 at the default
  tol 1e-3.  Measured: near_equal 50 HVPs (the whole 50-dimensional space: 9.9 vs 9.8 and the
  rest up to 9 need it at this tolerance), triple 39, ten_clusters 15."""
  eigenvalues, k, seed, max_hvps = CLUSTERED[name]
  loss_fn, params, true = quadratic(eigenvalues, seed)
  result = top_eigenvalues(loss_fn, params, k=k)
  np.testing.assert_allclose(result.eigenvalues, true[:k], rtol=1e-4)
  assert result.hvps <= max_hvps and result.block_size == k
  assert np.all(result.relative_residuals <= 1e-3)
  # Certificate: the k values within residual_bound of k eigenvalues counted with multiplicity
  # (here the true top k), and the next Ritz value below them.
  assert np.max(np.abs(np.asarray(result.eigenvalues) - true[:k])) <= result.residual_bound + 1e-5
  assert result.gap >= 0 and abs(result.next_eigenvalue) <= abs(float(result.eigenvalues[-1]))


@pytest.mark.parametrize("k, max_hvps", [(1, 12), (5, 40)])
def test_tiny_mlp_top_k_and_certificate_match_eigh_at_default_settings(k, max_hvps):
  """A 4–6–3 tanh MLP (51 parameters), cross-entropy on 16 points, default settings (block k,
  tol 1e-3) against ``jax.hessian`` + ``eigh``.  Measured: 11 HVPs for k = 1, 35 for k = 5."""
  keys = jax.random.split(jax.random.key(0), 3)
  x, y = jax.random.normal(keys[0], (16, 4)), jnp.arange(16) % 3
  params = {"w1": jax.random.normal(keys[1], (4, 6)), "b1": jnp.zeros(6),
            "w2": jax.random.normal(keys[2], (6, 3)), "b2": jnp.zeros(3)}

  def loss_fn(p):
    return cross_entropy(jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"], y)

  hessian = explicit_hessian(loss_fn, params)
  values = np.linalg.eigvalsh(hessian)
  true = values[np.argsort(-np.abs(values))]
  result = top_eigenvalues(loss_fn, params, k=k)
  np.testing.assert_allclose(result.eigenvalues, true[:k], rtol=1e-4)
  assert result.hvps <= max_hvps and result.block_size == k
  # The certificate against the explicit Hessian: ‖HV − VΛ‖₂, the next Ritz value near λ_{k+1},
  # and the quadratic residual bound ‖R‖²/(gap − next_residual) on the errors.
  vectors = np.stack([np.asarray(ravel_pytree(v)[0], np.float64) for v in result.eigenvectors], 1)
  found = np.asarray(result.eigenvalues, np.float64)
  np.testing.assert_allclose(result.residual_bound,
                             np.linalg.norm(hessian @ vectors - vectors * found, 2), rtol=1e-2)
  assert abs(result.next_eigenvalue - true[k]) <= result.next_residual
  assert result.gap == pytest.approx(abs(found[-1]) - abs(result.next_eigenvalue), abs=1e-6)
  separation = result.gap - result.next_residual
  assert separation > result.residual_bound
  assert np.max(np.abs(found - true[:k])) <= result.residual_bound**2 / separation


@pytest.mark.parametrize("b, blocks", [(1, 3), (2, 19)])
def test_basis_projects_and_combines_like_numpy(b, blocks):
  """The Krylov basis (blocks of b columns): projecting a matrix out of it and combining its
  columns equal numpy on the stacked blocks."""
  from smoothing_jax.analysis.hessian.lanczos import _Basis
  rng = np.random.default_rng(0)
  n = 64
  columns = np.linalg.qr(rng.normal(size=(n, b * blocks)))[0].astype(np.float32)  # orthonormal
  basis = _Basis(jnp.asarray(columns[:, :b]))
  for i in range(1, blocks):
    basis.append(jnp.asarray(columns[:, i * b:(i + 1) * b]))
  assert len(basis.blocks) == blocks
  np.testing.assert_array_equal(basis.last[-1], columns[:, -b:])
  w = rng.normal(size=(n, 3)).astype(np.float32)
  np.testing.assert_allclose(basis.project_out(jnp.asarray(w)), w - columns @ (columns.T @ w),
                             atol=1e-5)
  coefficients = rng.normal(size=(2, b * blocks))
  np.testing.assert_allclose(basis.combination(coefficients), coefficients @ columns.T,
                             atol=1e-5)


def test_cholesky_qr_equals_numpy_qr_and_flags_what_it_cannot_factor():
  """CholeskyQR2 (the step's QR) against numpy's Householder QR, signs fixed so R's diagonal is
  positive: equal on a well-conditioned block; ``ok`` False on a block of condition 1e5 (beyond
  float32's 1/√ε) and on one with a column at the breakdown level, both of which Gram–Schmidt
  then factors."""
  from smoothing_jax.analysis.hessian.lanczos import _cholesky_qr
  rng = np.random.default_rng(0)
  w = rng.normal(size=(500, 4))
  q, r = np.linalg.qr(w)
  signs = np.sign(np.diag(r))
  found_q, found_r, ok = _cholesky_qr(jnp.asarray(w, jnp.float32), 1.0)
  assert bool(ok)
  np.testing.assert_allclose(found_q, q * signs, atol=1e-5)
  np.testing.assert_allclose(found_r, r * signs[:, None], rtol=1e-5, atol=1e-4)
  ill = w.copy()
  ill[:, 3] = ill[:, 2] + 1e-5 * rng.normal(size=500)
  broken = w.copy()
  broken[:, 1] *= 1e-7
  for matrix in (ill, broken):
    assert not bool(_cholesky_qr(jnp.asarray(matrix, jnp.float32), float(np.abs(w).max()))[2])


def test_partial_reorthogonalization_matches_full_with_fewer_blocks():
  """The default partial reorthogonalisation (Simon's estimates of the basis's loss of
  orthogonality) against full, on a 300-parameter quadratic with λ = 100, 50 and 298 in
  [−1, 10], against eigh: λ_max and λ_min to tol 1e-6 (a long run: λ_min sits in the dense
  part), and 100 SLQ steps.  Both reach the same values; partial reorthogonalised 58 of the 90
  blocks of the first and 64 of the 100 of the second (measured: this small space loses
  orthogonality fast once many Ritz values converge), full all of them."""
  loss_fn, params, _ = quadratic(np.concatenate([[100, 50], np.random.default_rng(0).uniform(
      -1, 10, 298)]), 3)
  true = np.linalg.eigvalsh(explicit_hessian(loss_fn, params))
  runs = {mode: top_and_min_eigenvalues(loss_fn, params, tol=1e-6, max_iters=150,
                                        rng=jax.random.key(2), reorthogonalization=mode)
          for mode in ("partial", "full")}
  for mode, (top, low) in runs.items():
    assert float(top.eigenvalues[0]) == pytest.approx(true[-1], rel=1e-6), mode
    assert float(low.eigenvalues[0]) == pytest.approx(true[0], rel=1e-5), mode
    assert low.residuals[0] <= 1e-6 * abs(true[0])
  assert runs["full"][1].reorthogonalized == runs["full"][1].hvps
  assert 0 < runs["partial"][1].reorthogonalized < 0.8 * runs["partial"][1].hvps
  # SLQ: Gauss quadrature from the probe v integrates H's powers exactly, Σ wᵢθᵢᵖ = vᵀHᵖv/‖v‖²
  # (interior nodes are unconverged and move with rounding; these moments do not).
  hessian = explicit_hessian(loss_fn, params)
  probe = np.asarray(jax.random.rademacher(jax.random.split(jax.random.key(1), 1)[0], (300,),
                                           jnp.float32), np.float64)
  moments = [probe @ np.linalg.matrix_power(hessian, p) @ probe / 300 for p in range(1, 5)]
  for mode in ("partial", "full"):
    density = eigenvalue_density(loss_fn, params, num_iters=100, rng=jax.random.key(1),
                                 reorthogonalization=mode)
    quadrature = [np.sum(density.weights * density.nodes**p) for p in range(1, 5)]
    np.testing.assert_allclose(quadrature, moments, rtol=1e-4, err_msg=mode)
    np.testing.assert_allclose([density.nodes.max(), density.nodes.min()], true[[-1, 0]],
                               rtol=1e-5, err_msg=mode)


def test_invalid_arguments_are_named():
  params = {"w": jnp.zeros(3)}
  loss_fn = lambda p: jnp.sum(p["w"]**2)  # noqa: E731
  with pytest.raises(ValueError, match="Unknown eigensolver method 'arnoldi'"):
    top_eigenvalues(loss_fn, params, method="arnoldi")
  with pytest.raises(ValueError, match="k=4 exceeds the number of parameters"):
    top_eigenvalues(loss_fn, params, k=4)
  with pytest.raises(ValueError, match="tol must be > 0"):
    top_eigenvalues(loss_fn, params, tol=0.0)
  with pytest.raises(ValueError, match="block_size must be a positive integer"):
    top_eigenvalues(loss_fn, params, block_size=0)
  with pytest.raises(ValueError, match="block_size=4 exceeds the number of parameters"):
    top_eigenvalues(loss_fn, params, block_size=4)
  with pytest.raises(ValueError, match="Unknown reorthogonalization 'selective'"):
    top_eigenvalues(loss_fn, params, reorthogonalization="selective")


def test_hutchinson_trace_within_its_standard_error(problem):
  loss_fn, params, _, hessian = problem
  estimate, samples = hessian_trace(loss_fn, params, num_samples=2000, rng=jax.random.key(7))
  off_diagonal = hessian - np.diag(np.diag(hessian))
  std_error = np.sqrt(2 * np.sum(off_diagonal**2) /
                      2000)  # Var(vᵀHv) = 2 Σ_{i≠j} H_ij² for Rademacher v
  assert samples.shape == (2000,)
  assert abs(float(estimate) - np.trace(hessian)) < 4 * std_error


def test_slq_density_integrates_to_one_and_covers_the_spectrum(problem):
  loss_fn, params, _, hessian = problem
  true_values = np.linalg.eigvalsh(hessian)
  density = eigenvalue_density(loss_fn, params, num_iters=100, num_runs=2, rng=jax.random.key(8))
  np.testing.assert_allclose(density.weights.sum(axis=1), 1.0, rtol=1e-5)
  span = true_values[-1] - true_values[0]
  assert density.nodes.max() == pytest.approx(true_values[-1], abs=1e-2 * span)
  assert density.nodes.min() == pytest.approx(true_values[0], abs=1e-2 * span)
  grid, values = density.on_grid(sigma_squared=1e-4)
  assert np.sum(values) * (grid[1] - grid[0]) == pytest.approx(1.0, rel=1e-6)
  assert grid[0] <= true_values[0] and grid[-1] >= true_values[-1]


def _pyhessian_density(eigenvalues, weights, num_bins=10000, sigma_squared=1e-5, overhead=0.01):
  """PyHessian ``density_plot.density_generate``, transcribed: ``(density, grids)``."""
  eigenvalues, weights = np.array(eigenvalues), np.array(weights)
  lambda_max = np.mean(np.max(eigenvalues, axis=1), axis=0) + overhead
  lambda_min = np.mean(np.min(eigenvalues, axis=1), axis=0) - overhead
  grids = np.linspace(lambda_min, lambda_max, num=num_bins)
  sigma = sigma_squared * max(1, (lambda_max - lambda_min))
  density_output = np.zeros((eigenvalues.shape[0], num_bins))
  for i in range(eigenvalues.shape[0]):
    for j in range(num_bins):
      tmp = np.exp(-(grids[j] - eigenvalues[i, :])**2 / (2.0 * sigma)) / np.sqrt(2 * np.pi * sigma)
      density_output[i, j] = np.sum(tmp * weights[i, :])
  density = np.mean(density_output, axis=0)
  return density / (np.sum(density) * (grids[1] - grids[0])), grids


def test_density_on_grid_is_pyhessian_s_with_its_kernel_scaled_by_the_spectrum_width():
  from smoothing_jax.analysis.hessian import SpectralDensity
  rng = np.random.default_rng(0)
  # Two runs of 30 nodes over [-2, 120] (a trained network's spread), weights summing to 1.
  nodes = np.sort(np.concatenate([rng.uniform(-2, 5, (2, 25)), rng.uniform(20, 120, (2, 5))],
                                 axis=1), axis=1)
  nodes[:, 0], nodes[:, -1] = -2.0, 120.0
  weights = rng.dirichlet(np.ones(30), size=2)
  density = SpectralDensity(nodes, weights)
  assert density.kernel_variance() == pytest.approx(1e-5 * 122.02)
  grid, ours = density.on_grid()
  theirs, their_grid = _pyhessian_density(nodes, weights, num_bins=20000)
  assert np.sum(ours) * (grid[1] - grid[0]) == pytest.approx(1.0, rel=1e-9)
  np.testing.assert_allclose(np.interp(their_grid, grid, ours), theirs, atol=0.05 * theirs.max())
  with pytest.warns(UserWarning, match="does not resolve the density's kernel"):
    density.on_grid(grid_size=2000)  # step 0.06 against a kernel of std 0.035
