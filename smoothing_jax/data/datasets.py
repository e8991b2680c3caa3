"""Datasets: what a ``dataset`` config string names, and loading its examples.

Owns the dataset specs and name parsing (:class:`DatasetSpec`, :func:`parse_dataset`,
:func:`corruption_dataset` and the constants; the corruption types are in
:mod:`~smoothing_jax.data.corruption_names`), the sources (TFDS CIFAR-10/100, ImageNet,
corruption sets, CamVid; local ``npz:`` arrays; scikit-learn's ``digits``),
:class:`DatasetUnavailableError`, the class-balanced training subsets of ``train_fraction``
(:func:`class_balanced_subset`), the per-dataset normalisation statistics and sums over
processes (multi-host).  Each process reads only its shard.

TensorFlow (TFDS) is imported only when a TFDS dataset is read (:func:`import_tfds`); ``npz:``,
``digits`` and ``synthetic:`` need none.
"""
from __future__ import annotations

import dataclasses
import os
import re
import socket
import threading
import time
import urllib.parse
import urllib.request

import jax
import numpy as np

from smoothing_jax.data.corruption_names import CORRUPTIONS, EXTRA_CORRUPTIONS

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
SEGMENTATION_DATASETS = ("camvid",)  # TFDS builder in smoothing_jax.data.camvid
# Other TFDS image sets read as they are (out-of-distribution sets of the uncertainty literature).
OTHER_TFDS = ("svhn_cropped",)
# A TFDS download starts only once its hosts answer: offline, TFDS retries each file for minutes
# and a run killed meanwhile leaves ``incomplete.*`` folders in the data_dir.  Each host (or the
# proxy that reaches it) gets this many seconds to accept a connection, all probed at once.
PROBE_TIMEOUT_S = 3.0
DEFAULT_PORTS = {"http": 80, "https": 443, "ftp": 21}


class DatasetUnavailableError(RuntimeError):
  """A dataset is neither prepared locally nor downloadable; the message says how to get it."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """What a ``dataset`` config string refers to.

  ``name`` forms: ``cifar10``, ``cifar100``, ``imagenet2012``, ``camvid``, ``svhn_cropped``,
  ``<base>_corrupted/<type>_<severity>`` (test set only), ``npz:<dir>`` (uint8
  ``images`` [N,H,W,3] + ``labels`` [N], or label maps [N,H,W], in
  ``<dir>/{train,test}.npz``), ``digits`` (scikit-learn's bundled 8×8 digits,
  upsampled to 32×32; no network needed), ``synthetic:<N>x<H>x<W>x<C>:<classes>`` (N random
  uint8 training images and labels, and N/5 test ones, at most 10,000; for benchmarks).
  """
  name: str
  source: str                     # "tfds", "npz", "digits" or "synthetic"
  base: str                       # cifar10 | cifar100 | imagenet2012 | npz | digits | synthetic
  corruption: tuple | None = None  # (type, severity)
  num_classes: int | None = None   # where the name says it (synthetic)

  @property
  def geometry(self) -> str:
    return "imagenet" if self.base == "imagenet2012" else "cifar"

  @property
  def eval_split(self) -> str:
    return "validation" if self.base == "imagenet2012" else "test"

  @property
  def tfds_name(self) -> str:
    """The TFDS builder (and config) to read: corruption types in the source's own naming."""
    if self.corruption is None:
      return self.name
    return corruption_dataset(self.base, *self.corruption, source_names=True)


def corruption_dataset(base: str, corruption: str, severity: int,
                       source_names: bool = False) -> str:
  """``<base>_corrupted/<type>_<severity>`` for a canonical corruption type; ``source_names``
  spells the type as the TFDS builder of ``base`` does (e.g. ``elastic`` for CIFAR-10-C)."""
  if source_names:
    corruption = SOURCE_CORRUPTION_NAMES.get(base, {}).get(corruption, corruption)
  return f"{base}_corrupted/{corruption}_{severity}"


