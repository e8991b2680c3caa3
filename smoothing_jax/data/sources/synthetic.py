"""``synthetic:<N>x<H>x<W>x<C>:<classes>``: N random uint8 training images and labels, and N/5
test ones (at most 10,000), the same for the same name and split; for benchmarks."""
from __future__ import annotations

import re

import numpy as np

from smoothing_jax.data.dataset_spec import DatasetSpec
from smoothing_jax.data.sources.base import Source


class Synthetic(Source):
  prefix = "synthetic"
  forms = ("synthetic:<N>x<H>x<W>x<C>:<classes> (random images, for benchmarks)",)

  def parse(self, name: str) -> DatasetSpec:
    match = re.fullmatch(r"synthetic:(\d+)x(\d+)x(\d+)x(\d+):(\d+)", name)
    if not match or min(int(g) for g in match.groups()) < 1:
      raise ValueError(f"dataset {name!r}: write synthetic:<N>x<H>x<W>x<C>:<classes> with positive "
                       "integers, e.g. synthetic:50000x32x32x3:100.")
    return DatasetSpec(name, "synthetic", "synthetic", num_classes=int(match.group(5)))

  def load(self, spec, split, data_dir, download, size):
    n, h, w, c = (int(d) for d in spec.name.split(":")[1].split("x"))
    if size is not None:
      h, w = size
    if split != "train":
      n = max(1, min(10_000, n // 5))
    rng = np.random.default_rng([n, h, w, c, spec.num_classes, split == "train"])
    return (rng.integers(0, 256, (n, h, w, c), dtype=np.uint8),
            rng.integers(0, spec.num_classes, n, dtype=np.int32))
