"""Learning trajectories in polar coordinates (HV Fig. 1b: "ViT converges to the optimum along a
smooth trajectory"), from the record training keeps
(``smoothing_jax.training.trajectory_recorder``).

**Estimator.**  For snapshots s, t, ‖y_s − y_t‖² = ‖G(θ_s − θ_t)‖² / D is an unbiased estimate
of ‖θ_s − θ_t‖², distributed as ‖θ_s − θ_t‖² · χ²_D / D (Johnson–Lindenstrauss): relative
error √(2/D) for squared distances, about √(1/(2D)) for distances (D = 256: 8.8% and 4.4%);
inner products of differences, hence angles, are estimated with errors of the same order.  The
exact ‖θ‖² lets a record check itself: ``norm_error`` = ‖y‖²/‖θ‖² − 1 per snapshot are draws
of that relative error.

**Polar coordinates** (:func:`polar_coordinates`), relative to the final optimum θ_T::

    r_t = ‖θ_t − θ_T‖,   φ_t = ∠(θ_t − θ_T, θ_0 − θ_T) ∈ [0, π]

so every trajectory starts at angle 0 and radius r_0 and ends at the origin; descending
straight to θ_T keeps φ = 0 with r falling linearly in the distance covered, and every turn
shows as a change of angle.  HV's slides show the figure without a formula, and HV's code
repository has none, so this definition (the angle measured from the initial offset) is ours.
Smoothness is reported as the path length Σ_t ‖θ_{t+1} − θ_t‖ over the straight distance
‖θ_0 − θ_T‖ (1: a straight line); it grows with the sampling rate k⁻¹ (SGD noise adds length),
so compare runs recorded with the same k.
"""
from __future__ import annotations

import numpy as np

from smoothing_jax.training.trajectory_recorder import Trajectory


def polar_coordinates(points) -> dict:
  """Polar coordinates of a trajectory about its last point (see the module docstring).

  Args:
    points: ``[S, D]`` snapshots θ_0 … θ_T (S >= 2), in parameter space or projected.

  Returns:
    ``radius [S]`` (r_t = ‖θ_t − θ_T‖), ``angle [S]`` (φ_t in radians, 0 where r_t = 0),
    ``path_length`` (Σ ‖θ_{t+1} − θ_t‖), ``distance`` (r_0) and ``path_ratio`` (their ratio,
    >= 1; 1 for a straight line).

  Raises:
    ValueError: fewer than two snapshots, or a trajectory that ends where it starts.
  """
  points = np.asarray(points, np.float64)
  if points.ndim != 2 or len(points) < 2:
    raise ValueError(f"A trajectory needs points [S, D] with S >= 2, got shape {points.shape}.")
  offsets = points - points[-1]
  radius = np.linalg.norm(offsets, axis=1)
  if radius[0] == 0:
    raise ValueError("The trajectory ends where it starts (θ_0 = θ_T): its angles are undefined.")
  cosine = offsets @ offsets[0] / np.maximum(radius * radius[0], np.finfo(np.float64).tiny)
  angle = np.where(radius > 0, np.arccos(np.clip(cosine, -1.0, 1.0)), 0.0)
  path_length = float(np.sum(np.linalg.norm(np.diff(points, axis=0), axis=1)))
  return {"radius": radius, "angle": angle, "path_length": path_length,
          "distance": float(radius[0]), "path_ratio": path_length / float(radius[0])}


def polar_trajectory(trajectory: Trajectory) -> dict:
  """:func:`polar_coordinates` of a record's projections, with its ``steps``, the expected
  relative error of squared distances √(2/dims) (``relative_error``) and the observed one of
  each snapshot's squared norm, ‖y‖²/‖θ‖² − 1 (``norm_error [S]``)."""
  projections = np.asarray(trajectory.projections, np.float64)
  norm_error = np.sum(projections ** 2, axis=1) / np.asarray(trajectory.norm_sq, np.float64) - 1
  return {**polar_coordinates(projections), "steps": np.asarray(trajectory.steps),
          "relative_error": float(np.sqrt(2.0 / trajectory.dims)), "norm_error": norm_error}
