"""Pieces shared by the CNN families: convolutions with PyTorch padding, heads, options.

Submodule names follow the PyTorch reference's ``state_dict`` keys with
``Sequential`` indices joined by ``_`` (``layer1.0.conv1`` ↔ ``layer1_0/conv1``),
so :mod:`smoothing_jax.convert` maps reference checkpoints one to one.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.layers import MCDropout, Smooth
from smoothing_jax.layers.batch_ensemble import (
  RANDOM_SIGN_INIT,
  BatchEnsembleConv,
  BatchEnsembleDense,
)
from smoothing_jax.layers.grouped_conv import GroupedConv
from smoothing_jax.layers.mean_field import (
  POSTERIOR_STD_INIT,
  BayesianConv,
  BayesianDense,
  MeanFieldConv,
  MeanFieldDense,
)
from smoothing_jax.layers.node_noise import NodeNoiseConv, NodeNoiseDense
from smoothing_jax.layers.sngp import RandomFeatureGP, SpectralNormConv, SpectralNormDense

STEMS = ("cifar", "imagenet")
# What a conv / dense layer's weights are (``CNN.weights``): point estimates, iBNN node noise on
# their inputs, mean-field Gaussians (BNN-VI), BatchEnsemble fast weights, or spectrally
# normalised point estimates (SNGP).
WEIGHTS = ("point", "ibnn", "mean_field", "batch_ensemble", "spectral_norm")
WEIGHT_NAMES = {"point": "point-estimate", "ibnn": "iBNN", "mean_field": "BNN-VI",
                "batch_ensemble": "BatchEnsemble", "spectral_norm": "spectrally normalised"}
CLASSIFIERS = ("gap", "mlp", "mlp512")
# Whose mean-field layers a BNN-VI builds (``CNN.bnn_reference``): uncertainty-baselines'
# (Flipout, deterministic biases) or the iBNN repository's (one sample per pass, variational
# biases).
MEAN_FIELD_LAYERS = {"ub": (MeanFieldConv, MeanFieldDense), "ibnn": (BayesianConv, BayesianDense)}

# PyTorch BatchNorm2d defaults: running = 0.9 · running + 0.1 · batch, eps 1e-5.
batch_norm = functools.partial(nn.BatchNorm, momentum=0.9, epsilon=1e-5)
conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")
# PyTorch's default ``reset_parameters`` of nn.Conv2d / nn.Linear: kaiming_uniform(a=√5), i.e.
# U(±1/√fan_in), and biases U(±1/√fan_in).
pytorch_default = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


def pytorch_default_bias(fan_in: int):
  """PyTorch's default bias initialisation of a layer with ``fan_in`` inputs: U(±1/√fan_in)."""
  bound = 1.0 / np.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


class WeightInit(NamedTuple):
  """Kernel initialisers of the conv and dense layers, and whether their biases start as
  PyTorch's U(±1/√fan_in) (else zeros)."""
  conv: Callable
  dense: Callable
  conv_bias_uniform: bool = False
  dense_bias_uniform: bool = False


# ``CNN.kernel_init``.  "reference": the SS/HV references' N(0, 2 / (k²·C_out)) convs and Flax's
# default (LeCun normal) dense layers; "he_normal": Keras ``he_normal`` (truncated normal of
# variance 2 / fan_in) for both, as uncertainty-baselines; "pytorch_default": PyTorch's defaults
# everywhere (the iBNN reference's WRN, which defines ``conv_init`` but never applies it);
# "pytorch_dense": reference convs with zero biases, PyTorch's default dense layers (the iBNN
# reference's VGG-16, which initialises only its convs).
KERNEL_INITS = {
    "reference": WeightInit(conv_init, nn.initializers.lecun_normal()),
    "he_normal": WeightInit(*(nn.initializers.variance_scaling(2.0, "fan_in",
                                                               "truncated_normal"),) * 2),
    "pytorch_default": WeightInit(pytorch_default, pytorch_default, True, True),
    "pytorch_dense": WeightInit(conv_init, pytorch_default, False, True),
}