def parse_dataset(name: str) -> DatasetSpec:
  """Parse a dataset string; raise ``ValueError`` naming the supported forms."""
  if name == "digits":
    return DatasetSpec(name, "digits", "digits")
  if name.startswith("synthetic:"):
    match = re.fullmatch(r"synthetic:(\d+)x(\d+)x(\d+)x(\d+):(\d+)", name)
    if not match or min(int(g) for g in match.groups()) < 1:
      raise ValueError(f"dataset {name!r}: write synthetic:<N>x<H>x<W>x<C>:<classes> with positive "
                       "integers, e.g. synthetic:50000x32x32x3:100.")
    return DatasetSpec(name, "synthetic", "synthetic", num_classes=int(match.group(5)))
  if name.endswith(".npz") and not name.startswith("npz:"):  # one file: a test split
    name = f"npz:{name}"
  if name.startswith("npz:"):
    if not name[4:]:
      raise ValueError(
          "dataset 'npz:' needs a directory: npz:<dir> with train.npz and test.npz.")
    return DatasetSpec(name, "npz", "npz")
  if name in BASES + SEGMENTATION_DATASETS + OTHER_TFDS:
    return DatasetSpec(name, "tfds", name)
  base, _, config = name.partition("_corrupted/")
  if base in BASES and config:
    ctype, _, severity = config.rpartition("_")
    source_to_canonical = {v: k for k, v in SOURCE_CORRUPTION_NAMES.get(base, {}).items()}
    canonical = source_to_canonical.get(ctype, ctype)
    if canonical in CORRUPTIONS + EXTRA_CORRUPTIONS and severity in {"1", "2", "3", "4", "5"}:
      return DatasetSpec(corruption_dataset(base, canonical, int(severity)), "tfds", base,
                         (canonical, int(severity)))
  raise ValueError(
      f"Unknown dataset {name!r}. Supported: "
      f"{', '.join(BASES + SEGMENTATION_DATASETS + OTHER_TFDS)}, "
      "'<base>_corrupted/<type>_<1-5>' "
      f"(types: {', '.join(CORRUPTIONS)}), 'npz:<dir>' and 'digits'.")


# ----------------------------------------------------------------------------- TFDS

def hide_accelerators_from_tensorflow() -> None:
  """TensorFlow only feeds the host; keep it off GPUs/TPUs that JAX owns.

  Called before TensorFlow runs its first op (:func:`import_tfds`).  Harmless to call again; once
  TensorFlow has initialised its devices they can no longer be changed, and this does nothing.
  """
  import tensorflow as tf
  for device_type in ("GPU", "TPU"):
    try:
      tf.config.set_visible_devices([], device_type)
    except RuntimeError:  # "Visible devices cannot be modified after being initialized"
      pass


def import_tfds(dataset: str):
  """``tensorflow_datasets``, with our TFDS builders registered and TensorFlow kept off the
  accelerators; where TensorFlow is missing, a :class:`DatasetUnavailableError` saying what to
  install to read ``dataset``."""
  try:
    import tensorflow_datasets as tfds
  except ImportError as e:
    raise DatasetUnavailableError(
        f"Dataset {dataset!r} is read with TensorFlow Datasets, which is not installed ({e}): "
        "pip install tensorflow-cpu tensorflow-datasets, or give the arrays as "
        "--config.input.dataset=npz:<dir>.") from None
  hide_accelerators_from_tensorflow()
  from smoothing_jax.data import camvid, cifar100_corrupted  # noqa: F401  (register builders)
  return tfds


def unreachable_download_host(urls) -> str | None:
  """``"<host>:<port> (<why>)"`` for a host of ``urls`` (or the proxy that reaches it) that
  accepts no TCP connection within :data:`PROBE_TIMEOUT_S`; None when every one does.  Each probe
  runs in a daemon thread, so a name lookup that hangs costs the timeout, not the resolver's."""
  proxies = urllib.request.getproxies()
  endpoints = set()
  for url in urls:
    parts = urllib.parse.urlsplit(url)
    if proxies.get(parts.scheme) and not urllib.request.proxy_bypass(parts.hostname):
      parts = urllib.parse.urlsplit(proxies[parts.scheme])
    if parts.hostname:
      endpoints.add((parts.hostname, parts.port or DEFAULT_PORTS.get(parts.scheme, 443)))
  timeout = PROBE_TIMEOUT_S
  failures = {endpoint: f"no answer within {timeout:g} s" for endpoint in endpoints}

  def probe(endpoint):
    try:
      socket.create_connection(endpoint, timeout=timeout).close()
      failures[endpoint] = None
    except OSError as e:
      failures[endpoint] = str(e) or type(e).__name__

  threads = [threading.Thread(target=probe, args=(e,), daemon=True) for e in sorted(endpoints)]
  for thread in threads:
    thread.start()
  deadline = time.monotonic() + timeout
  for thread in threads:  # one deadline: a probe still waiting then counts as no answer
    thread.join(max(0.0, deadline - time.monotonic()))
  return next((f"{host}:{port} ({why})" for (host, port), why in sorted(failures.items())
               if why is not None), None)


