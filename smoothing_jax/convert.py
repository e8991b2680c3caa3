"""Load checkpoints trained with the PyTorch reference implementations (SS, HV) and with timm.

``from_torch_state_dict("resnet_dnn_18", {k: v.numpy() for k, v in torch.load(p).items()})``
returns Flax variables ``{"params": ..., "batch_stats": ...}``.  Our submodule
names mirror the reference ``state_dict`` keys (``layer1_0/conv1`` ↔
``layer1.0.conv1``), so the mapping is by name: conv kernels OIHW → HWIO, dense
weights transposed, BatchNorm ``weight/bias/running_mean/running_var`` →
``scale/bias`` (params) and ``mean/var`` (batch_stats).  torch is not needed.
"""
from __future__ import annotations

import re
from typing import Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util

from smoothing_jax.layers import blur_kernel
from smoothing_jax.models import get_model
from smoothing_jax.models.pit import PiT
from smoothing_jax.models.swin import Swin
from smoothing_jax.models.vit import ViT

_LEAF_NAMES = {
    ("params", "kernel"): "weight",
    ("params", "bias"): "bias",
    ("params", "scale"): "weight",
    ("batch_stats", "mean"): "running_mean",
    ("batch_stats", "var"): "running_var"
}
_BLUR_FILTER = re.compile(r"^smooth\d+\.\d+\.layer1\.filter$")


def torch_key(path) -> str:
  """Reference ``state_dict`` key of a Flax variable path ``(collection, module..., leaf)``."""
  collection, *modules, leaf = path
  return ".".join([re.sub(r"_(\d+)$", r".\1", m) for m in modules] +
                  [_LEAF_NAMES[(collection, leaf)]])


def _to_flax(array: np.ndarray, leaf: str) -> np.ndarray:
  if leaf == "kernel" and array.ndim == 4:
    return np.transpose(array, (2, 3, 1, 0))  # OIHW -> HWIO
  if leaf == "kernel" and array.ndim == 2:
    return array.T  # (out, in) -> (in, out)
  return array


def _abstract_variables(model, image_shape: Optional[tuple] = None):
  """``jax.eval_shape`` of ``model``'s variables on images of ``image_shape`` (H, W, 3) (default:
  the stem's, 32×32 or 224×224; a ViT's position embedding follows it)."""
  size = 224 if model.stem == "imagenet" else 32
  shape = (1,) + tuple(image_shape or (size, size, 3))
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(0)}
  return jax.eval_shape(lambda: model.init(rngs, jnp.zeros(shape, jnp.float32)))


def classifier_paths(model, image_shape: Optional[tuple] = None) -> list:
  """Flattened variable paths ``(collection, module..., leaf)`` whose shape follows
  ``model.num_classes`` (the output layer's), on images of ``image_shape`` (default: the
  stem's)."""
  one, two = (traverse_util.flatten_dict(
      dict(_abstract_variables(model.clone(num_classes=n), image_shape))) for n in (1, 2))
  return [p for p in one if one[p].shape != two[p].shape]


def _infer_num_classes(model_name, state_dict, overrides) -> int:
  # The output layer's bias is the only bias whose shape follows num_classes.
  (output_bias,) = [p for p in classifier_paths(get_model(model_name, 1, **overrides))
                    if p[-1] == "bias"]
  key = torch_key(output_bias)
  if key not in state_dict:
    raise ValueError(
        f"Cannot infer num_classes: classifier key {key!r} is missing from the state_dict.")
  return int(np.shape(state_dict[key])[0])