def conv(features,
         kernel_size,
         stride=1,
         padding=0,
         groups=1,
         bias=False,
         name=None,
         dtype=jnp.float32,
         kernel_init=conv_init,
         bias_init=nn.initializers.zeros):
  """``nn.Conv2d``-equivalent: explicit symmetric zero padding, no bias by default
  (``groups`` > 1: :class:`~smoothing_jax.layers.grouped_conv.GroupedConv`, the same parameters)."""
  if groups > 1:
    return GroupedConv(features, kernel_size, stride, padding, groups, bias, kernel_init,
                       bias_init, dtype, name=name)
  return nn.Conv(features, (kernel_size, kernel_size), strides=(stride, stride),
                 padding=((padding, padding), (padding, padding)), feature_group_count=groups,
                 use_bias=bias, kernel_init=kernel_init, bias_init=bias_init, dtype=dtype,
                 name=name)


def staged_units(depths) -> list:
  """``[(name, kind)]`` of the pre-norm transformer units of a staged model (Swin, PiT):
  ``stage{s}_block{j}_{msa|mlp}``, s from 1, ``depths[s-1]`` blocks of an MSA and an MLP unit."""
  return [(f"stage{s}_block{j}_{kind}", kind) for s, depth in enumerate(depths, start=1)
          for j in range(depth) for kind in ("msa", "mlp")]


def staged_taps(depths, transition: str) -> list:
  """``[(name, kind)]`` feature taps of a staged model (Swin, PiT) in order: the sown
  ``patch_embedding`` (depth 0), then each stage's units, stages after the first starting with
  their down-sampling submodule ``stage{s}_{transition}`` (kind ``transition``)."""
  units = staged_units(depths)
  taps = [("patch_embedding", "embedding")]
  for s in range(1, len(depths) + 1):
    if s > 1:
      taps.append((f"stage{s}_{transition}", transition))
    taps += [(name, kind) for name, kind in units if name.startswith(f"stage{s}_")]
  return taps


def drop_path(branch, rate: float, train: bool, keep=None):
  """A residual branch under stochastic depth and lesioning: call inside a compact module.

  Training drops the whole branch per example with probability ``rate`` and scales
  survivors by 1/(1 − rate) (DropPath; ``"dropout"`` RNG); ``keep`` (a scalar, None = 1)
  multiplies the branch at any time, so ``keep = 0`` removes the unit (lesion study).
  """
  if rate > 0:
    branch = nn.Dropout(rate, broadcast_dims=tuple(range(1, branch.ndim)),
                        deterministic=not train)(branch)
  return branch if keep is None else branch * jnp.asarray(keep, branch.dtype)


def max_pool(x, kernel_size, stride, padding=0):
  """``nn.MaxPool2d`` (floor mode; padding counts as -inf)."""
  return nn.max_pool(x, (kernel_size, kernel_size), (stride, stride),
                     padding=((padding, padding), (padding, padding)))


def adaptive_avg_pool(x, output_size: int):
  """``nn.AdaptiveAvgPool2d(output_size)`` on NHWC maps.

  Bin ``i`` of an ``n``-pixel axis averages pixels ``floor(i·n/o) … ceil((i+1)·n/o) - 1``
  (so a 1×1 map is replicated to o×o, as in the reference VGG on CIFAR).
  """
  def averaging_matrix(n):
    m = np.zeros((output_size, n), np.float32)
    for i in range(output_size):
      start, end = (i * n) // output_size, -(-((i + 1) * n) // output_size)
      m[i, start:end] = 1.0 / (end - start)
    return jnp.asarray(m, x.dtype)

  return jnp.einsum("ih,jw,bhwc->bijc", averaging_matrix(x.shape[1]), averaging_matrix(x.shape[2]),
                    x)


def check_images(x, channels: int = 3):
  """Raise a clear error unless ``x`` is a float NHWC batch with ``channels`` channels."""
  if not hasattr(x, "ndim") or x.ndim != 4:
    raise ValueError(f"Expected images of shape [batch, height, width, {channels}] (NHWC), "
                     f"got shape {getattr(x, 'shape', type(x))}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"Expected floating-point images (normalised float32), got dtype {x.dtype}; "
                    "convert uint8 images with the input pipeline's normalisation first.")
  if x.shape[-1] != channels:
    raise ValueError(f"Expected {channels} channels in the last axis (NHWC), got shape {x.shape}; "
                     "NCHW inputs must be transposed to NHWC.")


