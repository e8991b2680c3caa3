"""Device-resident datasets: the split on the devices as uint8, each batch gathered by index and
augmented inside the jitted step, with no host pipeline per step and no TensorFlow.

Placement: the whole split is *replicated* on every device.  A global batch draws rows from
anywhere in the split, so a split sharded over the devices would need a cross-device gather in
every step; replicated, each device gathers its own slice of the batch locally.  CIFAR-100 (50,000
training + 10,000 test images of 32×32×3 uint8, labels int32) takes 184 MB (176 MiB) per device,
0.2% of an 80 GB H100; a split above ``MAX_DEVICE_FRACTION`` of a device's memory is refused,
pointing to the streaming (tf.data) path.

Augmentation (paper Appendix A, SGD recipe): a random crop of the 4-pixel zero-padded image back
to its size and a random horizontal flip (dm-pix ``random_crop`` and ``random_flip_left_right``);
for segmentation label maps, the same random ``crop_size`` crop and flip of image and labels;
then RandAugment (:mod:`~smoothing_jax.data.device_randaugment`) when configured, and the
per-dataset normalisation.  Mixup/CutMix stay in the loss (:mod:`~smoothing_jax.data.mixup`).

Determinism: the rows of step ``s`` are ``epoch_order(s // steps_per_epoch)[s % steps_per_epoch]``
and example ``i`` of the global batch draws from ``fold_in(fold_in(key(seed), DATA_STREAM, s),
i)``: a pure function of ``(seed, step)``, whatever the device or process count, so a resumed
run is bit-identical.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import dm_pix as pix
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from smoothing_jax.data import device_randaugment
from smoothing_jax.data.datasets import as_model_images, load_arrays, parse_dataset
from smoothing_jax.data.pipeline_base import Batches, Pipeline
from smoothing_jax.parallel import create_mesh, shardings

MAX_DEVICE_FRACTION = 0.25  # of one device's memory; the rest is the model's
DATA_STREAM = 0x5EED        # separates the data's random draws from the model's (init, dropout)
PADDING = 4                 # pixels of zero padding before the random crop (CIFAR recipe)


def device_memory_bytes(device) -> int | None:
  """The memory of ``device`` that JAX may allocate, or None where the backend does not say (the
  CPU: host memory) or the device is another process's."""
  if getattr(device, "process_index", 0) != jax.process_index():
    return None
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return (stats or {}).get("bytes_limit")


def check_fits_on_devices(dataset: str, nbytes: int, devices,
                          fraction: float = MAX_DEVICE_FRACTION):
  """ValueError (one line, naming the streaming path) when ``nbytes`` held on each of
  ``devices`` exceeds ``fraction`` of the smallest one's memory."""
  limits = [m for m in (device_memory_bytes(d) for d in devices) if m]
  if limits and nbytes > fraction * min(limits):
    raise ValueError(
        f"Dataset {dataset!r} needs {nbytes / 2**20:.0f} MiB on each device to stay there, more "
        f"than {fraction:.0%} of the {min(limits) / 2**30:.1f} GiB a device has; stream it from "
        "the host instead with --config.input.data_pipeline=tfdata.")


