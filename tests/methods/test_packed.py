"""Packed-Ensembles: the layers and the ResNet-18 against TorchUncertainty's own (weights
transferred: logits within 1e-4, parameter counts equal), the predictive against an explicit loop
over the members (each member's weights sliced into a network of one member), training on every
member, what it cannot be, and on one trained tiny workdir: training, resuming, every evaluator,
and ``Run.predict``, ``ensemble_sizes`` and the training's evaluation agreeing."""
import functools
import importlib
import importlib.util
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from configs import cifar_resnet
from smoothing_jax import methods
from smoothing_jax.methods.losses import supervised_loss
from smoothing_jax.methods.packed import PackedEnsemble
from smoothing_jax.models import get_model
from smoothing_jax.models.packed import PackedBlock, packed_groups
from tests.helpers import init_variables, num_params, override, tiny_run, train_resume_and_evaluate
from tests.methods.paths import assert_every_evaluator_reports, assert_paths_agree, three_paths

M = 4


def import_torch_uncertainty():
  """``(torch, layers.packed, models.classification.resnet.packed)`` of TorchUncertainty (pinned
  in ``requirements-test.txt``); skips where torch or torch_uncertainty is not installed.

  The package's ``__init__`` imports Lightning (its CLI and trainer), which these modules do not
  use: where Lightning is missing they are imported under bare parent packages, which are then
  removed from ``sys.modules`` again."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("einops")
  spec = importlib.util.find_spec("torch_uncertainty")
  if spec is None:
    pytest.importorskip("torch_uncertainty")
  names = ("torch_uncertainty.layers.packed",
           "torch_uncertainty.models.classification.resnet.packed")
  if importlib.util.find_spec("lightning") is not None:
    return (torch, *map(importlib.import_module, names))
  before = set(sys.modules)
  root = spec.submodule_search_locations[0]
  try:
    for name in ("torch_uncertainty", "torch_uncertainty.layers", "torch_uncertainty.models",
                 "torch_uncertainty.models.classification",
                 "torch_uncertainty.models.classification.resnet"):
      package = types.ModuleType(name)
      package.__path__ = ["/".join([root, *name.split(".")[1:]])]
      sys.modules[name] = package
    sys.modules["torch_uncertainty.utils"] = types.SimpleNamespace(load_hf=None)
    layers = importlib.import_module(names[0])
    sys.modules["torch_uncertainty.layers"].PackedConv2d = layers.PackedConv2d
    sys.modules["torch_uncertainty.layers"].PackedLinear = layers.PackedLinear
    return torch, layers, importlib.import_module(names[1])
  finally:
    for name in set(sys.modules) - before:
      del sys.modules[name]


def from_torch(state_dict, target) -> dict:
  """Flax variables of the shapes of ``target`` from a TorchUncertainty packed module's
  ``state_dict`` (``layer1.0.conv1.conv.weight`` → ``params/layer1_0/conv1/kernel``)."""
  out = {}
  for path, like in traverse_util.flatten_dict(dict(target)).items():
    collection, *modules, leaf = path
    prefix = ".".join(modules).replace("_", ".")
    if leaf == "kernel" and modules[-1] == "linear":   # [G, O/G, I/G] → [1, 1, I/G, O]
      w = state_dict[f"{prefix}.weight"]
      value = w.reshape(-1, w.shape[-1]).T[None, None]
    elif leaf == "kernel":                              # [O, I/G, kh, kw] → [kh, kw, I/G, O]
      value = state_dict[f"{prefix}.conv.weight"].transpose(2, 3, 1, 0)
    else:
      key = {"scale": "weight", "bias": "bias", "mean": "running_mean", "var": "running_var"}[leaf]
      value = state_dict[f"{prefix}.{key}"]
    assert value.shape == like.shape, (path, value.shape, like.shape)
    out[path] = jnp.asarray(value)
  return traverse_util.unflatten_dict(out)


def torch_state(torch, module, seed: int = 0) -> dict:
  """``module``'s state as numpy, its BatchNorm statistics and affine parameters drawn at random
  (TorchUncertainty initialises them to 0 and 1), in evaluation mode."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, tensor in module.state_dict().items():
      if name.endswith(("running_mean", "bias")):
        tensor.copy_(0.1 * torch.randn_like(tensor))
      elif name.endswith("running_var") or (name.endswith("weight") and tensor.ndim == 1):
        tensor.copy_(torch.rand_like(tensor) + 0.5)
  module.eval()
  return {k: v.numpy() for k, v in module.state_dict().items()}