class GAPHead(nn.Module):
  """Global average pooling + dense (reference ``GAPBlock``; ``bn=True`` is ``BNGAPBlock``)."""
  num_classes: int
  bn: bool = False
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool):
    if self.bn:
      x = nn.relu(batch_norm(use_running_average=not train, dtype=self.dtype, name="bn")(x))
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes, dtype=self.dtype, name="dense")(x)


class MLPHead(nn.Module):
  """Flatten + 4096-4096-C MLP with train-only dropout 0.5 (reference ``MLPBlock``).

  Flattens in channel-major (PyTorch NCHW) order so converted weights apply directly.
  """
  num_classes: int
  hidden: int = 4096
  dropout_rate: float = 0.5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x, train: bool):
    x = jnp.transpose(x, (0, 3, 1, 2)).reshape(x.shape[0], -1)
    for i in (1, 2):
      x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, name=f"dense{i}")(x))
      x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    return nn.Dense(self.num_classes, dtype=self.dtype, name="dense3")(x)


class MultiHead(nn.Module):
  """MIMO's M heads: one dense layer of M·C outputs on ``[B, D]``, reshaped to ``[B, M, C]``
  (head m's logits at ``[:, m]``; edward2's ``DenseMultihead``)."""
  members: int
  num_classes: int
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(self.members * self.num_classes, kernel_init=self.kernel_init,
                 bias_init=self.bias_init, dtype=self.dtype, name="dense")(x)
    return y.reshape(x.shape[0], self.members, self.num_classes)


