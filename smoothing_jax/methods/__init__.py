"""The uncertainty methods, one :class:`~smoothing_jax.methods.base.Method` each, and the one
place that decides which a run uses (:func:`resolve`).

======================  ===============================================================
``deterministic``       one pass (:mod:`~smoothing_jax.methods.deterministic`)
``mc_dropout``          N dropout passes (:mod:`~smoothing_jax.methods.mc_dropout`)
``deep_ensemble``       M stacked members of a base method, one job
                        (:mod:`~smoothing_jax.methods.deep_ensemble`)
``batch_ensemble``      M rank-1 members in one pass (:mod:`~smoothing_jax.methods.batch_ensemble`)
``mimo``                M inputs and heads, one pass (:mod:`~smoothing_jax.methods.mimo`)
``packed_ensemble``     M grouped-conv members in one pass (:mod:`~smoothing_jax.methods.packed`)
``bnnvi``               N mean-field weight samples, the ELBO (:mod:`~smoothing_jax.methods.bnnvi`)
``ibnn``                S draws of K node-noise components, the ELBO
                        (:mod:`~smoothing_jax.methods.ibnn`)
======================  ===============================================================

A new method is one file here and one line in :data:`REGISTRY`.
"""
from __future__ import annotations

from smoothing_jax.methods.base import Method
from smoothing_jax.methods.batch_ensemble import BatchEnsemble
from smoothing_jax.methods.bnnvi import BNNVI
from smoothing_jax.methods.deep_ensemble import DeepEnsemble
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.methods.ibnn import IBNN
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.methods.mimo import MIMO
from smoothing_jax.methods.packed import PackedEnsemble

__all__ = ["REGISTRY", "Method", "as_method", "resolve"]

# name → method, asked in this order: the first whose ``matches`` holds is the model's method
# (``deterministic`` claims any model); then each matching method with ``wraps`` wraps it.
REGISTRY: dict[str, type[Method]] = {
    "ibnn": IBNN,
    "bnnvi": BNNVI,
    "batch_ensemble": BatchEnsemble,
    "mimo": MIMO,
    "packed_ensemble": PackedEnsemble,
    "mc_dropout": MCDropout,
    "deterministic": Deterministic,
    "deep_ensemble": DeepEnsemble,
}


def resolve(config, model) -> Method:
  """The method that trains and evaluates ``model`` under ``config`` (None: every setting at its
  default), its configuration checked (one-line ValueError for what it cannot do).

  The one place that reads what decides it: the model's node noise (``num_components``),
  mean-field weights, ``ensemble_size`` and dropout (through each method's ``matches``), and
  ``config.deep_ensemble.members``."""
  bases = [cls for cls in REGISTRY.values() if not cls.wraps]
  method = next(cls for cls in bases if cls.matches(config, model)).from_config(config, model)
  for cls in REGISTRY.values():
    if cls.wraps and cls.matches(config, model):
      method = cls.wrap(method, config)
  return method.check(config) if config is not None else method


def as_method(model_or_method, config=None) -> Method:
  """``model_or_method`` if it is a :class:`Method`, else the method of that Flax module
  (:func:`resolve`): what the functions that take a model (VQ-BNN, the analyses) predict with."""
  if isinstance(model_or_method, Method):
    return model_or_method
  return resolve(config, model_or_method)