def tfds_builder(spec: DatasetSpec, data_dir: str | None, download: bool):
  """The TFDS builder of ``spec``, downloaded and prepared first if ``download`` and needed;
  :class:`DatasetUnavailableError` at once where a download host does not answer."""
  tfds = import_tfds(spec.name)
  builder = tfds.builder(spec.tfds_name, data_dir=data_dir)
  if not builder.is_prepared() and download:
    unreachable = unreachable_download_host(builder.url_infos or ())
    if unreachable:
      raise DatasetUnavailableError(_missing_message(
          spec, builder, f"Downloading it (input.download) needs {unreachable}."))
    try:
      builder.download_and_prepare()
    except Exception as e:  # manual download required, a host that fails mid-way, ...
      raise DatasetUnavailableError(
          _missing_message(spec, builder, f"Download failed: {e}")) from e
  return builder


def prepared_tfds_builder(spec: DatasetSpec, data_dir: str | None, download: bool):
  """:func:`tfds_builder`, or :class:`DatasetUnavailableError` if it is not prepared."""
  builder = tfds_builder(spec, data_dir, download)
  if not builder.is_prepared():
    raise DatasetUnavailableError(_missing_message(spec, builder, _download_hint(download)))
  return builder


def _download_hint(download: bool) -> str:
  return "" if download else "--config.input.download=True downloads it (TFDS)."


def _missing_message(spec, builder, reason):
  """One line: ``spec`` is not in the data_dir, ``reason``, and the ways to provide it."""
  reason = f"{reason} " if reason else ""
  if spec.base in SEGMENTATION_DATASETS:
    return (f"Dataset {spec.name!r} is not prepared in data_dir {str(builder.data_dir_root)!r}. "
            f"{reason}Prepare it from the downloaded release with "
            f"`python -m smoothing_jax.data.{spec.base} --manual_dir=<release> "
            f"--data_dir=<dir>` and pass --config.input.data_dir=<dir>, or train from local arrays "
            f"with --config.input.dataset=npz:<dir> (uint8 images [N,H,W,3] and label maps [N,H,W] "
            f"in train.npz/test.npz).")
  return (f"Dataset {spec.name!r} is not prepared in data_dir {str(builder.data_dir_root)!r} "
          f"(searched {builder.data_dir!r}). {reason}Prepare it on a machine with network "
          f"access with `tfds build {spec.name.split('/')[0]} --data_dir=<dir>` (ImageNet and "
          f"CIFAR-100-C need --manual_dir) and pass --config.input.data_dir=<dir>, or name local "
          f"arrays npz:<dir> in its place (in --config.input.dataset or "
          f"--config.evals.ood.datasets; uint8 images [N,H,W,3] and labels [N] in "
          f"train.npz/test.npz).")


def tfds_split(spec: DatasetSpec, split: str, data_dir: str | None, download: bool,
               encoded_images: bool = False, shard: bool = True):
  """This process's shard (``shard=False``: all) of a TFDS split as ``{"image", "label"}``
  examples (``encoded_images``: the stored JPEG bytes, left for the augmentation to decode)."""
  tfds = import_tfds(spec.name)
  builder = tfds_builder(spec, data_dir, download)
  decoders = {"image": tfds.decode.SkipDecoding()} if encoded_images else None
  try:
    return builder.as_dataset(split=tfds.split_for_jax_process(split) if shard else split,
                              shuffle_files=False, decoders=decoders)
  except AssertionError as e:  # TFDS: "could not find data in ..."
    raise DatasetUnavailableError(_missing_message(spec, builder, _download_hint(download))) from e


# ----------------------------------------------------------------------------- arrays

