"""``Run``: one experiment in one process — its config, model spec, model, data, mesh, variables
and checkpoint manager, each made once.

* ``Run.from_config(config, workdir)``: a run to train (``train.train``) or, with ``init_from``
  and no checkpoints, to stand for another run's variables (``record_init_from``);
* ``Run.from_workdir(workdir, overrides)``: a trained run, restored (its ``config.json`` rebuilds
  the model; ``overrides`` change evaluation settings);
* ``Run.for_evaluation(workdir, config)``: what ``--mode=evaluate`` opens (either of the above).

Training, every evaluator (``smoothing_jax.evaluators``), the analyses
(``analysis.trained.load_trained`` / ``load_or_train``), the colabs and the benchmarks take a
``Run``; the data is loaded the first time ``run.pipeline`` is read, and never twice.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from jax.sharding import Mesh

from smoothing_jax.data import Pipeline, create_pipeline
from smoothing_jax.experiment import checkpoints, fits, init_from
from smoothing_jax.experiment import spec as spec_lib
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.config import check_key, with_overrides
from smoothing_jax.experiment.spec import ModelSpec, build_model, check_model_fits
from smoothing_jax.experiment.workdir_lock import lock_workdir
from smoothing_jax.methods import Method, resolve
from smoothing_jax.methods.base import PredictionData
from smoothing_jax.methods.deep_ensemble import member_seed_settings, seeds_of
from smoothing_jax.parallel import (
  create_mesh,
  eval_batch_size,
  evaluate_batches,
  sharded_eval_step,
  shardings,
)
from smoothing_jax.passes import member_of
from smoothing_jax.variables import abstract_variables

# Config keys (dotted) that decide which training examples a run trained on and held out.
DATA_SPLIT_KEYS = ("seed", "input.split_seed", "input.train_fraction", "input.holdout_fraction")
# Config keys an evaluation config never replaces: the split, and how many members the
# checkpoint stacks and which seeds they were trained with.
RECORDED_KEYS = DATA_SPLIT_KEYS + ("deep_ensemble.members", "deep_ensemble.member_seeds")


def create_run_pipeline(config, mesh: Mesh) -> Pipeline:
  """The input pipeline of ``config.input``, its batches in the order of ``config.seed``, on
  ``mesh`` (training batches augmented as in training)."""
  return create_pipeline(config.input, config.seed, mesh)


def split_seed(config) -> int:
  """The seed of the training split's ``train_fraction`` / ``holdout_fraction`` draws:
  ``config.input.split_seed``, or ``config.seed`` where it is -1 (or unrecorded)."""
  seed = config.input.get("split_seed", -1)
  return config.seed if seed == -1 else seed


def _has_key(config, key: str) -> bool:
  """Whether ``config`` holds the dotted ``key``."""
  try:
    check_key(config, key)
  except KeyError:
    return False
  return True


# What ``Run.normalize`` and ``Run.predict`` take: the convention of the stored images (uint8)
# and of the analyses' pixel space (float in [0, 1]).
PIXELS = "uint8 images in 0–255 or float images in [0, 1]"
# Float pixels may leave [0, 1] a little (noise, interpolation); images in 0–255 or already
# normalised (about -2 to 2.6 for CIFAR and ImageNet) land outside these bounds.
FLOAT_PIXEL_RANGE = (-0.5, 1.5)


def _unit_pixels(images):
  """``images`` as float32 pixels in [0, 1]: integer images (uint8) divided by 255, float images
  as they are.  Concrete values are checked (inside ``jit`` only the dtype is known): integers
  must lie in 0–255 and floats in ``FLOAT_PIXEL_RANGE``, so that 0–255 floats or images already
  normalised are refused in one line instead of scoring at chance."""
  if not hasattr(images, "dtype"):
    images = np.asarray(images)
  dtype = np.dtype(images.dtype)
  if not (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(f"Images must be {PIXELS}; got dtype {dtype}.")
  integer = jnp.issubdtype(dtype, jnp.integer)
  xp = jnp if isinstance(images, jax.Array) else np  # device arrays are checked on the device
  if not isinstance(images, jax.core.Tracer) and np.size(images):
    low, high = float(xp.min(images)), float(xp.max(images))
    bounds = (0, 255) if integer else FLOAT_PIXEL_RANGE
    if low < bounds[0] or high > bounds[1]:
      hint = ("" if integer else "; for 0–255 values pass uint8 (or divide by 255), for images "
              "already normalised pass their pixels")
      raise ValueError(f"Images must be {PIXELS}; got {dtype} values in [{low:.4g}, {high:.4g}]"
                       f"{hint}.")
  return xp.asarray(images, xp.float32) / 255.0 if integer else xp.asarray(images, xp.float32)


def check_config(config: ml_collections.ConfigDict) -> None:
  """Refuse, before any data is read or file written, what ``config`` can be refused for
  without its data: the batch size, the run's length and rate, the model's name and options
  (``get_model``) and its method's settings
  (``methods.resolve``; e.g. ``deep_ensemble.members=0``).  The data decides only the class count
  and stem geometry, which change neither the method nor its refusals, so a stand-in spec
  builds the model here; training builds the real one from the data."""
  batch = config.input.batch_size
  if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
    raise ValueError(f"input.batch_size must be a positive integer, got {batch!r}.")
  steps = config.num_train_steps
  evaluated_only = steps == 0 and config.get("init_from")  # the source run stands as it is
  if (not isinstance(steps, int) or isinstance(steps, bool)
      or (steps < 1 and steps != -1 and not evaluated_only)):
    raise ValueError(f"num_train_steps must be a positive integer, -1 for num_epochs' steps (or 0 "
                     f"with init_from: evaluate the source as it is); got {steps!r}.")
  if not config.learning_rate >= 0:
    raise ValueError(f"learning_rate must be >= 0, got {config.learning_rate!r}.")
  stand_in = ModelSpec(num_classes=config.num_classes if config.num_classes > 0 else 2,
                       stem="cifar", image_shape=(32, 32, 3))
  resolve(config, build_model(config, stand_in))


def _mean_probs(method: Method, variables, batch, rng):
  """``[B, C]`` mean predictive of ``method`` on one batch of normalised images
  (``Run.predict``)."""
  return method.predict(variables, batch["image"], rng=rng).mean_probs


class ConfigChangedError(ValueError):
  """A workdir's checkpoints cannot restore under the settings given, which differ from those it
  was trained with; the message names each setting that differs."""


@dataclasses.dataclass(eq=False)
class Run:
  """One run: ``config`` (evaluation overrides applied), ``model_spec`` and ``model`` (always from
  the recorded config), the ``mesh``, and once trained or restored its ``variables`` at ``step``.
  ``pipeline`` and ``manager`` are made on first use, once."""
  config: ml_collections.ConfigDict
  workdir: str
  model_spec: ModelSpec
  model: Any
  mesh: Mesh
  variables: dict | None = None
  step: int = 0
  read_only: bool = False  # a restored run never writes checkpoints (nor cleans up others')
  member_index: int | None = None  # Run.member's: which member of the workdir's ensemble

  @classmethod
  def from_config(cls, config: ml_collections.ConfigDict, workdir: str, *,
                  mesh: Mesh | None = None) -> Run:
    """``config.model`` on ``config.input.dataset`` for ``workdir``: loads the data, builds the
    model.  Resuming a run that recorded the model options of a timm ``init_from`` reads no
    ``init_from`` file."""
    mesh = mesh or create_mesh(config.num_devices)
    pipeline = create_run_pipeline(config, mesh)
    if checkpoints.has_checkpoint(workdir) and checkpoints.has_run(workdir):
      recorded, recorded_spec = workdir_lib.read_config(workdir)
      options = recorded_spec.model_options
    else:
      recorded, options = None, init_from.model_options(config)
    seeds = member_seed_settings(config, recorded)  # recorded in config.json
    config = with_overrides(config, seeds) if seeds else config
    spec = spec_lib.model_spec(config, pipeline, options)
    model = build_model(config, spec)
    check_model_fits(config, model, pipeline)
    run = cls(config, str(workdir), spec, model, mesh)
    run.__dict__["pipeline"] = pipeline
    return run

  @classmethod
  def from_workdir(cls, workdir: str,
                   overrides: Mapping[str, Any] | ml_collections.ConfigDict | None = None, *,
                   mesh: Mesh | None = None) -> Run:
    """The run recorded in ``workdir``, with the variables of its latest intact checkpoint (or,
    recorded to stand for its ``init_from``, those at step 0).  ``overrides``: dotted keys
    (``config.with_overrides``) or a whole ConfigDict replacing the recorded config (evaluation
    settings; the recorded ``RECORDED_KEYS`` are kept); the model is always the recorded one."""
    recorded, spec = workdir_lib.read_config(workdir)
    if isinstance(overrides, ml_collections.ConfigDict):
      # The recorded split of the training data (the held-out examples are those never trained
      # on), whatever the evaluation config says.
      config = with_overrides(overrides, {k: recorded[k] for k in RECORDED_KEYS
                                          if _has_key(recorded, k) and _has_key(overrides, k)})
    else:
      config = with_overrides(recorded, overrides or {})
    mesh = mesh or create_mesh(config.get("num_devices", -1))
    run = cls(config, str(workdir), spec, build_model(recorded, spec), mesh, read_only=True)
    if spec.evaluates_init_from and not checkpoints.has_checkpoint(workdir):
      run.variables = init_from.variables(recorded, spec, run.abstract_variables(), mesh)
      run.variables = jax.device_put(run.variables, shardings(mesh)[0])
    else:
      run.restore()
    return run

  @classmethod
  def for_evaluation(cls, workdir: str, config: ml_collections.ConfigDict | None = None
                     ) -> Run:
    """The run ``--mode=evaluate`` (and every evaluator alias) opens: ``workdir``'s, or for an
    empty workdir and a ``config`` with ``init_from``, that ``init_from`` recorded in
    ``workdir`` (:meth:`record_init_from`)."""
    if (config is not None and config.get("init_from") and not checkpoints.has_checkpoint(workdir)
        and not checkpoints.has_run(workdir)):
      run = cls.from_config(config, workdir)
      run.record_init_from()
      return run
    return cls.from_workdir(workdir, config)

  @functools.cached_property
  def pipeline(self) -> Pipeline:
    return create_run_pipeline(self.config, self.mesh)

  @functools.cached_property
  def manager(self) -> ocp.CheckpointManager:
    """This run's orbax manager of ``<workdir>/checkpoints`` (read-only for a restored run)."""
    keep = None if self.read_only else self.config.get("keep_checkpoints")  # a reader deletes none
    return checkpoints.checkpoint_manager(self.workdir, max_to_keep=keep, read_only=self.read_only)

  def abstract_variables(self):
    """Shapes and dtypes of the model's variables (``jax.eval_shape``; nothing computed)."""
    return abstract_variables(self.model, self.model_spec.image_shape)

  def restore(self, target=None):
    """Restore the latest intact checkpoint (``checkpoints.restore_latest``) onto this run's
    mesh, replicated: ``target`` (an abstract tree, e.g. the train state's) or, by default, the
    variables as saved; sets ``variables`` and ``step`` and returns the restored tree, or None
    when there is no checkpoint (FileNotFoundError for a read-only run)."""
    replicated, _ = shardings(self.mesh)

    def target_of(step):
      saved = self.manager.item_metadata(step).tree
      # As saved: without a target, or a checkpoint written before methods kept state of their
      # own (its train state has no method_state: the target's fresh one is kept, below).
      if target is None or (hasattr(target, "method_state") and "method_state" not in saved):
        return checkpoints.abstract_tree(saved, replicated)
      return checkpoints.abstract_tree(target, replicated)

    try:
      restored = checkpoints.restore_latest(self.manager, target_of)
    except checkpoints.NoIntactCheckpointError:
      # Most often the checkpoints are sound and the settings changed: name what changed.
      changed = workdir_lib.config_differences(self.workdir, self.config)
      if not changed:
        raise
      shown = "; ".join(changed[:6]) + ("; ..." if len(changed) > 6 else "")
      raise ConfigChangedError(
          f"{self.workdir} was trained with other settings ({shown}), and its checkpoints hold "
          "that run's state, which these settings cannot restore: train into a new --workdir, "
          "or drop those overrides to resume it.") from None
    if restored is None:
      if self.read_only:
        raise FileNotFoundError(f"No checkpoint in {workdir_lib.checkpoint_dir(self.workdir)}.")
      return None
    self.step, tree = restored
    if hasattr(target, "method_state") and isinstance(tree, Mapping):
      # Each saved field into the target's structure (orbax keeps tuples as lists, and the
      # leaves of a field flatten in the same order either way).
      tree = target.replace(**{k: jax.tree.unflatten(jax.tree.structure(getattr(target, k)),
                                                     jax.tree.leaves(v)) for k, v in tree.items()})
    self.variables = checkpoints.variables_of_tree(tree)
    self.__dict__.pop("_prediction_variables", None)  # prepared from the variables before
    return tree

  @property
  def checkpoint(self) -> str:
    """Where :attr:`variables` come from: ``<workdir>/checkpoints/<step>``, or the
    ``init_from`` this workdir stands for (:meth:`record_init_from`); what an evaluation records
    it scored."""
    if self.model_spec.evaluates_init_from and not checkpoints.has_checkpoint(self.workdir):
      return str(self.config.init_from)
    return str(workdir_lib.checkpoint_dir(self.workdir) / str(self.step))

  def record(self) -> None:
    """Write ``config.json`` (config and model spec; process 0), holding the workdir's lock."""
    with lock_workdir(self.workdir):
      workdir_lib.record_run(self.workdir, self.config, self.model_spec)

  def record_init_from(self) -> None:
    """Make this (empty) workdir stand for ``config.init_from``: record the config with
    ``model_spec.evaluates_init_from`` and take its variables, at step 0."""
    self.model_spec = dataclasses.replace(self.model_spec, evaluates_init_from=True)
    self.record()
    variables = init_from.variables(self.config, self.model_spec, self.abstract_variables(),
                                    self.mesh)
    self.variables, self.step = jax.device_put(variables, shardings(self.mesh)[0]), 0

  @functools.cached_property
  def method(self) -> Method:
    """The uncertainty method of this run's model and config (``methods.resolve``): its
    predictive, objective, optimiser rules and train state."""
    return resolve(self.config, self.model)

  # A method's post-hoc stage and the variables its predictive takes.
  def fit(self):
    """The post-hoc stage of the run's method (``Method.fit``) on the training split at the
    latest checkpoint step, stored in ``<workdir>/fits/<fit name>/<step>`` under the workdir's
    lock (``experiment.fits``); a fit already stored for this step is kept, not redone.  Returns
    that folder.  ValueError (one line) for a method without one."""
    method = self.method
    name = method.fit_name
    # Branch on the method: --mode=fit is refused for a method without a post-hoc stage.
    if name is None:
      raise ValueError(f"Method {method.describe()} has no post-hoc stage: --mode=fit is for "
                       "methods that fit after training (e.g. --config.method=laplace).")
    if fits.has_fit(self.workdir, name, self.step):
      logging.info("%s: the fit of step %d is in %s already.", name, self.step,
                   fits.fit_dir(self.workdir, name))
    else:
      with lock_workdir(self.workdir):
        logging.info("Fitting %s (%s) on the training split at step %d of %s.", name,
                     method.describe(), self.step, self.workdir)
        started = time.perf_counter()
        result = method.fit(self.variables, self.train_eval_batches)
        fits.save_fit(self.workdir, name, self.step, result)  # every process (orbax's barriers)
        logging.info("Fitted %s in %.1f s: %s/%d.", name, time.perf_counter() - started,
                     fits.fit_dir(self.workdir, name), self.step)
    return fits.fit_dir(self.workdir, name) / str(self.step)

  def prediction_variables(self, method: Method | None = None):
    """The variables ``method`` (default the run's) predicts with
    (``Method.prediction_variables``: the trained ones, joined by its stored fit, or made from
    them and the training split, e.g. SWAG's weight samples with their BatchNorm statistics).
    Cached per method: every evaluator of this run shares one preparation."""
    method = method or self.method
    cache = self.__dict__.setdefault("_prediction_variables", {})
    key = (method, self.step, id(self.variables))  # variables replaced: prepared again
    if key not in cache:
      cache[key] = method.prediction_variables(self.variables, self.prediction_data())
    return cache[key]

  def prediction_data(self) -> PredictionData:
    """What a predictive may read beside the variables: the training split's batches and this
    workdir's fits of the current step (FileNotFoundError saying how to make a missing one; of
    a deep ensemble's member, its slice), and which member this run is (0 for a whole run)."""
    def fit(name):
      fitted = fits.load_fit(self.workdir, name, self.step, self.mesh)
      return fitted if self.member_index is None else member_of(fitted, self.member_index)
    return PredictionData(self.train_eval_batches, fit, self.member_index or 0)

  # Deep ensembles trained as one job (``config.deep_ensemble.members``;
  # smoothing_jax.methods.deep_ensemble).
  @property
  def stacked_members(self) -> int:
    """M: the networks stacked along the leading axis of :attr:`variables` (a deep ensemble's
    members; 1 for one network, BatchEnsemble, MIMO and Packed-Ensembles included, whose members
    share one network: their N is the method's ``num_draws``)."""
    return self.method.members

  def member(self, m: int) -> Run:
    """Member ``m`` of an ensemble run as a run of its own (read-only, in this workdir): the
    single run with the member's recorded seed (``deep_ensemble.member_seeds[m]``), its
    variables the ensemble's slice ``m``; what per-model analyses take.  :meth:`write_member`
    writes it out as a workdir."""
    # Branch on the method: a member index must lie within the stacked members (M of a deep
    # ensemble, 1 otherwise), read from the method that stacked them.
    if not 0 <= m < self.stacked_members:
      raise ValueError(f"{self.workdir} holds an ensemble of {self.stacked_members} members; "
                       f"there is no member {m}.")
    config = with_overrides(self.config, {"seed": seeds_of(self.config)[m],
                                          "deep_ensemble.members": 1,
                                          "deep_ensemble.member_seeds": (),
                                          "input.split_seed": split_seed(self.config)})
    return dataclasses.replace(self, config=config, variables=member_of(self.variables, m),
                               read_only=True, member_index=m)

  def write_member(self, m: int, workdir: str) -> Run:
    """Write member ``m`` of this ensemble workdir into the empty ``workdir`` as the single run
    it is (config with member m's recorded seed, the checkpoint of the latest step with that
    member's slice of the train state: parameters, BatchNorm statistics, optimizer state; it
    resumes and every evaluator and analysis reads it); returns it, restored."""
    member = self.member(m)
    if checkpoints.has_checkpoint(workdir) or checkpoints.has_run(workdir):
      raise ValueError(f"{workdir} already holds a run; write the member into a new workdir.")
    with lock_workdir(workdir):
      replicated, _ = shardings(self.mesh)
      with checkpoints.checkpoint_manager(self.workdir, read_only=True) as source:
        tree = source.restore(self.step, args=ocp.args.StandardRestore(checkpoints.abstract_tree(
            source.item_metadata(self.step).tree, replicated)))
      tree = {k: v if k == "step" else member_of(v, m) for k, v in tree.items()}
      workdir_lib.record_run(workdir, member.config, self.model_spec)
      with checkpoints.checkpoint_manager(workdir) as target:
        target.save(self.step, args=ocp.args.StandardSave(tree))
        target.wait_until_finished()
    return Run.from_workdir(workdir, mesh=self.mesh)

  def close(self) -> None:
    """Wait for checkpoints being written, then close the manager (if one was opened)."""
    manager = self.__dict__.pop("manager", None)
    if manager is not None:
      manager.wait_until_finished()
      manager.close()

  def __enter__(self) -> Run:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # What the analyses and notebooks use.
  @property
  def stochastic(self) -> bool:
    """Whether two draws of the run's predictive differ (``Method.stochastic``)."""
    return self.method.stochastic

  def normalize(self, images) -> jax.Array:
    """Images ``[..., H, W, 3]`` as pixels (:data:`PIXELS`: uint8 in 0–255 or float in [0, 1])
    → the model's input, ``(pixels - mean) / std`` with the training data's per-channel
    statistics, as the input pipeline normalises.  ValueError (one line) for values outside
    those ranges (:func:`_unit_pixels`)."""
    return (_unit_pixels(images) - jnp.asarray(self.pipeline.mean)) / jnp.asarray(self.pipeline.std)

  def check_images(self, images) -> np.ndarray:
    """``images`` as numpy, or ValueError (one line) naming what the model cannot take: not
    ``[B, H, W, C]`` (grayscale without its channel), channels first, no images, another channel
    count or size than the model's, or non-finite pixels."""
    images = np.asarray(images)
    shape = tuple(self.model_spec.image_shape)
    if images.ndim != 4:
      raise ValueError(f"Images are [B, H, W, C] (the model takes {shape}), got shape "
                       f"{images.shape}: a grayscale batch needs its channel axis "
                       "(images[..., None]); one image, a batch axis (images[None]).")
    if len(images) == 0:
      raise ValueError("No images to predict (an empty batch).")
    if images.shape[1:] != shape:
      if images.shape[1] == shape[-1] and images.shape[2:] == shape[:2]:
        raise ValueError(f"Images of shape {images.shape[1:]} are channels-first; the model "
                         f"takes [B, H, W, C] = [B, {', '.join(map(str, shape))}]: "
                         "np.moveaxis(images, 1, -1).")
      if images.shape[1:3] == shape[:2]:
        hint = (f": np.repeat(images, {shape[-1]}, axis=-1) for grayscale images"
                if images.shape[-1] == 1 else "")
        raise ValueError(f"Images of shape {images.shape[1:]} have the model's size but not its "
                         f"channels: it takes {shape}{hint}.")
      raise ValueError(f"Images of shape {images.shape[1:]}; the model takes {shape}: bring them "
                       "to its size first (e.g. smoothing_jax.data.sources.base.fit_to_size, the "
                       "data's own rule).")
    if images.dtype.kind == "f" and not np.all(np.isfinite(images)):
      bad = int(np.sum(~np.all(np.isfinite(images.reshape(len(images), -1)), axis=1)))
      raise ValueError(f"{bad} of the {len(images)} images have non-finite pixels (NaN or inf).")
    return images

  def predict(self, images, num_samples: int = 1, rng: jax.Array | None = None,
              batch_size: int = 500) -> np.ndarray:
    """Mean predictive ``[B, C]`` (numpy) of ``images`` ``[B, H, W, 3]``, pixels as
    :meth:`normalize` takes them (uint8 in 0–255 or float in [0, 1]; anything else is refused in
    one line), by the run's method (``Method.predict``) with ``num_samples`` draws where it
    samples (MC dropout and BNN-VI: N passes; iBNN: S draws of each of its K components;
    ensembles: one draw per member), in batches of ``batch_size`` (at most the number of images,
    rounded up to the mesh) through the sharded evaluation loop: what the evaluators score at
    the same N, on the same batches, with the same key."""
    rng = jax.random.key(0) if rng is None else rng
    images = np.asarray(self.normalize(self.check_images(images)), np.float32)
    size = -(-min(batch_size, len(images)) // self.mesh.size) * self.mesh.size
    pad = -len(images) % size
    padded = np.concatenate([images, np.zeros((pad,) + images.shape[1:], np.float32)])
    method = self.method.with_samples(num_samples)
    step = sharded_eval_step(_mean_probs, self.mesh, method)
    batches = ({"image": padded[i:i + size]} for i in range(0, len(padded), size))
    probs = evaluate_batches(step, self.prediction_variables(method), batches,
                             shardings(self.mesh)[1], rng, concatenate=True)
    return probs[:len(images)]

  def eval_batches(self, dataset: str | None = None):
    """Padded, masked evaluation batches of ``dataset`` (default: the run's evaluation split),
    ``config.eval_batch_size`` rounded up to the mesh."""
    return self.pipeline.eval_batches(eval_batch_size(self.config, self.mesh), dataset)

  def train_eval_batches(self):
    """Padded, masked evaluation batches (no augmentation) of the training split."""
    return self.pipeline.train_eval_batches(eval_batch_size(self.config, self.mesh))
