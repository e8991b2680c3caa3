"""PiT (HV ``models/pit.py``; timm's ``PoolingVisionTransformer``): parameter counts, geometry,
parity with timm in both position-embedding layouts, lesions and the analyses on a tiny PiT."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax import convert
from smoothing_jax.analysis import top_eigenvalues
from smoothing_jax.analysis.features import (
  block_kinds,
  feature_maps,
  feature_variance,
  fourier_by_depth,
)
from smoothing_jax.analysis.lesion import lesion_accuracy_drops
from smoothing_jax.analysis.spectrum import training_loss
from smoothing_jax.models import get_model
from smoothing_jax.models.vit import TransformerUnit
from tests.helpers import abstract_variables, import_timm, init_variables, num_params

# HV layout, patch 2 with stride 2 on 16×16 inputs: maps 8×8 and 4×4 of widths 4 and 8.
TINY_PIT = dict(depths=(1, 1), num_heads=(1, 2), head_dim=4, patch_size=2, stride=2)
# A small timm PiT with the flags of HV's checkpoint (patch 2, stride 1) on 32×32 inputs (the
# converter's geometry): maps 31×31, 16×16 (odd map: the pooling's padding), 8×8; stage 2 has two
# blocks.
SMALL_TIMM = dict(base_dims=[4, 4, 4], depth=[1, 2, 1], heads=[1, 2, 4])
SMALL_OURS = dict(head_dim=4, depths=(1, 2, 1), num_heads=(1, 2, 4))


# ----------------------------------------------------------------------------- counts and shapes

@pytest.mark.parametrize("name, cifar100, imagenet", [
    # HV models/pit.py (commit 9571ff1370f31af2f433558fbfa7bc87a97b0bab) built with torch + einops
    # in a scratch script: tiny/small(100, image_size=32, patch_size=2, sd=0.1) (HV's
    # configs/cifar100_vit.yaml; stride stays 8) and (1000, image_size=224, patch_size=16).
    ("pit_ti", 4_516_260, 4_841_576),
    ("pit_s", 22_718_260, 23_449_096),
])
def test_parameter_counts_equal_hv(name, cifar100, imagenet):
  assert num_params(get_model(name, 100)) == cifar100
  assert num_params(get_model(name, 1000, stem="imagenet"), (1, 224, 224, 3)) == imagenet


def test_timm_layout_has_the_parameter_count_of_hv_checkpoint():
  # timm 1.0.31 PoolingVisionTransformer(num_classes=100, img_size=32, patch_size=2, stride=1,
  # base_dims=[32, 32, 32], depth=[2, 6, 4], heads=[2, 4, 8], mlp_ratio=4).
  assert num_params(get_model("pit_ti", 100, **convert.TIMM_LAYOUTS["pit_ti"])) == 4_582_436


def test_geometry_and_bad_options_are_named():
  positions = lambda model, size=32: abstract_variables(  # noqa: E731
      model, (1, size, size, 3))["params"]["pos_embedding"].shape
  assert positions(get_model("pit_ti", 10)) == (1, 1 + 4 * 4, 64)         # ⌊(32 − 2)/8⌋ + 1 = 4
  assert positions(get_model("pit_ti", 10, stem="imagenet"), 224) == (1, 1 + 27 * 27, 64)
  assert positions(get_model("pit_ti", 10, **convert.TIMM_LAYOUTS["pit_ti"])) == (1, 31, 31, 64)
  model = get_model("pit_s", 1000, stem="imagenet", dtype=jnp.bfloat16)
  out = jax.eval_shape(lambda x: model.init_with_output(jax.random.key(0), x)[0],
                       jnp.zeros((2, 224, 224, 3)))
  assert out.shape == (2, 1000) and out.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="Unknown position_embedding"):
    positions(get_model("pit_ti", 10, position_embedding="cls"))
  with pytest.raises(ValueError, match="one entry per stage"):
    positions(get_model("pit_ti", 10, num_heads=(2, 4)))
  with pytest.raises(ValueError, match="width 96 to be a multiple of stage 1's 64"):
    positions(get_model("pit_ti", 10, num_heads=(2, 3, 6)))
  with pytest.raises(ValueError, match="smaller than the patch size 16"):
    positions(get_model("pit_ti", 10, stem="imagenet"), 8)


def test_stochastic_depth_is_linear_in_the_block_index():
  rates = {}

  def record(next_fun, args, kwargs, context):
    if isinstance(context.module, TransformerUnit):
      rates[context.module.name] = context.module.drop_path_rate
    return next_fun(*args, **kwargs)

  model = get_model("pit_ti", 10, stochastic_depth=0.1)
  with nn.intercept_methods(record):
    abstract_variables(model)
  # HV: block k of the 2 + 6 + 4 = 12 blocks drops with 0.1 · k / 11 (both of its units).
  assert rates == pytest.approx({name: 0.1 * (i // 2) / 11
                                 for i, (name, _) in enumerate(model.units())})
  assert rates["stage3_block3_mlp"] == pytest.approx(0.1)


# ------------------------------------------------------------------------------- parity with timm

@pytest.fixture(scope="module")
def timm_pit():
  """``(timm model, its state_dict as numpy, images [2, 32, 32, 3], timm's logits)``: the small timm
  PiT with every parameter perturbed (LayerNorms, biases and embeddings not at their init)."""
  timm = import_timm()
  import torch
  torch.manual_seed(0)
  model = timm.models.pit.PoolingVisionTransformer(num_classes=5, img_size=32, patch_size=2,
                                                   stride=1, mlp_ratio=4, **SMALL_TIMM).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.add_(0.1 * torch.randn_like(param))
    x = np.random.default_rng(0).normal(size=(2, 32, 32, 3)).astype(np.float32)
    logits = model(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
  return model, {k: v.numpy() for k, v in model.state_dict().items()}, x, logits


def test_logits_equal_timm(timm_pit):
  _, state_dict, x, expected = timm_pit
  variables = convert.from_timm_state_dict("pit_ti", state_dict, **SMALL_OURS)
  ours = get_model("pit_ti", 5, **convert.TIMM_LAYOUTS["pit_ti"], **SMALL_OURS)
  # To 1e-5 (they agree to ~4e-7): LayerNorm ε 1e-5 instead of timm's 1e-6 moves them by ~1.5e-4.
  np.testing.assert_allclose(ours.apply(variables, x), expected, rtol=1e-5, atol=1e-5)


def test_token_position_embedding_with_timm_map_equals_timm(timm_pit):
  """HV's layout adds positions to [CLS, patches]: with a zero CLS row and timm's map on the
  patches (and timm's ε and qkv bias) it computes timm's logits."""
  _, state_dict, x, expected = timm_pit
  variables = convert.from_timm_state_dict("pit_ti", state_dict, **SMALL_OURS)
  params = dict(variables["params"])
  position_map = params["pos_embedding"]                            # [1, 31, 31, 4]
  params["pos_embedding"] = jnp.concatenate(
      [jnp.zeros((1, 1, 4)), position_map.reshape(1, 961, 4)], axis=1)
  ours = get_model("pit_ti", 5, patch_size=2, stride=1, qkv_bias=True, layer_norm_epsilon=1e-6,
                   **SMALL_OURS)
  np.testing.assert_allclose(ours.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-5)


def test_timm_state_dict_needs_the_timm_layout(timm_pit):
  _, state_dict, _, _ = timm_pit
  with pytest.raises(ValueError, match="pos_embed.*expected \\(1, 962, 4\\)"):
    convert.from_timm_state_dict("pit_ti", state_dict, position_embedding="tokens", **SMALL_OURS)
  with pytest.raises(ValueError, match="missing keys.*transformers.2.blocks.1"):
    convert.from_timm_state_dict("pit_ti", state_dict, **{**SMALL_OURS, "depths": (1, 2, 2)})


# ------------------------------------------------------------------------ lesions and analyses

@pytest.fixture(scope="module")
def tiny_pit():
  """``(model, variables, images, labels)``: a 2-stage PiT of widths 4 and 8 (3 classes), HV
  layout, on six 16×16 images."""
  model = get_model("pit_ti", 3, **TINY_PIT)
  x = jax.random.normal(jax.random.key(5), (6, 16, 16, 3))
  return model, init_variables(model, x), x, jnp.array([0, 1, 2, 0, 1, 2])


def test_lesion_of_a_zero_unit_changes_nothing(tiny_pit):
  model, variables, x, _ = tiny_pit
  apply = jax.jit(model.apply)
  names = [n for n, _ in model.units()]
  assert names == ["stage1_block0_msa", "stage1_block0_mlp", "stage2_block0_msa",
                   "stage2_block0_mlp"]
  index = names.index("stage2_block0_msa")
  params = jax.tree_util.tree_map_with_path(
      lambda path, v: jnp.zeros_like(v)
      if tuple(p.key for p in path[:3]) == (names[index], "attention", "out") else v,
      variables["params"])
  zeroed = {**variables, "params": params}
  keep_all = jnp.ones(len(names))
  full = apply(zeroed, x, block_mask=keep_all)
  np.testing.assert_allclose(apply(zeroed, x, block_mask=keep_all.at[index].set(0.0)), full,
                             rtol=1e-6, atol=1e-6)
  assert not np.allclose(apply(zeroed, x, block_mask=keep_all.at[index - 1].set(0.0)), full,
                         atol=1e-4)


def test_analyses_run_on_pit(tiny_pit):
  model, variables, x, y = tiny_pit
  names = [n for n, _ in model.units()]
  taps = ["patch_embedding"] + names[:2] + ["stage2_pool"] + names[2:]
  maps = feature_maps(model, variables, x)
  assert list(maps) == taps
  # Tokens become maps without the CLS token: 8×8 in stage 1, pooled to 4×4.
  assert [maps[n].shape for n in ("stage1_block0_mlp", "stage2_pool", "stage2_block0_mlp")] == [
      (6, 8, 8, 4), (6, 4, 4, 8), (6, 4, 4, 8)]
  assert block_kinds(model, taps)["stage2_pool"] == "pool"
  curves = fourier_by_depth(model, variables, x)
  assert list(curves) == taps and all(np.all(np.isfinite(c)) for c in curves.values())
  variance = feature_variance(model, variables, x, num_samples=2)
  assert all(v["model"] == 0.0 and v["data"] > 0 for v in variance.values())
  lesions = lesion_accuracy_drops(model, variables, [{"image": x, "label": y}])
  assert [r["name"] for r in lesions["units"]] == names
  loss = lambda p: training_loss(model, 0.0, {}, jax.random.key(0), x, y, p)  # noqa: E731
  eigenvalues = top_eigenvalues(loss, variables["params"], 1, max_iters=5)[0]
  assert eigenvalues.shape == (1,) and np.isfinite(eigenvalues[0])
