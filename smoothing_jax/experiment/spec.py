"""What rebuilds a run's model without its dataset: the ``ModelSpec`` recorded in ``config.json``,
and the model built from a config and a spec.

``model_spec(config, pipeline)`` reads the classes and the geometry from the data once, at
training time; every later load (evaluation, analyses, notebooks) rebuilds the same model from
the recorded config and spec alone (``build_model``).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from smoothing_jax.data import NUM_CLASSES
from smoothing_jax.models import get_model, is_segmentation_model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The model's classes, stem geometry (``"cifar"`` / ``"imagenet"``) and input shape ``(H, W,
  C)``; the training examples used (the ``train_fraction`` subset); the model options a timm
  ``init_from`` file needs; whether the workdir stands for its ``init_from`` (an evaluation
  run without checkpoints of its own); and the classes' names where the data names them (a
  ``folder:`` set's sorted folders: label i is ``class_names[i]``)."""
  num_classes: int
  stem: str
  image_shape: tuple
  num_train_examples: int | None = None  # None: recorded by a version that did not count them
  model_options: dict = dataclasses.field(default_factory=dict)
  evaluates_init_from: bool = False
  class_names: tuple = ()

  def to_record(self) -> dict:
    """The ``model_spec`` of ``config.json`` (optional fields only where set)."""
    record = {"num_classes": self.num_classes, "stem": self.stem,
              "image_shape": list(self.image_shape)}
    if self.num_train_examples is not None:
      record["num_train_examples"] = self.num_train_examples
    if self.model_options:
      record["model_options"] = dict(self.model_options)
    if self.evaluates_init_from:
      record["evaluates_init_from"] = True
    if self.class_names:
      record["class_names"] = list(self.class_names)
    return record

  @classmethod
  def from_record(cls, record: dict) -> ModelSpec:
    count = record.get("num_train_examples")
    return cls(int(record["num_classes"]), record["stem"],
               tuple(int(d) for d in record["image_shape"]),
               None if count is None else int(count), dict(record.get("model_options", {})),
               bool(record.get("evaluates_init_from", False)),
               tuple(record.get("class_names", ())))


def model_spec(config, pipeline, model_options: dict | None = None) -> ModelSpec:
  """The spec of ``config.model`` on ``pipeline``'s data: classes (``config.num_classes`` > 0
  overrides the dataset's), stem geometry, image shape and the number of training examples;
  ``model_options``: those of a timm ``init_from`` (``init_from.model_options``)."""
  dataset = pipeline.dataset_spec
  if config.num_classes <= 0 and pipeline.is_segmentation and dataset.base not in NUM_CLASSES:
    raise ValueError(
        f"Set --config.num_classes for the segmentation dataset {config.input.dataset!r}: label "
        "maps mark void pixels with values outside [0, num_classes), so the classes cannot be "
        "inferred.")
  num_classes = config.num_classes if config.num_classes > 0 else (
      NUM_CLASSES.get(dataset.base) or dataset.num_classes or int(pipeline.train_labels.max()) + 1)
  return ModelSpec(int(num_classes), dataset.geometry, tuple(int(d) for d in pipeline.image_shape),
                   int(pipeline.num_train), dict(model_options or {}),
                   class_names=tuple(dataset.class_names))


def compute_dtype(config):
  """The models' computation dtype: bfloat16 under ``config.half_precision`` (as in the Flax
  ImageNet example), else float32.  Parameters, optimizer state and BatchNorm statistics stay
  float32 either way, and softmax, losses and metrics are computed in float32."""
  return jnp.bfloat16 if config.get("half_precision", False) else jnp.float32


def model_overrides(config, spec: ModelSpec) -> dict:
  """The ``get_model`` options of a run: ``spec.model_options`` (the layout of a timm
  ``init_from``), then ``config.model_kwargs`` that are set, and the stem of ``spec`` unless
  set."""
  overrides = {**spec.model_options,
               **{k: v for k, v in config.model_kwargs.items() if v is not None}}
  overrides.setdefault("stem", spec.stem)
  return overrides


def build_model(config, spec: ModelSpec):
  """``config.model`` with :func:`model_overrides` for ``spec``'s classes and geometry, computing
  in :func:`compute_dtype` (training and every evaluation of the workdir alike)."""
  return get_model(config.model, spec.num_classes, dtype=compute_dtype(config),
                   **model_overrides(config, spec))


def check_model_fits(config, model, pipeline) -> None:
  """A clear error when a segmentation model meets one label per image, or a classifier label
  maps."""
  if is_segmentation_model(model) != pipeline.is_segmentation:
    kind = ("label maps (segmentation)"
            if pipeline.is_segmentation else "one label per image (classification)")
    raise ValueError(
        f"Model {config.model!r} does not fit dataset {config.input.dataset!r}, which has {kind}; "
        "use a unet_* model for segmentation and a classifier otherwise.")
