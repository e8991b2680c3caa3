"""TFDS: the built-in names (CIFAR-10/100, ImageNet, their corruption sets, CamVid, SVHN) and
``tfds:<name>[:<split>]``, any TFDS image-classification set, its image and label keys found
from its features.

``tfds:<name>`` reads the training split ``train`` and the evaluation split ``<split>`` (default
``test``).  A set whose prepared files exceed :data:`STREAM_ABOVE_BYTES` streams its training
split through tf.data as ImageNet does (ImageNet's geometry, crops and normalisation); a smaller
one is read into memory, each image brought to ``config.input.image_size`` where it is set.
TensorFlow is imported only when a set is read (:func:`import_tfds`).
"""
from __future__ import annotations

import dataclasses
import re
import socket
import threading
import time
import urllib.parse
import urllib.request

import numpy as np

from smoothing_jax.data.corruption_names import CORRUPTIONS, EXTRA_CORRUPTIONS
from smoothing_jax.data.dataset_spec import (
  BASES,
  SOURCE_CORRUPTION_NAMES,
  DatasetSpec,
  DatasetUnavailableError,
  corruption_dataset,
)
from smoothing_jax.data.sources.base import Source, stack_images

SEGMENTATION_DATASETS = ("camvid",)  # TFDS builder in smoothing_jax.data.camvid
# Other TFDS image sets read as they are (out-of-distribution sets of the uncertainty literature).
OTHER_TFDS = ("svhn_cropped",)
# A ``tfds:`` set whose prepared files are larger streams its training split (ImageNet's 148 GB
# does; CIFAR-100's 160 MB, Places365-small's 26 GB of 256×256 JPEGs would, ...).
STREAM_ABOVE_BYTES = 4 * 2 ** 30
# A TFDS download starts only once its hosts answer: offline, TFDS retries each file for minutes
# and a run killed meanwhile leaves ``incomplete.*`` folders in the data_dir.  Each host (or the
# proxy that reaches it) gets this many seconds to accept a connection, all probed at once.
PROBE_TIMEOUT_S = 3.0
DEFAULT_PORTS = {"http": 80, "https": 443, "ftp": 21}


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
          f"access with `tfds build {spec.tfds_name.split('/')[0]} --data_dir=<dir>` (ImageNet and "
          f"CIFAR-100-C need --manual_dir) and pass --config.input.data_dir=<dir>, or name local "
          f"arrays npz:<dir> in its place (in --config.input.dataset or "
          f"--config.evals.ood.datasets; uint8 images [N,H,W,3] and labels [N] in "
          f"train.npz/test.npz).")


def tfds_split(spec: DatasetSpec, split: str, data_dir: str | None, download: bool,
               encoded_images: bool = False, shard: bool = True, builder=None):
  """This process's shard (``shard=False``: all) of a TFDS split as ``{"image", "label"}``
  examples (``encoded_images``: the stored JPEG bytes, left for the augmentation to decode), read
  by ``builder`` (default: :func:`tfds_builder`'s)."""
  tfds = import_tfds(spec.name)
  builder = builder or tfds_builder(spec, data_dir, download)
  decoders = ({feature_keys(spec, builder.info.features)[0]: tfds.decode.SkipDecoding()}
              if encoded_images else None)
  try:
    return builder.as_dataset(split=tfds.split_for_jax_process(split) if shard else split,
                              shuffle_files=False, decoders=decoders)
  except AssertionError as e:  # TFDS: "could not find data in ..."
    raise DatasetUnavailableError(_missing_message(spec, builder, _download_hint(download))) from e


def feature_keys(spec: DatasetSpec, features) -> tuple[str, str]:
  """``(image key, label key)`` of a TFDS set's ``features``: the built-in sets' ``image`` and
  ``label``; another set's one ``Image`` and one ``ClassLabel`` feature (``image`` / ``label``
  where it has several), or ValueError (one line) for a set that is not image classification."""
  if not spec.name.startswith("tfds:"):
    return "image", "label"
  import tensorflow_datasets as tfds
  flat = dict(features.items()) if hasattr(features, "items") else {}

  def pick(kind, preferred):
    keys = sorted(k for k, f in flat.items() if isinstance(f, kind))
    return preferred if preferred in keys else (keys[0] if len(keys) == 1 else None)

  image, label = pick(tfds.features.Image, "image"), pick(tfds.features.ClassLabel, "label")
  if image is None or label is None:
    described = ", ".join(f"{k}: {type(f).__name__}" for k, f in sorted(flat.items()))
    raise ValueError(f"Dataset {spec.name!r} is not an image-classification set: its features "
                     f"({described}) need one Image and one ClassLabel.")
  return image, label


