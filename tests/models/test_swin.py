"""Swin (HV ``models/swin.py``; timm's ``SwinTransformer``): parameter counts, the shifted-window
mask, parity with timm, lesions and the analyses on a tiny Swin."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax import convert
from smoothing_jax.analysis import top_eigenvalues
from smoothing_jax.analysis.features import feature_variance, fourier_by_depth
from smoothing_jax.analysis.lesion import lesion_accuracy_drops
from smoothing_jax.analysis.spectrum import training_loss
from smoothing_jax.convert import timm_rules
from smoothing_jax.models import get_model
from smoothing_jax.models.swin import shifted_window_mask
from tests.helpers import import_timm, init_variables, num_params

TINY_SWIN = dict(embed_dim=8, depths=(2, 2), num_heads=(1, 2), head_dim=8, patch_size=2)
# A small timm Swin with the flags of HV's checkpoint (patch 1, window 4, qkv without bias) on
# 16×16 inputs: stage maps 16 (4×4 windows), 8 (2×2 windows) and 4 (one window, no shift).
SMALL_TIMM = dict(embed_dim=8, depths=(2, 2, 2), num_heads=(1, 2, 4))


# ----------------------------------------------------------------------------- counts and shapes

@pytest.mark.parametrize("name, cifar100, imagenet", [
    # HV models/swin.py (commit 9571ff1370f31af2f433558fbfa7bc87a97b0bab) built with torch + einops
    # in a scratch script: swin_t(100, window_size=4, pools=(1, 2, 2, 2)) on CIFAR-100 and the
    # defaults (window 7, pools (4, 2, 2, 2)) with 1000 classes.
    ("swin_t", 27_551_728, 28_249_588),
    ("swin_s", 48_832_060, 49_531_360),
])
def test_parameter_counts_equal_hv(name, cifar100, imagenet):
  assert num_params(get_model(name, 100)) == cifar100
  assert num_params(get_model(name, 1000, stem="imagenet"), (1, 224, 224, 3)) == imagenet


def test_timm_layout_has_the_parameter_count_of_hv_checkpoint():
  # timm 1.0.31 SwinTransformer(num_classes=100, img_size=32, patch_size=1, window_size=4,
  # embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), qkv_bias=False).
  assert num_params(get_model("swin_t", 100, **convert.TIMM_LAYOUTS["swin_t"])) == 27_562_126


def test_geometry_and_bad_options_are_named():
  model = get_model("swin_t", 1000, stem="imagenet", dtype=jnp.bfloat16)
  out = jax.eval_shape(lambda x: model.init_with_output(jax.random.key(0), x)[0],
                       jnp.zeros((2, 224, 224, 3)))
  assert out.shape == (2, 1000) and out.dtype == jnp.bfloat16
  shape = lambda m, s=32: jax.eval_shape(m.init, jax.random.key(0),  # noqa: E731
                                         jnp.zeros((1, s, s, 3)))
  with pytest.raises(ValueError, match="Unknown merge"):
    shape(get_model("swin_t", 10, merge="pool"))
  with pytest.raises(ValueError, match="one entry per stage"):
    shape(get_model("swin_t", 10, num_heads=(3, 6)))
  with pytest.raises(ValueError, match="window_size 7 does not divide the 32×32 map of stage 1"):
    shape(get_model("swin_t", 10, window_size=7))
  with pytest.raises(ValueError, match="not divisible by the patch size 4"):
    shape(get_model("swin_t", 10, patch_size=4), 30)


# ------------------------------------------------------------------------- shifted-window mask

def test_shifted_window_mask_by_hand():
  # One 4×4 window rolled by 2: its four 2×2 quadrants come from the four image corners.
  mask = shifted_window_mask(4, 4, 4, 2)[0]
  quadrant = np.array([[0, 0, 1, 1]] * 2 + [[2, 2, 3, 3]] * 2).reshape(-1)
  np.testing.assert_array_equal(mask == 0, quadrant[:, None] == quadrant[None, :])
  assert np.all(mask[mask != 0] == -np.inf)


def test_shifted_window_mask_equals_timm():
  timm = import_timm()
  from timm.models.swin_transformer import SwinTransformerBlock
  for height, width in ((8, 8), (8, 12), (16, 16)):
    block = SwinTransformerBlock(4, (height, width), 1, window_size=4, shift_size=2)
    ours = shifted_window_mask(height, width, 4, 2)
    np.testing.assert_array_equal(ours == 0, block.attn_mask.numpy() == 0)
  del timm


# ------------------------------------------------------------------------------- parity with timm

@pytest.fixture(scope="module")
def timm_swin():
  """``(timm model, its state_dict as numpy)``: the small timm Swin with random LayerNorms and
  position tables."""
  timm = import_timm()
  import torch
  torch.manual_seed(0)
  model = timm.models.swin_transformer.SwinTransformer(num_classes=5, img_size=16, patch_size=1,
                                                       window_size=4, qkv_bias=False,
                                                       drop_path_rate=0.0, **SMALL_TIMM).eval()
  with torch.no_grad():
    for param in model.parameters():
      param.add_(0.1 * torch.randn_like(param))
  return model, {k: v.numpy() for k, v in model.state_dict().items()}


def test_logits_equal_timm(timm_swin):
  import torch
  model, state_dict = timm_swin
  overrides = dict(SMALL_TIMM, head_dim=8)
  variables = convert.from_timm_state_dict("swin_t", state_dict, **overrides)
  ours = get_model("swin_t", 5, **convert.TIMM_LAYOUTS["swin_t"], **overrides)
  x = np.random.default_rng(0).normal(size=(2, 16, 16, 3)).astype(np.float32)
  with torch.no_grad():
    expected = model(torch.from_numpy(x).permute(0, 3, 1, 2)).numpy()
  np.testing.assert_allclose(ours.apply(variables, x), expected, rtol=1e-4, atol=1e-4)


def test_fused_heads_axes_are_split_by_our_shape():
  qkv = np.arange(2 * 12).reshape(2, 12)                       # [C, 3·h·d], h = 2, d = 2
  np.testing.assert_array_equal(timm_rules._split_fused_axes(qkv, (2, 3, 2, 2)),
                                np.arange(24).reshape(2, 3, 2, 2))
  # Not a split of value's axes (a transpose would be needed): left for the mismatch report.
  assert timm_rules._split_fused_axes(qkv, (12, 2)).shape == (2, 12)
  assert timm_rules._split_fused_axes(qkv, (4, 6)).shape == (2, 12)


def test_timm_state_dict_needs_the_timm_layout(timm_swin):
  _, state_dict = timm_swin
  with pytest.raises(ValueError, match="relative_position_bias_table.*expected"):
    convert.from_timm_state_dict("swin_t", state_dict, bias_table="shared", **SMALL_TIMM,
                                 head_dim=8)
  with pytest.raises(ValueError, match="missing keys.*layers.0.blocks.2"):
    convert.from_timm_state_dict("swin_t", state_dict, **{**SMALL_TIMM, "depths": (3, 2, 2)},
                                 head_dim=8)


# ------------------------------------------------------------------------ lesions and analyses

@pytest.fixture(scope="module")
def tiny_swin():
  """``(model, variables, images, labels)``: a 2-stage Swin of width 8 (3 classes), HV layout, on
  six 16×16 images (stage maps 8×8 and 4×4, window 4: shifted windows in stage 1)."""
  model = get_model("swin_t", 3, **TINY_SWIN)
  x = jax.random.normal(jax.random.key(5), (6, 16, 16, 3))
  return model, init_variables(model, x), x, jnp.array([0, 1, 2, 0, 1, 2])


def test_lesion_of_a_zero_unit_changes_nothing(tiny_swin):
  model, variables, x, _ = tiny_swin
  names = [n for n, _ in model.units()]
  assert names[:3] == ["stage1_block0_msa", "stage1_block0_mlp", "stage1_block1_msa"]
  index = names.index("stage1_block1_msa")              # the shifted MSA
  params = jax.tree_util.tree_map_with_path(
      lambda path, v: jnp.zeros_like(v)
      if tuple(p.key for p in path[:3]) == (names[index], "attention", "out") else v,
      variables["params"])
  zeroed = {**variables, "params": params}
  keep_all = jnp.ones(len(names))
  full = model.apply(zeroed, x)
  np.testing.assert_allclose(model.apply(zeroed, x, block_mask=keep_all.at[index].set(0.0)), full,
                             rtol=1e-6, atol=1e-6)
  assert not np.allclose(model.apply(zeroed, x, block_mask=keep_all.at[index - 1].set(0.0)), full,
                         atol=1e-4)


def test_analyses_run_on_swin(tiny_swin):
  model, variables, x, y = tiny_swin
  names = [n for n, _ in model.units()]
  curves = fourier_by_depth(model, variables, x)
  taps = ["patch_embedding"] + names[:4] + ["stage2_merge"] + names[4:]
  assert list(curves) == taps and all(np.all(np.isfinite(c)) for c in curves.values())
  variance = feature_variance(model, variables, x, num_samples=2)
  assert all(v["model"] == 0.0 and v["data"] > 0 for v in variance.values())
  lesions = lesion_accuracy_drops(model, variables, [{"image": x, "label": y}])
  assert [r["name"] for r in lesions["units"]] == names
  loss = lambda p: training_loss(model, 0.0, {}, jax.random.key(0), x, y, p)  # noqa: E731
  eigenvalues = top_eigenvalues(loss, variables["params"], 1, max_iters=5)[0]
  assert eigenvalues.shape == (1,) and np.isfinite(eigenvalues[0])
