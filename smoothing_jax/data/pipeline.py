"""Input pipelines: :func:`create_pipeline` picks the path by dataset and builds its
:class:`~smoothing_jax.data.pipeline_base.Pipeline` (one dataset's train/eval batches for this
process).

* :class:`~smoothing_jax.data.resident.ResidentPipeline` (``npz:``, ``digits``, ``synthetic:``,
  CIFAR-10/100 and their -C sets once read from TFDS): the split lives on the devices as uint8
  and each batch is gathered and augmented inside the jitted step.  No TensorFlow.
* :class:`~smoothing_jax.data.tfdata.TFDataPipeline` (ImageNet and CamVid, streamed from disk by
  tf.data; any dataset with ``data_pipeline="tfdata"``).

Both see the same examples in the same order
(:meth:`~smoothing_jax.data.pipeline_base.Pipeline.epoch_order`, a pure function of
``(seed, epoch)``); their augmentation draws differ.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from smoothing_jax.data.dataset_spec import NORMALIZATION
from smoothing_jax.data.datasets import (
  check_train_fraction,
  class_balanced_subset,
  load_arrays,
  normalization,
  parse_dataset,
  source_of,
)
from smoothing_jax.data.pipeline_base import Pipeline

DATA_PIPELINES = ("auto", "resident", "tfdata")
HOST_PATH = ("camvid",)  # segmentation: augmented by tf.data on the host
# The keys of a config's ``input`` block besides ``dataset`` and ``batch_size``, with the defaults
# of ``experiment.config_base`` (``randaugment`` None: off): what a block without them (a config
# recorded before they existed, a dict) reads.
INPUT_DEFAULTS = {"data_dir": None, "download": True, "data_pipeline": "auto", "crop_size": None,
                  "randaugment": None, "train_fraction": 1.0, "holdout_fraction": 0.0,
                  "split_seed": -1, "eval_cache": "", "image_size": 0}


def create_pipeline(input_config: Mapping[str, Any], seed: int, mesh=None) -> Pipeline:
  """The pipeline of a config's ``input`` block (a ConfigDict or a dict; the keys it lacks take
  :data:`INPUT_DEFAULTS`), training batches in the order ``seed`` draws; fails early with a clear
  message if the dataset is missing.

  Keys: ``dataset`` and ``batch_size`` (global).  ``data_dir`` / ``download``: TFDS's.
  ``data_pipeline``: "auto" (device-resident unless the dataset is streamed from disk: ImageNet,
  CamVid), "resident" or "tfdata" (the host path, which also keeps TensorFlow off the
  accelerators); ``mesh`` (default: all devices) holds a resident dataset.  ``crop_size``: (h, w)
  random training crop of segmentation datasets (None: whole images).  ``randaugment``:
  ``{num_layers, magnitude, magnitude_std}`` applied to training images after the crop and flip
  (None or num_layers 0: off).  ``train_fraction`` in (0, 1]: train on a fixed class-balanced
  subset of an in-memory training split
  (:func:`~smoothing_jax.data.datasets.class_balanced_subset`); ``num_train`` and the steps per
  epoch follow it, the normalisation statistics stay those of the whole split; the streamed
  ImageNet split takes 1 only.  ``holdout_fraction`` in [0, 1): a class-balanced part of the
  training split held out before ``train_fraction`` is drawn from the rest (never trained on;
  ``holdout_images`` / ``holdout_labels``: what recalibration fits on).  ``split_seed`` seeds
  those two draws (-1: ``seed``), e.g. an ensemble's split shared by its members.
  ``eval_cache``: a file prefix where the preprocessed evaluation images are kept after their
  first pass (for ImageNet, whose JPEGs are otherwise decoded at every evaluation).
  ``image_size`` S > 0: every image of a set held in memory brought to S × S as it is read (its
  shorter side resized to S, bilinear, then the centre cropped:
  :func:`~smoothing_jax.data.sources.base.fit_to_size`); 0: the images' own size, which must be
  one.  A set too large to hold in memory (ImageNet, a large ``tfds:`` set) is streamed
  (``data_pipeline`` "tfdata"), with ImageNet's crops and geometry.
  """
  unknown = sorted(set(input_config.keys()) - set(INPUT_DEFAULTS) - {"dataset", "batch_size"})
  if unknown:
    raise ValueError(f"Unknown input keys {', '.join(unknown)}; known: dataset, batch_size, "
                     f"{', '.join(INPUT_DEFAULTS)}.")
  options = {**INPUT_DEFAULTS, **input_config}
  dataset, global_batch_size = options["dataset"], options["batch_size"]
  data_dir, download = options["data_dir"], options["download"]
  data_pipeline, crop_size = options["data_pipeline"], options["crop_size"]
  holdout_fraction = options["holdout_fraction"]
  split_seed = seed if options["split_seed"] == -1 else options["split_seed"]
  rand = options["randaugment"]
  randaugment = ((rand["num_layers"], rand["magnitude"], rand["magnitude_std"])
                 if rand and rand["num_layers"] != 0 else None)
  if data_pipeline not in DATA_PIPELINES:
    raise ValueError(f"data_pipeline must be one of {', '.join(DATA_PIPELINES)}, got "
                     f"{data_pipeline!r}.")
  if randaugment is not None and randaugment[0] < 0:
    raise ValueError(f"RandAugment num_layers must be >= 0, got {randaugment[0]}.")
  image_size = options["image_size"]
  if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 0:
    raise ValueError(f"image_size must be an integer >= 0 (0: the images' own size), got "
                     f"{image_size!r}.")
  spec = parse_dataset(dataset)
  if not spec.corruption and source_of(spec).streams(spec, data_dir, download):
    from smoothing_jax.data.sources.tfds import streamed_spec
    spec = streamed_spec(spec)
  if data_pipeline == "auto":
    data_pipeline = "tfdata" if spec.streamed or spec.base in HOST_PATH else "resident"
  if data_pipeline == "resident" and spec.streamed:
    raise ValueError(f"{dataset!r} is streamed from disk (too large to hold in memory): use "
                     "data_pipeline 'tfdata' (or 'auto').")
  resident = data_pipeline == "resident"
  train_fraction = check_train_fraction(options["train_fraction"])
  if not 0.0 <= holdout_fraction < 1.0:
    raise ValueError(f"holdout_fraction must lie in [0, 1), got {holdout_fraction!r}.")
  if spec.corruption:
    raise ValueError(f"{dataset!r} is an evaluation-only corruption set; train on {spec.base!r}.")
  if global_batch_size % jax.process_count():
    raise ValueError(f"Global batch size {global_batch_size} is not divisible by "
                     f"{jax.process_count()} processes.")
  holdout_images = holdout_labels = None
  if spec.streamed:
    for name, value, default in (("train_fraction", train_fraction, 1.0),
                                 ("holdout_fraction", holdout_fraction, 0.0)):
      if value != default:
        raise ValueError(f"{name} {value} needs an in-memory training split (CIFAR, npz:, "
                         f"folder:, digits); {dataset!r}'s is streamed: prepare a subset as its "
                         "own dataset instead.")
    from smoothing_jax.data.sources.tfds import prepared_tfds_builder
    splits = prepared_tfds_builder(spec, data_dir, download).info.splits
    eval_images = eval_labels = None
    num_train, num_eval = splits["train"].num_examples, splits[spec.eval_split].num_examples
    # A streamed set's statistics would take a pass over it: its own constants, else ImageNet's.
    mean, std = NORMALIZATION.get(spec.base, NORMALIZATION["imagenet2012"])
    train_images = train_labels = None
  else:
    # The whole training split on every process (global batches independent of the process
    # count); the evaluation split sharded over the processes, or whole on the devices.
    size = (image_size, image_size) if image_size else None
    train_images, train_labels = load_arrays(spec, "train", data_dir, download, shard=False,
                                             size=size)
    if size and train_labels.ndim > 1:
      raise ValueError(f"image_size is for classification sets; {dataset!r} has label maps "
                       "(use crop_size).")
    eval_images, eval_labels = load_arrays(spec, spec.eval_split, data_dir, download,
                                           shard=not resident, size=size)
    mean, std = normalization(spec, train_images)
    if holdout_fraction > 0:
      held = class_balanced_subset(train_labels, holdout_fraction, split_seed)
      rest = np.setdiff1d(np.arange(len(train_labels)), held)
      holdout_images, holdout_labels = train_images[held], train_labels[held]
      train_images, train_labels = train_images[rest], train_labels[rest]
    if train_fraction < 1:
      kept = class_balanced_subset(train_labels, train_fraction, split_seed)
      train_images, train_labels = train_images[kept], train_labels[kept]
    num_train = len(train_images)
    num_eval = len(eval_images) * (1 if resident else jax.process_count())
  if resident:
    from smoothing_jax.data.resident import ResidentPipeline as cls
  else:
    from smoothing_jax.data.sources.tfds import hide_accelerators_from_tensorflow
    hide_accelerators_from_tensorflow()  # before TensorFlow's first op
    from smoothing_jax.data.tfdata import TFDataPipeline as cls
  pipeline = cls(dataset_spec=spec, global_batch_size=global_batch_size, seed=seed,
                 mean=tuple(mean), std=tuple(std), train_images=train_images,
                 train_labels=train_labels, eval_images=eval_images, eval_labels=eval_labels,
                 num_train=num_train, num_eval=num_eval, data_dir=data_dir, download=download,
                 randaugment=randaugment, crop_size=tuple(crop_size) if crop_size else None,
                 eval_cache=options["eval_cache"], holdout_images=holdout_images,
                 holdout_labels=holdout_labels)
  if pipeline.is_segmentation and pipeline.randaugment:
    raise ValueError("RandAugment is not supported for segmentation datasets (it would move "
                     "pixels off their labels).")
  if pipeline.crop_size is not None:
    if not pipeline.is_segmentation:
      raise ValueError(f"crop_size is for segmentation datasets; {dataset!r} has one label per "
                       "image.")
    height, width = train_images.shape[1:3]
    crop = pipeline.crop_size
    if len(crop) != 2 or not (0 < crop[0] <= height and 0 < crop[1] <= width):
      raise ValueError(f"crop_size {crop} must be (h, w) within the {height}×{width} training "
                       "images.")
  if resident:
    pipeline.put_on_devices(mesh)
  return pipeline
