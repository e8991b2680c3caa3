"""Reference checkpoints: converted weights give the reference's logits; clear errors otherwise."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.convert import from_torch_state_dict, to_torch_state_dict
from smoothing_jax.models import get_model
from tests.helpers import init_variables


def test_round_trip_of_a_synthetic_state_dict():
  model = get_model("preresnet_dnn_smoothing_18", 7, width=4)
  variables = init_variables(model, (1, 16, 16, 3))
  # Perturb everything (incl. batch_stats) so every leaf is distinct.
  variables = jax.tree.map(lambda x: x + jax.random.normal(jax.random.key(1), x.shape), variables)
  state_dict = to_torch_state_dict(variables)
  # Reference layouts: conv OIHW, dense (out, in), BN running stats.
  assert state_dict["layer0.0.weight"].shape == (4, 3, 3, 3)
  assert state_dict["layer2.0.shortcut.0.weight"].shape == (8, 4, 1, 1)
  assert state_dict["classifier.0.dense.weight"].shape == (7, 32)
  assert "classifier.0.bn.running_var" in state_dict
  state_dict["layer1.0.bn1.num_batches_tracked"] = np.array(3)
  back = from_torch_state_dict("preresnet_dnn_smoothing_18", state_dict, width=4)
  jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, variables))


def test_missing_unexpected_and_mismatched_keys_are_named():
  model = get_model("resnet_dnn_18", 10, width=4)
  state_dict = to_torch_state_dict(init_variables(model, (1, 16, 16, 3)))
  del state_dict["layer1.0.conv1.weight"]
  state_dict["layer9.extra.weight"] = np.zeros(3)
  state_dict["layer2.0.bn1.weight"] = np.zeros(5)
  with pytest.raises(ValueError) as err:
    from_torch_state_dict("resnet_dnn_18", state_dict, width=4)
  message = str(err.value)
  assert "missing keys (1): layer1.0.conv1.weight" in message
  assert "unexpected keys (1): layer9.extra.weight" in message
  assert "layer2.0.bn1.weight: reference (5,)" in message


torch = pytest.importorskip("torch")
from smoothing_jax import torch_reference as ref  # noqa: E402


PARITY_CASES = [
    ("resnet_dnn_smoothing_18", dict(width=4), lambda: ref.ResNet(
        (2, 2, 2, 2), False, 10, width=4, smoothing=True)),
    ("resnet_dnn_50", dict(width=4, classifier="mlp"), lambda: ref.ResNet(
        (3, 4, 6, 3), True, 10, width=4, mlp=True)),
    ("resnext_dnn_50", dict(width=8, width_per_group=16, groups=4), lambda: ref.ResNet(
        (3, 4, 6, 3), True, 10, width=8, groups=4, width_per_group=16)),
    ("preresnet_dnn_smoothing_34", dict(width=4), lambda: ref.ResNet(
        (3, 4, 6, 3), False, 10, width=4, preact=True, smoothing=True)),
    ("preresnet_dnn_50", dict(width=4), lambda: ref.ResNet(
        (3, 4, 6, 3), True, 10, width=4, preact=True)),
    ("vgg_dnn_smoothing_11", dict(width=4), lambda: ref.VGG(
        (1, 1, 2, 2, 2), 10, width=4, smoothing=True)),
    ("prevgg_dnn_11", dict(width=4), lambda: ref.VGG((1, 1, 2, 2, 2), 10, width=4, preact=True)),
    ("alexnet_dnn", dict(width=4), lambda: ref.AlexNetCifar(10, width=4)),
    ("wideresnet_dnn_28_10", dict(width=4,
                                  widen_factor=2), lambda: ref.WideResNet(28, 2, 10, width=4)),
]


@pytest.mark.parametrize("name,overrides,build", PARITY_CASES, ids=[c[0] for c in PARITY_CASES])
def test_converted_logits_equal_the_reference(name, overrides, build):
  torch_model = ref.randomize(build())
  state_dict = {k: v.numpy() for k, v in torch_model.state_dict().items()}
  variables = from_torch_state_dict(name, state_dict, **overrides)
  images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
  with torch.no_grad():
    expected = torch_model(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
  logits = get_model(name, 10, **overrides).apply(variables, jnp.asarray(images))
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_preact_mcdo_bottleneck_has_the_reference_shortcut_batchnorm():
  """SS ``preresnet_mcdo_block.Bottleneck``: shortcut = conv1×1 + BatchNorm
  (``shortcut.1.*`` keys).

  A dropout rate of 1e-9 keeps every unit in float32 (keep probability rounds to 1, scale to 1),
  so the MC-dropout network is deterministic and its logits must equal the reference's.
  """
  torch_model = ref.randomize(ref.ResNet((3, 4, 6, 3), True, 10, width=4, preact=True, mcdo=True))
  state_dict = {k: v.numpy() for k, v in torch_model.state_dict().items()}
  assert "layer2.0.shortcut.1.running_var" in state_dict
  overrides = dict(width=4, dropout_rate=1e-9)
  variables = from_torch_state_dict("preresnet_mcdo_50", state_dict, **overrides)
  images = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
  with torch.no_grad():
    expected = torch_model(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
  logits = get_model("preresnet_mcdo_50", 10, **overrides).apply(
      variables, jnp.asarray(images), rngs={"dropout": jax.random.key(0)})
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
