"""The deep-ensemble method, trained as one job (``config.deep_ensemble.members``): the predictive
against an explicit loop over members, each member against the single run with its seed (derived
from the ensemble's seed, so that ensembles of different seeds share no member), device
counts, resume, member workdirs, every evaluator against ``--ensemble_workdirs`` over the members
written out, and ``Run.predict``, ``ensemble_sizes`` and the training's evaluation agreeing."""
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax import main, methods
from smoothing_jax.analysis.trained import load_trained
from smoothing_jax.evaluators import calibration, ensemble_sizes, ood, selective, temporal_smoothing
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.run import Run
from smoothing_jax.methods.deep_ensemble import (
  DeepEnsemble,
  check_fits,
  member_seeds,
  state_bytes,
)
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh
from smoothing_jax.passes import member_of, sample_rngs
from smoothing_jax.training import train
from smoothing_jax.training.steps import state_initializer, variables_of
from tests.helpers import (
  flat_variables,
  override,
  small_npz,
  small_npz_config,
  subprocess_xla_flags,
)
from tests.methods.paths import assert_paths_agree, three_paths

MEMBERS = 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(data, **overrides):
  """The ensemble of :func:`small_npz_config` on one device, a quarter of the training split held
  out (so the split is the ensemble's)."""
  return small_npz_config(data, **{"deep_ensemble.members": MEMBERS,
                                  "input.holdout_fraction": 0.25, "num_devices": 1, **overrides})


def _assert_close(a, b, **tolerance):
  a, b = flat_variables(a), flat_variables(b)
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_allclose(a[k], b[k], err_msg=k, **tolerance)


@pytest.fixture(scope="module")
def ensemble_run(tmp_path_factory):
  """``(data, workdir)`` of a 2-member ensemble trained by the command line's ``main.run`` (4
  steps, checkpoints at 2 and 4, then the ``ensemble_sizes`` evaluator)."""
  root = tmp_path_factory.mktemp("ensemble")
  (root / "data").mkdir()
  data = small_npz(root / "data")
  main.run(_config(data), str(root / "ensemble"))
  return data, str(root / "ensemble")


def _members_unlike_their_single_runs(data: str, root: str) -> list:
  """Body of ``python -m tests.methods.test_deep_ensemble DATA ROOT``: trains the ensemble of
  :func:`_config` and, for each member, the single run of the seed it records, given the
  ensemble's split (seeded by the ensemble's seed, 0); returns ``(member, variable)`` of every
  variable that is not equal bit for bit."""
  train.train_from_config(_config(data), f"{root}/ensemble")
  run = Run.from_workdir(f"{root}/ensemble")
  unequal = []
  for m in range(MEMBERS):
    single = train.train_from_config(
        small_npz_config(data, seed=member_seeds(0, MEMBERS)[m], num_devices=1,
                         **{"input.split_seed": 0, "input.holdout_fraction": 0.25}),
        f"{root}/seed{m}")
    ours, theirs = flat_variables(run.member(m).variables), flat_variables(variables_of(single))
    unequal += [(m, k) for k in ours if not np.array_equal(ours[k], theirs[k])]
  return unequal


def test_each_member_equals_the_single_run_with_its_seed_and_the_members_differ(ensemble_run,
                                                                                  tmp_path):
  data, workdir = ensemble_run
  run = Run.from_workdir(workdir)
  assert run.step == 4 and jax.tree.leaves(run.variables)[0].shape[0] == MEMBERS
  # config.json records the members' seeds, derived from the pair (seed 0, m).
  seeds = member_seeds(0, MEMBERS)
  assert workdir_lib.read_record(workdir)["deep_ensemble"]["member_seeds"] == list(seeds)
  assert len(set(seeds)) == MEMBERS and not set(seeds) & set(member_seeds(1, MEMBERS))
  assert [run.write_member(m, str(tmp_path / f"member{m}")).config.seed
          for m in range(MEMBERS)] == list(seeds)
  first, second = (flat_variables(run.member(m).variables) for m in range(MEMBERS))
  kernels = [k for k in first if k.endswith("kernel")]  # initialised from each member's seed
  assert kernels and all(np.abs(first[k] - second[k]).max() > 1e-2 for k in kernels)
  # Member m is, bit for bit, the single run of its seed: in a process with XLA:CPU's default
  # emitters, as users run.  (The suite's older emitters, for compile speed, order the members'
  # reductions differently from a single run's: the two then differ by float32 round-off.)
  checked = subprocess.run(
      [sys.executable, "-m", "tests.methods.test_deep_ensemble", data, str(tmp_path / "exact")],
      cwd=ROOT, env=dict(os.environ, XLA_FLAGS=subprocess_xla_flags(default_emitters=True)),
      capture_output=True, text=True, timeout=600)
  assert checked.returncode == 0, checked.stderr[-5000:]
  assert json.loads(checked.stdout.splitlines()[-1]) == []


