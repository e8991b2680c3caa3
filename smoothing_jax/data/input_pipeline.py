"""Input pipelines (tf.data): TFDS CIFAR-10/100, ImageNet, corruption sets, CamVid, local ``npz:``, digits.

Paper Appendix A recipes: CIFAR training = random 32×32 crop of the 4-pixel
zero-padded image + horizontal flip; ImageNet training = random-resized crop 224
+ flip, evaluation = resize 256 / centre crop 224; per-dataset normalisation.
Segmentation (CamVid, or ``npz:`` with label maps ``[N, H, W]``): a random
``crop_size`` crop of image and label map together + flip; labels outside
``[0, num_classes)`` are void (masked from losses and metrics).

Determinism: the example order of epoch ``e`` is a pure function of
``(seed, e, process_index)`` and augmentation uses stateless ops seeded by the
example's position in that order, so a run resumed at step ``s`` sees exactly
the batches an uninterrupted run would.  Each process reads only its shard.
Evaluation pads the last batch and returns a ``mask`` so every example counts once.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Iterator, Optional

import jax
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from smoothing_jax.data.randaugment import randaugment

# TensorFlow only feeds the host; keep it off GPUs/TPUs that JAX owns.
tf.config.set_visible_devices([], "GPU")
tf.config.set_visible_devices([], "TPU")

NORMALIZATION = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),
    "cifar100": ((0.5071, 0.4867, 0.4408), (0.2675, 0.2565, 0.2761)),
    "imagenet2012": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100, "imagenet2012": 1000, "digits": 10, "camvid": 11}
CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur",
               "zoom_blur", "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate",
               "jpeg_compression")
EXTRA_CORRUPTIONS = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
# Corruption names above are the canonical ones (the paper's, SS's and Hendrycks' file names);
# TFDS ``cifar10_corrupted`` names two of them differently.  Our CIFAR-100-C builder and TFDS
# ``imagenet2012_corrupted`` use the canonical names.
SOURCE_CORRUPTION_NAMES = {"cifar10": {"glass_blur": "frosted_glass_blur", "elastic_transform": "elastic"}}
BASES = tuple(NORMALIZATION)
SEGMENTATION_DATASETS = ("camvid",)  # TFDS builder in smoothing_jax.data.camvid


class DatasetUnavailableError(RuntimeError):
  """A dataset is neither prepared locally nor downloadable; the message says how to get it."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
  """What a ``dataset`` config string refers to.

  ``name`` forms: ``cifar10``, ``cifar100``, ``imagenet2012``, ``camvid``,
  ``<base>_corrupted/<type>_<severity>`` (test set only), ``npz:<dir>`` (uint8
  ``images`` [N,H,W,3] + ``labels`` [N], or label maps [N,H,W], in
  ``<dir>/{train,test}.npz``), ``digits`` (scikit-learn's bundled 8×8 digits,
  upsampled to 32×32; no network needed).
  """
  name: str
  source: str                     # "tfds", "npz" or "digits"
  base: str                       # cifar10 | cifar100 | imagenet2012 | npz | digits
  corruption: Optional[tuple] = None  # (type, severity)

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


def corruption_dataset(base: str, corruption: str, severity: int, source_names: bool = False) -> str:
  """``<base>_corrupted/<type>_<severity>`` for a canonical corruption type; ``source_names``
  spells the type as the TFDS builder of ``base`` does (e.g. ``elastic`` for CIFAR-10-C)."""
  if source_names:
    corruption = SOURCE_CORRUPTION_NAMES.get(base, {}).get(corruption, corruption)
  return f"{base}_corrupted/{corruption}_{severity}"