class CNN(nn.Module):
  """Options every CNN family shares (dataclass fields of each model).

  Attributes:
    num_classes: output logits.
    dropout_rate: MC dropout rate at the reference positions; 0 gives the
      deterministic (``dnn``) network.
    smoothing: insert ``Smooth`` at the end of each stage (``_smoothing`` models).
    prob, temperature, blur_size, blur_same, pad_mode: ``Smooth`` options.
    stem: ``"cifar"`` (32×32 inputs) or ``"imagenet"`` (224×224 inputs).
    classifier: ``"gap"``, ``"mlp"`` or ``"mlp512"`` (None: the family's reference default).
    dtype: computation dtype (parameters stay float32).
    num_components: iBNN (VGG, WRN-28-10): K > 0 puts K-component multiplicative node noise on
      the input of every conv and dense layer (``smoothing_jax.layers.node_noise``); the models
      then take ``components`` [B] (default: row r uses component r mod K) and a ``"noise"`` key.
    noise_init_std: σ₀ of the iBNN mean initialisation μ ~ N(1, σ₀²).
    bias_noise: iBNN scalar noise on each layer's bias (the reference's default).
    mean_field: BNN-VI (VGG, WRN-28-10): every conv and dense kernel a mean-field Gaussian
      (``smoothing_jax.layers.mean_field``; a ``"noise"`` key per pass, BatchNorm
      deterministic), sampled as ``bnn_reference`` says.
    posterior_std_init: σ₀ of the BNN-VI initialisation: ρ ~ N(softplus⁻¹(σ₀), 0.1²) for
      ``bnn_reference="ub"``, ρ = softplus⁻¹|N(σ₀, 0.001²)| for ``"ibnn"``.
    bnn_reference: whose BNN-VI layers ``mean_field`` builds: ``"ub"`` (uncertainty-baselines:
      Flipout, deterministic biases) or ``"ibnn"`` (the iBNN repository's ``BayesianConv2d`` /
      ``BayesianLinear``: one sample of the kernels and biases per pass, variational biases).
    ensemble_size: BatchEnsemble (ResNet, VGG, WRN-28-10): M > 0 members with rank-1 fast weights
      on every conv and dense layer (``smoothing_jax.layers.batch_ensemble``); ``components`` [B]
      then names each row's member (default: row r uses member r mod M).
    random_sign_init: the fast weights' initialisation (uncertainty-baselines): p > 0 random
      signs, +1 with probability p; p < 0 N(1, p²).
    kernel_init: the conv and dense kernels' (BNN-VI: their means') initialisation, a key of
      ``KERNEL_INITS`` (the conv and dense layers built through ``conv`` / ``dense``).
    mimo_members: MIMO (ResNet, WRN-28-10): M > 0 inputs concatenated on channels and M heads
      (``mimo_inputs``, ``MultiHead``): the model takes ``[B, M, H, W, 3]`` (member m's input at
      ``[:, m]``) or ``[B, H, W, 3]`` (the same image to every input) and gives ``[B, M, C]``.
    spectral_norm: SNGP (ResNet, WRN-28-10): c > 0 spectrally normalises every conv and dense
      layer to norm ≤ c (``smoothing_jax.layers.sngp``), by ``spectral_norm_iterations`` steps of
      power iteration per training step.
    gp_features: SNGP: D > 0 makes the classifier the random-feature GP layer of D features
      (``layers.sngp.RandomFeatureGP``, ridge penalty ``gp_ridge``).
    filter_dropout_rate: training-only filter-wise dropout where a family places it (WRN:
      uncertainty-baselines' SNGP, after the stem and every BatchNorm-ReLU); 0: none.
  """
  num_classes: int = 10
  dropout_rate: float = 0.0
  smoothing: bool = False
  prob: str | None = "tanh"
  # None: 10 for "tanh", 5 for "scale" (layers.DEFAULT_TEMPERATURE)
  temperature: float | None = None
  blur_size: int = 2
  blur_same: bool = False
  pad_mode: str = "constant"
  stem: str = "cifar"
  classifier: str | None = None
  dtype: Any = jnp.float32
  num_components: int = 0
  noise_init_std: float = 0.5
  bias_noise: bool = True
  mean_field: bool = False
  posterior_std_init: float = POSTERIOR_STD_INIT
  bnn_reference: str = "ub"
  ensemble_size: int = 0
  random_sign_init: float = RANDOM_SIGN_INIT
  kernel_init: str = "reference"
  mimo_members: int = 0
  spectral_norm: float = 0.0
  spectral_norm_iterations: int = 1
  gp_features: int = 0
  gp_ridge: float = 1.0
  filter_dropout_rate: float = 0.0

  @property
  def weights(self) -> str:
    """What the conv and dense weights are: one of ``WEIGHTS``."""
    if self.spectral_norm:
      return "spectral_norm"
    if self.num_components:
      return "ibnn"
    if self.mean_field:
      return "mean_field"
    return "batch_ensemble" if self.ensemble_size else "point"

  def check_options(self,
                    default_classifier: str,
                    classifiers=("gap", "mlp"),
                    weights: tuple = ("point",),
                    mimo: bool = False) -> str:
    """Validate the shared options against what the family supports (``weights``: the kinds of
    ``WEIGHTS`` it builds; ``mimo``: whether it builds MIMO's inputs and heads); return the
    classifier to build."""
    if self.stem not in STEMS:
      raise ValueError(f"Unknown stem {self.stem!r}; choose one of {STEMS}.")
    classifier = self.classifier or default_classifier
    if classifier not in classifiers:
      raise ValueError(
          f"Unknown classifier {classifier!r} for {type(self).__name__}; choose one of "
          f"{classifiers}."
      )
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate!r}.")
    if self.num_components < 0:
      raise ValueError(
          "num_components (iBNN K) must be >= 1, or 0 for no node noise; got "
          f"{self.num_components}."
      )
    if self.kernel_init not in KERNEL_INITS:
      raise ValueError(f"Unknown kernel_init {self.kernel_init!r}; choose one of "
                       f"{sorted(KERNEL_INITS)}.")
    if self.ensemble_size < 0:
      raise ValueError("ensemble_size (BatchEnsemble M) must be >= 1, or 0 for no fast weights; "
                       f"got {self.ensemble_size}.")
    chosen = [name for name, on in (("num_components", self.num_components),
                                    ("mean_field", self.mean_field),
                                    ("ensemble_size", self.ensemble_size)) if on]
    if len(chosen) > 1:
      raise ValueError(f"{type(self).__name__}: choose one of num_components (iBNN), mean_field "
                       f"(BNN-VI) and ensemble_size (BatchEnsemble); got {' and '.join(chosen)}.")
    if self.bnn_reference not in MEAN_FIELD_LAYERS:
      raise ValueError(f"Unknown bnn_reference {self.bnn_reference!r}; choose one of "
                       f"{sorted(MEAN_FIELD_LAYERS)}.")
    if self.bnn_reference != "ub" and not self.mean_field:
      raise ValueError(f"bnn_reference={self.bnn_reference!r} chooses BNN-VI's layers; it needs "
                       "mean_field=True.")
    if self.weights not in weights:
      raise ValueError(f"{type(self).__name__} has no {WEIGHT_NAMES[self.weights]} variant; it "
                       f"builds {', '.join(WEIGHT_NAMES[w] for w in weights)} weights.")
    if self.mimo_members < 0:
      raise ValueError(f"mimo_members (MIMO M) must be >= 1, or 0 for one input and head; got "
                       f"{self.mimo_members}.")
    if self.mimo_members and not mimo:
      raise ValueError(f"{type(self).__name__} has no MIMO variant (mimo_members).")
    if self.mimo_members and self.weights != "point":
      raise ValueError(f"{type(self).__name__}: MIMO (mimo_members) takes point-estimate weights, "
                       f"not {WEIGHT_NAMES[self.weights]}.")
    if self.mimo_members and classifier != "gap":
      raise ValueError(f"{type(self).__name__}: MIMO (mimo_members) has the GAP classifier only.")
    if self.spectral_norm < 0 or self.gp_features < 0:
      raise ValueError(f"spectral_norm (the norm bound) and gp_features (random features) must be "
                       f"> 0, or 0 for none; got {self.spectral_norm} and {self.gp_features}.")
    if self.gp_features and (self.mimo_members or classifier != "gap"):
      raise ValueError(f"{type(self).__name__}: the GP output layer (gp_features) replaces the GAP "
                       "classifier's dense layer of one network.")
    return classifier

  def mimo_inputs(self, x):
    """The network's input: ``x`` checked (NHWC, 3 channels); with ``mimo_members`` M the M
    inputs ``[B, M, H, W, 3]`` (``[B, H, W, 3]``: the same image to each) concatenated on
    channels as uncertainty-baselines' ``wide_resnet_mimo`` does (``Permute([2, 3, 4, 1])`` then
    ``Reshape``): channel c·M + m is channel c of input m."""
    m = self.mimo_members
    if not m or getattr(x, "ndim", 0) != 5:
      check_images(x)
      if not m:
        return x
      x = jnp.broadcast_to(x[:, None], (x.shape[0], m) + x.shape[1:])
    if x.shape[1] != m:
      raise ValueError(f"Expected MIMO inputs of shape [batch, {m}, height, width, 3], got "
                       f"shape {x.shape}.")
    check_images(x[:, 0])
    return jnp.transpose(x, (0, 2, 3, 4, 1)).reshape(x.shape[:1] + x.shape[2:4] + (-1,))

  def classifier_dense(self, x, components, name=None):
    """The classifier on the pooled features ``x [B, D]``: :meth:`dense` to ``num_classes``, or
    with ``mimo_members`` M the M heads (:class:`MultiHead`, ``[B, M, C]``)."""
    if self.gp_features:
      return RandomFeatureGP(self.num_classes, self.gp_features, self.gp_ridge, dtype=self.dtype,
                             name=name)(x)
    if not self.mimo_members:
      return self.dense(x, components, self.num_classes, name=name)
    scheme = KERNEL_INITS[self.kernel_init]
    bias_init = (pytorch_default_bias(x.shape[-1]) if scheme.dense_bias_uniform
                 else nn.initializers.zeros)
    return MultiHead(self.mimo_members, self.num_classes, scheme.dense, bias_init,
                     dtype=self.dtype, name=name)(x)

  def weight_options(self) -> dict:
    """The fields that choose and initialise the weights, for passing on to blocks."""
    return dict(num_components=self.num_components,
                noise_init_std=self.noise_init_std,
                bias_noise=self.bias_noise,
                mean_field=self.mean_field,
                posterior_std_init=self.posterior_std_init,
                bnn_reference=self.bnn_reference,
                ensemble_size=self.ensemble_size,
                random_sign_init=self.random_sign_init,
                kernel_init=self.kernel_init,
                spectral_norm=self.spectral_norm,
                spectral_norm_iterations=self.spectral_norm_iterations)

  def conv(self, x, components, features, kernel_size, stride=1, padding=0, bias=False, name=None,
           groups=1, point=False):
    """A ``conv`` layer applied to ``x``, its weights as ``weights`` says (``point``: point
    estimates whatever it says; ``components``: each row's iBNN component or BatchEnsemble
    member)."""
    weights = "point" if point else self.weights
    if groups != 1 and weights in ("ibnn", "mean_field", "spectral_norm"):
      raise ValueError(f"Grouped convolutions have no {weights} variant.")
    scheme = KERNEL_INITS[self.kernel_init]
    init = scheme.conv
    bias_init = (pytorch_default_bias(kernel_size**2 * x.shape[-1] // groups)
                 if scheme.conv_bias_uniform else nn.initializers.zeros)
    if weights == "ibnn":
      return NodeNoiseConv(self.num_components,
                           self.bias_noise,
                           self.noise_init_std,
                           features=features,
                           kernel_size=kernel_size,
                           stride=stride,
                           padding=padding,
                           use_bias=bias,
                           kernel_init=init,
                           bias_init=bias_init,
                           dtype=self.dtype,
                           name=name)(x, components)
    if weights == "mean_field":
      layer = MEAN_FIELD_LAYERS[self.bnn_reference][0]
      return layer(self.posterior_std_init, features=features, kernel_size=kernel_size,
                   stride=stride, padding=padding, use_bias=bias, kernel_init=init,
                   bias_init=bias_init, dtype=self.dtype, name=name)(x)
    if weights == "spectral_norm":
      return SpectralNormConv(features, kernel_size, stride, padding, self.spectral_norm,
                              self.spectral_norm_iterations, use_bias=bias, kernel_init=init,
                              bias_init=bias_init, dtype=self.dtype, name=name)(x)
    if weights == "batch_ensemble":
      return BatchEnsembleConv(self.ensemble_size, self.random_sign_init, features=features,
                               kernel_size=kernel_size, stride=stride, padding=padding,
                               groups=groups, use_bias=bias, kernel_init=init,
                               bias_init=bias_init, dtype=self.dtype, name=name)(x, components)
    return conv(features, kernel_size, stride, padding, groups, bias=bias, dtype=self.dtype,
                name=name, kernel_init=init, bias_init=bias_init)(x)

  def dense(self, x, components, features, name=None):
    """``nn.Dense`` applied to ``x``, its weights as ``weights`` says."""
    scheme = KERNEL_INITS[self.kernel_init]
    init = scheme.dense
    bias_init = (pytorch_default_bias(x.shape[-1]) if scheme.dense_bias_uniform
                 else nn.initializers.zeros)
    if self.weights == "ibnn":
      return NodeNoiseDense(self.num_components,
                            self.bias_noise,
                            self.noise_init_std,
                            features=features,
                            kernel_init=init,
                            bias_init=bias_init,
                            dtype=self.dtype,
                            name=name)(x, components)
    if self.weights == "mean_field":
      layer = MEAN_FIELD_LAYERS[self.bnn_reference][1]
      return layer(self.posterior_std_init, features=features, kernel_init=init,
                   bias_init=bias_init, dtype=self.dtype, name=name)(x)
    if self.weights == "spectral_norm":
      return SpectralNormDense(features, self.spectral_norm, self.spectral_norm_iterations,
                               kernel_init=init, bias_init=bias_init, dtype=self.dtype,
                               name=name)(x)
    if self.weights == "batch_ensemble":
      return BatchEnsembleDense(self.ensemble_size, self.random_sign_init, features=features,
                                kernel_init=init, bias_init=bias_init, dtype=self.dtype,
                                name=name)(x, components)
    return nn.Dense(features, kernel_init=init, bias_init=bias_init, dtype=self.dtype,
                    name=name)(x)

  def smooth(self, x, name: str):
    """The stage-end smoothing block (identity unless ``smoothing``)."""
    if not self.smoothing:
      return x
    return Smooth(self.prob,
                  self.temperature,
                  self.blur_size,
                  self.blur_same,
                  self.pad_mode,
                  name=name)(x)

  def dropout(self, x):
    """MC dropout at a reference position (identity for ``dnn`` models)."""
    return MCDropout(self.dropout_rate)(x) if self.dropout_rate > 0 else x

  def filter_dropout(self, x, train: bool):
    """Training-only filter-wise dropout (``filter_dropout_rate``: whole channels of each example
    dropped, Keras's ``Dropout`` with ``noise_shape [B, 1, 1, C]``); identity at evaluation."""
    if not self.filter_dropout_rate:
      return x
    return nn.Dropout(self.filter_dropout_rate, broadcast_dims=(1, 2), deterministic=not train)(x)

  def bn(self, train: bool, name: str, **kwargs):
    return batch_norm(use_running_average=not train, dtype=self.dtype, name=name, **kwargs)
