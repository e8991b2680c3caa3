"""ViT and AlterNet (HV): shapes, parameter counts, attention in the models, stochastic depth,
lesions, parity with the reference, dropout."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.models import get_model
from smoothing_jax.models.cnn import drop_path
from tests.helpers import abstract_variables, init_variables, num_params, rngs

TINY_VIT = dict(hidden_dim=16, depth=2, num_heads=2, head_dim=8, mlp_dim=32, patch_size=4)
TINY_ALTERNET = dict(width=8,
                     stage_sizes=(1, 2, 2, 2),
                     msa_blocks=(0, 1, 1, 1),
                     num_heads=(1, 2, 2, 2),
                     head_dim=8)


@pytest.fixture(scope="module")
def images():
  return jax.random.normal(jax.random.key(3), (4, 16, 16, 3))


# ----------------------------------------------------------------------------- counts and shapes

@pytest.mark.parametrize("name, count", [
    # The reference implementation's counts (HV models/vit.py and alternet.py, CIFAR-100, 32×32,
    # patch 2, window 4), as built by tests/torch_reference.py; checked below when torch is
    # installed.
    ("vit_ti", 5_403_172),
    ("alternet_50", 34_062_538),
])
def test_parameter_counts_equal_the_reference(name, count):
  assert num_params(get_model(name, 100)) == count


def test_parameter_counts_equal_the_torch_reference():
  torch = pytest.importorskip("torch")
  from tests import torch_reference as ref
  torch_count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
  assert torch_count(ref.ViT(32, 2, 100, 12, 192, 3, 768)) == num_params(get_model("vit_ti", 100))
  assert torch_count(ref.AlterNet((3, 4, 6, 4), (0, 1, 3, 2), (3, 6, 12, 24), 100)) == num_params(
      get_model("alternet_50", 100))
  del torch


def test_shapes_of_the_registered_sizes():
  for name in ("vit_ti", "alternet_50"):
    model = get_model(name, 100)
    out = jax.eval_shape(lambda x, m=model: m.init_with_output(rngs(), x)[0],
                         jnp.zeros((2, 32, 32, 3)))
    assert out.shape == (2, 100)
  # ImageNet geometry: patch 16 / window 7 from the stem, like the CNNs.
  vit = get_model("vit_s", 1000, stem="imagenet")
  variables = abstract_variables(vit, (1, 224, 224, 3))
  assert variables["params"]["pos_embedding"].shape == (1, 14 * 14 + 1, 384)
  alternet = get_model("alternet_50", 1000, stem="imagenet")
  variables = abstract_variables(alternet, (1, 224, 224, 3))
  assert variables["params"]["layer4_3"]["attention"]["relative_position"].shape == (13, 13)


def test_alternet_build_up_rule_and_backbone():
  units = get_model("alternet_50", 10).units()
  kinds = [k for _, k in units]
  assert len(units) == 17 and kinds.count("msa") == 6
  # MSAs close each stage, alternating with Convs: stage 3 is C M C M C M.
  assert kinds[7:13] == ["conv", "msa"] * 3 and kinds[3:7] == ["conv"] * 3 + ["msa"]
  assert [k for _, k in get_model("alternet_50", 10, msa_blocks=(0, 0, 0, 0)).units()
         ] == ["conv"] * 17


def test_bad_configurations_are_named(images):
  with pytest.raises(ValueError, match="window_size 3 does not divide the 16×16"):
    init_variables(get_model("alternet_50", 10, **TINY_ALTERNET, window_size=3), (1, 32, 32, 3))
  with pytest.raises(ValueError, match="at most 1 MSA"):
    get_model("alternet_50", 10, stage_sizes=(2, 2, 2, 2), msa_blocks=(0, 2, 1, 1)).units()
  with pytest.raises(ValueError, match="not divisible by the patch size 4"):
    init_variables(get_model("vit_ti", 10, **TINY_VIT), (1, 18, 18, 3))
  with pytest.raises(ValueError, match="needs classifier='gap'"):
    init_variables(get_model("vit_ti", 10, **TINY_VIT, window_size=2), images)
  with pytest.raises(ValueError, match="Unknown option"):
    get_model("vit_ti", 10, smoothing=True)


# ----------------------------------------------------------------------------- attention semantics

def test_attention_rows_are_probabilities(images):
  model = get_model("vit_ti", 10, **TINY_VIT)
  variables = init_variables(model, images)
  _, state = model.apply(variables, images, mutable=["intermediates"])
  attention = state["intermediates"]["block1_msa"]["attention"]["attention"][0]
  assert attention.shape == (4, 2, 17, 17)  # [B, heads, CLS + 4×4 patches, ...]
  assert bool(jnp.all(attention >= 0))
  np.testing.assert_allclose(attention.sum(-1), 1.0, rtol=1e-5)


def test_local_vit_runs_and_window_changes_the_output(images):
  base = dict(TINY_VIT, patch_size=2, classifier="gap")  # 8×8 tokens
  outputs = []
  for local in ({}, {"window_size": 8}, {"window_size": 4}, {"kernel_size": 3}):
    model = get_model("vit_ti", 10, **base, **local)
    variables = init_variables(model, images)
    outputs.append(model.apply(variables, images))
  chex.assert_tree_all_finite(outputs)
  assert not np.allclose(outputs[2], outputs[3])


# --------------------------------------------------------------------- stochastic depth and lesions

def test_drop_path_drops_whole_examples():
  class Branch(nn.Module):
    @nn.compact
    def __call__(self, x, train):
      return drop_path(x, 0.5, train)
  x = jnp.ones((256, 3, 3, 2))
  y = Branch().apply({}, x, True, rngs={"dropout": jax.random.key(0)})
  per_example = np.asarray(y).reshape(256, -1)
  assert set(np.unique(per_example)) == {0.0, 2.0}
  assert np.all(per_example.min(1) == per_example.max(1))      # one decision per example
  assert 0.35 < np.mean(per_example[:, 0] == 0) < 0.65
  np.testing.assert_array_equal(Branch().apply({}, x, False), x)  # identity at test time


@pytest.mark.parametrize("name, kwargs, zero_unit", [
    ("vit_ti", TINY_VIT, ("block1_msa", "attention", "out")),
    ("alternet_50", TINY_ALTERNET, ("layer3_1", "attention", "attention", "out")),
])
def test_lesion_of_a_zero_unit_changes_nothing(name, kwargs, zero_unit, images):
  model = get_model(name, 10, **kwargs)
  x = jax.image.resize(images, (4, 32, 32, 3), "bilinear") if name == "alternet_50" else images
  variables = jax.tree.map(jnp.asarray, init_variables(model, x))
  names = [n for n, _ in model.units()]
  index = names.index(zero_unit[0])
  # Zero the unit's last projection: its residual branch is then exactly zero.
  params = jax.tree_util.tree_map_with_path(
      lambda path, v: jnp.zeros_like(v)
      if tuple(p.key for p in path[:len(zero_unit)]) == zero_unit else v, variables["params"])
  variables = {**variables, "params": params}
  full = model.apply(variables, x)
  keep_all = jnp.ones(len(names))
  lesioned = model.apply(variables, x, block_mask=keep_all.at[index].set(0.0))
  np.testing.assert_allclose(lesioned, full, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(model.apply(variables, x, block_mask=keep_all), full, rtol=1e-6)
  # Removing a unit that does something changes the logits.
  other = model.apply(variables, x, block_mask=keep_all.at[index - 1].set(0.0))
  assert not np.allclose(other, full, atol=1e-4)


# ------------------------------------------------------------------------ parity with the reference

def _vit_params_from_torch(t, depth, heads, head_dim):
  sd = {k: v.detach().numpy() for k, v in t.state_dict().items()}
  ln = lambda p: {"scale": sd[p + ".weight"], "bias": sd[p + ".bias"]}  # noqa: E731
  dense = lambda p: {"kernel": sd[p + ".weight"].T, "bias": sd[p + ".bias"]}  # noqa: E731
  params = {
      "embedding": dense("embedding"),
      "cls_token": sd["cls_token"],
      "pos_embedding": sd["pos_embedding"],
      "head_norm": ln("norm"),
      "head": dense("head")
  }
  for i in range(depth):
    p = f"transformers.{i}"
    dim = sd[p + ".norm1.weight"].shape[0]
    params[f"block{i}_msa"] = {"norm": ln(p + ".norm1"), "attention": {
        "qkv": {"kernel": sd[p + ".attn.to_qkv.weight"].T.reshape(dim, 3, heads, head_dim)},
        "out": {"kernel": sd[p + ".attn.to_out.weight"].T.reshape(heads, head_dim, dim),
                "bias": sd[p + ".attn.to_out.bias"]}}}
    params[f"block{i}_mlp"] = {
        "norm": ln(p + ".norm2"),
        "fc1": dense(p + ".ff.0"),
        "fc2": dense(p + ".ff.2")
    }
  return params


def test_vit_logits_equal_the_torch_reference():
  torch = pytest.importorskip("torch")
  from tests import torch_reference as ref
  torch.manual_seed(0)
  t = ref.ViT(16, 4, 10, depth=2, dim=16, heads=2, mlp_dim=32, dim_head=8).eval()
  x = np.random.default_rng(0).normal(size=(3, 3, 16, 16)).astype(np.float32)
  with torch.no_grad():
    expected = t(torch.from_numpy(x)).numpy()
  model = get_model("vit_ti", 10, **TINY_VIT)
  params = _vit_params_from_torch(t, 2, 2, 8)
  logits = model.apply({"params": params}, jnp.asarray(x.transpose(0, 2, 3, 1)))
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_alternet_logits_equal_the_torch_reference():
  torch = pytest.importorskip("torch")
  from smoothing_jax.convert import torch_key
  from tests import torch_reference as ref
  torch.manual_seed(0)
  t = ref.randomize(ref.AlterNet((1, 2, 2, 2), (0, 1, 1, 1), (1, 2, 2, 2), 10, width=8, dim_head=8))
  sd = {k: v.detach().numpy() for k, v in t.state_dict().items()}
  x = np.random.default_rng(0).normal(size=(2, 3, 32, 32)).astype(np.float32)
  with torch.no_grad():
    expected = t(torch.from_numpy(x)).numpy()
  model = get_model("alternet_50", 10, **TINY_ALTERNET)
  abstract = abstract_variables(model)
  renames = {
      ".bn1.": ".norm1.",
      ".bn2.": ".norm2.",
      ".attention.attention.qkv.": ".attn.attn.to_qkv.",
      ".attention.attention.out.": ".attn.attn.to_out."
  }

  msa_blocks = {n for n, kind in model.units() if kind == "msa"}

  def leaf(path, spec):
    keys = tuple(p.key for p in path)
    block = keys[1].replace("_", ".")
    if keys[-1] == "relative_position":
      return jnp.asarray(sd[f"{block}.attn.pos_embedding"])
    key = torch_key(keys)
    if keys[1] in msa_blocks:
      for a, b in renames.items():
        key = key.replace(a, b)
    value = sd[key]
    if keys[-2] in ("qkv", "out") and keys[-1] == "kernel":
      value = value.T.reshape(spec.shape)
    elif keys[-1] == "kernel":
      value = value.transpose(2, 3, 1, 0) if value.ndim == 4 else value.T
    assert value.shape == spec.shape, (keys, value.shape, spec.shape)
    return jnp.asarray(value)
  variables = jax.tree_util.tree_map_with_path(leaf, abstract)
  logits = model.apply(variables, jnp.asarray(x.transpose(0, 2, 3, 1)))
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------- dropout

def test_vit_has_no_dropout_by_default_as_in_the_reference(micro_vit):
  """HV ``models/vit.py`` (newest commit): ``ViT(..., dropout=0.0, emb_dropout=0.0, sd=0.0)``, so a
  training-mode forward pass does not depend on the dropout key; a rate of 0.1 makes it depend."""
  model, variables, x, _ = micro_vit
  assert (model.dropout_rate_train, model.embedding_dropout_rate,
          model.stochastic_depth) == (0.0, 0.0, 0.0)

  def train_logits(m, seed):
    return m.apply(variables, x, train=True, rngs={"dropout": jax.random.key(seed)})
  np.testing.assert_array_equal(train_logits(model, 0), train_logits(model, 1))
  dropped = model.clone(dropout_rate_train=0.1, embedding_dropout_rate=0.1)
  assert not np.allclose(train_logits(dropped, 0), train_logits(dropped, 1))


def test_the_vit_s_penultimate_features_are_its_classifier_input(micro_vit):
  """``inference.pass_outputs`` (the OOD scores' features) finds a ViT's head: the logits are
  the features through the head's dense layer."""
  from smoothing_jax.passes import pass_outputs
  model, variables, x, _ = micro_vit
  out = jax.jit(lambda v, images: pass_outputs(model, v, images))(variables, x)
  dense = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
           if out["features"].shape[1] in leaf.shape[:1] and leaf.ndim == 2
           and leaf.shape[1] == 3]
  biases = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
            if leaf.shape == (3,)]
  assert len(dense) == 1 and len(biases) == 1
  np.testing.assert_allclose(out["features"] @ dense[0] + biases[0], out["logits"], atol=1e-5)
  np.testing.assert_allclose(out["logits"], model.apply(variables, x), atol=1e-6)