def from_torch_state_dict(model_name: str, state_dict: Mapping[str, np.ndarray], *,
                          num_classes: Optional[int] = None, **overrides) -> dict:
  """Map a reference ``state_dict`` (names → numpy arrays) onto ``get_model(model_name)``
  variables.

  Args:
    model_name: registry name, e.g. ``"resnet_dnn_18"``.
    state_dict: mapping of reference parameter/buffer names to arrays.
    num_classes: inferred from the classifier bias when omitted.
    **overrides: model options, e.g. ``stem="imagenet"`` for ImageNet checkpoints.

  Raises:
    ValueError: naming every missing key, unexpected key and shape mismatch.
  """
  state_dict = {k: np.asarray(v) for k, v in state_dict.items()}
  if num_classes is None:
    num_classes = _infer_num_classes(model_name, state_dict, overrides)
  model = get_model(model_name, num_classes, **overrides)
  flat = traverse_util.flatten_dict(dict(_abstract_variables(model)))

  converted, missing, mismatched = {}, [], []
  for path, abstract in flat.items():
    key = torch_key(path)
    if key not in state_dict:
      missing.append(key)
      continue
    value = _to_flax(state_dict[key], path[-1])
    if value.shape != abstract.shape:
      mismatched.append(
          f"{key}: reference {state_dict[key].shape} -> {value.shape}, expected {abstract.shape}")
      continue
    converted[path] = jnp.asarray(value, abstract.dtype)

  used = {torch_key(p) for p in flat}
  unexpected = []
  for key, value in state_dict.items():
    if key in used or key.endswith("num_batches_tracked"):
      continue
    if _BLUR_FILTER.match(key) and model.smoothing:
      expected = blur_kernel(model.blur_size)
      if value.ndim != 4 or value.shape[-2:] != expected.shape or not np.allclose(
          value[:, 0], expected):
        mismatched.append(f"{key}: blur filter does not match blur_size={model.blur_size}")
      continue
    unexpected.append(key)

  _raise_on_mismatch(f"state_dict does not match {model_name!r} (num_classes={num_classes})",
                     missing, unexpected, mismatched)
  return traverse_util.unflatten_dict(converted)


def _raise_on_mismatch(title: str, missing, unexpected, mismatched) -> None:
  """ValueError listing the missing keys, unexpected keys and shape mismatches, if any."""
  if missing or unexpected or mismatched:
    lines = [f"{title}:"]
    for heading, items in (("missing keys", missing), ("unexpected keys", unexpected),
                           ("shape mismatches", mismatched)):
      if items:
        lines.append(f"  {heading} ({len(items)}): " + ", ".join(items[:20]) +
                     (" ..." if len(items) > 20 else ""))
    raise ValueError("\n".join(lines))


def to_torch_state_dict(variables) -> dict:
  """Inverse mapping: Flax variables → reference ``state_dict`` of numpy arrays."""
  out = {}
  for path, value in traverse_util.flatten_dict(dict(variables)).items():
    value = np.asarray(value)
    if path[-1] == "kernel" and value.ndim == 4:
      value = np.transpose(value, (3, 2, 0, 1))
    elif path[-1] == "kernel" and value.ndim == 2:
      value = value.T
    out[torch_key(path)] = value
  return out


def transfer_variables(target, source, *, keep_fresh: Optional[Callable] = None,
                       title: str = "variables do not match the model") -> tuple:
  """``target`` with every leaf replaced by the leaf of ``source`` at the same path (cast to the
  target's dtype), except the leaves ``keep_fresh(path, target_leaf, source_leaf)`` selects
  (``source_leaf`` None where ``source`` lacks the path).

  Args:
    target: the variables (or their ``jax.eval_shape``) of the model to start, e.g. a fresh
      initialisation.
    source: variables of the same architecture, e.g. a checkpoint's.
    keep_fresh: e.g. the output layer when fine-tuning to another class count, iBNN's
      variational parameters when starting from a deterministic run.
    title: the first line of the error.

  Returns:
    ``(variables, kept)``: the merged variables and the sorted "/"-joined paths kept from
    ``target``.

  Raises:
    ValueError: naming every other path missing from ``source``, only in ``source``, or whose
      shape differs.
  """
  flat_target = traverse_util.flatten_dict(dict(target))
  flat_source = traverse_util.flatten_dict(dict(source))
  merged, kept, missing, mismatched = {}, [], [], []
  for path, leaf in flat_target.items():
    value = flat_source.get(path)
    name = "/".join(path)
    if keep_fresh is not None and keep_fresh(path, leaf, value):
      merged[path] = leaf
      kept.append(name)
    elif value is None:
      missing.append(name)
    elif np.shape(value) != leaf.shape:
      mismatched.append(f"{name}: {np.shape(value)}, expected {leaf.shape}")
    else:
      merged[path] = jnp.asarray(value, leaf.dtype)
  unexpected = ["/".join(p) for p in flat_source if p not in flat_target]
  _raise_on_mismatch(title, missing, unexpected, mismatched)
  # Empty collections (a ViT's batch_stats) stay.
  return {**{k: {} for k in target}, **traverse_util.unflatten_dict(merged)}, sorted(kept)


