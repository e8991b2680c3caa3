"""The analyses of the papers' figures, run on a trained workdir.

``load_trained(workdir)`` restores a checkpoint with its config (``load_or_train(workdir,
config)`` trains the config into an empty workdir first); each ``*_study``
function computes the data of one figure and returns plain arrays/dicts that the
matching ``smoothing_jax.plots`` function (or a notebook) draws:

* ``hessian_spectrum_study``   Hessian max-eigenvalue spectrum (SS Fig. 8, App. A.3)
* ``fourier_study``            Δlog-amplitude of feature maps by depth (SS Fig. 6b)
* ``variance_study``           feature-map variance by depth (SS Fig. 5)
* ``similarity_study``         mini-batch CKA between every pair of blocks, or of two models
                               (HV Sec. 4.1)
* ``landscape_study``          2-D loss landscape (SS Fig. 7)
* ``frequency_noise_study``    accuracy under band-limited noise (SS Fig. 6c)
* ``consistency_study``        consistency / CEC / relative confidence (SS Table E.3)
* ``temporal_smoothing_study`` one pass vs MC dropout vs VQ-BNN on shift-translated streams
                               (SS Table E.4 layout)
* ``adversarial_study``        FGSM / PGD accuracy against the MC prediction
* ``lesion_study``             accuracy drop when one unit is removed (HV Sec. 4.1; ViT, AlterNet)
* ``trajectory_study``         learning trajectory in polar coordinates (HV Fig. 1b; recorded in
                               training with ``config.trajectory_every_steps``)
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import itertools
import os
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.tree_util import Partial

from smoothing_jax.analysis.features import feature_variance, fourier_by_depth
from smoothing_jax.analysis.frequency_noise import accuracy_vs_frequency
from smoothing_jax.analysis.landscape import loss_surface, random_direction
from smoothing_jax.analysis.lesion import lesion_accuracy_drops
from smoothing_jax.analysis.perturbation import (perturbation_metrics, sequence_predictions,
                                                 translate_sequences)
from smoothing_jax.analysis.robustness import ensemble_nll, fgsm, pgd
from smoothing_jax.analysis.similarity import cross_model_similarity, feature_similarity
from smoothing_jax.analysis.spectrum import max_eigenvalue_spectrum, training_loss
from smoothing_jax.analysis.trajectory import load_trajectory, polar_trajectory
from smoothing_jax.data import create_pipeline
from smoothing_jax.data.pipeline import Pipeline
from smoothing_jax import evaluate, temporal, train
from smoothing_jax.inference import mc_predict
from smoothing_jax import workdir as workdir_lib
from smoothing_jax.parallel import evaluate_batches


@dataclasses.dataclass
class TrainedModel:
  """A restored checkpoint: its config, model, variables and input pipeline."""
  workdir: str
  config: ml_collections.ConfigDict
  step: int
  model: object
  variables: dict
  pipeline: Pipeline

  @property
  def stochastic(self) -> bool:
    return getattr(self.model, "dropout_rate", 0.0) > 0

  def normalize(self, pixels):
    """Pixels in [0, 1], NHWC → the model's normalised input."""
    return (pixels - jnp.asarray(self.pipeline.mean)) / jnp.asarray(self.pipeline.std)

  def predict(self,
              images,
              num_samples: int = 1,
              rng: Optional[jax.Array] = None,
              batch_size: int = 500):
    """Mean predictive ``[B, C]`` (numpy) of normalised ``images`` over ``num_samples`` MC
    samples."""
    rng = jax.random.key(0) if rng is None else rng
    num_samples = num_samples if self.stochastic else 1
    out = [
        np.asarray(
            _predictive(self.model, self.variables, jnp.asarray(images[i:i + batch_size]), rng,
                        num_samples)) for i in range(0, len(images), batch_size)
    ]
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _predictive(model, variables, images, rng, num_samples):
  return mc_predict(model, variables, images, num_samples=num_samples, rng=rng).mean_probs