def test_the_members_log_their_own_metrics_and_the_ensemble_is_evaluated(ensemble_run):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  _, workdir = ensemble_run
  events = EventAccumulator(workdir)
  events.Reload()
  tags = set(events.Tags()["tensors"]) | set(events.Tags()["scalars"])
  for metric in ("train_loss", "train_accuracy", "eval_nll", "eval_acc", "eval_ece"):
    assert {metric, *(f"{metric}/member_{m}" for m in range(MEMBERS))} <= tags, metric
  table = (ensemble_run[1] + "/results/ensemble_sizes.csv")
  assert os.path.exists(table)


def test_eight_devices_match_one_and_an_eight_device_checkpoint_resumes_on_one(ensemble_run,
                                                                               tmp_path):
  data, workdir = ensemble_run
  split = str(tmp_path / "split")
  # Steps 1-2 on 8 devices, checkpoint at 2.
  train.train_from_config(_config(data, num_devices=8), split, stop_after_steps=2)
  on_one = Run.from_workdir(split, mesh=create_mesh(1))
  on_eight = Run.from_workdir(split, mesh=create_mesh(8))
  _assert_close(on_one.variables, on_eight.variables, rtol=0, atol=0)
  resumed = train.train_from_config(_config(data), split)  # steps 3-4 on 1 device
  _assert_close(variables_of(resumed), Run.from_workdir(workdir).variables, rtol=1e-5,
                atol=1e-6)


def test_a_resumed_ensemble_is_bit_identical(ensemble_run, tmp_path):
  data, workdir = ensemble_run
  train.train_from_config(_config(data), str(tmp_path / "resumed"), stop_after_steps=2)
  resumed = train.train_from_config(_config(data), str(tmp_path / "resumed"))
  _assert_close(variables_of(resumed), Run.from_workdir(workdir).variables, rtol=0, atol=0)


def test_every_evaluator_on_the_ensemble_equals_ensemble_workdirs_of_its_members(ensemble_run,
                                                                                 tmp_path):
  data, workdir = ensemble_run
  run = Run.from_workdir(workdir)
  members = [str(tmp_path / f"member{m}") for m in range(MEMBERS)]
  for m, member_dir in enumerate(members):
    written = run.write_member(m, member_dir)
    assert (written.config.seed, written.config.deep_ensemble.members) == (
        member_seeds(0, MEMBERS)[m], 1)
    assert written.config.input.split_seed == 0 and written.step == run.step
    _assert_close(written.variables, run.member(m).variables, rtol=0, atol=0)
  first = Run.from_workdir(members[0])
  for name, evaluate, options in (
      ("ensemble_sizes", ensemble_sizes.evaluate, {}),
      ("calibration", calibration.evaluate, {}),
      ("selective", selective.evaluate, {}),
      ("ood", ood.evaluate, {"datasets": (f"npz:{data}",)}),
  ):
    together = evaluate(run, tmp_path / "together" / name, **options)
    apart = evaluate(first, tmp_path / "apart" / name, members=members[1:], **options)
    if isinstance(together, dict):
      together, apart = [together], [apart]
    assert len(together) == len(apart) > 0, name
    for a, b in zip(together, apart, strict=True):
      assert a.keys() == b.keys(), name
      # Each names what it scored: the ensemble's checkpoint, or those of the member workdirs.
      assert a["checkpoint"] == f"{workdir}/checkpoints/{run.step}", name
      assert b["checkpoint"] == " + ".join(f"{m}/checkpoints/{run.step}" for m in members), name
      for key in a.keys() - {"checkpoint"}:
        if isinstance(a[key], float):
          np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-7, err_msg=f"{name} {key}")
        else:
          assert a[key] == b[key], (name, key)
  sizes = [row["ensemble_size"] for row in calibration.evaluate(run, tmp_path / "sizes")
           if row["placement"] == "members"]
  assert sizes == list(range(1, MEMBERS + 1))


def test_a_written_out_member_resumes_as_the_single_run(ensemble_run, tmp_path):
  _, workdir = ensemble_run
  member = Run.from_workdir(workdir).write_member(1, str(tmp_path / "member1"))
  config = override(member.config, num_train_steps=5)
  resumed = train.train_from_config(config, member.workdir)
  assert int(resumed.step) == 5
  with pytest.raises(ValueError, match="already holds a run"):
    Run.from_workdir(workdir).write_member(0, member.workdir)