def parse_dataset(name: str) -> DatasetSpec:
  """Parse a dataset string; raise ``ValueError`` naming the supported forms."""
  if name == "digits":
    return DatasetSpec(name, "digits", "digits")
  if name.startswith("npz:"):
    if not name[4:]:
      raise ValueError("dataset 'npz:' needs a directory: npz:<dir> with train.npz and test.npz.")
    return DatasetSpec(name, "npz", "npz")
  if name in BASES + SEGMENTATION_DATASETS:
    return DatasetSpec(name, "tfds", name)
  base, _, config = name.partition("_corrupted/")
  if base in BASES and config:
    ctype, _, severity = config.rpartition("_")
    canonical = {v: k for k, v in SOURCE_CORRUPTION_NAMES.get(base, {}).items()}.get(ctype, ctype)
    if canonical in CORRUPTIONS + EXTRA_CORRUPTIONS and severity in {"1", "2", "3", "4", "5"}:
      return DatasetSpec(corruption_dataset(base, canonical, int(severity)), "tfds", base,
                         (canonical, int(severity)))
  raise ValueError(
      f"Unknown dataset {name!r}. Supported: {', '.join(BASES + SEGMENTATION_DATASETS)}, "
      "'<base>_corrupted/<type>_<1-5>' "
      f"(types: {', '.join(CORRUPTIONS)}), 'npz:<dir>' and 'digits'.")


# ----------------------------------------------------------------------------- loading

def _tfds_builder(spec: DatasetSpec, data_dir: Optional[str], download: bool):
  builder = tfds.builder(spec.tfds_name, data_dir=data_dir)
  if not builder.is_prepared() and download:
    try:
      builder.download_and_prepare()
    except Exception as e:  # network down, manual download required, ...
      raise DatasetUnavailableError(_missing_message(spec, builder, f"Download failed: {e}")) from e
  return builder


def _missing_message(spec, builder, reason=""):
  if spec.base in SEGMENTATION_DATASETS:
    return (f"Dataset {spec.name!r} is not prepared in data_dir {builder.data_dir_root!r}. {reason} Prepare it "
            f"from the downloaded release with `python -m smoothing_jax.data.{spec.base} --manual_dir=<release> "
            f"--data_dir=<dir>` and pass --config.data_dir=<dir>, or train from local arrays with "
            f"--config.dataset=npz:<dir> (uint8 images [N,H,W,3] and label maps [N,H,W] in train.npz/test.npz).")
  return (f"Dataset {spec.name!r} is not prepared in data_dir {builder.data_dir_root!r} "
          f"(searched {builder.data_dir!r}). {reason} Prepare it on a machine with network access with "
          f"`tfds build {spec.name.split('/')[0]} --data_dir=<dir>` (ImageNet and CIFAR-100-C need "
          f"--manual_dir) and pass --config.data_dir=<dir>, or train from local arrays with "
          f"--config.dataset=npz:<dir> (uint8 images [N,H,W,3] and labels [N] in train.npz/test.npz).")


def tfds_split(spec: DatasetSpec, split: str, data_dir: Optional[str], download: bool) -> tf.data.Dataset:
  """This process's shard of a TFDS split as ``{"image", "label"}`` examples."""
  builder = _tfds_builder(spec, data_dir, download)
  try:
    return builder.as_dataset(split=tfds.split_for_jax_process(split), shuffle_files=False)
  except AssertionError as e:  # TFDS: "could not find data in ..."
    raise DatasetUnavailableError(_missing_message(spec, builder)) from e


def _digits_arrays(split: str):
  from sklearn.datasets import load_digits  # small; ships its data
  digits = load_digits()
  images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)[..., None]
  images = tf.image.resize(np.repeat(images, 3, axis=-1), (32, 32), method="bilinear").numpy()
  images = np.clip(np.round(images), 0, 255).astype(np.uint8)
  order = np.random.default_rng(0).permutation(len(images))
  held_out = order[:360]  # fixed held-out test split
  idx = np.sort(held_out if split == "test" else order[360:])
  return images[idx], digits.target[idx].astype(np.int32)


def _npz_arrays(spec: DatasetSpec, split: str):
  directory = spec.name[4:]
  path = os.path.join(directory, f"{split}.npz")
  if not os.path.exists(path):
    raise DatasetUnavailableError(f"Dataset {spec.name!r}: {path} does not exist (need train.npz and test.npz "
                                  "with uint8 'images' [N,H,W,3] and integer 'labels' [N]).")
  with np.load(path) as data:
    if "images" not in data or "labels" not in data:
      raise ValueError(f"{path} must contain arrays 'images' and 'labels', found {sorted(data.files)}.")
    images, labels = data["images"], data["labels"]
  if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
    raise ValueError(f"{path}: 'images' must be uint8 [N,H,W,3], got {images.dtype} {images.shape}.")
  if labels.shape not in (images.shape[:1], images.shape[:3]):
    raise ValueError(f"{path}: 'labels' shape {labels.shape} must be [N] (classes) or [N,H,W] (label maps) "
                     f"for images {images.shape}.")
  return images, labels.astype(np.int32)


