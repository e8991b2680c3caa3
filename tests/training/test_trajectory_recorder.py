"""smoothing_jax.training.trajectory_recorder (the record training keeps: the random projection
against numpy, its distance estimates, the record's resume) and smoothing_jax.analysis.trajectory
(polar coordinates on hand-made trajectories, the polar plot).

(The record written by training, and its resume, are tested in ``tests/training/test_train.py``.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax import plots
from smoothing_jax.analysis import trajectory
from smoothing_jax.training import trajectory_recorder as recording


def test_straight_line_to_the_optimum_keeps_angle_zero_and_shrinks_linearly():
  rng = np.random.default_rng(0)
  optimum, offset = rng.normal(size=7), rng.normal(size=7)
  points = [optimum + (1 - t / 4) * offset for t in range(5)]
  polar = trajectory.polar_coordinates(points)
  np.testing.assert_allclose(polar["radius"], np.linalg.norm(offset) * np.linspace(1, 0, 5),
                             atol=1e-12)
  np.testing.assert_allclose(polar["angle"], 0.0, atol=1e-6)
  assert polar["distance"] == pytest.approx(np.linalg.norm(offset))
  assert polar["path_ratio"] == pytest.approx(1.0)


def test_quarter_circle_around_the_optimum_keeps_the_radius_and_turns_to_a_right_angle():
  """θ_t = θ_T + R(cos α_t e₁ + sin α_t e₂), α_t = 0, π/8, …, π/2, then θ_T: r = R, φ = α, and
  the path is 4 chords 2R sin(π/16) plus the last jump R."""
  optimum, radius = np.array([1.0, -2.0, 0.5]), 3.0
  alphas = np.linspace(0, np.pi / 2, 5)
  points = [optimum + radius * np.array([np.cos(a), np.sin(a), 0.0]) for a in alphas] + [optimum]
  polar = trajectory.polar_coordinates(points)
  np.testing.assert_allclose(polar["radius"], [radius] * 5 + [0.0], atol=1e-12)
  np.testing.assert_allclose(polar["angle"], list(alphas) + [0.0], atol=1e-7)
  np.testing.assert_allclose(polar["path_length"], 4 * 2 * radius * np.sin(np.pi / 16) + radius)
  assert polar["path_ratio"] == pytest.approx(4 * 2 * np.sin(np.pi / 16) + 1)


def test_degenerate_trajectories_are_clear_errors():
  with pytest.raises(ValueError, match="S >= 2"):
    trajectory.polar_coordinates(np.zeros((1, 3)))
  with pytest.raises(ValueError, match="ends where it starts"):
    trajectory.polar_coordinates(np.ones((3, 2)))


def _tree(scale=1.0):
  return {"conv": {"kernel": scale * jnp.arange(12.0).reshape(2, 2, 3) - 4.0},
          "dense": scale * jnp.linspace(-1.0, 2.0, 5)}


def test_projection_equals_numpy_dot_products_with_the_documented_directions():
  """Direction d on leaf i: normal(fold_in(fold_in(direction_key(seed), i), d)); G θ / √D in
  float64 numpy, leaf by leaf, against the jitted projection, whole and in chunks (24 numbers at
  once: 2 of the 12-number leaf's directions, 4 of the 5-number leaf's, with a remainder)."""
  dims, params = 6, _tree()
  key = recording.direction_key(3)
  leaves = jax.tree.leaves(params)
  directions = np.concatenate([
      np.stack([np.asarray(jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, i), d),
                                             (leaf.size,))) for d in range(dims)])
      for i, leaf in enumerate(leaves)], axis=1).astype(np.float64)      # [D, n]
  theta = np.concatenate([np.ravel(leaf) for leaf in leaves]).astype(np.float64)
  expected = directions @ theta / np.sqrt(dims)
  project = jax.jit(recording.random_projection, static_argnums=(2, 3))
  for chunk in (recording.CHUNK_ELEMENTS, 24):
    np.testing.assert_allclose(project(params, key, dims, chunk), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(project(params, recording.direction_key(3), dims, 24),
                                project(params, key, dims, 24))  # same seed, same directions
  assert not np.allclose(project(params, recording.direction_key(4), dims, 24), expected)
  assert float(recording.squared_norm(params)) == pytest.approx(theta @ theta)


def test_projected_trajectory_estimates_distances_and_angles_within_the_stated_error():
  """A quarter circle in 4,000 dimensions (random orthonormal plane) projected on D = 256
  directions: squared radii within 3·√(2/D) of the true ones, angles within 0.15 rad."""
  dims, n = 256, 4000
  plane, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(n, 2)))
  optimum = np.random.default_rng(2).normal(size=n)
  alphas = np.linspace(0, np.pi / 2, 5)
  points = np.array([optimum + 2.0 * plane @ [np.cos(a), np.sin(a)] for a in alphas] + [optimum])
  project = jax.jit(jax.vmap(lambda p: recording.random_projection(p, recording.direction_key(0),
                                                                    dims)))
  projected = trajectory.polar_coordinates(np.asarray(project(jnp.asarray(points, jnp.float32))))
  exact = trajectory.polar_coordinates(points)
  relative_error = np.sqrt(2 / dims)
  np.testing.assert_allclose(projected["radius"][:-1] ** 2, exact["radius"][:-1] ** 2,
                             rtol=3 * relative_error)
  np.testing.assert_allclose(projected["angle"], exact["angle"], atol=0.15)


def _record_run(workdir, steps, every_steps=2, last_step=7, start=0):
  """A recorder over parameters that change with the step; written after each step."""
  recorder = recording.TrajectoryRecorder(workdir, every_steps, 4, 0, last_step)
  recorder.start(start, _tree(1.0 + start))
  for step in steps:
    recorder.observe(step, _tree(1.0 + step))
    recorder.write()
  return recording.load_trajectory(workdir)


def test_recorder_resume_drops_rows_after_the_restored_step_and_continues_exactly(tmp_path):
  full = _record_run(tmp_path / "full", range(1, 8))
  assert list(full.steps) == [0, 2, 4, 6, 7]  # every 2 steps, and the last
  _record_run(tmp_path / "cut", range(1, 7))  # rows up to 6 written, then "killed"...
  resumed = _record_run(tmp_path / "cut", range(5, 8), start=4)  # ...and resumed from step 4
  np.testing.assert_array_equal(resumed.steps, full.steps)
  np.testing.assert_array_equal(resumed.projections, full.projections)
  np.testing.assert_array_equal(resumed.norm_sq, full.norm_sq)
  norm_sq = [sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(
      _tree(1.0 + step))) for step in full.steps]
  np.testing.assert_allclose(full.norm_sq, norm_sq, rtol=1e-6)
  polar = trajectory.polar_trajectory(full)
  assert polar["relative_error"] == pytest.approx(np.sqrt(2 / 4))
  np.testing.assert_allclose(polar["norm_error"],
                             np.sum(np.square(full.projections, dtype=np.float64), 1) / norm_sq - 1,
                             rtol=1e-5)
  with pytest.raises(ValueError, match="trajectory_dims 4 and seed 0, this run has 8 and 0"):
    recording.TrajectoryRecorder(tmp_path / "full", 2, 8, 0, 7)
  for every, dims in ((-1, 4), (2, 0), (1.5, 4)):
    with pytest.raises(ValueError, match="trajectory_"):
      recording.TrajectoryRecorder(tmp_path / "new", every, dims, 0, 7)
  off = recording.TrajectoryRecorder(tmp_path / "off", 0, 4, 0, 7)
  off.start(0, _tree())
  off.observe(2, _tree())
  off.write()
  assert not (tmp_path / "off" / recording.TRAJECTORY_FILE).exists()
  with pytest.raises(FileNotFoundError, match="trajectory_every_steps"):
    recording.load_trajectory(tmp_path / "off")


def test_plot_trajectories_draws_each_run_on_one_polar_axes(tmp_path):
  import matplotlib
  matplotlib.use("Agg")
  straight = trajectory.polar_coordinates([[2.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
  turning = trajectory.polar_coordinates([[2.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
  fig = plots.plot_trajectories({"ViT": straight, "ResNet": turning})
  ax = fig.axes[0]
  assert ax.name == "polar" and len(ax.lines) == 2
  np.testing.assert_allclose(ax.lines[1].get_xdata(), [0, np.pi / 2, 0])
  np.testing.assert_allclose(ax.lines[1].get_ydata(), [1, 1, 0])  # r / r₀
  labels = [t.get_text() for t in ax.get_legend().get_texts()]
  assert labels == ["ViT (path / distance 1.00)",
                    f"ResNet (path / distance {(np.sqrt(8) + 2) / 2:.2f})"]
  fig.savefig(tmp_path / "trajectories.png")
