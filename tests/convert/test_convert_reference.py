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
from tests import torch_reference as ref  # noqa: E402

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


# ------------------------------------------------------------------ HV's released checkpoints

from smoothing_jax.convert import TIMM_LAYOUTS, load_torch_checkpoint, reference_keys  # noqa: E402
from tests.helpers import import_timm, num_params  # noqa: E402

# A ViT of HV's released layout (timm, qkv_bias=False), cut to 2 blocks of width 16 on 8×8 images.
SMALL_VIT = dict(hidden_dim=16, depth=2, num_heads=2, head_dim=8, mlp_dim=64)


def test_vit_ti_in_the_timm_layout_has_the_released_parameter_count():
  # HV README ViT-Ti: timm VisionTransformer(num_classes=100, img_size=32, patch_size=2,
  # embed_dim=192, depth=12, num_heads=3, qkv_bias=False); timm 1.0.31 counts 5,403,172.
  assert num_params(get_model("vit_ti", 100, **TIMM_LAYOUTS["vit_ti"])) == 5_403_172


@pytest.fixture(scope="module")
def timm_vit_file(tmp_path_factory):
  """``(path, timm model)``: a small timm ViT saved in HV's ``{"state_dict": ...}`` wrapper.

  Its embeddings are scaled down (token variance ~1e-6), so LayerNorm's ε (timm 1e-6, HV 1e-5)
  changes the logits."""
  timm = import_timm()
  vit = ref.randomize(timm.models.vision_transformer.VisionTransformer(
      num_classes=5, img_size=8, patch_size=2, embed_dim=16, depth=2, num_heads=2,
      qkv_bias=False))
  with torch.no_grad():
    for name in ("patch_embed.proj.weight", "patch_embed.proj.bias", "cls_token", "pos_embed"):
      vit.state_dict()[name].mul_(1e-3)
  path = tmp_path_factory.mktemp("timm") / "vit_ti_cifar100.pth.tar"
  torch.save({"state_dict": vit.state_dict()}, path)
  return path, vit


def test_timm_vit_checkpoint_file_gives_the_timm_logits(timm_vit_file):
  path, vit = timm_vit_file
  variables = load_torch_checkpoint(path, "vit_ti", image_shape=(8, 8, 3), **SMALL_VIT)
  images = np.random.default_rng(0).normal(size=(2, 8, 8, 3)).astype(np.float32)
  with torch.no_grad():
    expected = vit(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
  logits = get_model("vit_ti", 5, **TIMM_LAYOUTS["vit_ti"], **SMALL_VIT).apply(variables, images)
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
  hv_epsilon = get_model("vit_ti", 5, **SMALL_VIT).apply(variables, images)  # LN ε 1e-5
  assert np.abs(hv_epsilon - expected).max() > 1e-2


class _HVBottleneck(torch.nn.Module):
  """HV ``models/resnet_dnn_block.Bottleneck`` (sd = 0): each conv in an ``nn.Sequential`` with
  its BN (and ReLU)."""

  def __init__(self, cin, channels, stride):
    super().__init__()
    nn, cout = torch.nn, 4 * channels
    self.shortcut = nn.Sequential(*([nn.Conv2d(cin, cout, 1, stride, bias=False),
                                     nn.BatchNorm2d(cout)] if stride != 1 or cin != cout else []))
    self.conv1 = nn.Sequential(nn.Conv2d(cin, channels, 1, bias=False), nn.BatchNorm2d(channels),
                               nn.ReLU())
    self.conv2 = nn.Sequential(nn.Conv2d(channels, channels, 3, stride, 1, bias=False),
                               nn.BatchNorm2d(channels), nn.ReLU())
    self.conv3 = nn.Sequential(nn.Conv2d(channels, cout, 1, bias=False), nn.BatchNorm2d(cout))

  def forward(self, x):
    return torch.relu(self.conv3(self.conv2(self.conv1(x))) + self.shortcut(x))


class _HVGAPBlock(torch.nn.Module):
  """HV ``models/classifier_block.GAPBlock``."""

  def __init__(self, cin, num_classes):
    super().__init__()
    self.dense = torch.nn.Linear(cin, num_classes)

  def forward(self, x):
    return self.dense(x.mean(dim=(2, 3)))


class _HVResNet50(torch.nn.Module):
  """HV ``models.get_model("resnet_50", num_classes, stem=False)`` with stem width ``width``
  (HV: 64)."""

  def __init__(self, num_classes, width):
    super().__init__()
    nn = torch.nn
    self.layer0 = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                nn.ReLU())
    cin = width
    for i, (blocks, stride) in enumerate(zip((3, 4, 6, 3), (1, 2, 2, 2), strict=True)):
      layer = []
      for j in range(blocks):
        layer.append(_HVBottleneck(cin, width * 2**i, stride if j == 0 else 1))
        cin = 4 * width * 2**i
      setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
    self.classifier = nn.Sequential(_HVGAPBlock(cin, num_classes))

  def forward(self, x):
    for i in range(5):
      x = getattr(self, f"layer{i}")(x)
    return self.classifier(x)