def test_one_model_consumers_take_a_member_and_refuse_the_whole_ensemble(ensemble_run, tmp_path):
  _, workdir = ensemble_run
  with pytest.raises(ValueError, match="ensemble of 2 members.*member=<0..1>"):
    load_trained(workdir)
  assert load_trained(workdir, member=1).config.seed == member_seeds(0, MEMBERS)[1]
  with pytest.raises(ValueError, match="The temporal evaluator .* ensemble of 2 members"):
    temporal_smoothing.evaluate(Run.from_workdir(workdir), tmp_path)
  with pytest.raises(ValueError, match="^This run is a deep ensemble of 2 members already; "
                     "--ensemble_workdirs joins single runs"):
    ensemble_sizes.evaluate(Run.from_workdir(workdir), tmp_path, members=[workdir])
  # An evaluation config (--mode=<evaluator> --config=...) keeps the recorded member count and
  # split (``RECORDED_KEYS``: the evaluation config holds none held out).
  evaluated = Run.from_workdir(workdir, small_npz_config(ensemble_run[0]))
  assert (evaluated.stacked_members, evaluated.config.input.holdout_fraction) == (MEMBERS, 0.25)
  run = Run.from_workdir(workdir)
  images = np.asarray(run.pipeline.eval_arrays["images"][:3], np.float32) / 255.0
  probs = run.predict(images)
  each = [run.member(m).predict(images) for m in range(MEMBERS)]
  np.testing.assert_allclose(probs, np.mean(each, axis=0), rtol=1e-5, atol=1e-7)


def test_ensembles_of_different_seeds_share_no_member(ensemble_run, tmp_path):
  """Seed 1's ensemble (the fixture's programs, from the compilation cache) against seed 0's:
  with member m the run of seed + m, seed 1's member 0 was seed 0's member 1."""
  data, workdir = ensemble_run
  other = variables_of(train.train_from_config(_config(data, seed=1), str(tmp_path / "seed1")))
  ours = Run.from_workdir(workdir).variables
  for a in range(MEMBERS):
    for b in range(MEMBERS):
      first, second = flat_variables(member_of(ours, a)), flat_variables(member_of(other, b))
      shared = [k for k in first if k.endswith("kernel") and np.allclose(first[k], second[k])]
      assert not shared, (a, b, shared)


def test_an_ensemble_workdir_of_seed_plus_m_members_evaluates_as_before(ensemble_run, tmp_path):
  """A workdir recorded before member seeds were derived (no ``member_seeds``): its members are
  the runs of seed + m, and it predicts as it did."""
  _, workdir = ensemble_run
  old = tmp_path / "old"
  shutil.copytree(workdir, old)
  record = workdir_lib.read_record(old)
  del record["deep_ensemble"]["member_seeds"]
  (old / workdir_lib.CONFIG_FILE).write_text(json.dumps(record))
  run, today = Run.from_workdir(str(old)), Run.from_workdir(workdir)
  assert run.config.deep_ensemble.member_seeds == [0, 1]
  assert [run.member(m).config.seed for m in range(MEMBERS)] == [0, 1]
  images = np.asarray(run.pipeline.eval_arrays["images"][:3], np.float32) / 255.0
  np.testing.assert_array_equal(run.predict(images), today.predict(images))
  assert run.write_member(1, str(tmp_path / "member1")).config.seed == 1


@pytest.mark.parametrize("members", [0, -1])
def test_bad_ensemble_sizes_are_refused_in_one_line(members):
  config = override(small_npz_config("/nonexistent"), **{"deep_ensemble.members": members})
  with pytest.raises(ValueError,
                     match=r"^deep_ensemble.members must be an integer >= 1, got .*\.$"):
    methods.resolve(config, get_model("resnet_dnn_18", num_classes=10))


def test_an_ibnn_and_an_init_from_run_cannot_be_ensembles():
  config = lambda **values: small_npz_config(  # noqa: E731
      "/nonexistent", **{"deep_ensemble.members": 2, **values})
  with pytest.raises(ValueError, match="is an iBNN"):
    methods.resolve(config(model="vgg_ibnn_16"), get_model("vgg_ibnn_16", 10))
  with pytest.raises(ValueError, match="^init_from is for single runs"):
    methods.resolve(config(init_from="/elsewhere"), get_model("resnet_dnn_18", 10))
  method = methods.resolve(config(), get_model("resnet_mcdo_18", 10))
  assert isinstance(method, DeepEnsemble) and method.base.name == "mc_dropout"
  assert method.describe() == "deep_ensemble of 2 mc_dropout"
  with pytest.raises(ValueError, match="^VQ-BNN temporal smoothing takes one model's predictions"):
    method.frame_probs({}, np.zeros((1, 8, 8, 3), np.float32), jax.random.key(0))


