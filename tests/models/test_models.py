"""Model zoo: reference parameter counts, geometry, variants, registry and input errors; the
U-Net's layout, odd sizes, dropout and smoothing positions."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.models import get_model, list_models
from tests.helpers import TINY_UNET, abstract_variables, init_variables, num_params, rngs


def wrn_param_count(depth, k, num_classes):
  """Closed-form count of the iBNN/meliketoy WRN (conv biases, BN γ/β, 1×1 shortcuts)."""
  n = (depth - 4) // 6
  def conv(cin, cout, ks):
    return cin * cout * ks * ks + cout

  total, cin = conv(3, 16, 3), 16
  for width in (16 * k, 32 * k, 64 * k):
    for j in range(n):
      total += 2 * cin + conv(cin, width, 3) + 2 * width + conv(width, width, 3)
      if j == 0:
        total += conv(cin, width, 1)
      cin = width
  return total + 2 * cin + cin * num_classes + num_classes


# Trainable parameter counts of the PyTorch reference implementation.
@pytest.mark.parametrize("name,num_classes,expected", [
    ("resnet_dnn_18", 100, 11_220_132),
    ("resnet_dnn_50", 100, 23_705_252),
    ("preresnet_dnn_18", 100, 11_218_340),
    ("resnext_dnn_50", 100, 23_177_124),
    ("vgg_dnn_16", 100, 134_674_468),
    ("alexnet_dnn", 10, 23_467_722),
    ("resnet_dnn_34", 10, 21_282_122),
    ("wideresnet_dnn_28_10", 10, 36_489_290),
])
def test_reference_parameter_counts(name, num_classes, expected):
  assert num_params(get_model(name, num_classes)) == expected


def test_wrn_count_matches_closed_form():
  assert wrn_param_count(28, 10, 10) == 36_489_290
  assert num_params(get_model("wideresnet_dnn_28_10", 100)) == wrn_param_count(28, 10, 100)


@pytest.mark.parametrize("family", ["resnet_{}_18", "preresnet_{}_18", "vgg_{}_11", "alexnet_{}",
                                    "wideresnet_{}_28_10"])
def test_dropout_and_smoothing_add_no_parameters(family):
  counts = {
      v: num_params(get_model(family.format(v), 10))
      for v in ("dnn", "mcdo", "dnn_smoothing", "mcdo_smoothing")
  }
  assert len(set(counts.values())) == 1, counts


# Counted on SS's own classes (xxxnell/spatial-smoothing@5297b6e, models/preresnet.py, CIFAR stem
# ``stem=False``, 100 classes): its MC-dropout bottleneck has a BatchNorm after the 1×1 shortcut
# (models/preresnet_mcdo_block.py), the dnn bottleneck has none, so
# mcdo = dnn + 2·(256+512+1024+2048).
@pytest.mark.parametrize("depth,dnn,mcdo", [(50, 23_697_572, 23_705_252), (101, None, 42_697_380),
                                            (152, None, 58_341_028)])
def test_preact_bottleneck_counts_equal_the_reference_classes(depth, dnn, mcdo):
  if dnn is not None:
    assert num_params(get_model(f"preresnet_dnn_{depth}", 100)) == num_params(
        get_model(f"preresnet_dnn_smoothing_{depth}", 100)) == dnn
  assert num_params(get_model(f"preresnet_mcdo_{depth}", 100)) == mcdo
  assert num_params(get_model(f"preresnet_mcdo_smoothing_{depth}", 100)) == mcdo


def test_registry_has_the_reference_grid():
  names = set(list_models())
  for variant in ("dnn", "mcdo", "dnn_smoothing", "mcdo_smoothing"):
    for depth in (18, 34, 50, 101, 152):
      assert f"resnet_{variant}_{depth}" in names and f"preresnet_{variant}_{depth}" in names
    for depth in (11, 13, 16, 19):
      assert f"vgg_{variant}_{depth}" in names and f"prevgg_{variant}_{depth}" in names
    for name in (f"resnext_{variant}_50", f"resnext_{variant}_101", f"wideresnet_{variant}_50",
                 f"wideresnet_{variant}_101", f"wideresnet_{variant}_28_10", f"alexnet_{variant}"):
      assert name in names


def test_variant_options_follow_the_reference():
  assert get_model("resnet_dnn_18", 10).dropout_rate == 0.0
  assert get_model("resnet_mcdo_18", 10).dropout_rate == 0.3
  assert get_model("alexnet_mcdo_smoothing", 10).dropout_rate == 0.1
  assert get_model("vgg_mcdo_smoothing_16", 10).smoothing
  assert not get_model("vgg_mcdo_16", 10).smoothing


def test_unknown_name_lists_close_matches():
  with pytest.raises(ValueError,
                     match=r"Unknown model name 'resnet_mcdo_smooth_18'.*resnet_mcdo_smoothing_18"):
    get_model("resnet_mcdo_smooth_18", 10)


def test_unknown_option_is_named():
  with pytest.raises(ValueError, match=r"Unknown option\(s\) \['dropout'\]"):
    get_model("resnet_dnn_18", 10, dropout=0.1)


@pytest.mark.parametrize("stem,size,expected", [("cifar", 32, [33, 18, 10, 6]),
                                                ("imagenet", 224, [57, 30, 16, 9])])
def test_smoothing_grows_each_stage_map_by_one_pixel(stem, size, expected):
  model = get_model("resnet_dnn_smoothing_18", 10, stem=stem, width=8)
  _, state = jax.eval_shape(lambda: model.init_with_output(
      rngs(), jnp.zeros((1, size, size, 3)), capture_intermediates=True))
  sizes = [state["intermediates"][f"smooth{i}_0"]["__call__"][0].shape[1] for i in range(1, 5)]
  assert sizes == expected


def test_preactivation_resnet_smooths_stages_one_to_three():
  model = get_model("preresnet_dnn_smoothing_18", 10, width=8)
  _, state = jax.eval_shape(lambda: model.init_with_output(rngs(), jnp.zeros((1, 32, 32, 3)),
                                                           capture_intermediates=True))
  assert sorted(k for k in state["intermediates"] if k.startswith("smooth")) == [
      "smooth1_0", "smooth2_0", "smooth3_0"
  ]


@pytest.mark.parametrize("name,overrides,size", [
    ("resnet_mcdo_smoothing_50", {"stem": "imagenet"}, 224),
    ("resnext_dnn_smoothing_101", {}, 32),
    ("wideresnet_mcdo_50", {"classifier": "mlp"}, 32),
    ("preresnet_mcdo_smoothing_34", {"stem": "imagenet"}, 224),
    ("prevgg_mcdo_smoothing_13", {}, 32),
    ("vgg_dnn_19", {"classifier": "gap"}, 224),
    ("alexnet_mcdo_smoothing", {"stem": "imagenet"}, 224),
    ("alexnet_dnn", {}, 32),
    ("wideresnet_mcdo_smoothing_28_10", {}, 32),
])
def test_output_shapes(name, overrides, size):
  model = get_model(name, 7, **overrides)
  out = jax.eval_shape(lambda: model.init_with_output(rngs(), jnp.zeros((2, size, size, 3)))[0])
  assert out.shape == (2, 7)


def test_mlp_head_is_the_reference_head():
  params = abstract_variables(get_model("resnet_dnn_18", 10, classifier="mlp"))["params"]
  assert params["classifier_1"]["dense1"]["kernel"].shape == (7 * 7 * 512, 4096)
  assert params["classifier_1"]["dense3"]["kernel"].shape == (4096, 10)


@pytest.fixture(scope="module")
def narrow_models():
  out = {}
  for name in ("resnet_dnn_18", "resnet_mcdo_18"):
    model = get_model(name, 5, width=4)
    variables = init_variables(model, (1, 16, 16, 3))
    apply = jax.jit(lambda v, x, k, m=model: m.apply(v, x, rngs={"dropout": k}))
    out[name] = (model, variables, apply)
  return out


def test_dnn_is_deterministic_and_mcdo_samples(narrow_models, images):
  _, v, apply = narrow_models["resnet_dnn_18"]
  chex.assert_trees_all_equal(apply(v, images, jax.random.key(1)),
                              apply(v, images, jax.random.key(2)))
  _, v, apply = narrow_models["resnet_mcdo_18"]
  a, b = apply(v, images, jax.random.key(1)), apply(v, images, jax.random.key(2))
  assert not np.allclose(a, b)
  chex.assert_trees_all_close(a, apply(v, images, jax.random.key(1)))


@pytest.mark.parametrize("mc", [False, True])
def test_vgg_head_dropout_is_train_only_or_mc_dropout(mc):
  # The iBNN reference's DetVGG16: dropout 0.5 before the two hidden layers of its 512-512-C head.
  model = get_model("vgg_dnn_16", 5, width=4, stage_sizes=(1, 1, 1, 1, 1), batch_norm=False,
                    classifier="mlp512", head_dropout_rate=0.5, head_mc_dropout=mc)
  variables = init_variables(model, (1, 32, 32, 3))
  x = jax.random.normal(jax.random.key(0), (2, 32, 32, 3))
  apply = jax.jit(lambda k, train: model.apply(variables, x, train, rngs={"dropout": k}),
                  static_argnums=1)
  assert not np.allclose(apply(jax.random.key(1), True), apply(jax.random.key(2), True))
  evaluations = apply(jax.random.key(1), False), apply(jax.random.key(2), False)
  assert np.allclose(*evaluations) != mc


def test_train_mode_updates_batch_stats(narrow_models, images):
  model, v, _ = narrow_models["resnet_dnn_18"]
  logits, updates = model.apply(v, images, train=True, mutable=["batch_stats"])
  assert logits.shape == (3, 5)
  before = v["batch_stats"]["layer0_1"]["mean"]
  after = updates["batch_stats"]["layer0_1"]["mean"]
  assert not np.allclose(before, after)


def test_mcdo_without_dropout_rng_is_a_clear_error(narrow_models, images):
  model, v, _ = narrow_models["resnet_mcdo_18"]
  with pytest.raises(ValueError, match="'dropout' RNG"):
    model.apply(v, images)


@pytest.mark.parametrize("bad,error,message", [
    (jnp.zeros((16, 16, 3)), ValueError, "NHWC"),
    (jnp.zeros((1, 16, 16, 3), jnp.uint8), TypeError, "floating-point"),
    (jnp.zeros((1, 16, 16, 1)), ValueError, "3 channels"),
    (jnp.zeros((1, 3, 16, 16)), ValueError, "NCHW"),
])
def test_bad_images_are_rejected(narrow_models, bad, error, message):
  model, v, _ = narrow_models["resnet_dnn_18"]
  with pytest.raises(error, match=message):
    model.apply(v, bad)


@pytest.mark.parametrize("overrides,message", [({"stem": "tiny"}, "Unknown stem"),
                                               ({"classifier": "cls"}, "Unknown classifier"),
                                               ({"blur_size": 4}, "Unsupported blur size 4")])
def test_bad_options_are_rejected(overrides, message):
  model = get_model("resnet_dnn_smoothing_18", 10, width=4, **overrides)
  with pytest.raises(ValueError, match=message):
    abstract_variables(model)


# ----------------------------------------------------------------------------- U-Net


@pytest.mark.parametrize("name",
                         ["unet_dnn", "unet_mcdo", "unet_mcdo_smoothing", "unet_dnn_smoothing"])
@pytest.mark.parametrize("size", [(13, 17), (9, 7)])
def test_unet_output_shape_equals_input_shape_for_odd_sizes(name, size):
  model = get_model(name, 11, **TINY_UNET)
  x = jnp.zeros((2,) + size + (3,))
  out = jax.eval_shape(lambda: model.init_with_output(rngs(), x)[0])
  assert out.shape == (2,) + size + (11,)


def _unet_parameter_count(width=64, encoder=(2, 2, 3, 3, 3), decoder=(3, 3, 3, 2), classes=11):
  """Trainable parameters of the reference layout, counted by hand (conv 3×3 with bias,
  BN γ/β)."""
  conv = lambda cin, cout, k=3: k * k * cin * cout + cout  # noqa: E731
  total, cin = 0, 3
  for level, n in enumerate(encoder):
    cout = width * 2 ** level
    for _ in range(n):
      total += conv(cin, cout) + 2 * cout
      cin = cout
  for level, n in zip(reversed(range(len(decoder))), decoder, strict=True):
    cout = width * 2 ** level
    total += conv(cin, cout) + 2 * cout  # 3×3 transposed conv + BN
    for _ in range(n):
      total += conv(cout, cout) + 2 * cout
    cin = cout
  return total + conv(cin, classes, 1)


def test_unet_layout_is_the_reference_one():
  model = get_model("unet_mcdo", 11)
  count = num_params(model, (1, 64, 64, 3))
  assert count == _unet_parameter_count() == 46_885_195
  assert model.stages_with_dropout() == (3, 4, 5, 6, 7, 8) and model.dropout_rate == 0.5
  assert get_model("unet_dnn", 11).dropout_rate == 0.0


def test_unet_dropout_follows_stages_3_to_8():
  from smoothing_jax.layers import MCDropout
  model = get_model("unet_mcdo", 5, width=2, encoder_convs=(1,) * 5, decoder_convs=(1,) * 4)
  x = jnp.ones((1, 16, 16, 3))
  variables = init_variables(model, x)
  _, inter = model.apply(variables,
                         x,
                         rngs={"dropout": jax.random.key(2)},
                         mutable=["intermediates"],
                         capture_intermediates=lambda m, _: isinstance(m, MCDropout))
  calls = [
      inter["intermediates"][f"MCDropout_{i}"]["__call__"][0].shape
      for i in range(len(inter["intermediates"]))
  ]
  # Stages 3, 4 (encoder levels at 4×4, 2×2), 5 (bottleneck 1×1), 6, 7, 8 (decoder at
  # 2×2, 4×4, 8×8).
  assert calls == [(1, 4, 4, 8), (1, 2, 2, 16), (1, 1, 1, 32), (1, 2, 2, 16), (1, 4, 4, 8),
                   (1, 8, 8, 4)]


def test_unet_dropout_and_smoothing_positions(tiny_unet):
  model, variables = tiny_unet
  x = jax.random.normal(jax.random.key(3), (1, 12, 12, 3))
  a = model.apply(variables, x, rngs={"dropout": jax.random.key(1)})
  b = model.apply(variables, x, rngs={"dropout": jax.random.key(2)})
  assert not np.allclose(a, b)  # MC dropout stays on at evaluation
  det = get_model("unet_dnn_smoothing", 5, **TINY_UNET)
  np.testing.assert_array_equal(det.apply(variables, x), det.apply(variables, x))
  _, inter = det.apply(variables, x, capture_intermediates=lambda m, _: "smooth" in (m.name or ""),
                       mutable=["intermediates"])
  assert sorted(
      k for k in inter["intermediates"] if k.startswith("smooth")) == ["smooth1", "smooth2"]
  with pytest.raises(ValueError, match="dropout_stages"):
    init_variables(get_model("unet_mcdo", 5, **TINY_UNET, dropout_stages=(9,)), x)


@pytest.mark.parametrize("name,overrides,size", [
    ("resnet_mcdo_smoothing_18", dict(width=8), 16),
    ("vgg_ibnn_16", dict(width=8, num_components=2, stage_sizes=(1, 1)), 16),  # two stages
    ("alternet_18", dict(width=8, stage_sizes=(1, 1, 1, 2), msa_blocks=(0, 0, 0, 1),
                         num_heads=(1, 1, 1, 2), head_dim=4, window_size=2), 16),
    ("unet_mcdo_smoothing", TINY_UNET, 12),
])
def test_bfloat16_logits_stay_close_to_float32(name, overrides, size):
  """``dtype=bfloat16`` (``config.half_precision``) on the float32 parameters: the same stochastic
  pass (same keys).  bfloat16 keeps 8 significant bits (rounding 2⁻⁹ ≈ 0.2% per operation);
  over a dozen layers, with BatchNorm renormalising, errors stay at a few percent of the logits'
  scale, so the test allows 5% of their RMS and 0.05 in probability."""
  f32 = get_model(name, 10, **overrides)
  bf16 = get_model(name, 10, dtype=jnp.bfloat16, **overrides)
  x = jax.random.normal(jax.random.key(0), (4, size, size, 3))
  variables = init_variables(f32, x)
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(variables))
  chex.assert_trees_all_equal_shapes_and_dtypes(variables, abstract_variables(bf16, x))
  logits = {m: jax.jit(lambda v, x, m=m: m.apply(v, x, train=False, rngs=rngs(5)))(variables, x)
            for m in (f32, bf16)}
  low, high = np.asarray(logits[bf16], np.float32), np.asarray(logits[f32])
  assert logits[f32].dtype == jnp.float32 and not np.array_equal(low, high)  # bf16 was used
  rms = np.sqrt(np.mean(high**2))
  assert np.sqrt(np.mean((low - high)**2)) <= 0.05 * rms
  np.testing.assert_allclose(jax.nn.softmax(low), jax.nn.softmax(high), atol=0.05)


def test_ibnn_models_start_from_the_reference_s_pytorch_initialisation():
  """The iBNN reference's WRN never applies its ``conv_init``: PyTorch's default
  ``reset_parameters`` (kaiming_uniform(a=√5) weights, U(±1/√fan_in) biases) everywhere; its VGG-16
  initialises only the convs.  Against torch's own layers of the same shapes."""
  torch = pytest.importorskip("torch")
  wrn = init_variables(get_model("wideresnet_ibnn_28_10", 10, num_components=2, depth=10),
                       (1, 32, 32, 3))["params"]
  conv = wrn["layer2_0"]["conv1"]  # 160 → 320, 3×3
  reference = torch.nn.Conv2d(160, 320, 3)
  for ours, theirs in ((conv["kernel"], reference.weight), (conv["bias"], reference.bias)):
    ours, theirs = np.asarray(ours), theirs.detach().numpy()
    assert np.abs(ours).max() <= 1 / np.sqrt(9 * 160) + 1e-7
    assert np.std(ours) == pytest.approx(np.std(theirs), rel=0.05 if ours.ndim > 1 else 0.2)
  vgg = init_variables(get_model("vgg_ibnn_16", 10, num_components=2, width=8,
                                 stage_sizes=(1, 1, 1, 1, 1)), (1, 32, 32, 3))["params"]
  dense = vgg["classifier_0"]  # 64 → 64
  linear = torch.nn.Linear(64, 64)
  assert np.std(dense["kernel"]) == pytest.approx(float(linear.weight.detach().std()), rel=0.1)
  assert np.abs(dense["bias"]).max() <= 1 / 8 and np.any(np.asarray(dense["bias"]) != 0)
  assert not np.any(np.asarray(vgg["layer0_0"]["conv"]["bias"]))  # convs: N(0, 2/(k²·out)), 0
  assert np.std(vgg["layer0_0"]["conv"]["kernel"]) == pytest.approx(np.sqrt(2 / (9 * 8)),
                                                                     rel=0.15)