# ---------------------------------------------------------------------------------------------
# timm state dicts (HV's released ViT / PiT / Swin CIFAR-100 checkpoints are timm models).
#
# Each family maps one of our flattened variable paths ``(collection, module..., leaf)`` to the
# timm key it comes from and the function that turns that array into ours:
# ``key_fn(path) -> (timm_key, to_flax)``.  ``from_timm_state_dict`` checks the whole mapping
# (missing, unexpected, mismatched keys) in one place.  ``to_flax`` may leave axes fused that
# ours split (timm's heads axis h·d): ``_split_fused_axes`` splits them by our shape.
#
# Key names are timm 1.0.31's.  HV's notebooks pin timm 0.5.4, whose Swin and PiT name some keys
# otherwise (``tests/fixtures/timm_0_5_4_keys.json``): a state_dict with a key only that layout
# has is renamed to 1.0.31's first (``_TIMM_0_5_LAYOUTS``).

TimmKeyFn = Callable[[tuple], tuple]

# Model class -> key function; filled in below by each family's section.
_TIMM_KEYS: dict = {}
# Model class -> regular expressions of timm buffers that carry no parameters (e.g. Swin's
# ``relative_position_index``, ``attn_mask``): ignored when checking for unexpected keys.
_TIMM_BUFFERS: dict = {}
# Model class -> (regular expression of keys that only timm 0.5.4's layout has, its key -> timm
# 1.0.31's); ViT's keys are the same in both.
_TIMM_0_5_LAYOUTS: dict = {}
# Registry name -> ``get_model`` overrides that reproduce the timm constructor of HV's released
# CIFAR-100 checkpoint (HV README), e.g. ``TIMM_LAYOUTS["vit_ti"]``.
TIMM_LAYOUTS: dict = {}


def _split_fused_axes(value: np.ndarray, shape: tuple) -> np.ndarray:
  """``value`` reshaped to ``shape`` where ``shape`` only splits axes of ``value`` (e.g. timm's
  fused heads axis h·d into our (h, d): a key function need not know h); else ``value``."""
  groups, dims = [], list(shape)
  for size in value.shape:
    product = 1
    while dims and product < size:
      product *= dims.pop(0)
    groups.append(product)
  return value.reshape(shape) if groups == list(value.shape) and not dims else value


def from_timm_state_dict(model_name: str, state_dict: Mapping[str, np.ndarray], *,
                         num_classes: Optional[int] = None, image_shape: Optional[tuple] = None,
                         **overrides) -> dict:
  """Map a timm ``state_dict`` (names → numpy arrays) onto ``get_model(model_name)`` variables.

  Args:
    model_name: registry name of a family timm also has (``vit_*``, ``pit_*``, ``swin_*``).
    state_dict: timm parameter/buffer names → arrays (``{k: v.numpy() for k, v in sd.items()}``),
      in timm 1.0.31's layout or timm 0.5.4's (HV's pin; detected from its keys).
    num_classes: inferred from ``head.weight`` (Swin in timm 1.0.31: ``head.fc.weight``) when
      omitted.
    image_shape: (H, W, 3) of the checkpoint's images (default: the stem's, 32×32 or 224×224),
      which the position embeddings follow.
    **overrides: model options; ``TIMM_LAYOUTS[model_name]`` (the layout of HV's checkpoints) is
      applied first.

  Raises:
    ValueError: a family without a timm mapping, or naming every missing key, unexpected key
      and shape mismatch.
  """
  state_dict = {k: np.asarray(v) for k, v in state_dict.items()}
  overrides = {**TIMM_LAYOUTS.get(model_name, {}), **overrides}
  if num_classes is None:
    heads = [k for k in ("head.weight", "head.fc.weight") if k in state_dict]
    if not heads:
      raise ValueError("Cannot infer num_classes: 'head.weight' (Swin: 'head.fc.weight') is "
                       "missing from the state_dict.")
    num_classes = int(state_dict[heads[0]].shape[0])
  model = get_model(model_name, num_classes, **overrides)
  key_fn = _TIMM_KEYS.get(type(model))
  if key_fn is None:
    raise ValueError(f"No timm mapping for {model_name!r} ({type(model).__name__}); timm "
                     f"checkpoints load into {sorted(c.__name__ for c in _TIMM_KEYS)} models.")
  layout = "timm 1.0.31 keys"
  old_keys, rename = _TIMM_0_5_LAYOUTS.get(type(model), (None, None))
  if old_keys is not None and any(old_keys.search(k) for k in state_dict):
    state_dict = {rename(k): v for k, v in state_dict.items()}
    layout = "timm 0.5.4 keys, named below as timm 1.0.31's"
  flat = traverse_util.flatten_dict(dict(_abstract_variables(model, image_shape)))
  converted, missing, mismatched, used = {}, [], [], set()
  for path, abstract in flat.items():
    key, to_flax = key_fn(path)
    used.add(key)
    if key not in state_dict:
      missing.append(key)
      continue
    value = _split_fused_axes(np.asarray(to_flax(state_dict[key])), abstract.shape)
    if value.shape != abstract.shape:
      mismatched.append(
          f"{key}: timm {state_dict[key].shape} -> {value.shape}, expected {abstract.shape}")
      continue
    converted[path] = jnp.asarray(value, abstract.dtype)
  buffers = [re.compile(b) for b in _TIMM_BUFFERS.get(type(model), ())]
  unexpected = [k for k in state_dict
                if k not in used and not any(b.search(k) for b in buffers)]
  _raise_on_mismatch(f"timm state_dict does not match {model_name!r} "
                     f"({layout}; num_classes={num_classes}, options={overrides})",
                     missing, unexpected, mismatched)
  return traverse_util.unflatten_dict(converted)


