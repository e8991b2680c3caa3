"""Datasets: what a ``dataset`` config string names, and reading its examples.

Owns the parsing of a name (:func:`parse_dataset`: the spec and constants are in
:mod:`~smoothing_jax.data.dataset_spec`, the corruption types in
:mod:`~smoothing_jax.data.corruption_names`), the reading of a split through its source
(:func:`load_arrays`, :func:`check_available`; each source one module of
:mod:`smoothing_jax.data.sources`: TFDS, ``folder:``, ``npz:``, ``synthetic:``, ``digits``),
evaluation sets brought to the model's input (:func:`as_model_images`), the class-balanced
training subsets of ``train_fraction`` (:func:`class_balanced_subset`), and the per-dataset
normalisation statistics.  Each process reads only its shard.

TensorFlow (TFDS) is imported only when a TFDS dataset is read; ``folder:``, ``npz:``,
``digits`` and ``synthetic:`` need none.
"""
from __future__ import annotations

import jax
import numpy as np

from smoothing_jax.data.dataset_spec import NORMALIZATION, DatasetSpec


def parse_dataset(name: str) -> DatasetSpec:
  """The spec of a dataset string, read by the source its ``<prefix>:`` names, or for a name
  without one (``cifar10``, ``digits``, ...) by the source whose built-in names hold it; a path
  ending in ``.npz`` is ``npz:<path>``.  ValueError (one line) for a malformed name, or an
  unknown one naming every form and built-in name."""
  from smoothing_jax.data.sources import REGISTRY
  if name.endswith(".npz") and not name.startswith("npz:"):  # one file: a test split
    name = f"npz:{name}"
  prefix, colon, _ = name.partition(":")
  if colon and prefix in REGISTRY:
    return REGISTRY[prefix].parse(name)
  if not colon:  # the sources' built-in names are disjoint: one claims it at most
    for source in REGISTRY.values():
      spec = source.built_in_spec(name)
      if spec is not None:
        return spec
  forms = [form for source in REGISTRY.values() for form in source.forms]
  built_in = [n for source in REGISTRY.values() for n in source.built_in]
  raise ValueError(f"Unknown dataset {name!r}. Sources: {'; '.join(forms)}. Built-in names: "
                   f"{', '.join(built_in)}.")


def source_of(spec: DatasetSpec):
  """The :class:`~smoothing_jax.data.sources.base.Source` that reads ``spec``."""
  from smoothing_jax.data.sources import REGISTRY
  return REGISTRY[spec.source]


# ----------------------------------------------------------------------------- arrays

def as_model_images(name: str, images: np.ndarray, image_shape) -> np.ndarray:
  """Test ``images`` of the set ``name`` as the model takes them, as OpenOOD's test
  preprocessing brings every set to its model (openood/evaluation_api/preprocessor.py at
  3c35632, l. 42-59): grayscale ones ``[N,H,W,1]`` made RGB by repeating the channel (PIL's
  ``convert('RGB')``), and images of another size brought to the model's by
  :func:`~smoothing_jax.data.sources.base.fit_to_size` (the shorter side resized, bilinear,
  then the centre cropped)."""
  from smoothing_jax.data.sources.base import stack_images
  image_shape = tuple(image_shape)
  if images.shape[-1] == 1 and image_shape[-1] == 3:
    images = np.repeat(images, 3, axis=-1)
  if images.shape[1:3] != image_shape[:2]:
    images = stack_images(name, images, image_shape[:2])
  if images.shape[1:] != image_shape:
    raise ValueError(f"Dataset {name!r} has images of shape {images.shape[1:]}, the model takes "
                     f"{image_shape}.")
  return images


def check_available(spec: DatasetSpec, split: str, data_dir: str | None = None,
                    download: bool = False) -> None:
  """:class:`DatasetUnavailableError` (one line) unless ``split`` of ``spec`` can be read (its
  ``npz:`` file or ``folder:`` split exists, its TFDS split opens as reading it would,
  downloaded first where ``download``), without reading its examples.  For callers that read a
  set after long work (an evaluator's in-distribution pass), so that a missing set fails before
  that work, not after."""
  source_of(spec).check(spec, split, data_dir, download)


