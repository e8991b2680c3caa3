"""smoothing_jax.analysis.features: the taps each model declares start at depth 0 (stem or patch
embedding, HV's first point) and include PiT's poolings and Swin's patch mergings, marked in
``block_kinds``; features.py names no model class."""
import ast
import inspect

import flax.linen as nn
import jax
import numpy as np
import pytest

from smoothing_jax.analysis import features
from smoothing_jax.analysis.features import block_kinds, feature_maps, tokens_to_map
from smoothing_jax.models import get_model
from smoothing_jax.passes import sample_rngs
from tests.helpers import MICRO_VIT, abstract_variables, init_variables

TINY_ALTERNET = dict(width=4, stage_sizes=(1, 1, 1, 2), msa_blocks=(0, 0, 0, 1),
                     num_heads=(1, 1, 1, 1), head_dim=4, window_size=2)
TINY_PIT = dict(depths=(1, 1), num_heads=(1, 2), head_dim=4, patch_size=2, stride=2)
TINY_SWIN = dict(embed_dim=8, depths=(2, 2), num_heads=(1, 2), head_dim=8, patch_size=2)
UNITS = [("block0_msa", "msa"), ("block0_mlp", "mlp")]

# (model, overrides, image size, expected [(tap, kind)]).  The ResNet has the ImageNet stem, so its
# depth-0 tap must come after the stem's max-pool (32 → 16 → 8).
FAMILIES = {
    "resnet": ("resnet_dnn_smoothing_18", dict(width=4, stage_sizes=(1, 1, 1, 1), stem="imagenet"),
               32, [("stem", "stem")] + [(tap, kind) for s in range(1, 5)
                                         for tap, kind in ((f"layer{s}_0", "conv"),
                                                           (f"smooth{s}_0", "smooth"))]),
    "alternet": ("alternet_18", TINY_ALTERNET, 16,
                 [("stem", "stem"), ("layer1_0", "conv"), ("layer2_0", "conv"),
                  ("layer3_0", "conv"), ("layer4_0", "conv"), ("layer4_1", "msa")]),
    "vit": ("vit_ti", MICRO_VIT, 8, [("patch_embedding", "embedding")] + UNITS +
            [(n.replace("0", "1"), kind) for n, kind in UNITS]),
    "pit": ("pit_ti", TINY_PIT, 16,
            [("patch_embedding", "embedding")] + [(f"stage1_{n}", k) for n, k in UNITS] +
            [("stage2_pool", "pool")] + [(f"stage2_{n}", k) for n, k in UNITS]),
    "swin": ("swin_t", TINY_SWIN, 16,
             [("patch_embedding", "embedding")] +
             [(f"stage1_{n.replace('0', j)}", k) for j in "01" for n, k in UNITS] +
             [("stage2_merge", "merge")] +
             [(f"stage2_{n.replace('0', j)}", k) for j in "01" for n, k in UNITS]),
}
DOWN_SAMPLING = ("stem", "embedding", "pool", "merge")


def _unit_inputs(model, variables, x) -> dict:
  """``{top-level submodule: the array its first call receives}`` of one eval-mode pass."""
  inputs = {}

  def record(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name == "__call__" and module.scope and len(module.scope.path) == 1:
      inputs.setdefault(module.name, args[0])
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    model.apply(variables, x, train=False)
  return inputs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_taps_start_at_depth_0_and_mark_pooling_and_merging(family):
  name, overrides, size, expected = FAMILIES[family]
  model = get_model(name, 3, **overrides)
  x = jax.random.normal(jax.random.key(5), (2, size, size, 3))
  variables = init_variables(model, x[:1])
  maps = feature_maps(model, variables, x)
  assert list(maps) == [tap for tap, _ in expected]
  assert block_kinds(model, maps) == dict(expected)
  # Depth 0, each pooling and each merging is what the model hands to the next tap.
  inputs = _unit_inputs(model, variables, x)
  taps = list(maps)
  for i, (tap, kind) in enumerate(expected):
    if kind in DOWN_SAMPLING:
      received = inputs[taps[i + 1]]
      received = tokens_to_map(received) if received.ndim == 3 else received
      np.testing.assert_allclose(maps[tap], received, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,overrides", [
    ("preresnet_mcdo_smoothing_18", dict(width=4)),
    ("vgg_dnn_smoothing_11", dict(width=4)),
    ("alexnet_mcdo_smoothing", dict(width=4)),
    ("wideresnet_ibnn_28_10", dict(width=2, widen_factor=1, depth=10, smoothing=True)),
])
def test_declared_taps_are_produced_in_execution_order(name, overrides):
  model = get_model(name, 3, **overrides)
  taps = [tap for tap, _ in model.feature_taps()]
  produced = []

  def trace(variables, x):
    _, state = model.apply(variables, x, train=False, rngs=sample_rngs(jax.random.key(0)),
                           capture_intermediates=lambda m, method: method == "__call__",
                           mutable=["intermediates"])
    produced.extend(state["intermediates"])  # insertion order = execution order
  x = np.zeros((1, 32, 32, 3), np.float32)
  jax.eval_shape(trace, abstract_variables(model, x), x)
  assert [tap for tap in produced if tap in taps] == taps
  assert taps[0] == ("layer0_0" if name.startswith(("vgg", "alexnet")) else "stem")


def test_features_module_names_no_model_class():
  tree = ast.parse(inspect.getsource(features))
  imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
  assert not [m for m in imported if m.startswith(("smoothing_jax.models", "smoothing_jax.layers"))]
  assert "isinstance(module" not in inspect.getsource(features)


def test_a_model_without_declared_taps_is_named():
  model = get_model("unet_dnn", 3, width=2, encoder_convs=(1, 1), decoder_convs=(1,))
  with pytest.raises(TypeError, match="UNet declares no feature taps"):
    feature_maps(model, init_variables(model, (1, 8, 8, 3)), np.zeros((1, 8, 8, 3), np.float32))