# ---------------------------------------------------------------------------------------------
# Swin (``smoothing_jax.models.swin``) from timm's ``SwinTransformer``; key names of timm 1.0.31
# (pinned in requirements-test.txt): ``patch_embed.{proj,norm}``,
# ``layers.<i>.downsample.{norm,reduction}``, ``layers.<i>.blocks.<j>.{norm1,attn,norm2,mlp}``,
# ``norm``, ``head.fc``.  Needs the timm layout (``TIMM_LAYOUTS["swin_t"]``).

_SWIN_STAGE_MODULE = re.compile(r"^stage(\d+)_(merge|block(\d+)_(msa|mlp))$")
# Unit sub-keys of timm's transformer blocks (ViT and PiT ``Block``, ``SwinTransformerBlock``).
_TIMM_BLOCK_KEYS = {
    ("msa", "norm"): "norm1",
    ("msa", "attention", "qkv"): "attn.qkv",
    ("msa", "attention", "out"): "attn.proj",
    ("mlp", "norm"): "norm2",
    ("mlp", "fc1"): "mlp.fc1",
    ("mlp", "fc2"): "mlp.fc2",
}
_SWIN_TOP_KEYS = {"embedding": "patch_embed.proj", "embedding_norm": "patch_embed.norm",
                  "head_norm": "norm", "head": "head.fc"}


def _next_stage(key: str, stages: str, module: str) -> str:
  """``key`` with ``<stages>.<i>.<module>.`` moved to stage i + 1: timm 0.5.4 downsamples at the end
  of a stage (``layers.0.downsample``), timm 1.0.31 at the start of the next (``layers.1``)."""
  return re.sub(rf"^{stages}\.(\d+)\.{module}\.",
                lambda m: f"{stages}.{int(m.group(1)) + 1}.{module}.", key)


def _timm_swin_table(table: np.ndarray) -> np.ndarray:
  """timm's ``relative_position_bias_table`` [(2w−1)², heads], indexed by query − key, → ours
  [2w−1, 2w−1, heads], indexed by key − query (as ``layers.attention.relative_position_index``).
  """
  side = int(round(np.sqrt(table.shape[0])))
  return table.reshape(side, side, -1)[::-1, ::-1]


def _timm_swin_key(path) -> tuple:
  """(timm key, timm array → ours) of one Swin variable path."""
  _, module, *inner, leaf = path
  match = _SWIN_STAGE_MODULE.match(module)
  if leaf == "relative_position":
    return (f"layers.{int(match.group(1)) - 1}.blocks.{match.group(3)}.attn."
            "relative_position_bias_table", _timm_swin_table)
  to_flax = lambda a: _to_flax(a, leaf)  # noqa: E731
  torch_leaf = _LEAF_NAMES[("params", leaf)]
  if match is None:
    return f"{_SWIN_TOP_KEYS[module]}.{torch_leaf}", to_flax
  stage = int(match.group(1)) - 1
  if match.group(2) == "merge":
    return f"layers.{stage}.downsample.{inner[0]}.{torch_leaf}", to_flax
  prefix = f"layers.{stage}.blocks.{match.group(3)}"
  return f"{prefix}.{_TIMM_BLOCK_KEYS[(match.group(4), *inner)]}.{torch_leaf}", to_flax