def load_arrays(spec: DatasetSpec, split: str, data_dir: str | None = None,
                download: bool = False, shard: bool = True, size: tuple | None = None):
  """This process's shard (every ``process_count``-th example; ``shard=False``: the whole split)
  of a split held in memory as numpy ``(uint8 images [N,H,W,C], int32 labels [N] or label maps
  [N,H,W])``, read by the spec's source; ``size`` (h, w): every image brought to it
  (:func:`~smoothing_jax.data.sources.base.fit_to_size`)."""
  images, labels = source_of(spec).load(spec, split, data_dir, download, size)
  labels = np.asarray(labels).astype(np.int32, copy=False)
  if not shard:
    return images, labels
  process, count = jax.process_index(), jax.process_count()
  return images[process::count], labels[process::count]


def check_train_fraction(fraction) -> float:
  """``fraction`` as a float if it is a number in (0, 1]; otherwise a ValueError naming it."""
  if isinstance(fraction, bool) or not isinstance(fraction, (int, float, np.floating)) or not (
      0.0 < fraction <= 1.0):
    raise ValueError(f"train_fraction must be a number in (0, 1] (the fraction of the training "
                     f"split kept, class-balanced), got {fraction!r}.")
  return float(fraction)


def class_balanced_subset(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
  """Sorted indices of a fixed, class-balanced ``fraction`` of a training split (the
  small-data regime of HV, e.g. "ViT using 6% dataset for training").

  Class c keeps ``round(fraction · n_c)`` of its ``n_c`` examples (rounded half up), chosen by a
  permutation seeded by ``(seed, c)``: the same labels, fraction and seed always give the same
  subset, and the examples kept at a smaller fraction are among those of a larger one.  Label
  maps ``[N, H, W]`` (segmentation) have no class per example: they form one group, a uniform
  subset.

  Args:
    labels: int ``[N]`` classes (or ``[N, H, W]`` label maps) of the whole split.
    fraction: in (0, 1]; 1 keeps everything.
    seed: ``config.seed``.

  Returns:
    int64 ``[M]`` indices into the split, increasing.

  Raises:
    ValueError: ``fraction`` outside (0, 1], or so small that a class keeps no example.
  """
  fraction = check_train_fraction(fraction)
  labels = np.asarray(labels)
  groups = labels if labels.ndim == 1 else np.zeros(len(labels), np.int64)
  kept = []
  for group in np.unique(groups):
    members = np.flatnonzero(groups == group)
    count = int(np.floor(fraction * len(members) + 0.5))
    if count == 0:
      raise ValueError(f"train_fraction {fraction} keeps none of the {len(members)} training "
                       f"examples of class {group} (each class keeps round(fraction × its "
                       "count)); use a larger fraction.")
    order = np.random.default_rng([seed, int(group)]).permutation(len(members))
    kept.append(members[order[:count]])
  return np.sort(np.concatenate(kept))


# ----------------------------------------------------------------------------- statistics

def normalization(spec: DatasetSpec, train_images: np.ndarray | None = None):
  """Per-channel (mean, std) in [0, 1] units: the paper's constants, or those of
  ``train_images``, the whole training split (every process holds it, so all agree)."""
  key = spec.base if spec.base in NORMALIZATION else None
  if key:
    return NORMALIZATION[key]
  # From each channel's 256-bin histogram: exact, without a float copy of the split.
  channels = train_images.reshape(-1, train_images.shape[-1])
  counts = np.stack([np.bincount(channels[:, c], minlength=256) for c in range(channels.shape[1])])
  values = np.arange(256, dtype=np.float64) / 255.0
  mean = counts @ values / len(channels)
  std = np.sqrt(np.maximum(counts @ values ** 2 / len(channels) - mean ** 2, 0.0))
  return tuple(mean), tuple(std)
