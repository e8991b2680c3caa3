"""The analyses of the papers' figures, run on a trained workdir.

``load_trained(workdir)`` restores a checkpoint with its config as a ``Run``
(``load_or_train(workdir, config)`` trains the config into an empty workdir first); each
``*_study`` function takes that ``Run``, computes the data of one figure and returns plain
arrays/dicts that the matching ``smoothing_jax.plots`` function (or a notebook) draws:

* ``hessian_spectrum_study``   Hessian max-eigenvalue spectrum (SS Fig. 8, App. A.3)
* ``stage_hessian_study``      top Hessian eigenvalue restricted to each stage's parameters
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

import dataclasses
import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.tree_util import Partial

from smoothing_jax import temporal
from smoothing_jax.analysis.features import feature_variance, fourier_by_depth
from smoothing_jax.analysis.frequency_noise import accuracy_vs_frequency
from smoothing_jax.analysis.hessian import restricted_to, stages, top_eigenvalues
from smoothing_jax.analysis.landscape import loss_surface, random_direction
from smoothing_jax.analysis.lesion import lesion_accuracy_drops
from smoothing_jax.analysis.perturbation import perturbation_metrics, sequence_predictions
from smoothing_jax.analysis.robustness import ensemble_nll, fgsm, pgd
from smoothing_jax.analysis.similarity import cross_model_similarity, feature_similarity
from smoothing_jax.analysis.spectrum import max_eigenvalue_spectrum, training_loss
from smoothing_jax.analysis.trajectory import polar_trajectory
from smoothing_jax.evaluators import temporal_smoothing as temporal_evaluator
from smoothing_jax.experiment import checkpoints
from smoothing_jax.experiment import config as config_lib
from smoothing_jax.experiment.run import Run
from smoothing_jax.temporal import translate_sequences
from smoothing_jax.training.train import train
from smoothing_jax.training.trajectory_recorder import load_trajectory


def load_trained(workdir: str, member: int | None = None) -> Run:
  """The run of ``workdir`` with the variables of its latest intact checkpoint
  (``Run.from_workdir``: its ``config.json`` picks model and data; training batches come from the
  ``train_fraction`` subset it trained on); a workdir without checkpoints that records
  ``init_from`` (e.g. ``--mode=evaluate`` of a torch checkpoint) gives those variables, at step
  0.  The analyses take one model: of an ensemble workdir (``config.deep_ensemble.members``),
  its ``member`` (``Run.member``)."""
  run = Run.from_workdir(workdir)
  # Branch on the method: the analyses study one network's weights and features, which a deep
  # ensemble has M of; choosing one is the user's call, not a method's.
  if run.stacked_members > 1:
    if member is None:
      raise ValueError(f"{workdir} holds an ensemble of {run.stacked_members} members and the "
                       "analyses take one model: pass member=<0.."
                       f"{run.stacked_members - 1}>.")
    return run.member(member)
  if member not in (None, 0):
    raise ValueError(f"{workdir} holds one model; there is no member {member}.")
  return run


def load_or_train(workdir: str,
                  config: str | ml_collections.ConfigDict | None = None,
                  *,
                  overrides: Mapping[str, Any] | None = None) -> Run:
  """The trained run of ``workdir`` (:func:`load_trained`), trained first if it has no
  checkpoint.

  A workdir with a checkpoint (or recording an ``init_from``) is loaded as it is: its
  ``config.json`` rules, and ``config`` and ``overrides`` are not used (rerun the training
  command to resume an interrupted run).  Otherwise ``config`` — a ConfigDict or
  ``"<file>.py[:<args>]"`` — with ``overrides`` (``smoothing_jax.experiment.config.load``) is
  trained into
  ``workdir`` (``train.train``) and that same run is returned; with ``init_from`` set (a workdir,
  an SS or HV torch checkpoint) and ``num_train_steps`` 0 nothing is trained: the workdir records
  the config and stands for the checkpoint's variables, as ``--mode=evaluate``.

  Raises:
    ValueError: ``workdir`` has no checkpoint and no ``config`` is given, or a bad config or
      override.
  """
  if checkpoints.has_checkpoint(workdir) or checkpoints.evaluates_init_from(workdir):
    return load_trained(workdir)
  if config is None:
    raise ValueError(f"{workdir} holds no checkpoint: give a config to train one into it.")
  config = config_lib.load(config, overrides)
  run = Run.from_config(config, workdir)
  if config.init_from and config.num_train_steps == 0:
    run.record_init_from()
  else:
    with run:
      train(run)
  run.read_only = True  # analyses never write checkpoints
  return run


def eval_pixels(trained: Run, num_images: int):
  """The first ``num_images`` evaluation images as pixels in [0, 1] float32, and their labels."""
  if trained.pipeline.eval_images is None:
    raise ValueError(
        "The analyses need an in-memory evaluation split (CIFAR, npz or digits datasets).")
  images = trained.pipeline.eval_images[:num_images]
  return images.astype(np.float32) / 255.0, trained.pipeline.eval_labels[:num_images].astype(
      np.int32)


def train_batches(trained: Run,
                  num_batches: int,
                  batch_size: int | None = None) -> list:
  """``num_batches`` augmented training batches as in training (epoch 0 of the seeded pipeline)."""
  pipeline = trained.pipeline
  if batch_size is not None:
    pipeline = dataclasses.replace(pipeline, global_batch_size=batch_size)
  return list(itertools.islice(pipeline.train_iterator(), num_batches))


def hessian_spectrum_study(trained: Run,
                           *,
                           num_batches: int = 10,
                           batch_size: int | None = None,
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


def stage_hessian_study(trained: Run,
                        *,
                        batch_size: int | None = None,
                        max_iters: int = 100,
                        tol: float = 1e-3,
                        seed: int = 0,
                        regularizer: str = "half_squared_l2") -> dict:
  """``{stage: {"eigenvalue", "relative_residual", "parameters"}}`` for each stage of the model
  (``analysis.hessian.stages``): the largest-magnitude eigenvalue of the Hessian of NLL + weight
  decay · R(θ) restricted to the stage's parameters (``restricted_to``: the block H[S, S], the
  rest held fixed), by Lanczos on the first training batch.

  The batch, dropout key and solver key are those of ``hessian_spectrum_study``'s first batch at
  the same ``seed``, so up to the residuals each |λ| is at most that batch's whole-model |λ₁|
  (Cauchy interlacing).
  """
  batch = train_batches(trained, 1, batch_size)[0]
  dropout_key, solver_key = jax.random.split(jax.random.fold_in(jax.random.key(seed), 0))
  loss_fn = Partial(
      functools.partial(training_loss, trained.model, trained.config.weight_decay,
                        regularizer=regularizer), trained.variables.get("batch_stats", {}),
      dropout_key, jnp.asarray(batch["image"]), jnp.asarray(batch["label"]))
  params = trained.variables["params"]
  out = {}
  for stage in stages(params):
    # Masked: every stage's solve reuses one compiled program (a block's own structure would
    # compile the solver once per stage, most of the study's time on CPU).
    _, block = restricted_to(loss_fn, params, stage)
    pairs = top_eigenvalues(*restricted_to(loss_fn, params, stage, masked=True),
                            max_iters=max_iters, tol=tol, rng=solver_key)
    out[stage] = {"eigenvalue": float(pairs.eigenvalues[0]),
                  "relative_residual": float(pairs.relative_residuals[0]),
                  "parameters": sum(x.size for x in jax.tree.leaves(block))}
  return out


def fourier_study(trained: Run, *, num_images: int = 256, seed: int = 0) -> dict:
  """``{block: Δlog-amplitude curve from 0 to π}`` on test images; one stochastic pass."""
  pixels, _ = eval_pixels(trained, num_images)
  return fourier_by_depth(trained.model, trained.variables, trained.normalize(pixels),
                          jax.random.key(seed))


def variance_study(trained: Run,
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


def similarity_study(trained: Run,
                     *,
                     num_images: int = 1024,
                     batch_size: int = 256,
                     other: Run | None = None,
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


def landscape_study(trained: Run, *, num_points: int = 21, scale: float = 1.0,
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


def frequency_noise_study(trained: Run,
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
  noisy = accuracy_vs_frequency(lambda x: predict(jnp.clip(x, 0.0, 1.0)),
                                jnp.asarray(pixels),
                                labels,
                                frequencies,
                                std=std,
                                rng=jax.random.key(seed))
  clean = float(np.mean(predict(pixels).argmax(-1) == labels))
  return {"frequencies": np.asarray(frequencies), "accuracy": noisy, "clean_accuracy": clean}


def consistency_study(trained: Run,
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
  probs = sequence_predictions(predict, videos)
  first = probs[0, :, labels[0]] / probs[0].max(-1)
  return {**perturbation_metrics(probs, labels), "relative_confidence_curve": first}


def temporal_smoothing_study(trained: Run,
                             *,
                             num_images: int = 1000,
                             length: int = 6,
                             max_shift: int = 3,
                             num_samples: int = 10,
                             num_frames: int = temporal.NUM_FRAMES,
                             decay_rate: float = temporal.DECAY_RATE,
                             batch_size: int = 250,
                             seed: int = 0,
                             output_dir: str | None = None) -> list:
  """Temporal smoothing on data streams made of test images (``evaluators.temporal``: one pass
  per frame, MC dropout with ``num_samples`` passes, VQ-BNN with one pass per frame; the paper's
  Table E.4 layout); with ``output_dir`` also its table and figure there."""
  return temporal_evaluator.evaluate(
      trained, output_dir, num_images=num_images, length=length,
      max_shift=max_shift, num_samples=num_samples, num_frames=num_frames,
      decay_rate=decay_rate, batch_size=batch_size, seed=seed)


def _attack(trained: Run, num_samples: int, kind: str, pgd_steps: int, seed: int):
  """Jitted ``(variables, key, pixels, labels, eps) -> adversarial pixels`` against the run's
  predictive with ``num_samples`` draws (arrays as arguments, not constants, so XLA does not
  constant-fold the network)."""
  method = trained.method.with_samples(num_samples)

  def run(variables, key, x, y, eps):
    loss = functools.partial(ensemble_nll, method, variables, key, trained.normalize)
    if kind == "fgsm":
      return fgsm(loss, x, y, eps)
    return pgd(loss, x, y, eps, step_size=eps / 4, steps=pgd_steps, rng=jax.random.key(seed + 1))
  return jax.jit(run)


def adversarial_study(trained: Run,
                      epsilons: Sequence[float] = (1 / 255, 2 / 255, 4 / 255, 8 / 255),
                      *,
                      num_images: int = 256,
                      num_samples: int = 1,
                      pgd_steps: int = 10,
                      seed: int = 0) -> dict:
  """Accuracy and attack success rate of FGSM and PGD (random start) for each ε in pixel space,
  the attacks on the NLL of the predictive that scores them (``Run.predict`` with
  ``num_samples`` draws, and the same key)."""
  pixels, labels = eval_pixels(trained, num_images)
  key = jax.random.key(seed)
  predict = functools.partial(trained.predict, num_samples=num_samples, rng=jax.random.key(seed))
  clean_correct = predict(pixels).argmax(-1) == labels
  x, y = jnp.asarray(pixels), jnp.asarray(labels)
  attacks = {
      "fgsm": _attack(trained, num_samples, "fgsm", pgd_steps, seed),
      "pgd": _attack(trained, num_samples, "pgd", pgd_steps, seed)
  }
  rows = []
  for eps in epsilons:
    for name, attack in attacks.items():
      correct = predict(attack(trained.variables, key, x, y, eps)).argmax(-1) == labels
      success = float(np.sum(clean_correct & ~correct) / max(np.sum(clean_correct), 1))
      rows.append({
          "attack": name,
          "eps": float(eps),
          "accuracy": float(correct.mean()),
          "success_rate": success
      })
  return {"clean_accuracy": float(clean_correct.mean()), "attacks": rows}


def lesion_study(trained: Run,
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


def trajectory_study(trained: Run) -> dict:
  """The learning trajectory recorded in ``trained.workdir`` in polar coordinates about the
  final parameters, with its path length over the straight distance (``path_ratio``) and the
  projection's error (:func:`smoothing_jax.analysis.trajectory.polar_trajectory`); draw it with
  ``plots.plot_trajectories``."""
  return polar_trajectory(load_trajectory(trained.workdir))