def _digits_arrays(split: str):
  from sklearn.datasets import load_digits  # small; ships its data
  digits = load_digits()
  images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  images = np.repeat(images, 3, axis=-1).astype(np.float32)
  # Bilinear with half-pixel centres: equal to tf.image.resize(..., "bilinear") for upsampling.
  images = np.asarray(jax.image.resize(images, (len(images), 32, 32, 3), method="linear"))
  images = np.clip(np.round(images), 0, 255).astype(np.uint8)
  order = np.random.default_rng(0).permutation(len(images))
  held_out = order[:360]  # fixed held-out test split
  idx = np.sort(held_out if split == "test" else order[360:])
  return images[idx], digits.target[idx].astype(np.int32)


def _synthetic_arrays(spec: DatasetSpec, split: str):
  """Random uint8 images and labels, the same for the same name and split."""
  n, h, w, c = (int(d) for d in spec.name.split(":")[1].split("x"))
  if split != "train":
    n = max(1, min(10_000, n // 5))
  rng = np.random.default_rng([n, h, w, c, spec.num_classes, split == "train"])
  return (rng.integers(0, 256, (n, h, w, c), dtype=np.uint8),
          rng.integers(0, spec.num_classes, n, dtype=np.int32))


def _npz_path(spec: DatasetSpec, split: str) -> str:
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


def _npz_arrays(spec: DatasetSpec, split: str):
  path = _npz_path(spec, split)
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
  return images, labels.astype(np.int32)


def as_model_images(name: str, images: np.ndarray, image_shape) -> np.ndarray:
  """Test ``images`` of the set ``name`` as the model takes them: grayscale ones ``[N,H,W,1]``
  converted as OpenOOD's test preprocessing does for every set
  (openood/evaluation_api/preprocessor.py at 3c35632, l. 42-59: PIL ``convert('RGB')``, which
  repeats the channel, ``Resize(size)`` of the shorter side, bilinear, and ``CenterCrop``),
  with Pillow as there; colour images of another shape are refused in one line."""
  image_shape = tuple(image_shape)
  if images.shape[-1] == 1 and image_shape[-1] == 3:
    from PIL import Image
    height, width = image_shape[:2]
    short = min(images.shape[1:3])
    # torchvision's Resize(int): the shorter side to the size, the other in proportion.
    scale = min(height, width) / short
    size = (max(width, int(images.shape[2] * scale)), max(height, int(images.shape[1] * scale)))
    left, top = round((size[0] - width) / 2), round((size[1] - height) / 2)
    images = np.stack([
        np.asarray(Image.fromarray(x[..., 0], "L").convert("RGB").resize(size, Image.BILINEAR)
                   .crop((left, top, left + width, top + height)))
        for x in images])
  if images.shape[1:] != image_shape:
    raise ValueError(f"Dataset {name!r} has images of shape {images.shape[1:]}, the model takes "
                     f"{image_shape}.")
  return images


def check_available(spec: DatasetSpec, split: str, data_dir: str | None = None,
                    download: bool = False) -> None:
  """:class:`DatasetUnavailableError` (one line) unless ``split`` of ``spec`` can be read: its
  ``npz:`` file exists, or its TFDS split opens as reading it would (downloaded first where
  ``download``), without reading its examples.  For callers that read a set after long work (an
  evaluator's in-distribution pass), so that a missing set fails before that work, not after."""
  if spec.source == "npz":
    _npz_path(spec, split)
  elif spec.source == "tfds":
    tfds_split(spec, split, data_dir, download, shard=False)


def load_arrays(spec: DatasetSpec, split: str, data_dir: str | None = None,
                download: bool = False, shard: bool = True):
  """This process's shard (every ``process_count``-th example; ``shard=False``: the whole split)
  of a small split as numpy ``(uint8 images [N,H,W,3], int32 labels [N] or label maps
  [N,H,W])``."""
  if spec.source == "digits":
    images, labels = _digits_arrays(split)
  elif spec.source == "synthetic":
    images, labels = _synthetic_arrays(spec, split)
  elif spec.source == "npz":
    images, labels = _npz_arrays(spec, split)
  else:
    tfds = import_tfds(spec.name)
    ds = tfds_split(spec, split, data_dir, download, shard=shard)
    batches = list(tfds.as_numpy(ds.map(lambda ex: (ex["image"], ex["label"])).batch(4096)))
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches]).astype(np.int32)
    if labels.ndim == 4:  # label maps are stored as one-channel images
      labels = labels[..., 0]
    return images, labels
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
