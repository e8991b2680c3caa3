"""``npz:<dir>``: uint8 ``images`` [N, H, W, 3] (or grayscale [N, H, W] / [N, H, W, 1]) and
integer ``labels`` [N] (or label maps [N, H, W]) in ``<dir>/train.npz`` and ``<dir>/test.npz``;
``npz:<file>.npz`` (or a path ending in ``.npz``): one file, read as a test split."""
from __future__ import annotations

import os

import numpy as np

from smoothing_jax.data.dataset_spec import DatasetSpec, DatasetUnavailableError
from smoothing_jax.data.sources.base import Source, stack_images


def npz_path(spec: DatasetSpec, split: str) -> str:
  """``<dir>/<split>.npz`` of an ``npz:<dir>`` spec (``npz:<file>.npz``: that file, a test
  split only); DatasetUnavailableError where it is missing."""
  path = spec.name[4:]
  if path.endswith(".npz"):
    if split != "test":
      raise DatasetUnavailableError(
          f"Dataset {spec.name!r} is one file, read as a test split; its {split} split needs "
          f"npz:<dir> with {split}.npz.")
    if not os.path.isfile(path):
      raise DatasetUnavailableError(f"Dataset {spec.name!r}: {path} does not exist.")
    return path
  path = os.path.join(path, f"{split}.npz")
  if not os.path.exists(path):
    raise DatasetUnavailableError(
        f"Dataset {spec.name!r}: {path} does not exist (need train.npz and test.npz "
        "with uint8 'images' [N,H,W,3] and integer 'labels' [N]).")
  return path


class Npz(Source):
  prefix = "npz"
  forms = ("npz:<dir> (train.npz and test.npz: uint8 'images' [N,H,W,3], integer 'labels' [N])",)

  def parse(self, name: str) -> DatasetSpec:
    if not name[4:]:
      raise ValueError("dataset 'npz:' needs a directory: npz:<dir> with train.npz and test.npz.")
    return DatasetSpec(name, "npz", "npz")

  def load(self, spec, split, data_dir, download, size):
    path = npz_path(spec, split)
    with np.load(path) as data:
      if "images" not in data or "labels" not in data:
        raise ValueError(
            f"{path} must contain arrays 'images' and 'labels', found {sorted(data.files)}.")
      images, labels = data["images"], data["labels"]
    if images.dtype == np.uint8 and images.ndim == 3:  # grayscale [N,H,W] (MNIST)
      images = images[..., None]
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] not in (1, 3):
      raise ValueError(f"{path}: 'images' must be uint8 [N,H,W,3] (or grayscale [N,H,W] / "
                       f"[N,H,W,1]), got {images.dtype} {images.shape}.")
    if labels.shape not in (images.shape[:1], images.shape[:3]):
      raise ValueError(
          f"{path}: 'labels' shape {labels.shape} must be [N] (classes) or [N,H,W] "
          f"(label maps) for images {images.shape}.")
    if size is not None and images.shape[1:3] != tuple(size):
      images = stack_images(spec.name, images, size)
    return images, labels.astype(np.int32)

  def check(self, spec, split, data_dir, download):
    npz_path(spec, split)
