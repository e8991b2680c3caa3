"""SWA and SWAG against TorchUncertainty 0.13.0's ``SWA`` and ``SWAG`` (pinned in
``requirements-test.txt``), run here on one tiny torch MLP whose weights are set to a fixed
sequence of models and collected by both: the mean, the mean of squares and the deviation matrix
(TorchUncertainty's rows, oldest first, against our ring buffer's slots) equal, and a sample from
the standard normals TorchUncertainty drew (recorded from its ``torch.randn_like``/``torch.randn``)
equal to its sample, diagonal and low-rank, with more and with fewer models than the rank."""
import importlib
import importlib.util
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.methods import swag

# The torch MLP's parameters → (Flax module, leaf); a Linear's weight [out, in] is the Dense's
# kernel [in, out] transposed.
FLAX_LEAF = {"0.weight": ("Dense_0", "kernel"), "0.bias": ("Dense_0", "bias"),
             "2.weight": ("Dense_1", "kernel"), "2.bias": ("Dense_1", "bias")}
# How far each parameter moves between the collected models: "2.bias" never moves, so its σ² is
# TorchUncertainty's clamp; "0.bias" has σ² ~ 1e-4, under the 1e-3 clamp of one case.
SPREAD = {"0.weight": 0.3, "0.bias": 0.01, "2.weight": 0.1, "2.bias": 0.0}


class MLP(nn.Module):
  """The Flax twin of ``Sequential(Linear(4, 3), ReLU(), Linear(3, 2))``."""

  @nn.compact
  def __call__(self, x):
    hidden = nn.relu(nn.Dense(3)(x))   # Dense_0: named in the order the modules are built
    return nn.Dense(2)(hidden)


def import_swag():
  """``(torch, torch_uncertainty.methods.swag)``; skips where either is not installed.

  The package's ``__init__`` imports Lightning, which ``methods.swag`` does not use: where
  Lightning is missing the module is imported under bare parent packages, which are then removed
  from ``sys.modules`` again (as ``test_packed.import_torch_uncertainty`` does)."""
  torch = pytest.importorskip("torch")
  spec = importlib.util.find_spec("torch_uncertainty")
  if spec is None:
    pytest.importorskip("torch_uncertainty")
  name = "torch_uncertainty.methods.swag"
  if importlib.util.find_spec("lightning") is not None:
    return torch, importlib.import_module(name)
  before = set(sys.modules)
  root = spec.submodule_search_locations[0]
  try:
    for package_name in ("torch_uncertainty", "torch_uncertainty.methods"):
      package = types.ModuleType(package_name)
      package.__path__ = ["/".join([root, *package_name.split(".")[1:]])]
      sys.modules[package_name] = package
    return torch, importlib.import_module(name)
  finally:
    for module in set(sys.modules) - before:
      del sys.modules[module]


def torch_model(torch):
  torch.manual_seed(0)
  return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def weight_sequence(model, n: int) -> list[dict]:
  """n models, ``{torch name: float32 array}``: the model's weights moved by seeded noise."""
  rng = np.random.default_rng(0)
  base = {name: p.detach().numpy() for name, p in model.named_parameters()}
  return [{name: (w + SPREAD[name] * rng.normal(size=w.shape)).astype(np.float32)
           for name, w in base.items()} for _ in range(n)]


def flax_leaf(name: str, value):
  """A torch-shaped array (after any leading axes) in the layout of the Flax leaf."""
  value = np.asarray(value)
  return np.swapaxes(value, -1, -2) if name.endswith("weight") else value


def to_flax(named: dict) -> dict:
  """``{torch name: array}`` → the Flax parameter tree of ``MLP``."""
  tree = {}
  for name, value in named.items():
    module, leaf = FLAX_LEAF[name]
    tree.setdefault(module, {})[leaf] = flax_leaf(name, value)
  return tree


def leaf_of(tree, name: str):
  module, leaf = FLAX_LEAF[name]
  return np.asarray(tree[module][leaf])


def set_weights(torch, model, weights: dict) -> None:
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(torch.from_numpy(weights[name]))


