"""What a dataset source is (:class:`Source`), and the one rule that brings images to a size.

A source reads the datasets of one form of ``config.input.dataset`` (``npz:<dir>``,
``folder:<dir>``, ``tfds:<name>``, ...) into uint8 arrays; :mod:`smoothing_jax.data.datasets`
asks the source its name names, and nothing else asks which source a dataset comes from.
"""
from __future__ import annotations

import numpy as np


class Source:
  """One way of naming and reading datasets.  A new source is one file in
  ``smoothing_jax/data/sources/`` subclassing this, and one line in ``sources.REGISTRY``.

  ``prefix``: the ``<prefix>:`` its names start with ("" where it reads names without one);
  ``forms``: what the names look like, for the message naming every form (``"npz:<dir>"``);
  ``built_in``: the names without a prefix it reads (:meth:`built_in_spec`; disjoint from every
  other source's), for the message.
  """
  prefix: str = ""
  forms: tuple[str, ...] = ()
  built_in: tuple[str, ...] = ()

  def parse(self, name: str):
    """The :class:`~smoothing_jax.data.dataset_spec.DatasetSpec` of ``name``, which starts with this
    source's ``<prefix>:`` (``ValueError``, one line naming the form, where it is malformed)."""
    raise NotImplementedError

  def built_in_spec(self, name: str):
    """The spec of ``name`` (no prefix) where it is one of this source's built-in names; None
    where it is not (default: a source without built-in names)."""
    return None

  def load(self, spec, split: str, data_dir: str | None, download: bool,
           size: tuple[int, int] | None):
    """``(uint8 images [N, H, W, C], integer labels [N] or label maps [N, H, W])`` of ``split``;
    with ``size`` (h, w) every image brought to it by :func:`fit_to_size`; without, images of
    several sizes are refused in one line naming ``config.input.image_size``."""
    raise NotImplementedError

  def check(self, spec, split: str, data_dir: str | None, download: bool) -> None:
    """:class:`~smoothing_jax.data.dataset_spec.DatasetUnavailableError` (one line) unless ``split``
    can be read, without reading its examples (default: nothing to check ahead)."""

  def streams(self, spec, data_dir: str | None, download: bool) -> bool:
    """Whether the training split is streamed from disk through tf.data, too large to hold in
    memory (default: never)."""
    return False


def fit_to_size(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
  """``image`` (uint8 [H, W, C]) at ``size`` (h, w): the shorter side resized to the target's
  shorter side (bilinear, Pillow), the other in proportion, then the centre cropped; unchanged at
  that size already.  torchvision's ``Resize(s)`` + ``CenterCrop(size)``: the evaluation
  preprocessing of OpenOOD (openood/evaluation_api/preprocessor.py at 3c35632, l. 42-59) and of
  most ImageNet-style sets."""
  height, width = size
  if image.shape[:2] == (height, width):
    return image
  from PIL import Image
  channels = image.shape[-1]
  picture = Image.fromarray(image[..., 0] if channels == 1 else image,
                            "L" if channels == 1 else "RGB")
  # torchvision's Resize(int): the shorter side to the size, the other in proportion (truncated).
  scale = min(height, width) / min(image.shape[:2])
  resized = (max(width, int(image.shape[1] * scale)), max(height, int(image.shape[0] * scale)))
  left, top = round((resized[0] - width) / 2), round((resized[1] - height) / 2)
  out = np.asarray(picture.resize(resized, Image.BILINEAR).crop(
      (left, top, left + width, top + height)))
  return out[..., None] if channels == 1 else out


def stack_images(name: str, images, size: tuple[int, int] | None) -> np.ndarray:
  """uint8 ``[N, H, W, C]`` of the images (each ``[H, W, C]``) of the set ``name``: each fitted to
  ``size`` (:func:`fit_to_size`), or, without ``size``, stacked as they are where they share one
  shape, else refused in one line."""
  images = list(images)
  if size is not None:
    return np.stack([fit_to_size(image, size) for image in images])
  shapes = sorted({image.shape for image in images})
  if len(shapes) > 1:
    shown = ", ".join("×".join(map(str, s[:2])) + ("" if s[2:] == (3,) else f"×{s[2]}")
                      for s in shapes[:3])
    raise ValueError(f"Dataset {name!r} has images of {len(shapes)} sizes ({shown}, ...): set "
                     "--config.input.image_size=<S> (each image's shorter side resized to S, "
                     "then the centre S×S cropped).")
  return np.stack(images) if images else np.zeros((0, 1, 1, 3), np.uint8)