def test_hv_resnet_50_checkpoint_file_loads_into_resnet_dnn_50(tmp_path):
  hv = ref.randomize(_HVResNet50(7, width=4))
  state_dict = hv.state_dict()
  # HV's keys differ from SS's only inside the blocks: conv<k>.0 is SS's conv<k>, conv<k>.1 bn<k>.
  assert reference_keys({"layer1.0.conv1.0.weight": 0, "layer1.0.conv3.1.running_var": 0,
                         "layer2.0.shortcut.1.weight": 0, "layer0.1.bias": 0}) == {
                             "layer1.0.conv1.weight": 0, "layer1.0.bn3.running_var": 0,
                             "layer2.0.shortcut.1.weight": 0, "layer0.1.bias": 0}
  path = tmp_path / "resnet_50_cifar100.pth.tar"  # as saved from nn.DataParallel, in SS's wrapper
  torch.save({"name": "resnet_50", "state_dict": {f"module.{k}": v for k, v in state_dict.items()}},
             path)
  variables = load_torch_checkpoint(path, "resnet_dnn_50", width=4)  # every key matched
  ours = set(to_torch_state_dict(variables))
  assert ours == {k for k in reference_keys(state_dict) if not k.endswith("num_batches_tracked")}
  images = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
  with torch.no_grad():
    expected = hv(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
  logits = get_model("resnet_dnn_50", 7, width=4).apply(variables, images)
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_checkpoint_file_errors_name_the_file_and_the_problem(timm_vit_file, tmp_path):
  path, _ = timm_vit_file
  with pytest.raises(FileNotFoundError, match="No torch checkpoint file .*missing.pth"):
    load_torch_checkpoint(tmp_path / "missing.pth", "vit_ti")
  (tmp_path / "text.pth").write_text("not a checkpoint")
  with pytest.raises(ValueError, match="text.pth is not a torch checkpoint"):
    load_torch_checkpoint(tmp_path / "text.pth", "vit_ti")
  torch.save({"epoch": 3, "optimizer": {}}, tmp_path / "no_weights.pth")
  with pytest.raises(ValueError, match=r"no_weights.pth holds no state_dict .*'epoch'"):
    load_torch_checkpoint(tmp_path / "no_weights.pth", "vit_ti")
  with pytest.raises(ValueError,
                     match="vit_ti_cifar100.pth.tar: No timm mapping for 'resnet_dnn_18'"):
    load_torch_checkpoint(path, "resnet_dnn_18")
  with pytest.raises(ValueError) as error:  # depth 1: the second block's keys are unexpected
    load_torch_checkpoint(path, "vit_ti", image_shape=(8, 8, 3), **{**SMALL_VIT, "depth": 1})
  assert str(error.value).startswith(str(path))
  assert "unexpected keys (11): blocks.1.norm1.weight" in str(error.value)