def collected(torch, tu_swag, rank: int, n: int, var_clamp: float):
  """TorchUncertainty's SWAG (rank 0: ``diag_covariance``, else ``max_num_models`` = rank) and
  our moments, both after collecting the same n models; and the Flax parameters' shapes."""
  model = torch_model(torch)
  weights = weight_sequence(model, n)
  wrapper = tu_swag.SWAG(model, cycle_start=0, cycle_length=1, diag_covariance=rank == 0,
                         max_num_models=max(rank, 1), var_clamp=var_clamp, num_estimators=1)
  params = jax.eval_shape(MLP().init, jax.random.key(0), jnp.zeros((1, 4)))["params"]
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, to_flax(weights[0]))
  moments = swag.init_moments(params, rank)
  collect = jax.jit(swag.collect)
  for epoch, w in enumerate(weights, start=1):   # SWAG collects at every epoch > cycle_start
    set_weights(torch, model, w)
    wrapper.update_wrapper(epoch)
    moments = collect(moments, to_flax(w))
  assert int(wrapper.num_avgd_models) == n
  return wrapper, moments, weights


def torch_draws(torch, monkeypatch, wrapper, scale: float, diagonal: bool):
  """TorchUncertainty's sample and the normals it drew, ``{name: z₁}`` and ``{name: z₂}``
  (``torch.randn_like`` and ``torch.randn`` recorded, each called once per parameter)."""
  z_diag, z_low_rank = [], []

  def recording(draw, into):
    def recorded(*args, **kwargs):
      out = draw(*args, **kwargs)
      into.append(out.clone())
      return out
    return recorded

  with monkeypatch.context() as patch:
    patch.setattr(torch, "randn_like", recording(torch.randn_like, z_diag))
    patch.setattr(torch, "randn", recording(torch.randn, z_low_rank))
    torch.manual_seed(1)
    sampled = wrapper.sample(scale, diag_covariance=diagonal)
  names = [name for name, _ in sampled.named_parameters()]
  assert len(z_diag) == len(names) and len(z_low_rank) == (0 if diagonal else len(names))
  return sampled, dict(zip(names, z_diag, strict=True)), dict(zip(names, z_low_rank, strict=False))


CASES = {
    # rank, models collected, diagonal sample, scale, var_clamp
    "low_rank_ring_wrapped": (3, 6, False, 0.5, 1e-6),
    "low_rank_fewer_than_rank": (4, 2, False, 1.0, 1e-3),
    "diagonal_of_low_rank": (3, 5, True, 2.0, 1e-6),
    "diagonal_swag": (0, 5, True, 0.5, 1e-6),
}


