"""Checkpoint and snapshot ensembles: the cyclic cosine rate and the snapshot steps against a
hand-worked schedule, the snapshots a trained run keeps against its checkpoints of those steps,
and ``Run.predict`` and ``ensemble_sizes`` scoring one predictive."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from smoothing_jax.methods.base import Clock
from smoothing_jax.methods.snapshot import CheckpointEnsemble, SnapshotEnsemble, cosine_restarts
from smoothing_jax.models import get_model


def test_the_rate_restarts_every_cycle_as_huang_et_al_eq_2():
  """T = 12 steps in M = 3 cycles of L = 4: α(t) = α₀/2 (cos(π (t mod 4)/4) + 1), by hand 1,
  (1 + cos(π/4))/2, 1/2, (1 + cos(3π/4))/2, three times.  T = 10 (M does not divide it): cycles of
  4, 3 and 3 iterations, each from α₀: 1, (1 + cos(π/3))/2 = 3/4, (1 + cos(2π/3))/2 = 1/4."""
  by_hand = [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2]
  rates = [float(cosine_restarts(0.2, 12, 3)(t)) for t in range(12)]
  np.testing.assert_allclose(rates, [0.2 * r for r in by_hand * 3], rtol=1e-6)
  rates = [float(cosine_restarts(0.2, 10, 3)(t)) for t in range(10)]
  np.testing.assert_allclose(rates, [0.2 * r for r in by_hand + [1, 0.75, 0.25] * 2], rtol=1e-6)


def _taken(method, num_steps: int, steps_per_epoch: int) -> dict:
  """``{step: slot}`` of the steps whose clock makes ``method`` take a snapshot."""
  out = {}
  for step in range(1, num_steps + 1):
    due, slot = method.slot(Clock.after(jnp.asarray(step), steps_per_epoch, num_steps))
    if bool(due):
      out[step] = int(slot)
  return out


def test_snapshots_are_taken_at_the_cycle_ends_and_checkpoints_at_the_last_epochs():
  model = get_model("resnet_dnn_18", 10, width=4, stage_sizes=(1,))
  # 12 steps, 3 cycles of 4: after steps 4, 8 and 12; 10 steps: cycles of 4, 3 and 3; 9 steps
  # in 4 cycles: 3, 2, 2 and 2 (Eq. 2's ⌈9/4⌉ = 3 would leave the fourth cycle empty).
  assert _taken(SnapshotEnsemble(model, size=3), 12, 5) == {4: 0, 8: 1, 12: 2}
  assert _taken(SnapshotEnsemble(model, size=3), 10, 5) == {4: 0, 7: 1, 10: 2}
  assert _taken(SnapshotEnsemble(model, size=4), 9, 5) == {3: 0, 5: 1, 7: 2, 9: 3}
  # 6 epochs of 2 steps, 3 snapshots every 2 epochs: the ends of epochs 2, 4 and 6.
  assert _taken(CheckpointEnsemble(model, size=3, every_epochs=2), 12, 2) == {4: 0, 8: 1, 12: 2}
  assert _taken(CheckpointEnsemble(model, size=2), 12, 2) == {10: 0, 12: 1}


@pytest.fixture(scope="module")
def snapshot_run(tmp_path_factory):
  """The small npz run (4 steps an epoch) trained 12 steps as a snapshot ensemble of 3 (cycles
  of 4 steps), checkpoints at every snapshot."""
  from smoothing_jax.experiment.config_base import with_method
  from smoothing_jax.training import train
  from tests.helpers import override, small_npz, small_npz_config
  root = tmp_path_factory.mktemp("snapshot")
  (root / "data").mkdir()
  data = small_npz(root / "data")
  config = override(with_method(small_npz_config(data, num_train_steps=12,
                                                 checkpoint_every_steps=4, keep_checkpoints=3,
                                                 ensemble_sizes=(1, 2, 3)), "snapshot_ensemble"),
                    **{"snapshot_ensemble.size": 3})
  train.train_from_config(config, str(root / "run"))
  return str(root / "run")


def test_a_checkpoint_from_before_the_last_snapshot_is_refused_in_one_line(snapshot_run):
  from smoothing_jax.experiment.run import Run
  run = Run.from_workdir(snapshot_run)
  state = dict(run.variables["snapshot_ensemble"])
  state["filled"] = state["filled"].at[2].set(False)  # as a checkpoint before the last cycle's end
  run.variables = {**run.variables, "snapshot_ensemble": state}
  with pytest.raises(ValueError, match=r"^This checkpoint holds 2 of the 3 snapshots of its "
                     r"snapshot_ensemble .*: train the run to its end\.$"):
    run.prediction_variables()


def test_the_snapshots_are_the_networks_at_the_cycle_ends_newest_first(snapshot_run):
  from smoothing_jax.experiment.checkpoints import checkpoint_manager
  from smoothing_jax.experiment.run import Run
  run = Run.from_workdir(snapshot_run)
  prepared = run.prediction_variables()
  with checkpoint_manager(snapshot_run, read_only=True) as manager:
    for n, step in enumerate((12, 8, 4)):
      saved = manager.restore(step)
      for part in ("params", "batch_stats"):
        ours = flatten_dict(jax.tree.map(lambda x, n=n: np.asarray(x[n]), prepared[part]))
        for key, value in flatten_dict(saved[part]).items():
          np.testing.assert_array_equal(ours[key], value, err_msg=f"{step} {key}")


def test_predict_and_the_evaluators_score_one_predictive(snapshot_run, tmp_path):
  from tests.methods.paths import assert_paths_agree, three_paths
  paths = three_paths(snapshot_run, tmp_path, num_samples=3)
  assert set(paths) == {"predict", "ensemble_sizes"}
  assert_paths_agree(paths)