def load_arrays(spec: DatasetSpec, split: str, data_dir: Optional[str] = None, download: bool = False):
  """This process's shard of a small split as numpy ``(uint8 images [N,H,W,3], int32 labels [N])``."""
  if spec.source == "digits":
    images, labels = _digits_arrays(split)
  elif spec.source == "npz":
    images, labels = _npz_arrays(spec, split)
  else:
    ds = tfds_split(spec, split, data_dir, download)
    batches = list(tfds.as_numpy(ds.map(lambda ex: (ex["image"], ex["label"])).batch(4096)))
    images = np.concatenate([b[0] for b in batches])
    labels = np.concatenate([b[1] for b in batches]).astype(np.int32)
    if labels.ndim == 4:  # label maps are stored as one-channel images
      labels = labels[..., 0]
    return images, labels
  process, count = jax.process_index(), jax.process_count()
  return images[process::count], labels[process::count]


def sum_over_processes(x: np.ndarray) -> np.ndarray:
  """``x`` summed over all processes (multi-host); ``x`` itself on one process."""
  if jax.process_count() == 1:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.sum(multihost_utils.process_allgather(np.asarray(x)), axis=0)


def normalization(spec: DatasetSpec, train_images: Optional[np.ndarray] = None):
  """Per-channel (mean, std) in [0, 1] units: the paper's constants, or the (whole) training set's own."""
  key = spec.base if spec.base in NORMALIZATION else None
  if key:
    return NORMALIZATION[key]
  pixels = train_images.reshape(-1, 3).astype(np.float64) / 255.0
  if jax.process_count() == 1:
    return tuple(pixels.mean(0)), tuple(pixels.std(0))
  # Each process holds a shard: combine the moments so that every process normalises alike.
  total = sum_over_processes(np.concatenate([[len(pixels)], pixels.sum(0), np.square(pixels).sum(0)]))
  mean = total[1:4] / total[0]
  return tuple(mean), tuple(np.sqrt(np.maximum(total[4:7] / total[0] - mean ** 2, 0.0)))


# ----------------------------------------------------------------------------- augmentation

def _normalize(image, mean, std):
  return (tf.cast(image, tf.float32) / 255.0 - tf.constant(mean, tf.float32)) / tf.constant(std, tf.float32)


def class_pixel_counts(labels: np.ndarray, num_classes: int) -> np.ndarray:
  """``[2, C]``: pixels of each class, and pixels of the images in which it appears (void not a class)."""
  labels = np.asarray(labels).reshape(len(labels), -1)
  counts = np.stack([np.bincount(np.where((row >= 0) & (row < num_classes), row, num_classes),
                                 minlength=num_classes + 1)[:num_classes] for row in labels])  # [N, C]
  return np.stack([counts.sum(0), np.sum((counts > 0) * labels.shape[1], axis=0)]).astype(np.int64)


def median_frequency_weights(labels: np.ndarray, num_classes: int, counts: Optional[np.ndarray] = None) -> np.ndarray:
  """Median-frequency class balancing (Eigen & Fergus 2015) from label maps ``[N, H, W]``.

  freq_c = (pixels of class c) / (pixels of the images in which c appears);
  weight_c = median_c(freq_c) / freq_c.  Void labels (outside ``[0, C)``) are not
  counted as any class; classes absent from ``labels`` get weight 0.  ``counts``
  (:func:`class_pixel_counts`, e.g. summed over processes) replaces ``labels``.
  """
  pixels, image_pixels = class_pixel_counts(labels, num_classes) if counts is None else counts
  present = image_pixels > 0
  freq = np.where(present, pixels / np.maximum(image_pixels, 1), 0.0)
  weights = np.zeros(num_classes)
  weights[present] = np.median(freq[present]) / freq[present]
  return weights.astype(np.float32)