_TIMM_KEYS[Swin] = _timm_swin_key


def _timm_0_5_swin_key(key: str) -> str:
  """timm 0.5.4 Swin key → timm 1.0.31's: patch merging ``layers.<i>.downsample`` →
  ``layers.<i+1>.downsample``, classifier ``head`` → ``head.fc``."""
  return re.sub(r"^head\.(weight|bias)$", r"head.fc.\1", _next_stage(key, "layers", "downsample"))


# Only timm 0.5.4 has ``head.weight`` (with stages: ``layers.0.downsample``).
_TIMM_0_5_LAYOUTS[Swin] = (re.compile(r"^(head\.(weight|bias)$|layers\.0\.downsample\.)"),
                           _timm_0_5_swin_key)
# Non-persistent in timm 1.0.31, persistent in older checkpoints.
_TIMM_BUFFERS[Swin] = (r"relative_position_index$", r"attn_mask$")
# HV README: SwinTransformer(num_classes=100, img_size=32, patch_size=1, window_size=4,
# embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), qkv_bias=False) (head width
# 96 / 3 = 32 as ours); Swin-S (no released checkpoint) takes the same CIFAR flags.
TIMM_LAYOUTS["swin_t"] = dict(patch_size=1,
                              window_size=4,
                              patch_norm=True,
                              merge="linear_concat",
                              bias_table="per_head",
                              final_norm="tokens",
                              fit_window=True)
TIMM_LAYOUTS["swin_s"] = dict(TIMM_LAYOUTS["swin_t"])


# ---------------------------------------------------------------------------------------------
# PiT (``smoothing_jax.models.pit``) from timm's ``PoolingVisionTransformer``; key names of timm
# 1.0.31 (pinned in requirements-test.txt): ``patch_embed.conv``, ``pos_embed`` [1, D, h, w],
# ``cls_token``, ``transformers.<i>.pool.{conv,fc}``, ``transformers.<i>.blocks.<j>.{norm1,attn,
# norm2,mlp}`` (timm's ViT ``Block``, as Swin's: ``_TIMM_BLOCK_KEYS``), ``norm``, ``head``.  Needs
# the timm layout (``TIMM_LAYOUTS["pit_ti"]``); distilled PiTs (``head_dist``) are not mapped.

_PIT_STAGE_MODULE = re.compile(r"^stage(\d+)_(pool|block(\d+)_(msa|mlp))$")
_PIT_TOP_KEYS = {"embedding": "patch_embed.conv", "head_norm": "norm", "head": "head"}
_PIT_POOL_KEYS = {"conv": "conv", "cls_dense": "fc"}
_PIT_TOKENS = {
    "cls_token": ("cls_token", np.asarray),
    # timm's [1, D, h, w] map → ours [1, h, w, D].
    "pos_embedding": ("pos_embed", lambda a: np.transpose(a, (0, 2, 3, 1))),
}


def _timm_pit_key(path) -> tuple:
  """(timm key, timm array → ours) of one PiT variable path."""
  if len(path) == 2:
    return _PIT_TOKENS[path[1]]
  _, module, *inner, leaf = path
  to_flax = lambda a: _to_flax(a, leaf)  # noqa: E731
  torch_leaf = _LEAF_NAMES[("params", leaf)]
  match = _PIT_STAGE_MODULE.match(module)
  if match is None:
    return f"{_PIT_TOP_KEYS[module]}.{torch_leaf}", to_flax
  prefix = f"transformers.{int(match.group(1)) - 1}"
  if match.group(2) == "pool":
    return f"{prefix}.pool.{_PIT_POOL_KEYS[inner[0]]}.{torch_leaf}", to_flax
  unit_key = _TIMM_BLOCK_KEYS[(match.group(4), *inner)]
  return f"{prefix}.blocks.{match.group(3)}.{unit_key}.{torch_leaf}", to_flax


_TIMM_KEYS[PiT] = _timm_pit_key
# timm 0.5.4 pools at the end of stage i (``transformers.<i>.pool``; 1.0.31 at the start of stage
# i + 1): only it has ``transformers.0.pool``.
_TIMM_0_5_LAYOUTS[PiT] = (re.compile(r"^transformers\.0\.pool\."),
                          lambda k: _next_stage(k, "transformers", "pool"))