@pytest.mark.parametrize("case", CASES)
def test_moments_and_sample_equal_torch_uncertainty(case, monkeypatch):
  torch, tu_swag = import_swag()
  rank, n, diagonal, scale, var_clamp = CASES[case]
  wrapper, moments, _ = collected(torch, tu_swag, rank, n, var_clamp)
  stats = {key[len(wrapper.prfx):]: value.numpy() for key, value in wrapper.swag_stats.items()}
  assert moments.count.dtype == jnp.int32 and int(moments.count) == n
  rows = min(n, rank)
  # TorchUncertainty's row j (oldest first) is collection n − rows + j: our slot of it.
  slots = [(n - rows + j) % rank for j in range(rows)]
  for name in FLAX_LEAF:
    np.testing.assert_allclose(leaf_of(moments.mean, name), flax_leaf(name, stats[f"{name}_mean"]),
                               rtol=1e-6, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(leaf_of(moments.sq_mean, name),
                               flax_leaf(name, stats[f"{name}_sq_mean"]), rtol=1e-6, atol=1e-7,
                               err_msg=name)
    deviations = leaf_of(moments.deviations, name)
    assert deviations.shape[0] == rank
    if rank:
      shape = dict(wrapper.core_model.named_parameters())[name].shape
      theirs = stats[f"{name}_covariance_sqrt"].reshape(-1, *shape)
      assert theirs.shape[0] == rows
      np.testing.assert_allclose(deviations[slots], flax_leaf(name, theirs), rtol=1e-5,
                                 atol=1e-6, err_msg=name)
      assert not np.any(np.delete(deviations, slots, axis=0)), name   # not collected: zeros
  sq_minus_mean = {name: stats[f"{name}_sq_mean"] - stats[f"{name}_mean"]**2 for name in FLAX_LEAF}
  for name, var in sq_minus_mean.items():
    np.testing.assert_allclose(leaf_of(swag.variance(moments, var_clamp), name),
                               flax_leaf(name, np.maximum(var, var_clamp)), rtol=1e-4, atol=1e-7,
                               err_msg=name)
  assert min(v.min() for v in sq_minus_mean.values()) < var_clamp   # the clamp is exercised

  sampled, z_diag, z_low_rank = torch_draws(torch, monkeypatch, wrapper, scale, diagonal)
  ours_z_low_rank = None
  if not diagonal:
    ours_z_low_rank = {}
    for name, z in z_low_rank.items():
      z_slots = np.full(rank, 1e3, np.float32)   # slots never collected: any draw adds nothing
      z_slots[slots] = z.numpy()
      module, leaf = FLAX_LEAF[name]
      ours_z_low_rank.setdefault(module, {})[leaf] = z_slots
  ours = swag.sample(moments, to_flax({k: v.numpy() for k, v in z_diag.items()}), ours_z_low_rank,
                     scale, diagonal, var_clamp)
  theirs = {name: p.detach().numpy() for name, p in sampled.named_parameters()}
  for name in FLAX_LEAF:
    np.testing.assert_allclose(leaf_of(ours, name), flax_leaf(name, theirs[name]), rtol=1e-5,
                               atol=1e-6, err_msg=name)
  x = np.random.default_rng(2).normal(size=(5, 4)).astype(np.float32)
  np.testing.assert_allclose(MLP().apply({"params": ours}, x),
                             sampled(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_swa_params_equal_torch_averaged_model():
  """SWA's mean against torch's ``swa_utils.AveragedModel`` (Izmailov's running mean, as
  TorchUncertainty's SWAG; its ``SWA`` starts the count at 2 and weighs the first model twice:
  (2θ₁ + θ₂ + … + θₙ)/(n + 1), which the last assertion records)."""
  torch, tu_swag = import_swag()
  model = torch_model(torch)
  averaged = torch.optim.swa_utils.AveragedModel(model)
  tu_swa = tu_swag.SWA(model, cycle_start=1, cycle_length=1)
  weights = weight_sequence(model, 5)
  moments = swag.init_moments(to_flax(weights[0]), 0)
  for epoch, w in enumerate(weights, start=1):   # SWA collects at every epoch ≥ cycle_start
    set_weights(torch, model, w)
    averaged.update_parameters(model)
    tu_swa.update_wrapper(epoch)
    moments = swag.collect(moments, to_flax(w))
  mean = swag.swa_params(moments)
  tu_mean = dict(tu_swa.swa_model.named_parameters())
  for name, p in averaged.module.named_parameters():
    np.testing.assert_allclose(leaf_of(mean, name), flax_leaf(name, p.detach().numpy()),
                               rtol=1e-6, atol=1e-7, err_msg=name)
    stacked = np.stack([w[name] for w in weights])
    np.testing.assert_allclose(tu_mean[name].detach().numpy(),
                               (stacked[0] + stacked.sum(0)) / (len(weights) + 1), rtol=1e-5,
                               atol=1e-6, err_msg=name)


def test_too_small_ranks_refused_where_torch_uncertainty_fails(monkeypatch):
  """Rank 0 (its ``diag_covariance``) refuses a low-rank sample as TorchUncertainty does; rank 1
  (its ``max_num_models=1``) has no 1/(K − 1): it divides by zero, ours refuses."""
  torch, tu_swag = import_swag()
  diagonal_swag, moments, _ = collected(torch, tu_swag, 0, 2, 1e-6)
  with pytest.raises(ValueError, match="Cannot sample full rank"):
    diagonal_swag.sample(1.0, diag_covariance=False)
  z = jax.tree.map(jnp.zeros_like, moments.mean)
  with pytest.raises(ValueError, match="rank of at least 2"):
    swag.sample(moments, z, None, 1.0)
  rank_one, moments, _ = collected(torch, tu_swag, 1, 3, 1e-6)
  assert not all(torch.isfinite(p).all() for p in rank_one.sample(1.0).parameters())
  with pytest.raises(ValueError, match="rank of at least 2"):
    swag.sample(moments, z, jax.tree.map(lambda m: jnp.zeros(1), moments.mean), 1.0)
  assert swag.low_rank_min_collections(20) == 20


def test_samples_from_key_have_torch_uncertainty_moments():
  """N samples from keys: mean θ̄ and variance scale·(σ² + Σ_j d_j² / (K − 1)) per weight, both
  from TorchUncertainty's statistics; each member's moments under ``vmap`` as on its own."""
  torch, tu_swag = import_swag()
  rank, scale, num = 3, 0.5, 4000
  wrapper, moments, weights = collected(torch, tu_swag, rank, 5, 1e-6)
  stats = {key[len(wrapper.prfx):]: value.numpy() for key, value in wrapper.swag_stats.items()}
  samples = swag.samples_from_key(moments, jax.random.key(3), num, scale, False)
  for name in FLAX_LEAF:
    mean, sq_mean = stats[f"{name}_mean"], stats[f"{name}_sq_mean"]
    deviations = stats[f"{name}_covariance_sqrt"].reshape(-1, *mean.shape)
    expected = scale * (np.maximum(sq_mean - mean**2, 1e-6)
                        + np.sum(deviations**2, axis=0) / (rank - 1))
    drawn = leaf_of(samples, name)
    assert drawn.shape == (num, *leaf_of(moments.mean, name).shape)
    np.testing.assert_allclose(drawn.var(axis=0), flax_leaf(name, expected), rtol=0.15,
                               err_msg=name)
    np.testing.assert_array_less(np.abs(drawn.mean(axis=0) - flax_leaf(name, mean)),
                                 5 * np.sqrt(flax_leaf(name, expected) / num) + 1e-7)

  # Two members' moments stacked: the second collects each model scaled by 2.
  stacked = jax.vmap(swag.init_moments, in_axes=(0, None))(
      jax.tree.map(lambda x: np.stack([x, x]), to_flax(weights[0])), rank)
  for w in weights:
    pair = jax.tree.map(lambda x: np.stack([x, 2 * x]), to_flax(w))
    stacked = jax.jit(jax.vmap(swag.collect))(stacked, pair)
  np.testing.assert_array_equal(stacked.count, [5, 5])
  for member, factor in enumerate((1, 2)):
    one = jax.tree.map(lambda x, member=member: x[member], stacked)
    for name in FLAX_LEAF:
      np.testing.assert_allclose(leaf_of(one.mean, name),
                                 factor * flax_leaf(name, stats[f"{name}_mean"]), rtol=1e-6,
                                 atol=1e-7)
      np.testing.assert_allclose(leaf_of(one.sq_mean, name),
                                 factor**2 * flax_leaf(name, stats[f"{name}_sq_mean"]), rtol=1e-6,
                                 atol=1e-7)


# --- The methods, trained through the door: ``--config.method=swag`` on the small npz run.

@pytest.fixture(scope="module")
def swag_run(tmp_path_factory):
  """``(data_dir, workdir)`` of ``small_npz_config`` trained with ``method=swag`` for 16 steps
  (4 steps an epoch: collections at the ends of epochs 3 and 4, steps 12 and 16; checkpoints every
  4 steps, all kept), rank 2."""
  from smoothing_jax.experiment.config_base import with_method
  from smoothing_jax.training import train
  from tests.helpers import override, small_npz, small_npz_config
  root = tmp_path_factory.mktemp("swag")
  (root / "data").mkdir()
  data = small_npz(root / "data")
  config = override(with_method(small_npz_config(data, num_train_steps=16,
                                                 checkpoint_every_steps=4, keep_checkpoints=5,
                                                 ensemble_sizes=(1, 3)), "swag"),
                    **{"swag.rank": 2})
  train.train_from_config(config, str(root / "run"))
  return data, str(root / "run"), config


def _flat(tree) -> dict:
  from flax.traverse_util import flatten_dict
  return {"/".join(k): np.asarray(v, np.float64) for k, v in flatten_dict(tree).items()}


def test_training_collects_the_parameters_at_the_epoch_ends_after_the_start(swag_run):
  """The moments in the trained state are those of the parameters of the step-12 and step-16
  checkpoints (the ends of epochs 3 and 4 of 4, Maddox's start 161/300 → after epoch 2), computed
  here in numpy: mean, mean of squares and the deviations from the running mean."""
  from smoothing_jax.experiment.checkpoints import checkpoint_manager
  from smoothing_jax.experiment.run import Run
  _, workdir, _ = swag_run
  with checkpoint_manager(workdir, read_only=True) as manager:
    assert manager.all_steps() == [4, 8, 12, 16]
    params = [_flat(manager.restore(s)["params"]) for s in (12, 16)]
  moments = Run.from_workdir(workdir).variables["swag"]
  assert int(moments["count"]) == 2
  mean, sq_mean = _flat(moments["mean"]), _flat(moments["sq_mean"])
  deviations = _flat(moments["deviations"])
  for key, first in params[0].items():
    second = params[1][key]
    np.testing.assert_allclose(mean[key], (first + second) / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sq_mean[key], (first ** 2 + second ** 2) / 2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(deviations[key][0], 0.0, atol=1e-6)  # θ₁ − θ̄₁
    np.testing.assert_allclose(deviations[key][1], second - (first + second) / 2, rtol=1e-4,
                               atol=1e-6)


def test_predict_and_the_evaluators_score_one_predictive_of_n_samples(swag_run, tmp_path):
  """``Run.predict`` and ``ensemble_sizes`` at N = 3 (three weight samples, each with its
  BatchNorm statistics recomputed) agree; the training's evaluation scores the SGD iterate, so
  it is not this predictive."""
  from tests.methods.paths import assert_paths_agree, three_paths
  _, workdir, _ = swag_run
  paths = three_paths(workdir, tmp_path, num_samples=3)
  assert set(paths) == {"predict", "ensemble_sizes"}
  assert_paths_agree(paths)


def test_batch_norm_statistics_are_each_samples_own_on_the_training_batches(swag_run):
  """A sample's recomputed statistics: the mean over the full training batches of each batch's
  mean and biased variance at the BatchNorm's input, computed here by capturing those inputs
  (``nn.intercept_methods``) in a plain evaluation-mode pass."""
  from smoothing_jax.experiment.run import Run
  _, workdir, _ = swag_run
  run = Run.from_workdir(workdir)
  method = run.method.with_samples(2)
  prepared = run.prediction_variables(method)
  batches = [b for b in run.train_eval_batches() if np.all(np.asarray(b["mask"]) > 0)]
  assert len(batches) == 2
  sample = jax.tree.map(lambda x: x[1], prepared)
  inputs = {}

  def capture(next_fun, args, kwargs, context):
    if isinstance(context.module, nn.BatchNorm):
      inputs.setdefault("/".join(context.module.scope.path), []).append(np.asarray(args[0]))
    return next_fun(*args, **kwargs)

  for batch in batches:
    with nn.intercept_methods(capture):
      method.model.apply({"params": sample["params"], "batch_stats": sample["batch_stats"]},
                         batch["image"], train=True, mutable=["batch_stats"])
  stats = _flat(sample["batch_stats"])
  assert {f"{path}/{s}" for path in inputs for s in ("mean", "var")} == set(stats)  # every layer
  for path, xs in inputs.items():
    axes = tuple(range(xs[0].ndim - 1))
    mean = np.mean([x.mean(axes) for x in xs], axis=0)
    var = np.mean([x.var(axes) for x in xs], axis=0)
    np.testing.assert_allclose(stats[f"{path}/mean"], mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(stats[f"{path}/var"], var, rtol=1e-4, atol=1e-5)


def test_a_run_resumed_during_the_collection_ends_bit_identical(swag_run, tmp_path):
  """A copy of the run cut back to its step-12 checkpoint (as a kill after it leaves it: one
  model collected), rerun, ends with the same parameters and moments, bit for bit."""
  import shutil

  from smoothing_jax.experiment.run import Run
  from smoothing_jax.training import train
  from smoothing_jax.training.steps import variables_of
  _, workdir, config = swag_run
  shutil.copytree(workdir, tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "16")
  resumed = train.train_from_config(config, str(tmp_path / "resumed"))
  a, b = _flat(variables_of(resumed)), _flat(Run.from_workdir(workdir).variables)
  assert a.keys() == b.keys() and any(k.startswith("swag/") for k in a)
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_swa_of_the_same_run_is_the_mean_with_its_statistics_and_one_pass(swag_run, tmp_path):
  """``--config.method=swa`` on the SWAG run: one network, the mean of the moments."""
  from smoothing_jax.experiment.run import Run
  _, workdir, _ = swag_run
  run = Run.from_workdir(workdir, {"method": None})
  swa_run = Run.from_workdir(workdir, _with_method(run.config, "swa"))
  assert swa_run.method.name == "swa" and swa_run.method.nested((1, 5)) == (swa_run.method, (1,))
  prepared = swa_run.prediction_variables()
  expected = _flat(run.variables["swag"]["mean"])
  for key, value in _flat(prepared["params"]).items():
    np.testing.assert_allclose(value, expected[key], rtol=1e-6)


def _with_method(config, name):
  from smoothing_jax.experiment.config_base import with_method
  return with_method(config, name)


def test_a_swag_run_starts_from_a_deterministic_run_of_another_method(swag_run, small_npz_run,
                                                                      tmp_path):
  """``init_from`` a workdir trained without SWAG: its parameters and statistics, the moments
  fresh (the method's state is not taken from another run)."""
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.training import train
  from tests.helpers import override
  _, source, _ = small_npz_run
  _, _, config = swag_run
  config = override(config.copy_and_resolve_references(), init_from=source, num_devices=-1)
  train.train_from_config(config, str(tmp_path / "run"))
  assert int(Run.from_workdir(str(tmp_path / "run")).variables["swag"]["count"]) == 2


def test_a_run_too_short_to_collect_is_refused_in_one_line_before_training(swag_run, tmp_path):
  """8 steps are 2 epochs: collection would start after epoch 1 and collect one model."""
  from smoothing_jax import main
  from tests.helpers import override
  _, _, config = swag_run
  short = override(config.copy_and_resolve_references(), num_train_steps=8)
  with pytest.raises(ValueError, match=r"^swag collects 1 model\(s\) in 2 whole epochs \(from "
                     r"epoch 1, every 1\) and needs at least 2: train longer or lower "
                     r"swag.start_fraction\.$"):
    main.run(short, str(tmp_path / "run"))
  assert not (tmp_path / "run" / "checkpoints").exists()
  assert not (tmp_path / "run" / "config.json").exists()


def test_multiswag_is_a_deep_ensemble_of_swag_members_with_nothing_written_for_it(swag_run,
                                                                                tmp_path):
  """``--config.method=swag --config.deep_ensemble.members=2`` (Wilson & Izmailov 2020): each
  member collects its own moments in the one compiled job, and the predictive's draws are the
  members' own SWAG draws, sample-major (draw s·M + m is member m's sample s), each member's
  equal to that member evaluated alone (``Run.member``)."""
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.methods.deep_ensemble import DeepEnsemble
  from smoothing_jax.training import train
  from tests.helpers import override
  _, _, config = swag_run
  config = override(config.copy_and_resolve_references(), **{"deep_ensemble.members": 2})
  train.train_from_config(config, str(tmp_path / "run"))
  run = Run.from_workdir(str(tmp_path / "run"))
  assert isinstance(run.method, DeepEnsemble) and run.method.per_member.name == "swag"
  assert run.variables["swag"]["count"].tolist() == [2, 2]
  method, sizes = run.method.nested((1, 2, 4))
  assert sizes == (1, 2, 4) and method.num_draws == 4
  images = jnp.asarray(next(run.eval_batches())["image"])
  per_draw = images[None] + jax.random.normal(jax.random.key(4), (4,) + images.shape)  # ODIN's
  key = jax.random.key(3)
  prepared = run.prediction_variables(method)
  draws = np.asarray(method.sample_log_probs(prepared, images, key))
  logits = np.asarray(method.sample_outputs(prepared, per_draw, key)["logits"])
  keys = jax.random.split(key, 2)
  own_samples = []
  for m in range(2):
    member = run.member(m)
    alone = member.method.with_samples(2)
    own = member.prediction_variables(alone)
    own_samples.append(jax.tree.leaves(own["params"])[0])
    np.testing.assert_allclose(draws[m::2], alone.sample_log_probs(own, images, keys[m]),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[m::2], alone.sample_outputs(own, per_draw[m::2],
                                                                  keys[m])["logits"],
                               rtol=1e-5, atol=1e-5)
  # The members draw independently (member m > 0 folds m into the samples' key).
  assert not np.allclose(own_samples[0] - own_samples[0].mean(0),
                         own_samples[1] - own_samples[1].mean(0))
