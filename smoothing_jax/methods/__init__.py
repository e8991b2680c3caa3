"""The uncertainty methods, one :class:`~smoothing_jax.methods.base.Method` each, and the one
place that decides which a run uses (:func:`resolve`).

=========================  ============================================================
``deterministic``          one pass (:mod:`~smoothing_jax.methods.deterministic`)
``mc_dropout``             N dropout passes (:mod:`~smoothing_jax.methods.mc_dropout`)
``deep_ensemble``          M stacked members of any method below, one job
                           (:mod:`~smoothing_jax.methods.deep_ensemble`)
``batch_ensemble``         M rank-1 members in one pass
                           (:mod:`~smoothing_jax.methods.batch_ensemble`)
``mimo``                   M inputs and heads, one pass (:mod:`~smoothing_jax.methods.mimo`)
``packed_ensemble``        M grouped-conv members in one pass
                           (:mod:`~smoothing_jax.methods.packed`)
``bnnvi``                  N mean-field weight samples, the ELBO
                           (:mod:`~smoothing_jax.methods.bnnvi`)
``ibnn``                   S draws of K node-noise components, the ELBO
                           (:mod:`~smoothing_jax.methods.ibnn`)
``swa``, ``swag``          the mean of the weights collected in training; N samples of their
                           Gaussian (:mod:`~smoothing_jax.methods.swag`)
``laplace``                a Gaussian posterior of the last layer fitted after training,
                           probit or N samples (:mod:`~smoothing_jax.methods.laplace`)
``checkpoint_ensemble``,   the network at the last M epoch ends; at the ends of M cosine
``snapshot_ensemble``      cycles (:mod:`~smoothing_jax.methods.snapshot`)
``sngp``                   spectral normalisation and a random-feature GP output layer
                           (:mod:`~smoothing_jax.methods.sngp`)
``tta``                    any method above on A augmented views of each image
                           (:mod:`~smoothing_jax.methods.tta`)
=========================  ============================================================

A run's method is the one ``config.method`` names (default: the one its model is built for), with
test-time augmentation where ``config.tta.augmentations`` lists views, and a deep ensemble of
that where ``config.deep_ensemble.members`` > 1 (:func:`resolve`).  A new method is
one file here and one line in :data:`REGISTRY`.
"""
from __future__ import annotations

import difflib

from smoothing_jax.methods.base import Method, setting
from smoothing_jax.methods.batch_ensemble import BatchEnsemble
from smoothing_jax.methods.bnnvi import BNNVI
from smoothing_jax.methods.deep_ensemble import DeepEnsemble
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.methods.ibnn import IBNN
from smoothing_jax.methods.laplace import LastLayerLaplace
from smoothing_jax.methods.mc_dropout import MCDropout
from smoothing_jax.methods.mimo import MIMO
from smoothing_jax.methods.packed import PackedEnsemble
from smoothing_jax.methods.snapshot import CheckpointEnsemble, SnapshotEnsemble
from smoothing_jax.methods.sngp import SNGP
from smoothing_jax.methods.swag import SWA, SWAG
from smoothing_jax.methods.tta import TestTimeAugmentation
from smoothing_jax.models import implied_method

__all__ = ["COMPOSED", "REGISTRY", "DeepEnsemble", "Method", "TestTimeAugmentation", "as_method",
           "method_name", "resolve"]

# name → method: ``config.method`` names one (default: the one the model is built for,
# ``models.implied_method``).  A deep ensemble is not in it: it composes with any of them
# (``config.deep_ensemble.members`` > 1), and its settings block is in every config.
REGISTRY: dict[str, type[Method]] = {
    "deterministic": Deterministic,
    "mc_dropout": MCDropout,
    "batch_ensemble": BatchEnsemble,
    "mimo": MIMO,
    "packed_ensemble": PackedEnsemble,
    "bnnvi": BNNVI,
    "ibnn": IBNN,
    "swa": SWA,
    "swag": SWAG,
    "laplace": LastLayerLaplace,
    "checkpoint_ensemble": CheckpointEnsemble,
    "snapshot_ensemble": SnapshotEnsemble,
    "sngp": SNGP,
}
# The methods that wrap any of those (not chosen by ``config.method``): ``wrap(method, config)``
# wraps where their settings turn them on, in this order (``resolve``); their settings blocks are
# in every config.
COMPOSED: dict[str, type[Method]] = {"tta": TestTimeAugmentation, "deep_ensemble": DeepEnsemble}


def method_name(config, model) -> str:
  """The name of the method ``config`` trains and evaluates ``model`` with: ``config.method``,
  or where unset the one the model is built for; ValueError (one line) for a name not in
  :data:`REGISTRY`, with the closest and every name."""
  name = setting(config, "method") or implied_method(model)
  if name not in REGISTRY:
    close = difflib.get_close_matches(name, REGISTRY, n=1)
    hint = f"Did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"Unknown method {name!r}. {hint}Methods: {', '.join(REGISTRY)}.")
  return name


def resolve(config, model) -> Method:
  """The method that trains and evaluates ``model`` under ``config`` (None: every setting at its
  default), its configuration checked (one-line ValueError for what it cannot do): the one
  ``config.method`` names (:func:`method_name`), refused in one line where it does not take the
  model, on the views of ``config.tta.augmentations`` where it lists any, and a deep ensemble of
  that where ``config.deep_ensemble.members`` > 1."""
  name = method_name(config, model)
  cls = REGISTRY[name]
  reason = cls.refuses(model)
  if reason:
    what = setting(config, "model") or f"this {type(model).__name__}"
    raise ValueError(f"Method {name} cannot train or evaluate {what}: {reason}.")
  method = cls.from_config(config, model)
  for composed in COMPOSED.values():  # each wraps what its settings turn on, in this order
    method = composed.wrap(method, config)
  return method.check(config) if config is not None else method


def as_method(model_or_method, config=None) -> Method:
  """``model_or_method`` if it is a :class:`Method`, else the method of that Flax module
  (:func:`resolve`): what the functions that take a model (VQ-BNN, the analyses) predict with."""
  if isinstance(model_or_method, Method):
    return model_or_method
  return resolve(config, model_or_method)