# HV README: PoolingVisionTransformer(num_classes=100, img_size=32, patch_size=2, stride=1,
# base_dims=[32, 32, 32], depth=[2, 6, 4], heads=[2, 4, 8], mlp_ratio=4) (4,582,436 parameters;
# timm's base_dims is our head_dim); PiT-S (no released checkpoint) takes the same CIFAR flags.
TIMM_LAYOUTS["pit_ti"] = dict(patch_size=2,
                              stride=1,
                              position_embedding="map",
                              qkv_bias=True,
                              layer_norm_epsilon=1e-6)
TIMM_LAYOUTS["pit_s"] = dict(TIMM_LAYOUTS["pit_ti"])


# ---------------------------------------------------------------------------------------------
# ViT (``smoothing_jax.models.vit``) from timm's ``VisionTransformer``; key names of timm 1.0.31
# (pinned in requirements-test.txt): ``cls_token``, ``pos_embed`` [1, 1 + N, D] (as ours),
# ``patch_embed.proj`` (a p×p conv of stride p), ``blocks.<i>.{norm1,attn,norm2,mlp}`` (as
# Swin's units: ``_TIMM_BLOCK_KEYS``), ``norm``, ``head``.  Only the CLS-token classifier (timm's
# ``global_pool="token"``, HV's) is mapped; timm's average pooling normalises with ``fc_norm``.

_VIT_UNIT_MODULE = re.compile(r"^block(\d+)_(msa|mlp)$")
_VIT_TOP_KEYS = {"head_norm": "norm", "head": "head"}
_VIT_TOKENS = {"cls_token": ("cls_token", np.asarray), "pos_embedding": ("pos_embed", np.asarray)}


def _timm_patch_embedding(weight: np.ndarray) -> np.ndarray:
  """timm's conv kernel [D, C, p, p] → our Dense kernel [p·p·C, D] on (row, col,
  channel)-ordered patches."""
  return np.transpose(weight, (2, 3, 1, 0)).reshape(-1, weight.shape[0])


def _timm_vit_key(path) -> tuple:
  """(timm key, timm array → ours) of one ViT variable path."""
  if len(path) == 2:
    return _VIT_TOKENS[path[1]]
  _, module, *inner, leaf = path
  torch_leaf = _LEAF_NAMES[("params", leaf)]
  if module == "embedding":
    return f"patch_embed.proj.{torch_leaf}", (_timm_patch_embedding
                                              if leaf == "kernel" else np.asarray)
  to_flax = lambda a: _to_flax(a, leaf)  # noqa: E731
  match = _VIT_UNIT_MODULE.match(module)
  if match is None:
    return f"{_VIT_TOP_KEYS[module]}.{torch_leaf}", to_flax
  unit_key = _TIMM_BLOCK_KEYS[(match.group(2), *inner)]
  return f"blocks.{match.group(1)}.{unit_key}.{torch_leaf}", to_flax


_TIMM_KEYS[ViT] = _timm_vit_key
# HV README: VisionTransformer(num_classes=100, img_size=32, patch_size=2, embed_dim=192,
# depth=12, num_heads=3, qkv_bias=False) (5,403,172 parameters; head width 192 / 3 = 64 as ours);
# ViT-S/B (no released checkpoints) take the same CIFAR flags.
TIMM_LAYOUTS["vit_ti"] = dict(patch_size=2, qkv_bias=False, layer_norm_epsilon=1e-6)
TIMM_LAYOUTS["vit_s"] = dict(TIMM_LAYOUTS["vit_ti"])
TIMM_LAYOUTS["vit_b"] = dict(TIMM_LAYOUTS["vit_ti"])


# ---------------------------------------------------------------------------------------------
# Checkpoint files: ``torch.save`` output of the reference code (SS ``{"name", "state_dict"[,
# "optimizer"]}``, HV ``{"state_dict"}`` as released), a bare ``state_dict``, or one saved from
# ``nn.DataParallel`` (keys prefixed ``module.``), in the reference (SS / HV CNN) or timm layout.

# HV's post-activation ResNet blocks (``resnet_{dnn,mcdo}_block``) wrap each conv with its BN
# (and ReLU) in an ``nn.Sequential``: ``layer1.0.conv1.0`` is SS's ``layer1.0.conv1`` and
# ``layer1.0.conv1.1`` SS's ``layer1.0.bn1``; every other key (``layer0``, ``shortcut``,
# ``classifier``) is named as SS's.
_HV_BLOCK_KEY = re.compile(r"^(layer\d+\.\d+\.)conv(\d+)\.([01])\.")