def test_packed_groups_and_block_match_torch_uncertainty():
  """γ lowered where a group would hold fewer than 64 input channels, as ``PackedConv2d`` does;
  a block where γ = 2 holds (64 channels a group) and where it is lowered, logits within 1e-4."""
  torch, layers, resnet = import_torch_uncertainty()
  for in_channels in (16, 64, 128, 256, 512, 1024):
    for m, gamma in ((1, 1), (2, 2), (2, 4), (4, 2), (4, 4)):
      if in_channels % m:
        continue
      ours = packed_groups(in_channels, m, gamma)
      # PackedConv2d takes the base width and multiplies it by α.
      theirs = layers.PackedConv2d(in_channels // 2, 8 * m * gamma, 1, alpha=2, num_estimators=m,
                                   gamma=gamma).conv.groups
      assert ours == theirs, (in_channels, m, gamma)

  block = resnet._BasicBlock(in_planes=256, planes=512, stride=2, alpha=2, num_estimators=M,
                             gamma=2, conv_bias=False, dropout_rate=0.0, groups=1,
                             normalization_layer=torch.nn.BatchNorm2d)
  assert [c.conv.groups for c in (block.conv1, block.conv2, block.shortcut[0])] == [4, 8, 8]
  state = torch_state(torch, block)
  x = np.random.default_rng(0).normal(size=(2, 512, 4, 4)).astype(np.float32)
  with torch.no_grad():
    expected = block(torch.from_numpy(x)).numpy().transpose(0, 2, 3, 1)
  ours = PackedBlock(1024, 2, M, 2, 64)
  nhwc = jnp.asarray(x.transpose(0, 2, 3, 1))
  variables = from_torch(state, jax.eval_shape(lambda: ours.init(jax.random.key(0), nhwc, False)))
  got = jax.jit(lambda v, x: ours.apply(v, x, False))(variables, nhwc)
  np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


