"""timm's names of our ViT, PiT and Swin (one table of ``timm_rules.TimmRule``s per family), the
timm constructor options of HV's checkpoints (``TIMM_LAYOUTS``) and ``from_timm_state_dict``."""
from __future__ import annotations

import functools
import re
from collections.abc import Mapping

import numpy as np

from smoothing_jax.convert.reference import convert_and_check
from smoothing_jax.convert.timm_rules import TimmFamily, TimmRule, block_rules, next_stage, timm_key
from smoothing_jax.models import get_model
from smoothing_jax.models.pit import PiT
from smoothing_jax.models.swin import Swin
from smoothing_jax.models.vit import ViT
from smoothing_jax.variables import abstract_variables

# Model class -> its ``TimmFamily``; filled in below by each family's section.
_TIMM_FAMILIES: dict = {}
# Registry name -> ``get_model`` overrides that reproduce the timm constructor of HV's released
# CIFAR-100 checkpoint (HV README), e.g. ``TIMM_LAYOUTS["vit_ti"]``.
TIMM_LAYOUTS: dict = {}


def from_timm_state_dict(model_name: str, state_dict: Mapping[str, np.ndarray], *,
                         num_classes: int | None = None, image_shape: tuple | None = None,
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
  return convert_and_check(f"timm state_dict does not match {model_name!r} "
                           f"({layout}; num_classes={num_classes}, options={overrides})",
                           "timm", abstract_variables(model, image_shape), state_dict,
                           functools.partial(timm_key, family.rules), family.buffer)


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
_TIMM_FAMILIES[Swin] = TimmFamily(
    rules=(TimmRule("embedding", "patch_embed.proj"),
           TimmRule("embedding_norm", "patch_embed.norm"),
           TimmRule(r"stage(?P<stage>\d+)_merge/(?P<module>norm|reduction)",
                    "layers.{stage}.downsample.{module}"),
           TimmRule(rf"{_SWIN_BLOCK}_msa/relative_position",
                    "layers.{stage}.blocks.{block}.attn.relative_position_bias_table",
                    _timm_swin_table),
           *block_rules(_SWIN_BLOCK, "layers.{stage}.blocks.{block}"),
           TimmRule("head_norm", "norm"),
           TimmRule("head", "head.fc")),
    # Non-persistent in timm 1.0.31, persistent in older checkpoints.
    buffers=r"(relative_position_index|attn_mask)$",
    # Only timm 0.5.4 has ``head.weight`` (with stages: ``layers.0.downsample``).
    old_keys=r"^(head\.(weight|bias)$|layers\.0\.downsample\.)",
    renames=(next_stage("layers", "downsample"), (r"^head\.(weight|bias)$", r"head.fc.\1")))
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
# norm2,mlp}`` (timm's ViT ``Block``, as Swin's: ``block_rules``), ``norm``, ``head``.  Needs
# the timm layout (``TIMM_LAYOUTS["pit_ti"]``); distilled PiTs (``head_dist``) are not mapped.

_TIMM_FAMILIES[PiT] = TimmFamily(
    rules=(TimmRule("cls_token", "cls_token"),
           # timm's [1, D, h, w] map → ours [1, h, w, D].
           TimmRule("pos_embedding", "pos_embed", lambda a: np.transpose(a, (0, 2, 3, 1))),
           TimmRule("embedding", "patch_embed.conv"),
           TimmRule(r"stage(?P<stage>\d+)_pool/conv", "transformers.{stage}.pool.conv"),
           TimmRule(r"stage(?P<stage>\d+)_pool/cls_dense", "transformers.{stage}.pool.fc"),
           *block_rules(r"stage(?P<stage>\d+)_block(?P<block>\d+)",
                        "transformers.{stage}.blocks.{block}"),
           TimmRule("head_norm", "norm"),
           TimmRule("head", "head")),
    # timm 0.5.4 pools at the end of stage i (``transformers.<i>.pool``; 1.0.31 at the start of
    # stage i + 1): only it has ``transformers.0.pool``.
    old_keys=r"^transformers\.0\.pool\.",
    renames=(next_stage("transformers", "pool"),))
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
# Swin's units: ``block_rules``), ``norm``, ``head``.  Only the CLS-token classifier (timm's
# ``global_pool="token"``, HV's) is mapped; timm's average pooling normalises with ``fc_norm``.
# Its keys are the same in timm 0.5.4.


def _timm_patch_embedding(weight: np.ndarray) -> np.ndarray:
  """timm's conv kernel [D, C, p, p] → our Dense kernel [p·p·C, D] on (row, col,
  channel)-ordered patches."""
  return np.transpose(weight, (2, 3, 1, 0)).reshape(-1, weight.shape[0])


_TIMM_FAMILIES[ViT] = TimmFamily(
    rules=(TimmRule("cls_token", "cls_token"),
           TimmRule("pos_embedding", "pos_embed"),
           TimmRule("embedding/kernel", "patch_embed.proj.weight", _timm_patch_embedding),
           TimmRule("embedding", "patch_embed.proj"),
           *block_rules(r"block(?P<block>\d+)", "blocks.{block}"),
           TimmRule("head_norm", "norm"),
           TimmRule("head", "head")))
# HV README: VisionTransformer(num_classes=100, img_size=32, patch_size=2, embed_dim=192,
# depth=12, num_heads=3, qkv_bias=False) (5,403,172 parameters; head width 192 / 3 = 64 as ours);
# ViT-S/B (no released checkpoints) take the same CIFAR flags.
TIMM_LAYOUTS["vit_ti"] = dict(patch_size=2, qkv_bias=False, layer_norm_epsilon=1e-6)
TIMM_LAYOUTS["vit_s"] = dict(TIMM_LAYOUTS["vit_ti"])
TIMM_LAYOUTS["vit_b"] = dict(TIMM_LAYOUTS["vit_ti"])