def test_the_predictive_is_one_draw_of_each_member(tiny_mcdo):
  """A deep ensemble of MC-dropout members: member m is one dropout pass of its own variables
  with key ``split(key, M)[m]``, an explicit loop averaged in numpy."""
  model, variables = tiny_mcdo
  members = [jax.tree.map(lambda x, m=m: x * (1.0 + 0.1 * m), variables) for m in range(3)]
  stacked = jax.tree.map(lambda *xs: jax.numpy.stack(xs), *members)
  method = DeepEnsemble.wrap(methods.resolve(None, model), size=3)
  assert method.nested((1, 10)) == (method, (1, 2, 3))
  images = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
  rng = jax.random.key(1)
  pred = method.predict(stacked, images, rng=rng)
  one_pass = jax.jit(lambda v, key: jax.nn.softmax(model.apply(v, images, train=False,
                                                               rngs=sample_rngs(key))))
  loop = [np.asarray(one_pass(member_of(stacked, m), key), np.float64)
          for m, key in enumerate(jax.random.split(rng, 3))]
  np.testing.assert_allclose(pred.sample_probs, np.stack(loop), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(pred.mean_probs, np.mean(loop, axis=0), rtol=1e-5, atol=1e-6)


def test_predict_the_evaluators_and_the_training_evaluation_agree(ensemble_run, tmp_path):
  _, workdir = ensemble_run
  paths = three_paths(workdir, tmp_path)
  assert_paths_agree(paths)


class _Device:
  process_index = 0

  def __init__(self, limit):
    self.limit = limit

  def memory_stats(self):
    return {"bytes_limit": self.limit}


def test_an_ensemble_too_large_for_the_device_is_refused_with_the_estimate():
  from smoothing_jax.training.optim import create_learning_rate_schedule
  config = small_npz_config("/nonexistent", **{"model_kwargs.width": 4})
  model = get_model("resnet_dnn_18", num_classes=10, width=4, stage_sizes=(1,))
  schedule = create_learning_rate_schedule(config, 10)
  method = DeepEnsemble.wrap(methods.resolve(config, model), config, size=3)
  init_one = state_initializer(config, method.base, (32, 32, 3), schedule)
  estimate = state_bytes(init_one)
  # The estimate is what a real initialised state takes: parameters, momentum, statistics, step.
  state = method.init_train_state(config, init_one, [_Device(10**9)])
  assert 3 * estimate == sum(x.nbytes for x in jax.tree.leaves(state)) + 2 * 4  # one shared step
  with pytest.raises(ValueError, match=r"^An ensemble of 3 resnet_dnn_18 needs .* GiB .* more "
                     r"than 50% of the 0\.0 GiB a device has"):
    check_fits(config, init_one, 3, [_Device(estimate)])




def test_a_laplace_ensemble_fits_each_member_and_predicts_by_each_members_posterior(
    ensemble_run, tmp_path):
  """``--mode=fit --config.method=laplace`` on the ensemble's workdir: the fit is each member's
  (equal to that member fitted alone, ``Run.member``), and the predictive's draw m is member m's
  probit predictive."""
  import shutil

  from smoothing_jax.experiment.run import Run
  _, workdir = ensemble_run
  copy = str(tmp_path / "ensemble")
  shutil.copytree(workdir, copy)
  config = main.resolve_config("fit", copy, None, [("method", "laplace"),
                                                   ("laplace.structure", "diag")])
  main.run(config, copy, "fit")
  run = Run.from_workdir(copy, config)
  assert run.method.name == "deep_ensemble" and run.method.per_member.name == "laplace"
  fitted = run.prediction_variables()["laplace"]
  images = jnp.asarray(next(run.eval_batches())["image"])
  draws = run.method.sample_log_probs(run.prediction_variables(), images, jax.random.key(0))
  assert draws.shape[0] == MEMBERS
  for m in range(MEMBERS):
    member = run.member(m)
    alone = member.method.fit(member.variables, member.train_eval_batches)["laplace"]
    for key, value in alone.items():
      np.testing.assert_allclose(fitted[key][m], value, rtol=1e-5, atol=1e-6, err_msg=key)
    # The member as a run of its own reads its slice of the ensemble's stored fit.
    own = member.method.sample_log_probs(member.prediction_variables(), images, None)
    np.testing.assert_allclose(draws[m], own[0], rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
  print(json.dumps(_members_unlike_their_single_runs(sys.argv[1], sys.argv[2])))