def test_resnet_packed_18_matches_torch_uncertainty():
  """TorchUncertainty's ``packed_resnet(arch=18, style="cifar")`` at its defaults (M 4, α 2,
  γ 2): the same parameter count (abstract init), and at a quarter of the width (its
  ``width_multiplier``) the same logits with its weights, its ``PackedLinear`` head included."""
  torch, _, resnet = import_torch_uncertainty()
  defaults = dict(in_channels=3, num_classes=10, arch=18, style="cifar", num_estimators=M,
                  alpha=2, gamma=2)
  full = resnet.packed_resnet(**defaults)
  model = get_model("resnet_packed_18", 10)
  assert (model.num_estimators, model.alpha, model.gamma) == (M, 2, 2)
  assert num_params(model) == sum(p.numel() for p in full.parameters())

  narrow = resnet.packed_resnet(**defaults, width_multiplier=0.25)
  state = torch_state(torch, narrow)
  x = np.random.default_rng(1).normal(size=(2, 3, 16, 16)).astype(np.float32)
  with torch.no_grad():
    expected = narrow(torch.from_numpy(x)).numpy()                 # [(m b), C]
  model = get_model("resnet_packed_18", 10, width=16)
  nhwc = jnp.asarray(x.transpose(0, 2, 3, 1))
  variables = from_torch(state, jax.eval_shape(lambda: model.init(jax.random.key(0), nhwc)))
  assert num_params(model) == sum(p.numel() for p in narrow.parameters())
  logits = jax.jit(model.apply)(variables, nhwc)                   # [(b m), C]
  np.testing.assert_allclose(logits.reshape(2, M, 10).swapaxes(0, 1).reshape(-1, 10), expected,
                             rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_packed():
  # Groups of 2 input channels at least, so that γ = 2 holds in the later stages of this narrow net.
  model = get_model("resnet_packed_18", 5, width=4, stage_sizes=(1, 1), min_channels_per_group=2)
  return model, init_variables(model, (2, 16, 16, 3))


def member_variables(variables, m: int, num: int) -> dict:
  """Member ``m``'s variables of a packed network of ``num`` members: its block of every layer's
  output channels (a grouped kernel's input axis is already the group's own)."""
  def block(x):
    size = x.shape[-1] // num
    return x[..., m * size:(m + 1) * size]
  return jax.tree.map(block, variables)


def test_the_predictive_is_the_members_and_training_is_every_members_loss(tiny_packed):
  model, variables = tiny_packed
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  labels = jnp.array([0, 1, 2, 3])
  method = methods.resolve(None, model)
  assert isinstance(method, PackedEnsemble) and method.nested() == (method, (1, 2, 3, 4))
  assert not method.stochastic and method.num_draws == M
  prediction = method.predict(variables, images, rng=jax.random.key(0))
  assert prediction.sample_probs.shape == (M, 4, 5)
  # Member m alone: a packed network of one member, α/M as wide, on member m's weights.
  member = model.clone(num_estimators=1, alpha=model.alpha / M)
  one = jax.jit(lambda v: jax.nn.softmax(member.apply(v, images)))
  per_member = [one(member_variables(variables, m, M)) for m in range(M)]
  np.testing.assert_allclose(prediction.sample_probs, np.stack(per_member), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(prediction.mean_probs, np.mean(per_member, 0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(per_member[0], per_member[1])

  # Training mode: every member's cross-entropy on the whole (unrepeated) batch, averaged.
  @jax.jit
  def loss_and_explicit():
    loss_fn = supervised_loss(model, tile=method.tile)
    loss, aux = loss_fn(variables["params"], variables["batch_stats"],
                        {"image": images, "label": labels}, jax.random.key(2), 0)
    logits = model.apply(variables, images, train=True,
                         mutable=["batch_stats"])[0].reshape(4, M, 5)
    per_member = [optax.softmax_cross_entropy_with_integer_labels(logits[:, m], labels).mean()
                  for m in range(M)]
    return loss, aux["labels"], jnp.mean(jnp.stack(per_member))

  loss, repeated_labels, explicit = loss_and_explicit()
  np.testing.assert_allclose(loss, explicit, rtol=1e-5)
  assert repeated_labels.tolist() == np.repeat(labels, M).tolist()


def test_sample_outputs_are_the_members_of_the_predictive(tiny_packed):
  """Each member's logits and classifier input (its block of the pooled features); per-member
  images go to their own member (ODIN's steps)."""
  model, variables = tiny_packed
  images = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
  method = methods.resolve(None, model)
  outputs = jax.jit(lambda x: method.sample_outputs(variables, x, None))
  out = outputs(images)
  assert out["logits"].shape == (M, 4, 5) and out["features"].shape == (M, 4, 4 * 2 * 2 // M)
  np.testing.assert_allclose(jax.nn.log_softmax(out["logits"]),
                             method.sample_log_probs(variables, images, None), atol=1e-5)
  per_member = outputs(jnp.stack([images * (1 + m) for m in range(M)]))
  for m in (0, M - 1):
    alone = outputs(images * (1 + m))
    for key in ("logits", "features"):
      np.testing.assert_allclose(per_member[key][m], alone[key][m], rtol=1e-5, atol=1e-5)


def test_a_packed_ensemble_is_not_a_deep_ensemble_member():
  config = override(cifar_resnet.get_config("resnet_packed_18"), **{"deep_ensemble.members": 2})
  with pytest.raises(ValueError, match=r"Packed-Ensemble of 4 members already; train it with "
                     r"deep_ensemble.members=1\.$"):
    methods.resolve(config, get_model("resnet_packed_18", 10))
  with pytest.raises(ValueError, match=r"^gamma must be an integer >= 1, got 0\."):
    num_params(get_model("resnet_packed_18", 10, gamma=0))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """``(workdir, data, {evaluator: result})`` of a tiny Packed-Ensemble (2 members) trained from
  the command line under TFDS mock data, resumed, and every evaluator run on it."""
  tfds = pytest.importorskip("tensorflow_datasets")
  root = tmp_path_factory.mktemp("packed")
  config = tiny_run(cifar_resnet.get_config("resnet_packed_18,cifar10,runlocal"),
                    num_train_steps=4, **{"input.holdout_fraction": 0.25,
                                          "model_kwargs.stage_sizes": (1,),
                                          "model_kwargs.num_estimators": 2})
  results = train_resume_and_evaluate(config, root)
  return str(root / "run"), functools.partial(tfds.testing.mock_data, num_examples=16), results


def test_trains_resumes_and_runs_every_evaluator_from_the_command_line(trained):
  assert_every_evaluator_reports(trained[2], "packed_ensemble")


def test_predict_the_evaluators_and_the_training_evaluation_agree(trained, tmp_path):
  workdir, data, _ = trained
  assert_paths_agree(three_paths(workdir, tmp_path, data=data))

