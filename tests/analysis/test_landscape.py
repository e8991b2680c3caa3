"""smoothing_jax.analysis.landscape: every kernel's output units normalised, whatever its layout
(Dense, Conv, fused qkv, MSA output projection), in each model family; HV's regulariser."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.analysis import landscape
from smoothing_jax.analysis.spectrum import regularization
from smoothing_jax.models import get_model
from tests.helpers import rngs, small_net_problem

FAMILIES = [
    ("resnet_dnn_18", dict(width=4, stage_sizes=(1, 1, 1, 1))),
    ("vit_ti", dict(hidden_dim=8, depth=1, num_heads=2, head_dim=4, mlp_dim=8, patch_size=4)),
    ("pit_ti", dict(depths=(1, 1), num_heads=(1, 2), head_dim=4, patch_size=2, stride=2)),
    ("swin_t", dict(embed_dim=8, depths=(2, 2), num_heads=(1, 2), head_dim=4, patch_size=2)),
    ("alternet_18", dict(width=4, stage_sizes=(1, 1, 1, 2), msa_blocks=(0, 0, 0, 1),
                         num_heads=(1, 1, 1, 2), head_dim=4, window_size=2)),
]


def _params_and_output_axes(model, x):
  """``(params, {kernel path: number of output axes})``: Gaussian parameters, and the axes read
  from the modules themselves: a Dense or Conv has one output axis, a DenseGeneral one per entry
  of its ``features``."""
  shapes = jax.eval_shape(model.init, rngs(), x)
  rng = np.random.default_rng(0)
  variables = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), shapes)
  outputs = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and isinstance(
        module, (nn.Dense, nn.DenseGeneral, nn.Conv)):
      features = module.features
      outputs["/".join(module.path) + "/kernel"] = (
          len(features) if isinstance(features, (tuple, list)) else 1)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):  # traced only
    jax.eval_shape(lambda v: model.apply(v, x, train=False, rngs=rngs(1)), variables)
  return variables["params"], outputs


@pytest.mark.parametrize("name,kwargs", FAMILIES, ids=[f[0] for f in FAMILIES])
def test_every_output_unit_gets_the_norm_of_its_weights(name, kwargs):
  """"filter": ‖d_u‖ = ‖w_u‖ over the inputs of every output unit u; "reference" (HV
  ``normalize_filter``: ``torch.norm(w, dim=0)`` on PyTorch's [out, in, ...] layout):
  ‖d_i‖ = ‖w_i‖ over the outputs of every input position i."""
  model = get_model(name, 10, **kwargs)
  params, outputs = _params_and_output_axes(model, jnp.zeros((1, 16, 16, 3)))
  kernels = {"/".join(str(k.key) for k in path): v
             for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
             if path[-1].key == "kernel"}
  assert set(kernels) == set(outputs), set(kernels) ^ set(outputs)  # every kernel identified
  if name != "resnet_dnn_18":
    assert 3 in outputs.values()  # a fused qkv [C, 3, h, d]
  for normalization in landscape.NORMALIZATIONS:
    d = jax.jit(landscape.random_direction, static_argnums=(2, 3))(params, jax.random.key(0),
                                                                   normalization, ())
    for path, w in kernels.items():
      w, dk = np.asarray(w, np.float64), np.asarray(_at(d, path), np.float64)
      out = tuple(range(w.ndim - outputs[path], w.ndim))
      inputs = tuple(a for a in range(w.ndim) if a not in out)
      axes = inputs if normalization == "filter" else out
      np.testing.assert_allclose(np.sqrt((dk ** 2).sum(axes)), np.sqrt((w ** 2).sum(axes)),
                                 rtol=1e-4, err_msg=f"{normalization} {path} {w.shape}")


def test_the_class_token_is_normalised_as_each_reference_does():
  """ViT-Ti's ``cls_token`` [1, 1, D] has PyTorch's layout: Li et al.'s ``normalize_direction``
  scales each slice along dim 0, so the whole token (‖d‖ = ‖w‖); HV's ``normalize_filter`` divides
  by ``torch.norm(w, dim=0)``, a norm over a size-1 axis, so element by element (|dᵢ| = |wᵢ|)."""
  model = get_model("vit_ti", 10, **FAMILIES[1][1])
  params = jax.eval_shape(lambda: model.init(rngs(0), jnp.zeros((1, 16, 16, 3))))["params"]
  w = np.random.default_rng(0).normal(size=params["cls_token"].shape).astype(np.float32)
  token = {"cls_token": jnp.asarray(w)}
  filtered = np.asarray(landscape.random_direction(token, jax.random.key(1), "filter", ())[
      "cls_token"], np.float64)
  assert w.shape == (1, 1, 8)
  assert np.linalg.norm(filtered) == pytest.approx(np.linalg.norm(w), rel=1e-5)
  assert not np.allclose(np.abs(filtered), np.abs(w), rtol=1e-3)
  reference = np.asarray(landscape.random_direction(token, jax.random.key(1), "reference", ())[
      "cls_token"], np.float64)
  np.testing.assert_allclose(np.abs(reference), np.abs(w), rtol=1e-4)


def _at(tree, path):
  for key in path.split("/"):
    tree = tree[key]
  return tree


def test_hv_regularizer_is_the_sum_of_each_tensors_l2_norm():
  """HV ``ops/norm.l2``: Σ over parameter tensors of ‖θᵢ‖₂ (not squared), added as wd·l2; the
  surface's ``loss_l2`` against numpy at every grid point."""
  loss_fn, params = small_net_problem()  # Dense and BatchNorm parameters
  d1, d2 = (landscape.random_direction(params, jax.random.key(k)) for k in (1, 2))
  axis = np.array([-1.0, 0.0, 0.5], np.float32)
  surface = landscape.loss_surface(loss_fn, params, d1, d2, axis, axis, weight_decay=0.01,
                                   regularizer="sum_of_l2_norms", chunk_size=4)
  leaves = [jax.tree.leaves(t) for t in (params, d1, d2)]
  for i, a in enumerate(axis):
    for j, b in enumerate(axis):
      norms = sum(np.sqrt(np.sum((np.asarray(p, np.float64) + a * np.asarray(u) +
                                  b * np.asarray(v)) ** 2))
                  for p, u, v in zip(*leaves, strict=True))
      assert surface["loss_l2"][i, j] - surface["loss"][i, j] == pytest.approx(0.01 * norms,
                                                                               rel=1e-4)
  squared = sum(float(np.sum(np.asarray(p, np.float64) ** 2)) for p in leaves[0])
  assert float(regularization(params)) == pytest.approx(squared / 2, rel=1e-5)
  assert surface["regularizer"] == "sum_of_l2_norms"
  with pytest.raises(ValueError, match="Unknown regularizer"):
    landscape.loss_surface(loss_fn, params, d1, d2, axis, axis, regularizer="l2")