def examples(spec: DatasetSpec, split: str, data_dir: str | None, download: bool,
             encoded_images: bool = False, shard: bool = True, builder=None):
  """This process's shard (``shard=False``: all) of a TFDS split as ``(image, label)`` pairs (the
  set's own keys, :func:`feature_keys`; ``encoded_images``: the stored JPEG bytes), read by
  ``builder`` (default: :func:`tfds_builder`'s)."""
  builder = builder or tfds_builder(spec, data_dir, download)
  image, label = feature_keys(spec, builder.info.features)
  ds = tfds_split(spec, split, data_dir, download, encoded_images, shard, builder)
  return ds.map(lambda ex: (ex[image], ex[label]))


class TFDS(Source):
  prefix = "tfds"
  forms = ("tfds:<name>[:<split>] (any TFDS image-classification set; <split>: the evaluation "
           "split, default test)",
           f"<base>_corrupted/<type>_<1-5> (types: {', '.join(CORRUPTIONS)})")
  built_in = BASES + SEGMENTATION_DATASETS + OTHER_TFDS

  def parse(self, name: str) -> DatasetSpec:
    base, _, split = name[len("tfds:"):].partition(":")
    if not re.fullmatch(r"[a-z0-9_]+(/[A-Za-z0-9_.-]+)?", base):
      raise ValueError(f"dataset {name!r}: write tfds:<name>[:<split>] with a TFDS builder "
                       "name, e.g. tfds:oxford_flowers102 or tfds:places365_small:validation.")
    return DatasetSpec(name, "tfds", base, split=split,
                       geometry="imagenet" if base == "imagenet2012" else "cifar")

  def built_in_spec(self, name: str) -> DatasetSpec | None:
    if name in self.built_in:
      return DatasetSpec(name, "tfds", name,
                         geometry="imagenet" if name == "imagenet2012" else "cifar")
    base, _, config = name.partition("_corrupted/")
    if base in BASES and config:
      ctype, _, severity = config.rpartition("_")
      source_to_canonical = {v: k for k, v in SOURCE_CORRUPTION_NAMES.get(base, {}).items()}
      canonical = source_to_canonical.get(ctype, ctype)
      if canonical in CORRUPTIONS + EXTRA_CORRUPTIONS and severity in {"1", "2", "3", "4", "5"}:
        return DatasetSpec(corruption_dataset(base, canonical, int(severity)), "tfds", base,
                           (canonical, int(severity)),
                           geometry="imagenet" if base == "imagenet2012" else "cifar")
    return None

  def load(self, spec, split, data_dir, download, size):
    tfds = import_tfds(spec.name)
    builder = tfds_builder(spec, data_dir, download)
    image_key, _ = feature_keys(spec, builder.info.features)
    ds = examples(spec, split, data_dir, download, shard=False, builder=builder)
    if None not in tuple(builder.info.features[image_key].shape):  # one size: whole batches
      batches = list(tfds.as_numpy(ds.batch(4096)))
      images = np.concatenate([b[0] for b in batches])
      labels = np.concatenate([b[1] for b in batches]).astype(np.int32)
      if size is not None and images.shape[1:3] != tuple(size):
        images = stack_images(spec.name, images, size)
    else:
      pairs = list(tfds.as_numpy(ds))
      images = stack_images(spec.name, (image for image, _ in pairs), size)
      labels = np.asarray([label for _, label in pairs], np.int32)
    if labels.ndim == 4:  # label maps are stored as one-channel images
      labels = labels[..., 0]
    return images, labels

  def check(self, spec, split, data_dir, download):
    tfds_split(spec, split, data_dir, download, shard=False)

  def streams(self, spec, data_dir, download):
    if spec.base == "imagenet2012":
      return True
    if spec.base in self.built_in or not spec.name.startswith("tfds:"):
      return False
    # (0 for a set not prepared yet: read into memory, or refused there in one line)
    return tfds_builder(spec, data_dir, download).info.dataset_size > STREAM_ABOVE_BYTES


def streamed_spec(spec: DatasetSpec) -> DatasetSpec:
  """``spec`` read as ImageNet is: streamed, ImageNet's geometry (224 × 224 crops)."""
  return dataclasses.replace(spec, streamed=True, geometry="imagenet")