def cifar_train_augment(image, seed, padding: int = 4):
  """Random crop of the zero-padded image back to its size (32×32 for CIFAR), then a random horizontal flip."""
  shape = tf.shape(image)
  image = tf.pad(image, [[padding, padding], [padding, padding], [0, 0]])
  image = tf.image.stateless_random_crop(image, shape, seed=seed)
  return tf.image.stateless_random_flip_left_right(image, seed=seed + 1)


def segmentation_train_augment(image, labels, seed, crop_size):
  """The same random ``crop_size`` (h, w) crop (None: no crop) and horizontal flip of an image
  ``[H, W, 3]`` and its label map ``[H, W]``."""
  both = tf.concat([tf.cast(image, tf.int32), tf.cast(labels, tf.int32)[..., None]], axis=-1)
  if crop_size is not None:
    both = tf.image.stateless_random_crop(both, (crop_size[0], crop_size[1], 4), seed=seed)
  both = tf.image.stateless_random_flip_left_right(both, seed=seed + 1)
  return tf.cast(both[..., :3], tf.uint8), both[..., 3]


def imagenet_train_augment(image, seed, image_size: int = 224):
  """Random-resized crop (scale 0.08–1, ratio 3/4–4/3) to ``image_size``, then a random flip."""
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.shape(image), tf.zeros((1, 0, 4)), seed=seed, area_range=(0.08, 1.0),
      aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10, use_image_if_no_bounding_boxes=True)
  image = tf.slice(image, begin, size)
  image = tf.image.resize(image, (image_size, image_size), method="bilinear")
  return tf.image.stateless_random_flip_left_right(image, seed=seed + 1)


def imagenet_eval_preprocess(image, image_size: int = 224, resize: int = 256):
  """Resize the shorter side to ``resize``, centre crop ``image_size``."""
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  scale = resize / tf.reduce_min(shape)
  image = tf.image.resize(image, tf.cast(tf.round(shape * scale), tf.int32), method="bilinear")
  return tf.image.resize_with_crop_or_pad(image, image_size, image_size)


def _options(ds):
  options = tf.data.Options()
  options.deterministic = True
  options.threading.private_threadpool_size = max(1, os.cpu_count() or 1)
  return ds.with_options(options)


# ----------------------------------------------------------------------------- public pipeline

