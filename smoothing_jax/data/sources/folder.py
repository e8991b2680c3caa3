"""``folder:<dir>``: torchvision ImageFolder's layout, ``<dir>/{train,test}/<class>/<image>``
(``.png``, ``.jpg``, ``.jpeg``, any case).  Classes are the sorted names of the training split's
folders (a folder with ``test/`` alone, e.g. an OOD set: of its own), label i the i-th; the run
records them (``model_spec.class_names`` in ``config.json``).  Images are decoded with Pillow as
RGB, once: the arrays are kept in ``<dir>/.smoothing_jax_cache/`` (written atomically, rebuilt
when a file, its size or its time changes; not written where the folder is read-only) and held
resident like ``npz:``."""
from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np
from absl import logging

from smoothing_jax.data.dataset_spec import DatasetSpec, DatasetUnavailableError
from smoothing_jax.data.sources.base import Source, stack_images

EXTENSIONS = (".png", ".jpg", ".jpeg")
CACHE = ".smoothing_jax_cache"


def class_names(root: str) -> tuple[str, ...]:
  """The sorted class folders of ``root/train`` (or of ``root/test`` where there is no
  training split)."""
  for split in ("train", "test"):
    path = os.path.join(root, split)
    if os.path.isdir(path):
      return tuple(sorted(e.name for e in os.scandir(path) if e.is_dir()))
  return ()


def image_files(root: str, split: str, classes: tuple[str, ...]) -> list[tuple[str, int]]:
  """``(path relative to root, label)`` of every image of ``split``, in class then file order;
  DatasetUnavailableError (one line) where the split is missing or empty, ValueError where it has
  a class the training split lacks."""
  path = os.path.join(root, split)
  if not os.path.isdir(path):
    raise DatasetUnavailableError(
        f"Dataset 'folder:{root}': {path} does not exist (need {root}/train/<class>/<image> and "
        f"{root}/test/<class>/<image>, .png or .jpg).")
  found = sorted(e.name for e in os.scandir(path) if e.is_dir())
  unknown = sorted(set(found) - set(classes))
  if unknown:
    raise ValueError(f"Dataset 'folder:{root}': {split}/ has classes the training split lacks: "
                     f"{', '.join(unknown[:5])}.")
  files = [(os.path.join(split, name, f), label) for label, name in enumerate(classes)
           if name in found
           for f in sorted(os.listdir(os.path.join(path, name)))
           if f.lower().endswith(EXTENSIONS)]
  if not files:
    raise DatasetUnavailableError(f"Dataset 'folder:{root}': no .png or .jpg image in {path}.")
  return files


def decode(root: str, files: list[tuple[str, int]], size) -> tuple[np.ndarray, np.ndarray]:
  from PIL import Image
  images = []
  for relative, _ in files:
    with Image.open(os.path.join(root, relative)) as image:
      images.append(np.asarray(image.convert("RGB")))
  return (stack_images(f"folder:{root}", images, size),
          np.asarray([label for _, label in files], np.int32))


def cache_path(root: str, split: str, files: list, size) -> str:
  """The cache file of ``split`` at ``size``, named by a digest of every file's path, size and
  modification time (a changed folder gets a new file)."""
  digest = hashlib.sha256(repr(size).encode())
  for relative, label in files:
    stat = os.stat(os.path.join(root, relative))
    digest.update(f"{relative}\0{label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
  return os.path.join(root, CACHE, f"{split}-{digest.hexdigest()[:16]}.npz")


class Folder(Source):
  prefix = "folder"
  forms = ("folder:<dir> (ImageFolder: <dir>/{train,test}/<class>/*.png|jpg)",)

  def parse(self, name: str) -> DatasetSpec:
    root = name[len("folder:"):]
    if not root:
      raise ValueError("dataset 'folder:' needs a directory: folder:<dir> with "
                       "train/<class>/<image> and test/<class>/<image>.")
    classes = class_names(root)
    return DatasetSpec(name, "folder", "folder", num_classes=len(classes) or None,
                       class_names=classes)

  def load(self, spec, split, data_dir, download, size):
    root = spec.name[len("folder:"):]
    files = image_files(root, split, spec.class_names)
    path = cache_path(root, split, files, None if size is None else tuple(size))
    if os.path.exists(path):
      with np.load(path) as cached:
        return cached["images"], cached["labels"]
    logging.info("Decoding the %d images of %s/%s (once; kept in %s).", len(files), root, split,
                 os.path.dirname(path))
    images, labels = decode(root, files, size)
    try:
      os.makedirs(os.path.dirname(path), exist_ok=True)
      handle, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".npz.partial")
      try:
        with os.fdopen(handle, "wb") as f:
          np.savez(f, images=images, labels=labels)
        os.replace(temporary, path)  # complete or absent
      except BaseException:
        os.unlink(temporary)
        raise
    except OSError as e:
      logging.warning("Not caching the decoded images of %s (%s): they are decoded again at "
                      "every run.", root, e)
    return images, labels

  def check(self, spec, split, data_dir, download):
    image_files(spec.name[len("folder:"):], split, spec.class_names)
