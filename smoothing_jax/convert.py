"""Load checkpoints trained with the PyTorch reference implementations (SS, HV) and with timm.

``from_torch_state_dict("resnet_dnn_18", {k: v.numpy() for k, v in torch.load(p).items()})``
returns Flax variables ``{"params": ..., "batch_stats": ...}``.  Our submodule
names mirror the reference ``state_dict`` keys (``layer1_0/conv1`` ↔
``layer1.0.conv1``), so the mapping is by name: conv kernels OIHW → HWIO, dense
weights transposed, BatchNorm ``weight/bias/running_mean/running_var`` →
``scale/bias`` (params) and ``mean/var`` (batch_stats).  timm names ours otherwise: a table of
rules per family (ViT, PiT, Swin) names each of our variables' timm key
(``from_timm_state_dict``).  Both are converted and checked by one loop (``_convert``).  torch is
not needed.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Mapping, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import traverse_util

from smoothing_jax.layers import blur_kernel
from smoothing_jax.models import get_model
from smoothing_jax.models.pit import PiT
from smoothing_jax.models.swin import Swin
from smoothing_jax.models.vit import ViT
from smoothing_jax.variables import abstract_variables, classifier_paths, raise_on_mismatch
# Re-exported: a converted checkpoint is loaded onto a model through it.
from smoothing_jax.variables import transfer_variables  # noqa: F401

_LEAF_NAMES = {
    ("params", "kernel"): "weight",
    ("params", "bias"): "bias",
    ("params", "scale"): "weight",
    ("batch_stats", "mean"): "running_mean",
    ("batch_stats", "var"): "running_var"
}
# Kernels by rank: the axes of the reference array in our order (conv OIHW → HWIO, dense
# (out, in) → (in, out)).
_KERNEL_AXES = {4: (2, 3, 1, 0), 2: (1, 0)}
_BLUR_FILTER = re.compile(r"^smooth\d+\.\d+\.layer1\.filter$")


def torch_key(path) -> str:
  """Reference ``state_dict`` key of a Flax variable path ``(collection, module..., leaf)``."""
  collection, *modules, leaf = path
  return ".".join([re.sub(r"_(\d+)$", r".\1", m) for m in modules] +
                  [_LEAF_NAMES[(collection, leaf)]])


def _reference_axes(array, leaf: str, inverse: bool = False) -> np.ndarray:
  """A reference array of our variable ``leaf`` in our axis order (``inverse``: ours in the
  reference's); only kernels differ (``_KERNEL_AXES``)."""
  axes = _KERNEL_AXES.get(np.ndim(array)) if leaf == "kernel" else None
  if axes is None:
    return np.asarray(array)
  return np.transpose(array, np.argsort(axes) if inverse else axes)


def _convert(title: str, source: str, abstract, state_dict: Mapping[str, np.ndarray],
             key_fn: Callable, buffer: Callable) -> dict:
  """Variables of the model whose :func:`abstract_variables` are ``abstract`` from
  ``state_dict``: each path ``(collection, module..., leaf)`` from the key that
  ``key_fn(path) -> (key, to_flax)`` names, ``to_flax(array, our shape)``.

  Args:
    title: the error's first line.
    source: the checkpoint's kind in shape mismatches ("reference", "timm").
    buffer: ``(key, array)`` of a key no path reads → None where it is unexpected, else (a
      buffer without parameters) the mismatch it shows, "" for none.

  Raises:
    ValueError: naming every missing key, unexpected key and shape mismatch.
  """
  converted, missing, mismatched, used = {}, [], [], set()
  for path, leaf in traverse_util.flatten_dict(dict(abstract)).items():
    key, to_flax = key_fn(path)
    used.add(key)
    if key not in state_dict:
      missing.append(key)
      continue
    value = to_flax(state_dict[key], leaf.shape)
    if value.shape != leaf.shape:
      mismatched.append(f"{key}: {source} {state_dict[key].shape} -> {value.shape}, "
                        f"expected {leaf.shape}")
      continue
    converted[path] = jnp.asarray(value, leaf.dtype)
  unexpected = []
  for key, value in state_dict.items():
    if key in used:
      continue
    problem = buffer(key, value)
    if problem is None:
      unexpected.append(key)
    elif problem:
      mismatched.append(problem)
  raise_on_mismatch(title, missing, unexpected, mismatched)
  return traverse_util.unflatten_dict(converted)


# ---------------------------------------------------------------------------------------------
# Reference state dicts (SS, HV CNNs): keys by ``torch_key``, kernels by ``_KERNEL_AXES``.

def _reference_key(path) -> tuple:
  """(reference key, (reference array, our shape) → ours) of one of our variable paths."""
  return torch_key(path), lambda array, _: _reference_axes(array, path[-1])


def _reference_buffer(model, key: str, value: np.ndarray) -> Optional[str]:
  """The mismatch an unread reference key shows ("" none), None where it is unexpected: BN's
  ``num_batches_tracked`` and the blur filters of spatial smoothing hold no parameters."""
  if key.endswith("num_batches_tracked"):
    return ""
  if not (_BLUR_FILTER.match(key) and model.smoothing):
    return None
  expected = blur_kernel(model.blur_size)
  matches = (value.ndim == 4 and value.shape[-2:] == expected.shape and
             np.allclose(value[:, 0], expected))
  return "" if matches else f"{key}: blur filter does not match blur_size={model.blur_size}"


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
  return _convert(f"state_dict does not match {model_name!r} (num_classes={num_classes})",
                  "reference", abstract_variables(model), state_dict, _reference_key,
                  functools.partial(_reference_buffer, model))


def to_torch_state_dict(variables) -> dict:
  """Inverse of :func:`from_torch_state_dict`: Flax variables → reference ``state_dict`` of numpy
  arrays (no ``num_batches_tracked``, no blur filters)."""
  return {torch_key(path): _reference_axes(value, path[-1], inverse=True)
          for path, value in traverse_util.flatten_dict(dict(variables)).items()}


# ---------------------------------------------------------------------------------------------
# timm state dicts (HV's released ViT / PiT / Swin CIFAR-100 checkpoints are timm models).
#
# Each family's table of ``_TimmRule``s names the timm key of each of our flattened variable
# paths, and how that array becomes ours; ``from_timm_state_dict`` checks the whole mapping
# (missing, unexpected, mismatched keys) in ``_convert``.  A rule's ``to_flax`` may leave axes
# fused that ours split (timm's heads axis h·d): ``_split_fused_axes`` splits them by our shape.
#
# Key names are timm 1.0.31's.  HV's notebooks pin timm 0.5.4, whose Swin and PiT name some keys
# otherwise (``tests/fixtures/timm_0_5_4_keys.json``): a state_dict with a key only that layout
# has is renamed to 1.0.31's first (``_TimmFamily.old_keys``, ``renames``).


class _TimmRule(NamedTuple):
  """Our variables whose "/"-joined path (without the collection) ``ours`` (a regular expression)
  matches whole come from timm's ``timm`` key; or, where it matches all but the leaf (kernel,
  bias, scale), from ``timm`` + ``.weight`` / ``.bias``.  ``timm`` is formatted with the named
  groups of ``ours``, ``stage`` counted from 0 (ours from 1)."""
  ours: str
  timm: str
  to_flax: Optional[Callable] = None  # timm's array → ours; default: as a reference array's


class _TimmFamily(NamedTuple):
  """timm's names of one of our model classes."""
  rules: tuple                    # ``_TimmRule``s; the first that matches a path names it
  buffers: Optional[str] = None   # timm buffers that carry no parameters (a regular expression)
  old_keys: Optional[str] = None  # keys only timm 0.5.4's layout has (a regular expression)
  renames: tuple = ()             # ``re.sub`` (pattern, replacement)s: timm 0.5.4 key → 1.0.31's

  def buffer(self, key: str, _) -> Optional[str]:
    """The mismatch an unread ``key`` shows: "" (none) where it is a buffer, None where it is
    unexpected."""
    return "" if self.buffers and re.search(self.buffers, key) else None

  def new_key(self, key: str) -> str:
    """timm 1.0.31's name of a timm 0.5.4 key."""
    return functools.reduce(lambda k, rename: re.sub(*rename, k), self.renames, key)


# Model class -> its ``_TimmFamily``; filled in below by each family's section.
_TIMM_FAMILIES: dict = {}
# Registry name -> ``get_model`` overrides that reproduce the timm constructor of HV's released
# CIFAR-100 checkpoint (HV README), e.g. ``TIMM_LAYOUTS["vit_ti"]``.
TIMM_LAYOUTS: dict = {}
# timm's transformer blocks (ViT and PiT ``Block``, ``SwinTransformerBlock``): the module of our
# unit (``<block>_msa``, ``<block>_mlp``) → timm's within the block.
_TIMM_BLOCK_KEYS = {
    "msa/norm": "norm1",
    "msa/attention/qkv": "attn.qkv",
    "msa/attention/out": "attn.proj",
    "mlp/norm": "norm2",
    "mlp/fc1": "mlp.fc1",
    "mlp/fc2": "mlp.fc2",
}


def _block_rules(ours: str, timm: str) -> list:
  """The rules of the transformer blocks ``ours`` (a pattern of our block's name, e.g.
  ``block(?P<block>\\d+)``) whose timm key is ``timm`` (e.g. ``blocks.{block}``)."""
  return [_TimmRule(f"{ours}_{unit}", f"{timm}.{key}") for unit, key in _TIMM_BLOCK_KEYS.items()]


def _next_stage(stages: str, module: str) -> tuple:
  """The rename of ``<stages>.<i>.<module>.`` to stage i + 1: timm 0.5.4 downsamples at the end
  of a stage (``layers.0.downsample``), timm 1.0.31 at the start of the next (``layers.1``)."""
  return (rf"^{stages}\.(\d+)\.{module}\.",
          lambda m: f"{stages}.{int(m.group(1)) + 1}.{module}.")


def _split_fused_axes(value: np.ndarray, shape: tuple) -> np.ndarray:
  """``value`` reshaped to ``shape`` where ``shape`` only splits axes of ``value`` (e.g. timm's
  fused heads axis h·d into our (h, d): a rule need not know h); else ``value``."""
  groups, dims = [], list(shape)
  for size in value.shape:
    product = 1
    while dims and product < size:
      product *= dims.pop(0)
    groups.append(product)
  return value.reshape(shape) if groups == list(value.shape) and not dims else value


def _timm_key(rules: tuple, path) -> tuple:
  """(timm key, (timm array, our shape) → ours) of one of our variable paths, by the first of
  ``rules`` that matches it."""
  name = "/".join(path[1:])
  for rule in rules:
    match = re.fullmatch(rf"(?:{rule.ours})(?:/(?P<leaf>kernel|bias|scale))?", name)
    if match is None:
      continue
    fields = {k: int(v) - 1 if k == "stage" else v for k, v in match.groupdict().items()}
    key = rule.timm.format(**fields)
    if fields["leaf"] is not None:
      key += "." + _LEAF_NAMES[(path[0], fields["leaf"])]
    to_flax = rule.to_flax or functools.partial(_reference_axes, leaf=path[-1])
    return key, lambda array, shape: _split_fused_axes(np.asarray(to_flax(array)), shape)
  raise ValueError(f"No timm key for our variable {'/'.join(path)}.")


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
  family = _TIMM_FAMILIES.get(type(model))
  if family is None:
    raise ValueError(f"No timm mapping for {model_name!r} ({type(model).__name__}); timm "
                     f"checkpoints load into {sorted(c.__name__ for c in _TIMM_FAMILIES)} models.")
  layout = "timm 1.0.31 keys"
  if family.old_keys and any(re.search(family.old_keys, k) for k in state_dict):
    state_dict = {family.new_key(k): v for k, v in state_dict.items()}
    layout = "timm 0.5.4 keys, named below as timm 1.0.31's"
  return _convert(f"timm state_dict does not match {model_name!r} "
                  f"({layout}; num_classes={num_classes}, options={overrides})",
                  "timm", abstract_variables(model, image_shape), state_dict,
                  functools.partial(_timm_key, family.rules), family.buffer)


# ---------------------------------------------------------------------------------------------
# Swin (``smoothing_jax.models.swin``) from timm's ``SwinTransformer``; key names of timm 1.0.31
# (pinned in requirements-test.txt): ``patch_embed.{proj,norm}``,
# ``layers.<i>.downsample.{norm,reduction}``, ``layers.<i>.blocks.<j>.{norm1,attn,norm2,mlp}``,
# ``norm``, ``head.fc``.  Needs the timm layout (``TIMM_LAYOUTS["swin_t"]``).


def _timm_swin_table(table: np.ndarray) -> np.ndarray:
  """timm's ``relative_position_bias_table`` [(2w−1)², heads], indexed by query − key, → ours
  [2w−1, 2w−1, heads], indexed by key − query (as
  ``layers.attention.relative_position_index``)."""
  side = int(round(np.sqrt(table.shape[0])))
  return table.reshape(side, side, -1)[::-1, ::-1]


_SWIN_BLOCK = r"stage(?P<stage>\d+)_block(?P<block>\d+)"
_TIMM_FAMILIES[Swin] = _TimmFamily(
    rules=(_TimmRule("embedding", "patch_embed.proj"),
           _TimmRule("embedding_norm", "patch_embed.norm"),
           _TimmRule(r"stage(?P<stage>\d+)_merge/(?P<module>norm|reduction)",
                     "layers.{stage}.downsample.{module}"),
           _TimmRule(rf"{_SWIN_BLOCK}_msa/relative_position",
                     "layers.{stage}.blocks.{block}.attn.relative_position_bias_table",
                     _timm_swin_table),
           *_block_rules(_SWIN_BLOCK, "layers.{stage}.blocks.{block}"),
           _TimmRule("head_norm", "norm"),
           _TimmRule("head", "head.fc")),
    # Non-persistent in timm 1.0.31, persistent in older checkpoints.
    buffers=r"(relative_position_index|attn_mask)$",
    # Only timm 0.5.4 has ``head.weight`` (with stages: ``layers.0.downsample``).
    old_keys=r"^(head\.(weight|bias)$|layers\.0\.downsample\.)",
    renames=(_next_stage("layers", "downsample"), (r"^head\.(weight|bias)$", r"head.fc.\1")))
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

_TIMM_FAMILIES[PiT] = _TimmFamily(
    rules=(_TimmRule("cls_token", "cls_token"),
           # timm's [1, D, h, w] map → ours [1, h, w, D].
           _TimmRule("pos_embedding", "pos_embed", lambda a: np.transpose(a, (0, 2, 3, 1))),
           _TimmRule("embedding", "patch_embed.conv"),
           _TimmRule(r"stage(?P<stage>\d+)_pool/conv", "transformers.{stage}.pool.conv"),
           _TimmRule(r"stage(?P<stage>\d+)_pool/cls_dense", "transformers.{stage}.pool.fc"),
           *_block_rules(r"stage(?P<stage>\d+)_block(?P<block>\d+)",
                         "transformers.{stage}.blocks.{block}"),
           _TimmRule("head_norm", "norm"),
           _TimmRule("head", "head")),
    # timm 0.5.4 pools at the end of stage i (``transformers.<i>.pool``; 1.0.31 at the start of
    # stage i + 1): only it has ``transformers.0.pool``.
    old_keys=r"^transformers\.0\.pool\.",
    renames=(_next_stage("transformers", "pool"),))
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
# Its keys are the same in timm 0.5.4.


def _timm_patch_embedding(weight: np.ndarray) -> np.ndarray:
  """timm's conv kernel [D, C, p, p] → our Dense kernel [p·p·C, D] on (row, col,
  channel)-ordered patches."""
  return np.transpose(weight, (2, 3, 1, 0)).reshape(-1, weight.shape[0])


_TIMM_FAMILIES[ViT] = _TimmFamily(
    rules=(_TimmRule("cls_token", "cls_token"),
           _TimmRule("pos_embedding", "pos_embed"),
           _TimmRule("embedding/kernel", "patch_embed.proj.weight", _timm_patch_embedding),
           _TimmRule("embedding", "patch_embed.proj"),
           *_block_rules(r"block(?P<block>\d+)", "blocks.{block}"),
           _TimmRule("head_norm", "norm"),
           _TimmRule("head", "head")))
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
