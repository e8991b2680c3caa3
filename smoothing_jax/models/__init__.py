"""Model zoo and the one registry: ``get_model("resnet_mcdo_smoothing_18", num_classes=100)``.

Names follow the reference implementation: ``<family>_<variant>[_<depth>]`` with
variant ``dnn`` (deterministic), ``mcdo`` (MC dropout), ``dnn_smoothing`` or
``mcdo_smoothing``; plus the iBNN models ``vgg_ibnn_16`` and ``wideresnet_ibnn_28_10``
(``num_components=K`` override; they take ``components`` and a ``"noise"`` key); the BNN-VI
models ``vgg_bnnvi_16`` and ``wideresnet_bnnvi_28_10`` (mean-field Gaussian kernels, a
``"noise"`` key per pass) and the iBNN repository's own BNN-VI ``vgg_bayesian_16`` and
``wideresnet_bayesian_28_10`` (its ``BayesianVGG16``, ``BayesianWideResNet28x10``); the
BatchEnsemble models ``resnet_batchensemble_18`` and
``wideresnet_batchensemble_28_10`` (``ensemble_size=M`` override, default 4; ``components``
names each row's member); the MIMO models ``resnet_mimo_18`` and ``wideresnet_mimo_28_10``
(``mimo_members=M`` override, default 3: M inputs ``[B, M, H, W, 3]``, or one image for all, and
logits ``[B, M, C]``); the Packed-Ensembles ResNet-18 ``resnet_packed_18`` (``num_estimators``
M, ``alpha``, ``gamma``; logits ``[B·M, C]``, ``smoothing_jax.models.packed``); the SNGP
models ``resnet_sngp_18`` and ``wideresnet_sngp_28_10`` (spectral normalisation and a
random-feature GP output layer, ``smoothing_jax.layers.sngp``); and the
self-attention models ``vit_{ti,s,b}``, ``pit_{ti,s}``, ``swin_{t,s}`` and
``alternet_{18,34,50,101,152}`` (HV); and the segmentation U-Nets
``unet_{dnn,mcdo,dnn_smoothing,mcdo_smoothing}`` (per-pixel logits ``[B, H, W, C]``).  Every
model is called as ``model.apply(variables, images_nhwc, train=False, rngs={"dropout": key})``.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import types
import typing

import flax.linen as nn

from smoothing_jax.models.alexnet import AlexNet
from smoothing_jax.models.alternet import AlterNet
from smoothing_jax.models.packed import PackedResNet
from smoothing_jax.models.pit import PiT
from smoothing_jax.models.resnet import ResNet
from smoothing_jax.models.swin import Swin
from smoothing_jax.models.unet import UNet
from smoothing_jax.models.vgg import VGG, VGG_STAGES
from smoothing_jax.models.vit import ViT
from smoothing_jax.models.wideresnet import WideResNet

__all__ = [
    "AlexNet", "AlterNet", "PiT", "ResNet", "Swin", "UNet", "VGG", "ViT", "WideResNet", "get_model",
    "list_models", "is_segmentation_model"
]

RESNET_STAGES = {
    18: ((2, 2, 2, 2), "basic"),
    34: ((3, 4, 6, 3), "basic"),
    50: ((3, 4, 6, 3), "bottleneck"),
    101: ((3, 4, 23, 3), "bottleneck"),
    152: ((3, 8, 36, 3), "bottleneck")
}
VARIANTS = ("dnn", "mcdo", "dnn_smoothing", "mcdo_smoothing")
MCDO_RATE = 0.3
ALEXNET_MCDO_RATE = 0.1
UNET_MCDO_RATE = 0.5  # Bayesian SegNet
IBNN_COMPONENTS = 4
# The iBNN repository's BNN-VI layers (``bnn_reference="ibnn"``), σ₀ of ρ = softplus⁻¹|N(σ₀,
# 0.001²)|.
IBNN_BNNVI = dict(mean_field=True, bnn_reference="ibnn", posterior_std_init=0.015)
BATCH_ENSEMBLE_SIZE = 4
MIMO_MEMBERS = 3  # uncertainty-baselines' baselines/cifar/mimo.py flag ensemble_size
# uncertainty-baselines' baselines/cifar/sngp.py flags: spec_norm_bound 6, spec_norm_iteration 1,
# gp_hidden_dim 1024, gp_cov_ridge_penalty 1 (and, in its WRN, dropout_rate 0.1: training-only
# filter-wise dropout, ``filter_dropout_rate``).
SNGP = dict(spectral_norm=6.0, spectral_norm_iterations=1, gp_features=1024, gp_ridge=1.0)
# uncertainty-baselines' WRN-28-10 (``wide_resnet_variational``, ``wide_resnet_batchensemble``).
UB_WIDERESNET = dict(depth=28, widen_factor=10, conv_bias=False, stride_first=True,
                     head_bn_momentum=0.9, kernel_init="he_normal")
# ViT sizes: (hidden_dim, heads, mlp_dim); depth 12, head width 64 (HV ``vit.py``).
VIT_SIZES = {"ti": (192, 3, 768), "s": (384, 6, 1536), "b": (768, 12, 3072)}
# Swin sizes: blocks per stage; width 96 doubling per stage, heads (3, 6, 12, 24) (HV ``swin.py``).
SWIN_DEPTHS = {"t": (2, 2, 6, 2), "s": (2, 2, 18, 2)}
# PiT sizes: (heads per stage, head width); blocks (2, 6, 4), MLP ×4 (HV ``pit.py``).
PIT_SIZES = {"ti": ((2, 4, 8), 32), "s": ((3, 6, 12), 48)}
# AlterNet: (block, blocks per stage, MSA blocks per stage) (HV ``alternet.py``).
ALTERNET_STAGES = {
    18: ("basic", (2, 2, 2, 2), (0, 1, 1, 1)),
    34: ("basic", (3, 4, 6, 4), (0, 1, 3, 2)),
    50: ("bottleneck", (3, 4, 6, 4), (0, 1, 3, 2)),
    101: ("bottleneck", (3, 4, 23, 4), (0, 1, 3, 2)),
    152: ("bottleneck", (3, 8, 36, 4), (0, 1, 3, 2))
}


def _architectures():
  """``{"<family>_{variant}_<depth>": (module class, architecture kwargs, MC dropout rate)}``."""
  archs = {}
  for depth, (stages, block) in RESNET_STAGES.items():
    archs[f"resnet_{{}}_{depth}"] = (ResNet, dict(stage_sizes=stages, block=block), MCDO_RATE)
    archs[f"preresnet_{{}}_{depth}"] = (ResNet, dict(stage_sizes=stages, block=block,
                                                     preact=True), MCDO_RATE)
  for depth, width_per_group in ((50, 4), (101, 8)):
    archs[f"resnext_{{}}_{depth}"] = (
        ResNet, dict(stage_sizes=RESNET_STAGES[depth][0], block="bottleneck", groups=32,
                     width_per_group=width_per_group), MCDO_RATE)
  for depth in (50, 101):
    archs[f"wideresnet_{{}}_{depth}"] = (ResNet,
                                         dict(stage_sizes=RESNET_STAGES[depth][0],
                                              block="bottleneck",
                                              width_per_group=128), MCDO_RATE)
  archs["wideresnet_{}_28_10"] = (WideResNet, dict(depth=28, widen_factor=10), MCDO_RATE)
  for depth, stages in VGG_STAGES.items():
    archs[f"vgg_{{}}_{depth}"] = (VGG, dict(stage_sizes=stages), MCDO_RATE)
    archs[f"prevgg_{{}}_{depth}"] = (VGG, dict(stage_sizes=stages, preact=True), MCDO_RATE)
  archs["alexnet_{}"] = (AlexNet, {}, ALEXNET_MCDO_RATE)
  archs["unet_{}"] = (UNet, {}, UNET_MCDO_RATE)
  return archs


@functools.cache
def _registry():
  registry = {}
  for pattern, (cls, kwargs, rate) in _architectures().items():
    for variant in VARIANTS:
      registry[pattern.format(variant)] = (cls, dict(
          kwargs, dropout_rate=rate if variant.startswith("mcdo") else 0.0,
          smoothing=variant.endswith("smoothing")))
  # iBNN (Trinh et al.): node noise is a constructor option of the same families.
  registry["vgg_ibnn_16"] = (VGG,
                             dict(stage_sizes=VGG_STAGES[16],
                                  batch_norm=False,
                                  classifier="mlp512",
                                  num_components=IBNN_COMPONENTS,
                                  noise_init_std=0.75,
                                  kernel_init="pytorch_dense"))
  registry["wideresnet_ibnn_28_10"] = (WideResNet,
                                       dict(depth=28,
                                            widen_factor=10,
                                            num_components=IBNN_COMPONENTS,
                                            kernel_init="pytorch_default"))
  # BNN-VI (Blundell et al.): the iBNN paper's VGG-16 and uncertainty-baselines' WRN-28-10.
  registry["vgg_bnnvi_16"] = (VGG, dict(stage_sizes=VGG_STAGES[16], batch_norm=False,
                                        classifier="mlp512", mean_field=True,
                                        kernel_init="pytorch_dense"))
  registry["wideresnet_bnnvi_28_10"] = (WideResNet, dict(UB_WIDERESNET, mean_field=True))
  # The iBNN repository's own BNN-VI (trungtrinh44/ibnn at 665ba40: ``BayesianVGG16`` in
  # ``models/vgg.py``, ``BayesianWideResNet28x10`` in ``models/resnet.py``): variational kernels
  # and biases drawn once per pass, its VGG-16 and WRN (the stem a plain conv), its initialisation.
  registry["vgg_bayesian_16"] = (VGG, dict(stage_sizes=VGG_STAGES[16], batch_norm=False,
                                           classifier="mlp512", kernel_init="pytorch_dense",
                                           **IBNN_BNNVI))
  registry["wideresnet_bayesian_28_10"] = (WideResNet, dict(depth=28, widen_factor=10,
                                                            kernel_init="pytorch_default",
                                                            point_stem=True, **IBNN_BNNVI))
  # BatchEnsemble (Wen et al.): uncertainty-baselines' WRN-28-10 and a CIFAR ResNet-18.
  registry["resnet_batchensemble_18"] = (ResNet, dict(stage_sizes=RESNET_STAGES[18][0],
                                                      block="basic",
                                                      ensemble_size=BATCH_ENSEMBLE_SIZE))
  registry["wideresnet_batchensemble_28_10"] = (WideResNet,
                                                dict(UB_WIDERESNET,
                                                     ensemble_size=BATCH_ENSEMBLE_SIZE))
  # MIMO (Havasi et al.): uncertainty-baselines' WRN-28-10 (``wide_resnet_mimo``) and a ResNet-18.
  registry["resnet_mimo_18"] = (ResNet, dict(stage_sizes=RESNET_STAGES[18][0], block="basic",
                                             mimo_members=MIMO_MEMBERS))
  registry["wideresnet_mimo_28_10"] = (WideResNet, dict(UB_WIDERESNET, mimo_members=MIMO_MEMBERS))
  # SNGP (Liu et al.): spectral normalisation (bound 6, one power iteration) and a GP output layer
  # of 1,024 random features, uncertainty-baselines' ``wide_resnet_sngp`` and a ResNet-18.
  registry["resnet_sngp_18"] = (ResNet, dict(stage_sizes=RESNET_STAGES[18][0], block="basic",
                                             **SNGP))
  registry["wideresnet_sngp_28_10"] = (WideResNet, dict(UB_WIDERESNET, filter_dropout_rate=0.1,
                                                        **SNGP))
  # Packed-Ensembles (Laurent et al.): TorchUncertainty's CIFAR ResNet-18 (M 4, α 2, γ 2).
  registry["resnet_packed_18"] = (PackedResNet, dict(stage_sizes=RESNET_STAGES[18][0]))
  # MSA as trainable smoothing (HV): ViTs and AlterNets (geometry from ``stem``, like the CNNs).
  for size, (dim, heads, mlp_dim) in VIT_SIZES.items():
    registry[f"vit_{size}"] = (ViT, dict(hidden_dim=dim, num_heads=heads, mlp_dim=mlp_dim))
  for depth, (block, stages, msas) in ALTERNET_STAGES.items():
    registry[f"alternet_{depth}"] = (AlterNet, dict(block=block,
                                                    stage_sizes=stages,
                                                    msa_blocks=msas))
  for size, depths in SWIN_DEPTHS.items():
    registry[f"swin_{size}"] = (Swin, dict(depths=depths))
  for size, (heads, head_dim) in PIT_SIZES.items():
    registry[f"pit_{size}"] = (PiT, dict(num_heads=heads, head_dim=head_dim))
  return registry


def list_models() -> list[str]:
  """All registered model names, sorted."""
  return sorted(_registry())


def is_segmentation_model(model: nn.Module) -> bool:
  """True for models with per-pixel outputs ``[B, H, W, C]`` (the U-Nets)."""
  return isinstance(model, UNet)


def is_ibnn(model: nn.Module) -> bool:
  """True for iBNN models: K ≥ 1 components of multiplicative node noise (``num_components``)."""
  return getattr(model, "num_components", 0) > 0


def is_mean_field(model: nn.Module) -> bool:
  """True for BNN-VI models: mean-field Gaussian kernels (``mean_field``)."""
  return bool(getattr(model, "mean_field", False))


def is_batch_ensemble(model: nn.Module) -> bool:
  """True for BatchEnsemble models: M ≥ 1 members of fast weights (``ensemble_size``)."""
  return getattr(model, "ensemble_size", 0) > 0


def is_mimo(model: nn.Module) -> bool:
  """True for MIMO models: M ≥ 1 inputs and heads (``mimo_members``)."""
  return getattr(model, "mimo_members", 0) > 0


def is_sngp(model: nn.Module) -> bool:
  """True for SNGP models: a random-feature GP output layer (``gp_features``)."""
  return getattr(model, "gp_features", 0) > 0


def is_stochastic(model: nn.Module) -> bool:
  """True when two evaluation passes differ: MC dropout, iBNN node noise or BNN-VI weights."""
  head_mc_dropout = getattr(model, "head_mc_dropout", False) and model.head_dropout_rate > 0
  # (VGG refuses head dropout outside its mlp512 head.)
  return (getattr(model, "dropout_rate", 0.0) > 0 or head_mc_dropout or is_ibnn(model)
          or is_mean_field(model))


def implied_method(model: nn.Module) -> str:
  """The name of the uncertainty method ``model`` is built for (``smoothing_jax.methods``), what
  a config's ``method`` defaults to: the model's structure decides it (node noise, mean-field
  kernels, fast weights, M heads, grouped members), then dropout kept on at evaluation; a model
  with none of these is one deterministic network.  The layer factory knows which structure
  each model has, so this is the one place outside ``methods/`` that names methods."""
  structures = (("ibnn", is_ibnn), ("bnnvi", is_mean_field),
                ("batch_ensemble", is_batch_ensemble), ("mimo", is_mimo), ("sngp", is_sngp),
                ("packed_ensemble", lambda m: isinstance(m, PackedResNet)))
  for name, holds in structures:
    if holds(model):
      return name
  return "mc_dropout" if is_stochastic(model) else "deterministic"


def _registered(name: str) -> tuple:
  """``(module class, registry options)`` of ``name``; ValueError with the closest names."""
  registry = _registry()
  if name not in registry:
    close = difflib.get_close_matches(name, registry, n=5, cutoff=0.6)
    hint = f" Did you mean one of {close}?" if close else " See smoothing_jax.models.list_models()."
    raise ValueError(f"Unknown model name {name!r}.{hint}")
  return registry[name]


def _option_type(hint):
  """The config type of a module field's annotation: bool/int/float/str, tuple for sequences,
  None for anything else (e.g. ``dtype``)."""
  if typing.get_origin(hint) in (typing.Union, types.UnionType):
    hint = next(a for a in typing.get_args(hint) if a is not type(None))
  if (typing.get_origin(hint) or hint) in (tuple, list, collections.abc.Sequence):
    return tuple
  return hint if hint in (bool, int, float, str) else None


def model_options(name: str) -> dict:
  """``{option: type}`` of the module options a config may set for model ``name`` (its fields
  but ``num_classes`` and ``dtype``; sequences as tuples)."""
  cls, _ = _registered(name)
  hints = typing.get_type_hints(cls)
  options = {f.name: _option_type(hints.get(f.name)) for f in dataclasses.fields(cls)
             if f.name not in ("parent", "name", "num_classes", "dtype")}
  return {k: v for k, v in options.items() if v is not None}


def get_model(name: str, num_classes: int, **overrides) -> nn.Module:
  """Build a registered model.

  Args:
    name: e.g. ``resnet_dnn_18``, ``resnet_mcdo_smoothing_50``, ``vgg_mcdo_16``,
      ``alexnet_dnn_smoothing``, ``wideresnet_mcdo_28_10``.
    num_classes: number of output logits.
    **overrides: module fields, e.g. ``stem="imagenet"``, ``classifier="mlp"``,
      ``dropout_rate=0.2``, ``temperature=5.0``, ``blur_size=3``, ``width=8``.

  Raises:
    ValueError: unknown name (with the closest registered names) or unknown override.
  """
  cls, kwargs = _registered(name)
  fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name"}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(
        f"Unknown option(s) {unknown} for model {name!r}; valid options: {sorted(fields)}.")
  if not isinstance(num_classes, int) or num_classes < 1:
    raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}.")
  # Lists (e.g. from a JSON config) become tuples: modules must be hashable to be jit-static.
  kwargs = {**kwargs, **{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}}
  if "_ibnn_" in name and kwargs["num_components"] < 1:
    raise ValueError(f"{name!r} needs num_components (K) >= 1, got {kwargs['num_components']}.")
  if "_batchensemble_" in name and kwargs["ensemble_size"] < 1:
    raise ValueError(f"{name!r} needs ensemble_size (M) >= 1, got {kwargs['ensemble_size']}.")
  if "_mimo_" in name and kwargs["mimo_members"] < 1:
    raise ValueError(f"{name!r} needs mimo_members (M) >= 1, got {kwargs['mimo_members']}.")
  return cls(num_classes=num_classes, **kwargs)