def read_torch_checkpoint(path) -> dict:
  """The ``state_dict`` (names → numpy arrays) of a torch checkpoint file (any layout above).

  Read with ``torch.load(weights_only=True)``: tensors and containers only, no pickled code.

  Raises:
    FileNotFoundError: no such file.
    ValueError: naming the file: PyTorch not installed, not a torch file (or one holding other
      Python objects), or no state_dict in it.
  """
  path = str(path)
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ValueError(f"Reading the torch checkpoint {path} needs PyTorch (pip install "
                     "-r requirements-test.txt, or pip install .[torch]).") from None
  if not epath.Path(path).exists():
    raise FileNotFoundError(f"No torch checkpoint file {path}.")
  try:
    with epath.Path(path).open("rb") as f:
      checkpoint = torch.load(f, map_location="cpu", weights_only=True)
  except Exception as error:  # noqa: BLE001  (torch raises many kinds; all mean "cannot read")
    raise ValueError(f"{path} is not a torch checkpoint that torch.load(weights_only=True) reads "
                     f"({type(error).__name__}: {str(error).splitlines()[0][:300]}).") from None
  state_dict = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
  if not isinstance(state_dict, dict) or not state_dict or not all(
      isinstance(v, torch.Tensor) for v in state_dict.values()):
    found = sorted(checkpoint)[:10] if isinstance(checkpoint, dict) else type(checkpoint).__name__
    raise ValueError(f"{path} holds no state_dict (a dict of tensors, bare or under "
                     f"'state_dict'); found {found}.")
  if all(k.startswith("module.") for k in state_dict):
    state_dict = {k[len("module."):]: v for k, v in state_dict.items()}
  return {k: (v.float() if v.dtype == torch.bfloat16 else v).numpy() for k, v in state_dict.items()}


def is_timm_state_dict(state_dict: Mapping[str, np.ndarray]) -> bool:
  """Whether a state_dict has timm's layout (its ViT, PiT and Swin, in timm 0.5.4 as in 1.0.31,
  all have ``patch_embed``)."""
  return any(k.startswith("patch_embed.") for k in state_dict)


def reference_keys(state_dict: Mapping[str, np.ndarray]) -> dict:
  """``state_dict`` with HV's ResNet block keys (``layer1.0.conv1.0.weight``,
  ``layer1.0.conv1.1.running_var``) renamed to SS's (``layer1.0.conv1.weight``,
  ``layer1.0.bn1.running_var``), which ``from_torch_state_dict`` reads; other keys as they are."""
  def rename(key):
    return _HV_BLOCK_KEY.sub(
        lambda m: f"{m.group(1)}{'conv' if m.group(3) == '0' else 'bn'}{m.group(2)}.", key)
  return {rename(k): v for k, v in state_dict.items()}


def load_torch_checkpoint(path, model_name: str, *, num_classes: Optional[int] = None,
                          image_shape: Optional[tuple] = None, **overrides) -> dict:
  """Flax variables of ``get_model(model_name)`` from a torch checkpoint file: timm layouts
  through :func:`from_timm_state_dict` (``TIMM_LAYOUTS[model_name]`` first), SS / HV CNN layouts
  through :func:`from_torch_state_dict` (:func:`reference_keys`).

  Args:
    path: a ``torch.save`` file (:func:`read_torch_checkpoint`), e.g. HV's released
      ``vit_ti_cifar100_9857b21357.pth.tar``.
    model_name: registry name, e.g. ``"vit_ti"``, ``"resnet_dnn_50"`` (HV's ``resnet_50``).
    num_classes: inferred from the classifier when omitted.
    image_shape: (H, W, 3) of the checkpoint's images (default: the stem's; a timm ViT's
      position embedding follows it).
    **overrides: model options.

  Raises:
    FileNotFoundError, ValueError: naming the file and the problem (every key that does not
      match).
  """
  state_dict = read_torch_checkpoint(path)
  try:
    if is_timm_state_dict(state_dict):
      return from_timm_state_dict(model_name, state_dict, num_classes=num_classes,
                                  image_shape=image_shape, **overrides)
    return from_torch_state_dict(model_name, reference_keys(state_dict), num_classes=num_classes,
                                 **overrides)
  except ValueError as error:
    raise ValueError(f"{path}: {error}") from None