def replicate(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """``array`` (the same on every process) as a global array with a copy on every device."""
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def augment_example(key, image, label, randaugment: tuple | None = None,
                    crop_size: tuple | None = None):
  """The training augmentation of one example: uint8 ``image [H, W, C]`` and its ``label`` (a
  class ``[]`` or a label map ``[H, W]``) → ``(uint8 image, label)``, cropped to ``crop_size``
  for label maps (None: whole)."""
  k_crop, k_flip, k_rand = jax.random.split(key, 3)
  if label.ndim == 2:  # segmentation: crop and flip pixels and labels together
    both = jnp.concatenate([image.astype(jnp.int32), label[..., None].astype(jnp.int32)], -1)
    if crop_size is not None:
      both = pix.random_crop(k_crop, both, (crop_size[0], crop_size[1], both.shape[-1]))
    both = pix.random_flip_left_right(k_flip, both)
    return both[..., :-1].astype(jnp.uint8), both[..., -1]
  padded = jnp.pad(image, ((PADDING, PADDING), (PADDING, PADDING), (0, 0)))
  image = pix.random_flip_left_right(k_flip, pix.random_crop(k_crop, padded, image.shape))
  if randaugment:
    image = device_randaugment.randaugment(k_rand, image, *randaugment)
  return image, label


@dataclasses.dataclass
class ResidentPipeline(Pipeline):
  """:class:`Pipeline` whose splits live on ``mesh``'s devices (:meth:`put_on_devices`); its
  batches are global ``jax.Array`` s sharded on ``data``."""
  mesh: Mesh | None = None
  arrays: dict | None = None       # {"images", "labels"} of the training split, on the devices
  eval_arrays: dict | None = None  # the same of the evaluation split
  resident = True

  def __post_init__(self):  # also for copies (dataclasses.replace), which share the arrays
    self._order = (None, None)  # (epoch, its order on the devices)
    self._batch_fn = jax.jit(self.train_batch)
    self._eval_batch_fn = jax.jit(self._eval_batch, static_argnums=(3,))

  def put_on_devices(self, mesh: Mesh | None = None):
    """Copy the training and evaluation splits to every device of ``mesh`` (default: all)."""
    self.mesh = mesh or create_mesh()
    held = (self.train_images, self.train_labels, self.eval_images, self.eval_labels)
    check_fits_on_devices(self.dataset_spec.name, sum(a.nbytes for a in held),
                          self.mesh.devices.flat)
    self.arrays = self._put(self.train_images, self.train_labels)
    self.eval_arrays = self._put(self.eval_images, self.eval_labels)

  def _put(self, images, labels) -> dict:
    replicated, _ = shardings(self.mesh)
    return {"images": replicate(images, replicated), "labels": replicate(labels, replicated)}

  def _data_sharding(self, batch_size: int) -> NamedSharding:
    spec = P("data") if batch_size % self.mesh.size == 0 else P()
    return NamedSharding(self.mesh, spec)

  def _normalize(self, images):
    mean, std = jnp.asarray(self.mean, jnp.float32), jnp.asarray(self.std, jnp.float32)
    return (images.astype(jnp.float32) / 255.0 - mean) / std

  def device_order(self, epoch: int) -> jax.Array:
    """:meth:`epoch_order` of ``epoch`` on the devices (int32, replicated; the last one kept)."""
    if self._order[0] != epoch:
      order = self.epoch_order(epoch).astype(np.int32)
      self._order = (epoch, replicate(order, shardings(self.mesh)[0]))
    return self._order[1]

  def train_batch(self, arrays: dict, order: jax.Array, step, sharding=None) -> dict:
    """The augmented global batch of ``step`` (0-based; pure, for use inside ``jit``):
    ``{"image": float32 [B, H, W, C] normalised, "label"}``.  ``arrays``: :attr:`arrays`;
    ``order``: :meth:`device_order` of step's epoch; ``sharding``: where the batch's rows
    are computed (default: the mesh's ``data`` axis)."""
    sharding = sharding or self._data_sharding(order.shape[1])
    rows = jax.lax.with_sharding_constraint(order[step % order.shape[0]], sharding)
    positions = jax.lax.with_sharding_constraint(jnp.arange(order.shape[1]), sharding)
    step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), DATA_STREAM), step)
    keys = jax.vmap(lambda i: jax.random.fold_in(step_key, i))(positions)
    augment = lambda k, x, y: augment_example(k, x, y, self.randaugment, self.crop_size)  # noqa
    images, labels = jax.vmap(augment)(keys, arrays["images"][rows], arrays["labels"][rows])
    return {"image": self._normalize(images), "label": labels.astype(jnp.int32)}

  def train_iterator(self, start_step: int = 0) -> Iterator[dict]:
    """Endless global batches from step ``start_step`` on (one jitted call each)."""
    for step in itertools.count(start_step):
      yield self._batch_fn(self.arrays, self.device_order(step // self.steps_per_epoch), step)

  def _eval_batch(self, images, labels, start, batch_size: int) -> dict:
    index = start + jnp.arange(batch_size)
    mask = index < images.shape[0]
    index = jnp.minimum(index, images.shape[0] - 1)
    image = jnp.where(mask[:, None, None, None], self._normalize(images[index]), 0.0)
    label = jnp.where(mask.reshape((-1,) + (1,) * (labels.ndim - 1)), labels[index], 0)
    batch = {"image": image, "label": label.astype(jnp.int32), "mask": mask.astype(jnp.float32)}
    return jax.lax.with_sharding_constraint(batch, self._data_sharding(batch_size))

  def eval_batches(self, batch_size: int | None = None,
                   dataset: str | None = None) -> Batches:
    """Global evaluation batches ``{"image", "label", "mask"}`` of ``dataset`` (default: this
    dataset's evaluation split; another one, e.g. ``"cifar10_corrupted/fog_3"``, is read once and
    held on the devices while it is evaluated); the last one zero-padded, nothing dropped."""
    batch_size = batch_size or self.global_batch_size
    spec = self.dataset_spec if dataset is None else parse_dataset(dataset)
    if spec.name == self.dataset_spec.name:
      arrays = self.eval_arrays
    else:
      images, labels = load_arrays(spec, spec.eval_split, self.data_dir, self.download,
                                   shard=False,
                                   size=None if self.is_segmentation else self.image_shape[:2])
      images = as_model_images(spec.name, images, self.image_shape)
      check_fits_on_devices(spec.name, images.nbytes + labels.nbytes, self.mesh.devices.flat)
      arrays = self._put(images, labels)
    return self._batches(arrays, batch_size)

  def train_eval_batches(self, batch_size: int | None = None) -> Batches:
    """Evaluation batches (no augmentation) of the training split: what post-hoc OOD scores
    fit on."""
    return self._batches(self.arrays, batch_size or self.global_batch_size)

  def _batches(self, arrays: dict, batch_size: int) -> Batches:
    count = arrays["images"].shape[0]
    return Batches(-(-count // batch_size), (
        self._eval_batch_fn(arrays["images"], arrays["labels"], start, batch_size)
        for start in range(0, count, batch_size)), examples=count)

  def holdout_batches(self, batch_size: int | None = None) -> Batches:
    """Global batches ``{"image", "label", "mask"}`` of the held-out training examples
    (``holdout_fraction``), held on the devices while they are evaluated."""
    if self.holdout_images is None or not len(self.holdout_images):
      raise ValueError("No held-out training examples: set --config.input.holdout_fraction (e.g. "
                       "0.1; they are left out of training) and train the run with it.")
    arrays = self._put(self.holdout_images, self.holdout_labels)
    return self._batches(arrays, batch_size or self.global_batch_size)
