"""TFDS builder for CIFAR-100-C (Hendrycks & Dietterich 2019), which the TFDS catalogue lacks.

Reads the published release from ``manual_dir``: ``<corruption>.npy`` (uint8
[50000, 32, 32, 3], severities 1–5 stacked in blocks) and ``labels.npy``,
either directly in ``manual_dir`` or in ``manual_dir/CIFAR-100-C/``.  Configs
are named like CIFAR-10-C's: ``cifar100_corrupted/<corruption>_<severity>``.
"""
from __future__ import annotations

import os

import numpy as np
import tensorflow_datasets as tfds

from smoothing_jax.data.corruption_names import CORRUPTIONS, EXTRA_CORRUPTIONS

SEVERITIES = (1, 2, 3, 4, 5)


class Cifar100CorruptedConfig(tfds.core.BuilderConfig):
  def __init__(self, *, corruption: str, severity: int, **kwargs):
    super().__init__(name=f"{corruption}_{severity}",
                     description=f"{corruption}, severity {severity}",
                     **kwargs)
    self.corruption = corruption
    self.severity = severity


class Cifar100Corrupted(tfds.core.GeneratorBasedBuilder):
  """CIFAR-100-C: the CIFAR-100 test set under 19 corruptions × 5 severities."""
  VERSION = tfds.core.Version("1.0.0")
  MANUAL_DOWNLOAD_INSTRUCTIONS = (
      "Download CIFAR-100-C.tar (https://zenodo.org/record/3555552), extract it, and pass the "
      "folder holding labels.npy and <corruption>.npy (or its parent) as --manual_dir.")
  BUILDER_CONFIGS = [Cifar100CorruptedConfig(corruption=c, severity=s)
                     for c in CORRUPTIONS + EXTRA_CORRUPTIONS for s in SEVERITIES]

  def _info(self):
    return self.dataset_info_from_configs(
        features=tfds.features.FeaturesDict({
            "image": tfds.features.Image(shape=(32, 32, 3)),
            "label": tfds.features.ClassLabel(num_classes=100),
        }),
        supervised_keys=("image", "label"),
        homepage="https://github.com/hendrycks/robustness")

  def _split_generators(self, dl_manager):
    root = dl_manager.manual_dir
    if not os.path.exists(os.path.join(root, "labels.npy")):
      root = os.path.join(root, "CIFAR-100-C")
    return {"test": self._generate_examples(root)}

  def _generate_examples(self, root):
    images = np.load(os.path.join(root, f"{self.builder_config.corruption}.npy"), mmap_mode="r")
    labels = np.load(os.path.join(root, "labels.npy"))
    per_severity = len(images) // len(SEVERITIES)
    start = per_severity * (self.builder_config.severity - 1)
    for i in range(start, start + per_severity):
      yield i - start, {"image": np.asarray(images[i], np.uint8), "label": int(labels[i])}