def load_trained(workdir: str) -> TrainedModel:
  """Restore the latest checkpoint of ``workdir`` (its ``config.json`` picks model and data;
  training batches come from the ``train_fraction`` subset it trained on); a workdir without
  checkpoints that records ``init_from`` (e.g. ``--mode=evaluate`` of a torch checkpoint) gives
  those variables, at step 0."""
  config, spec = workdir_lib.read_config(workdir)
  _, step, variables = workdir_lib.load_checkpoint(workdir, config)
  rand = config.get("randaugment")  # training batches augmented as in training (Mixup/CutMix aside)
  pipeline = create_pipeline(config.dataset, config.batch_size, config.seed, config.data_dir, False,
                             (rand.num_layers, rand.magnitude,
                              rand.magnitude_std) if rand else None,
                             train_fraction=config.get("train_fraction", 1.0),
                             data_pipeline=config.get("data_pipeline", "auto"))
  return TrainedModel(workdir, config, step, workdir_lib.build_model(config, spec), variables,
                      pipeline)


def config_from_file(spec: str) -> ml_collections.ConfigDict:
  """``"<file>.py[:<args>]"`` (as ``--config=`` of ``smoothing_jax.main``; the path relative to
  the current directory, e.g. ``"configs/cifar_resnet.py:resnet_mcdo_18,cifar10"``) → that
  file's ``get_config(<args>)``."""
  path, _, arg = spec.partition(":")
  if not path.endswith(".py") or not os.path.isfile(path):
    raise ValueError(f"Config {spec!r}: {path!r} is not a config file (a .py path relative to "
                     f"{os.getcwd()}, e.g. 'configs/quickstart.py').")
  module_spec = importlib.util.spec_from_file_location("_config_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg)


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """A copy of ``config`` with ``overrides`` set: dotted keys as ``--config.<key>=…`` (e.g.
  ``{"model_kwargs.width": 8}``); only keys the config has, with values of their type."""
  config = copy.deepcopy(config)
  for key, value in overrides.items():
    try:
      config.update_from_flattened_dict({key: value})
    except KeyError:
      *path, _ = key.split(".")
      node = functools.reduce(lambda c, k: c.get(k) if hasattr(c, "get") else None, path, config)
      known = ", ".join(sorted(node.keys())) if hasattr(node, "keys") else "(none)"
      raise ValueError(f"Override {key!r}: the config has no such key; keys there: "
                       f"{known}.") from None
    except TypeError as error:
      raise ValueError(f"Override {key}={value!r}: {error}") from None
  return config


def load_or_train(workdir: str,
                  config: Union[str, ml_collections.ConfigDict, None] = None,
                  *,
                  overrides: Optional[Mapping[str, Any]] = None) -> TrainedModel:
  """The trained model of ``workdir`` (:func:`load_trained`), trained first if it has no
  checkpoint.

  A workdir with a checkpoint (or recording an ``init_from``) is loaded as it is: its
  ``config.json`` rules, and ``config`` and ``overrides`` are not used (rerun the training
  command to resume an interrupted run).  Otherwise ``config`` — a ConfigDict or
  ``"<file>.py[:<args>]"`` (:func:`config_from_file`) — with ``overrides``
  (:func:`with_overrides`) is trained into ``workdir`` by
  :func:`smoothing_jax.train.train_and_evaluate`, then loaded; with ``init_from`` set (a
  workdir, an SS or HV torch checkpoint) and ``num_train_steps`` 0 nothing is trained: the
  workdir records the config and stands for the checkpoint's variables, as ``--mode=evaluate``.

  Raises:
    ValueError: ``workdir`` has no checkpoint and no ``config`` is given, or a bad config or
      override.
  """
  if not workdir_lib.has_checkpoint(workdir) and not workdir_lib.evaluates_init_from(workdir):
    if config is None:
      raise ValueError(f"{workdir} holds no checkpoint: give a config to train one into it.")
    if isinstance(config, str):
      config = config_from_file(config)
    config = with_overrides(config, overrides or {})
    if config.init_from and config.num_train_steps == 0:
      evaluate.record_init_from(workdir, config)
    else:
      train.train_and_evaluate(config, workdir)
  return load_trained(workdir)


def eval_pixels(trained: TrainedModel, num_images: int):
  """The first ``num_images`` evaluation images as pixels in [0, 1] float32, and their labels."""
  if trained.pipeline.eval_images is None:
    raise ValueError(
        "The analyses need an in-memory evaluation split (CIFAR, npz or digits datasets).")
  images = trained.pipeline.eval_images[:num_images]
  return images.astype(np.float32) / 255.0, trained.pipeline.eval_labels[:num_images].astype(
      np.int32)


def train_batches(trained: TrainedModel,
                  num_batches: int,
                  batch_size: Optional[int] = None) -> list:
  """``num_batches`` augmented training batches as in training (epoch 0 of the seeded pipeline)."""
  pipeline = trained.pipeline
  if batch_size is not None:
    pipeline = dataclasses.replace(pipeline, global_batch_size=batch_size)
  return list(itertools.islice(pipeline.train_iterator(), num_batches))


def hessian_spectrum_study(trained: TrainedModel,
                           *,
                           num_batches: int = 10,
                           batch_size: Optional[int] = None,
                           k: int = 1,
                           max_iters: int = 100,
                           tol: float = 1e-3,
                           seed: int = 0,
                           negative: bool = False,
                           method: str = "lanczos",
                           regularizer: str = "half_squared_l2") -> dict:
  """Top-``k`` Hessian eigenvalues of NLL + weight decay · R(θ) on each of ``num_batches``
  training batches (``negative``: also the most negative eigenvalue of each batch), with their
  residuals and the solver (``analysis.spectrum.max_eigenvalue_spectrum``); R is
  ``regularizer`` (``analysis.spectrum.regularization``: ½‖θ‖², or HV's Σᵢ‖θᵢ‖₂)."""
  return max_eigenvalue_spectrum(trained.model,
                                 trained.variables,
                                 train_batches(trained, num_batches, batch_size),
                                 k=k,
                                 weight_decay=trained.config.weight_decay,
                                 max_iters=max_iters,
                                 tol=tol,
                                 rng=jax.random.key(seed),
                                 negative=negative,
                                 method=method,
                                 regularizer=regularizer)


def fourier_study(trained: TrainedModel, *, num_images: int = 256, seed: int = 0) -> dict:
  """``{block: Δlog-amplitude curve from 0 to π}`` on test images; one stochastic pass."""
  pixels, _ = eval_pixels(trained, num_images)
  return fourier_by_depth(trained.model, trained.variables, trained.normalize(pixels),
                          jax.random.key(seed))


def variance_study(trained: TrainedModel,
                   *,
                   num_images: int = 128,
                   num_samples: int = 10,
                   seed: int = 0) -> dict:
  """``{block: {"data", "model"}}`` feature-map variances on test images."""
  pixels, _ = eval_pixels(trained, num_images)
  return feature_variance(trained.model,
                          trained.variables,
                          trained.normalize(pixels),
                          num_samples=num_samples,
                          rng=jax.random.key(seed))


def similarity_study(trained: TrainedModel,
                     *,
                     num_images: int = 1024,
                     batch_size: int = 256,
                     other: Optional[TrainedModel] = None,
                     seed: int = 0) -> dict:
  """Mini-batch linear CKA between every pair of blocks of ``trained``
  (:func:`smoothing_jax.analysis.similarity.feature_similarity`), or with ``other`` between
  every block of ``trained`` (rows) and of ``other`` (columns), each model fed the images
  normalised for it (``cross_model_similarity``).

  Test images in batches of ``batch_size`` (≥ 4; Nguyen et al. use 256); a last partial batch is
  left out. One stochastic pass per batch.
  """
  pixels, _ = eval_pixels(trained, num_images)
  if batch_size < 4 or len(pixels) < batch_size:
    raise ValueError(f"similarity_study: batch_size {batch_size} must be at least 4 and at most "
                     f"the {len(pixels)} test images used.")
  batches = [pixels[i:i + batch_size] for i in range(0, len(pixels) - batch_size + 1, batch_size)]
  rng = jax.random.key(seed)
  if other is None:
    return feature_similarity(trained.model, trained.variables,
                              (trained.normalize(x) for x in batches), rng)
  return cross_model_similarity(trained.model, trained.variables, other.model, other.variables,
                                ((trained.normalize(x), other.normalize(x)) for x in batches), rng)


def landscape_study(trained: TrainedModel, *, num_points: int = 21, scale: float = 1.0,
                    normalization: str = "filter", batch_size: int = 512, seed: int = 0,
                    regularizer: str = "half_squared_l2") -> dict:
  """Training loss (NLL, and NLL + weight decay · R(θ) with R the ``regularizer`` of
  ``analysis.spectrum.regularization``: ½‖θ‖², or HV's Σᵢ‖θᵢ‖₂) on a ``num_points²`` grid over
  [−scale, scale]² (one augmented batch, one fixed dropout key)."""
  batch = train_batches(trained, 1, batch_size)[0]
  key_d1, key_d2, dropout_key = jax.random.split(jax.random.key(seed), 3)
  params = trained.variables["params"]
  loss_fn = Partial(functools.partial(training_loss, trained.model, 0.0),
                    trained.variables.get("batch_stats", {}), dropout_key,
                    jnp.asarray(batch["image"]), jnp.asarray(batch["label"]))
  axis = np.linspace(-scale, scale, num_points)
  return loss_surface(loss_fn, params, random_direction(params, key_d1, normalization),
                      random_direction(params, key_d2, normalization), axis, axis,
                      weight_decay=trained.config.weight_decay, regularizer=regularizer)


def frequency_noise_study(trained: TrainedModel,
                          frequencies: Sequence[float] = tuple(np.arange(0, 1.01, 0.1)),
                          *,
                          std: float = 0.1,
                          num_images: int = 1000,
                          num_samples: int = 1,
                          seed: int = 0) -> dict:
  """Accuracy under Gaussian noise of pixel std ``std`` band-limited around each frequency
  (units of π)."""
  pixels, labels = eval_pixels(trained, num_images)
  predict = functools.partial(trained.predict,
                              num_samples=num_samples,
                              rng=jax.random.key(seed + 1))
  noisy = accuracy_vs_frequency(lambda x: predict(trained.normalize(jnp.clip(x, 0.0, 1.0))),
                                jnp.asarray(pixels),
                                labels,
                                frequencies,
                                std=std,
                                rng=jax.random.key(seed))
  clean = float(np.mean(predict(trained.normalize(pixels)).argmax(-1) == labels))
  return {"frequencies": np.asarray(frequencies), "accuracy": noisy, "clean_accuracy": clean}


def consistency_study(trained: TrainedModel,
                      *,
                      num_images: int = 500,
                      length: int = 31,
                      max_shift: int = 3,
                      num_samples: int = 1,
                      seed: int = 0) -> dict:
  """Consistency, CEC and relative confidence on shift-translated sequences of test images.

  Also returns ``relative_confidence_curve`` of the first sequence (SS Fig. E.3).
  """
  pixels, labels = eval_pixels(trained, num_images)
  videos = translate_sequences(pixels, length, max_shift, seed)
  predict = functools.partial(trained.predict, num_samples=num_samples, rng=jax.random.key(seed))
  probs = sequence_predictions(lambda x: predict(trained.normalize(x)), videos)
  first = probs[0, :, labels[0]] / probs[0].max(-1)
  return {**perturbation_metrics(probs, labels), "relative_confidence_curve": first}


@functools.partial(jax.jit, static_argnames=("model", "num_samples", "num_frames"))
def _stream_statistics(model, variables, frames, labels, rng, num_samples, num_frames, decay_rate):
  predictions = temporal.stream_predictions(model,
                                            variables,
                                            frames,
                                            rng=rng,
                                            num_samples=num_samples,
                                            num_frames=num_frames,
                                            decay_rate=decay_rate)
  return temporal.stream_statistics(predictions, labels)


def temporal_smoothing_study(trained: TrainedModel,
                             *,
                             num_images: int = 1000,
                             length: int = 6,
                             max_shift: int = 3,
                             num_samples: int = 10,
                             num_frames: int = temporal.NUM_FRAMES,
                             decay_rate: float = temporal.DECAY_RATE,
                             batch_size: int = 250,
                             seed: int = 0) -> list:
  """Temporal smoothing on data streams made of test images: each image becomes a clip of
  ``length`` frames shifted by up to ``max_shift`` pixels (:func:`translate_sequences`).

  Rows (the paper's Table E.4 layout) for one pass per frame (``single``), MC dropout
  with ``num_samples`` passes (``mc``, dropout models) and VQ-BNN with one pass per
  frame (``temporal``): NLL, accuracy, ECE, … on the last frame and consistency
  between the last two frames.
  """
  pixels, labels = eval_pixels(trained, num_images)
  videos = translate_sequences(pixels, length, max_shift, seed)

  def step(variables, batch, key):
    frames = jnp.swapaxes(trained.normalize(jnp.asarray(batch["videos"])), 0, 1)
    return _stream_statistics(trained.model, variables, frames, jnp.asarray(batch["labels"]), key,
                              num_samples, num_frames, decay_rate)
  batches = ({"videos": videos[i:i + batch_size], "labels": labels[i:i + batch_size]}
             for i in range(0, len(videos), batch_size))
  totals = evaluate_batches(step, trained.variables, batches, None, jax.random.key(seed))
  return temporal.statistics_rows(totals, num_samples)


def _attack(trained: TrainedModel, kind: str, pgd_steps: int, seed: int):
  """Jitted ``(variables, keys, pixels, labels, eps) -> adversarial pixels`` (arrays as
  arguments, not constants, so XLA does not constant-fold the network)."""
  def run(variables, keys, x, y, eps):
    loss = functools.partial(ensemble_nll, trained.model, variables, keys, trained.normalize)
    if kind == "fgsm":
      return fgsm(loss, x, y, eps)
    return pgd(loss, x, y, eps, step_size=eps / 4, steps=pgd_steps, rng=jax.random.key(seed + 1))
  return jax.jit(run)


def adversarial_study(trained: TrainedModel,
                      epsilons: Sequence[float] = (1 / 255, 2 / 255, 4 / 255, 8 / 255),
                      *,
                      num_images: int = 256,
                      num_samples: int = 1,
                      pgd_steps: int = 10,
                      seed: int = 0) -> dict:
  """Accuracy and attack success rate of FGSM and PGD (random start) for each ε in pixel space."""
  pixels, labels = eval_pixels(trained, num_images)
  num_samples = num_samples if trained.stochastic else 1
  keys = jax.random.split(jax.random.key(seed), num_samples)
  predict = functools.partial(trained.predict, num_samples=num_samples, rng=jax.random.key(seed))
  clean_correct = predict(trained.normalize(pixels)).argmax(-1) == labels
  x, y = jnp.asarray(pixels), jnp.asarray(labels)
  attacks = {
      "fgsm": _attack(trained, "fgsm", pgd_steps, seed),
      "pgd": _attack(trained, "pgd", pgd_steps, seed)
  }
  rows = []
  for eps in epsilons:
    for name, attack in attacks.items():
      correct = predict(trained.normalize(attack(trained.variables, keys, x, y,
                                                 eps))).argmax(-1) == labels
      success = float(np.sum(clean_correct & ~correct) / max(np.sum(clean_correct), 1))
      rows.append({
          "attack": name,
          "eps": float(eps),
          "accuracy": float(correct.mean()),
          "success_rate": success
      })
  return {"clean_accuracy": float(clean_correct.mean()), "attacks": rows}


def lesion_study(trained: TrainedModel,
                 *,
                 num_images: int = 1000,
                 batch_size: int = 500,
                 seed: int = 0) -> dict:
  """Test accuracy with each residual unit removed
  (:func:`smoothing_jax.analysis.lesion.lesion_accuracy_drops`)."""
  pixels, labels = eval_pixels(trained, num_images)
  batches = [{
      "image": trained.normalize(pixels[i:i + batch_size]),
      "label": labels[i:i + batch_size]
  } for i in range(0, len(pixels), batch_size)]
  return lesion_accuracy_drops(trained.model, trained.variables, batches, jax.random.key(seed))


def trajectory_study(trained: TrainedModel) -> dict:
  """The learning trajectory recorded in ``trained.workdir`` in polar coordinates about the
  final parameters, with its path length over the straight distance (``path_ratio``) and the
  projection's error (:func:`smoothing_jax.analysis.trajectory.polar_trajectory`); draw it with
  ``plots.plot_trajectories``."""
  return polar_trajectory(load_trajectory(trained.workdir))
