"""What a dataset string names: :class:`DatasetSpec`, the errors of a set that cannot be read,
the corruption sets' names and the statistics of the built-in sets.  The layer below
:mod:`~smoothing_jax.data.datasets` and the sources (:mod:`smoothing_jax.data.sources`), which
both use it."""
from __future__ import annotations

import dataclasses

NORMALIZATION = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet2012": 1000, "digits": 10, "camvid": 11}
# Corruption types are named canonically (:mod:`~smoothing_jax.data.corruption_names`); TFDS
# ``cifar10_corrupted`` names two of them differently.  Our CIFAR-100-C builder and TFDS
# ``imagenet2012_corrupted`` use the canonical names.
SOURCE_CORRUPTION_NAMES = {
    "cifar10": {"glass_blur": "frosted_glass_blur", "elastic_transform": "elastic"}}
BASES = tuple(NORMALIZATION)


class DatasetUnavailableError(RuntimeError):
  """A dataset is neither prepared locally nor downloadable; the message says how to get it."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """What a ``dataset`` config string refers to (:func:`parse_dataset`; the forms: its message
  and the Data page).

  ``source``: the key of :data:`smoothing_jax.data.sources.REGISTRY` that reads it; ``base``:
  the set it is, or derives from (``cifar10`` for ``cifar10_corrupted/fog_3`` and
  ``tfds:cifar10``; the source's name for ``npz:``, ``folder:``, ...); ``split``: the
  evaluation split a ``tfds:<name>:<split>`` name gives; ``class_names``: where the source
  names them (``folder:``); ``geometry``: "imagenet" (224 × 224 crops, ImageNet's stem) or
  "cifar"; ``streamed``: the training split read from disk through tf.data as training goes.
  """
  name: str
  source: str
  base: str
  corruption: tuple | None = None  # (type, severity)
  num_classes: int | None = None   # where the name or the source says it
  split: str = ""
  class_names: tuple = ()
  geometry: str = "cifar"
  streamed: bool = False

  @property
  def eval_split(self) -> str:
    return self.split or ("validation" if self.base == "imagenet2012" else "test")

  @property
  def tfds_name(self) -> str:
    """The TFDS builder (and config) to read: corruption types in the source's own naming."""
    if self.corruption is None:
      return self.base
    return corruption_dataset(self.base, *self.corruption, source_names=True)


def corruption_dataset(base: str, corruption: str, severity: int,
                       source_names: bool = False) -> str:
  """``<base>_corrupted/<type>_<severity>`` for a canonical corruption type; ``source_names``
  spells the type as the TFDS builder of ``base`` does (e.g. ``elastic`` for CIFAR-10-C)."""
  if source_names:
    corruption = SOURCE_CORRUPTION_NAMES.get(base, {}).get(corruption, corruption)
  return f"{base}_corrupted/{corruption}_{severity}"