@dataclasses.dataclass
class Pipeline:
  """Train/eval batches of one dataset for this process.

  Attributes:
    spec: the parsed dataset.
    num_train: examples in the (global) training split.
    num_eval: examples in the (global) evaluation split.
    local_batch_size / global_batch_size: per-process and global training batch.
  """
  spec: DatasetSpec
  global_batch_size: int
  seed: int
  mean: tuple
  std: tuple
  train_images: Optional[np.ndarray]
  train_labels: Optional[np.ndarray]
  eval_images: Optional[np.ndarray]
  eval_labels: Optional[np.ndarray]
  num_train: int
  num_eval: int
  data_dir: Optional[str] = None
  download: bool = False
  randaugment: Optional[tuple] = None  # (num_layers, magnitude, magnitude_std) after crop + flip
  crop_size: Optional[tuple] = None    # segmentation: random (h, w) training crop (None: whole image)

  @property
  def is_segmentation(self) -> bool:
    """Label maps ``[H, W]`` per example (per-pixel classes) rather than one class per image."""
    labels = self.eval_labels if self.eval_labels is not None else self.train_labels
    return labels is not None and labels.ndim == 3

  def class_weights(self, num_classes: int) -> np.ndarray:
    """Median-frequency weights ``[C]`` of the training label maps of all processes (segmentation only)."""
    if not self.is_segmentation:
      raise ValueError(f"Class balancing needs a segmentation dataset; {self.spec.name!r} has one label per image.")
    counts = sum_over_processes(class_pixel_counts(self.train_labels, num_classes))
    return median_frequency_weights(None, num_classes, counts)

  def normalize(self, images: np.ndarray) -> np.ndarray:
    """uint8 images ``[..., 3]`` → the float32 inputs the model was trained on."""
    mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
    return (np.asarray(images, np.float32) / 255.0 - mean) / std

  @property
  def local_batch_size(self) -> int:
    return self.global_batch_size // jax.process_count()

  @property
  def steps_per_epoch(self) -> int:
    return (self.num_train // jax.process_count()) // self.local_batch_size

  @property
  def image_shape(self):
    return (224, 224, 3) if self.spec.geometry == "imagenet" else tuple(self.eval_images.shape[1:])

  def train_dataset(self, epoch: int, start_step: int = 0) -> tf.data.Dataset:
    """Batches of epoch ``epoch`` from step ``start_step`` on: ``{"image", "label"}``, normalised float32."""
    steps, batch = self.steps_per_epoch, self.local_batch_size
    epoch_seed = np.random.default_rng([self.seed, epoch, jax.process_index()])
    order_seed = int(epoch_seed.integers(2 ** 31))
    if self.train_images is not None:
      order = np.random.default_rng([self.seed, epoch, jax.process_index(), 1]).permutation(
          len(self.train_images))[start_step * batch:steps * batch]
      ds = tf.data.Dataset.from_tensor_slices((self.train_images[order], self.train_labels[order]))
    else:  # streaming (ImageNet): seeded shuffle buffer, then skip what was already consumed
      ds = tfds_split(self.spec, "train", self.data_dir, self.download).map(lambda ex: (ex["image"], ex["label"]))
      ds = ds.shuffle(16 * 1024, seed=order_seed, reshuffle_each_iteration=False)
      ds = ds.take(steps * batch).skip(start_step * batch)
    positions = tf.data.Dataset.range(start_step * batch, steps * batch)
    augment = imagenet_train_augment if self.spec.geometry == "imagenet" else cifar_train_augment
    mean, std, rand_layers = self.mean, self.std, self.randaugment
    segmentation, crop_size = self.is_segmentation, self.crop_size

    def prepare(position, example):
      image, label = example
      seed = tf.stack([tf.constant(order_seed, tf.int64), position])
      if segmentation:
        image, label = segmentation_train_augment(image, label, seed, crop_size)
      else:
        image = augment(image, seed)
      if rand_layers:
        image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8) if image.dtype != tf.uint8 else image
        image = randaugment(image, seed + 2, *rand_layers)
      return {"image": _normalize(image, mean, std), "label": tf.cast(label, tf.int32)}

    ds = tf.data.Dataset.zip(positions, ds).map(prepare, num_parallel_calls=tf.data.AUTOTUNE)
    return _options(ds.batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))

  def train_iterator(self, start_step: int = 0) -> Iterator[dict]:
    """Endless numpy batches starting at global step ``start_step``."""
    epoch, step_in_epoch = divmod(start_step, self.steps_per_epoch)
    while True:
      yield from tfds.as_numpy(self.train_dataset(epoch, step_in_epoch))
      epoch, step_in_epoch = epoch + 1, 0

  def eval_batches(self, batch_size: Optional[int] = None, dataset: Optional[str] = None) -> Iterator[dict]:
    """Evaluation batches ``{"image", "label", "mask"}``; the last one is zero-padded, nothing is dropped.

    ``dataset`` (e.g. ``"cifar10_corrupted/fog_3"``) defaults to this dataset's
    evaluation split.  Every process yields the same number of batches (padding
    the shorter shards); ImageNet-sized sets are streamed, the others held in memory.
    """
    batch = (batch_size or self.global_batch_size) // jax.process_count()
    spec = self.spec if dataset is None else parse_dataset(dataset)
    if spec == self.spec and self.eval_images is not None:
      ds = tf.data.Dataset.from_tensor_slices((self.eval_images, self.eval_labels))
      num_global = self.num_eval
    elif spec.geometry == "imagenet":
      ds = tfds_split(spec, spec.eval_split, self.data_dir, self.download).map(lambda ex: (ex["image"], ex["label"]))
      num_global = _tfds_builder(spec, self.data_dir, False).info.splits[spec.eval_split].num_examples
    else:
      images, labels = load_arrays(spec, spec.eval_split, self.data_dir, self.download)
      ds = tf.data.Dataset.from_tensor_slices((images, labels))
      num_global = len(images) * jax.process_count()
    num_batches = -(-(-(-num_global // jax.process_count())) // batch)
    mean, std = self.mean, self.std
    preprocess = imagenet_eval_preprocess if self.spec.geometry == "imagenet" else (lambda x: x)
    ds = ds.map(lambda x, y: (_normalize(preprocess(x), mean, std), tf.cast(y, tf.int32)),
                num_parallel_calls=tf.data.AUTOTUNE)
    iterator = iter(tfds.as_numpy(_options(ds.batch(batch).prefetch(tf.data.AUTOTUNE))))
    for _ in range(num_batches):
      x, y = next(iterator, (None, None))
      n = 0 if x is None else len(x)
      out = {"image": np.zeros((batch,) + tuple(self.image_shape), np.float32),
             "label": np.zeros((batch,) + tuple(self.eval_labels.shape[1:] if self.is_segmentation else ()),
                               np.int32),
             "mask": np.zeros((batch,), np.float32)}
      if n:
        out["image"][:n], out["label"][:n], out["mask"][:n] = x, y, 1.0
      yield out


def create_pipeline(dataset: str, global_batch_size: int, seed: int, data_dir: Optional[str] = None,
                    download: bool = False, randaugment: Optional[tuple] = None,
                    crop_size: Optional[tuple] = None) -> Pipeline:
  """Load (or open, for ImageNet) ``dataset``; fail early with a clear message if it is missing.

  ``randaugment``: ``(num_layers, magnitude, magnitude_std)`` applied to training images
  after the crop and flip (None or num_layers 0: off).  ``crop_size``: (h, w) random
  training crop of segmentation datasets (None: whole images).
  """
  if randaugment is not None and randaugment[0] < 0:
    raise ValueError(f"RandAugment num_layers must be >= 0, got {randaugment[0]}.")
  spec = parse_dataset(dataset)
  if spec.corruption:
    raise ValueError(f"{dataset!r} is an evaluation-only corruption set; train on {spec.base!r}.")
  if global_batch_size % jax.process_count():
    raise ValueError(f"Global batch size {global_batch_size} is not divisible by {jax.process_count()} processes.")
  if spec.base == "imagenet2012":
    builder = _tfds_builder(spec, data_dir, download)
    if not builder.is_prepared():
      raise DatasetUnavailableError(_missing_message(spec, builder))
    splits = builder.info.splits
    eval_images = eval_labels = None
    num_train, num_eval = splits["train"].num_examples, splits["validation"].num_examples
    mean, std = NORMALIZATION["imagenet2012"]
    train_images = train_labels = None
  else:
    train_images, train_labels = load_arrays(spec, "train", data_dir, download)
    eval_images, eval_labels = load_arrays(spec, spec.eval_split, data_dir, download)
    num_train = len(train_images) * jax.process_count()
    num_eval = len(eval_images) * jax.process_count()
    mean, std = normalization(spec, train_images)
  pipeline = Pipeline(spec, global_batch_size, seed, tuple(mean), tuple(std), train_images, train_labels,
                      eval_images, eval_labels, num_train, num_eval, data_dir, download,
                      tuple(randaugment) if randaugment and randaugment[0] > 0 else None,
                      tuple(crop_size) if crop_size else None)
  if pipeline.is_segmentation and pipeline.randaugment:
    raise ValueError("RandAugment is not supported for segmentation datasets (it would move pixels off their labels).")
  if pipeline.crop_size is not None:
    if not pipeline.is_segmentation:
      raise ValueError(f"crop_size is for segmentation datasets; {dataset!r} has one label per image.")
    height, width = train_images.shape[1:3]
    if len(pipeline.crop_size) != 2 or not (0 < pipeline.crop_size[0] <= height and 0 < pipeline.crop_size[1] <= width):
      raise ValueError(f"crop_size {pipeline.crop_size} must be (h, w) within the {height}×{width} training images.")
  return pipeline
