"""Benchmark: train-step throughput with and without spatial smoothing, and the input pipeline
alone.

Prints one JSON object, all measured in the same run on the same devices:
  * images/s of a jitted, data-parallel ``train_step`` for each model (default
    ``resnet_dnn_18``, ``resnet_dnn_smoothing_18``, ``resnet_mcdo_smoothing_18``,
    and the smoothing model with the size-preserving ``blur_same=True``);
  * each model's compiled FLOPs (XLA cost analysis) and its step-time and FLOP
    ratios against the first model, so the smoothing overhead can be read as
    "beyond what its larger feature maps cost" = time ratio / FLOP ratio;
  * images/s of the training input pipeline alone (augmentation + batching);
  * end to end: images/s of the real training loop (``train.train_and_evaluate``: data,
    augmentation, step, logging, evaluation and checkpoint at the end) for ``--loop-steps``
    steps of the first model, with the dataset on the devices (``data_pipeline="resident"``)
    and through tf.data (``"tfdata"``), and their ratio;
  * images/s of the ImageNet training augmentation on synthetic 375×500 JPEGs it writes to a
    temporary folder: decoding only each random crop (the pipeline's way) vs the whole file.

  python experiments/bench_train.py                       # CIFAR, batch 128
  python experiments/bench_train.py --steps 3 --width 16  # quick
  # iBNN (S=2 rows per image) vs deterministic
  python experiments/bench_train.py --models vgg_dnn_16:plain vgg_ibnn_16:K4
  python experiments/bench_train.py --recipe vit   # ViT-Ti and AlterNet-50 vs ResNet-50, HV recipe

``--recipe vit`` times the step of ``configs/cifar_vit.py`` (AdamW, gradient clipping,
label smoothing + Mixup/CutMix in the step, stochastic depth 0.1) for every model,
default ``resnet_dnn_50 vit_ti alternet_50`` (ratios against ResNet-50), and the
input pipeline with RandAugment.

Model variants: ``:same`` (blur_same), ``:plain`` (no BatchNorm, 512-512-C head),
``:K<n>`` (iBNN with n components; its step is the ELBO step on the S-times repeated batch).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from smoothing_jax.data import create_pipeline
from smoothing_jax.experiment import config as config_lib
from smoothing_jax.methods import resolve
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shard_batch, shardings
from smoothing_jax.training import train
from smoothing_jax.training.optim import create_learning_rate_schedule
from smoothing_jax.training.steps import compile_steps, create_train_state

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10")


def recipe_config(recipe: str, arg: str):
  """``configs/<recipe>.py``'s ``get_config(arg)``, wherever the benchmark runs from."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", f"{recipe}.py")
  return config_lib.from_file(os.path.normpath(path), arg)


def program_flops(lowered):
  """XLA's FLOP count of a lowered program, before the backend's passes (None where none is
  given): XLA:GPU's count of the compiled executable leaves out the convolutions and matrix
  products it hands to cuDNN and cuBLAS (100× too few on an H200)."""
  cost = lowered.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return (cost or {}).get("flops")


def time_train_steps(name, overrides, config, batch, steps):
  fields = {f.name for f in dataclasses.fields(type(get_model(name, 10)))}
  model = get_model(name, 10, **{k: v for k, v in overrides.items() if k in fields})
  mesh = create_mesh()
  replicated, data = shardings(mesh)
  schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
  state = jax.device_put(
      create_train_state(config, model, jax.random.key(0), batch["image"].shape[1:], schedule),
      replicated)
  method = resolve(config, model)
  loss_fn = method.loss(config, num_train=50000, steps_per_epoch=100)
  step_fn, _ = compile_steps(method, schedule, mesh, 10, loss_fn)
  batch = shard_batch(batch, data)
  rng = jax.random.key(1)
  flops = program_flops(step_fn.lower(state, batch, rng))
  flops = float("nan") if flops is None else flops
  state, metrics = step_fn(state, batch, rng)  # compile + warm up
  jax.block_until_ready(metrics)
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    state, metrics = step_fn(state, batch, rng)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return statistics.median(times), flops


def use_persistent_compilation_cache(directory: str):
  """Keep compiled executables in ``directory``, so that a training loop started again in this
  process loads its steps instead of compiling them."""
  jax.config.update("jax_compilation_cache_dir", directory)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def train_loop_images_per_s(config, log=print) -> dict:
  """images/s of ``train.train_and_evaluate(config)`` without compilation and fixed costs.

  Runs in fresh workdirs, the persistent compilation cache on
  (:func:`use_persistent_compilation_cache`): one step (it compiles), one step twice more (T1,
  their mean: the fixed costs of building the run, one evaluation and one checkpoint; the pair
  shows their noise), then ``config.num_train_steps`` (T2; -1: the configured epochs).  The rate
  is (steps − 1) · batch / (T2 − T1).
  """
  def run(num_train_steps):
    config.num_train_steps = num_train_steps
    with tempfile.TemporaryDirectory(prefix="bench_train_loop_") as workdir:
      start = time.perf_counter()
      state = train.train_and_evaluate(config, workdir)
      jax.block_until_ready(state.params)
      return time.perf_counter() - start, int(state.step)

  steps = config.num_train_steps
  compile_seconds, _ = run(1)
  one_step = [run(1)[0] for _ in range(2)]
  seconds, steps = run(steps)
  log(f"train loop ({config.input.data_pipeline}): {steps} steps in {seconds:.1f} s, one step in "
      f"{one_step[0]:.1f} s and {one_step[1]:.1f} s (first run {compile_seconds:.1f} s)")
  batch_size = config.input.batch_size
  return {"data_pipeline": config.input.data_pipeline, "batch_size": batch_size, "steps": steps,
          "first_run_seconds": compile_seconds, "one_step_seconds": one_step, "seconds": seconds,
          "images_per_s": (steps - 1) * batch_size / (seconds - np.mean(one_step))}


def loop_resident_vs_tfdata(config, dataset: str, model: str, width, steps: int) -> dict:
  """:func:`train_loop_images_per_s` of ``model`` on ``dataset`` on both input paths."""
  config.input.dataset, config.model = dataset, model
  config.eval_every_epochs = 10 ** 6  # evaluate and checkpoint after the last step only
  config.checkpoint_every_steps = 10 ** 9
  config.log_every_steps = max(1, steps // 4)
  if width:
    config.model_kwargs.width = width
  rows = {}
  for path in ("resident", "tfdata"):
    config.input.data_pipeline, config.num_train_steps = path, steps
    rows[path] = train_loop_images_per_s(config)
  return {"dataset": dataset, "model": model, "width": width,
          "batch_size": config.input.batch_size,
          **rows, "resident_over_tfdata": rows["resident"]["images_per_s"] /
          rows["tfdata"]["images_per_s"]}


def imagenet_jpeg_pipeline(num_files: int, batch_size: int, num_batches: int) -> dict:
  """images/s of the ImageNet training augmentation on synthetic JPEGs written here
  (375×500, quality 90, like ImageNet's typical file): decoding only the random crop
  (``tf.image.decode_and_crop_jpeg``, what the pipeline does) vs decoding the whole file first."""
  import tempfile

  import tensorflow as tf

  from smoothing_jax.data.augment import imagenet_train_augment
  rng = np.random.default_rng(0)
  folder = tempfile.mkdtemp(prefix="synthetic_jpegs_")
  paths = []
  for i in range(num_files):
    pixels = (np.cumsum(rng.integers(0, 5, (375, 500, 3)), axis=1) % 256).astype(np.uint8)
    paths.append(os.path.join(folder, f"{i}.jpg"))
    tf.io.write_file(paths[-1], tf.io.encode_jpeg(pixels, quality=90))

  def rate(decode_first: bool) -> float:
    def prepare(position, path):
      data = tf.io.read_file(path)
      image = tf.io.decode_jpeg(data, channels=3) if decode_first else data
      return imagenet_train_augment(image, tf.stack([tf.constant(0, tf.int64), position]))

    ds = tf.data.Dataset.zip(tf.data.Dataset.range(10 ** 9),
                             tf.data.Dataset.from_tensor_slices(paths).repeat())
    ds = ds.map(prepare, num_parallel_calls=tf.data.AUTOTUNE).batch(batch_size)
    iterator = iter(ds.prefetch(tf.data.AUTOTUNE))
    next(iterator)
    start = time.perf_counter()
    for _ in range(num_batches):
      next(iterator)
    return num_batches * batch_size / (time.perf_counter() - start)

  crop, whole = rate(False), rate(True)
  return {"files": num_files, "decode_and_crop_images_per_s": crop,
          "decode_then_crop_images_per_s": whole, "speedup": crop / whole}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--recipe", choices=("sgd", "vit"), default="sgd",
                      help="sgd: the paper's CNN recipe; vit: configs/cifar_vit.py (HV)")
  parser.add_argument("--models", nargs="+", default=None)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--steps",
                      type=int,
                      default=10,
                      help="timed steps per model (median reported)")
  parser.add_argument("--width",
                      type=int,
                      default=None,
                      help="override the model width (quick runs)")
  parser.add_argument("--dataset",
                      default=f"npz:{DEFAULT_DATA}" if os.path.isdir(DEFAULT_DATA) else "digits",
                      help="dataset for the input-pipeline measurement")
  parser.add_argument("--pipeline-batches", type=int, default=50)
  parser.add_argument("--jpeg-files", type=int, default=256,
                      help="synthetic JPEGs for the ImageNet-style pipeline (0: skip it)")
  parser.add_argument("--loop-steps", type=int, default=40,
                      help="steps of the end-to-end training loop per input path (0: skip it)")
  args = parser.parse_args(argv)

  recipe, arg = ("cifar_vit", "vit_ti,cifar10") if args.recipe == "vit" else (
      "cifar_resnet", "resnet_dnn_18,cifar10")  # the CIFAR SGD recipe; values do not affect timing
  config = recipe_config(recipe, arg)
  if args.recipe == "vit":
    models = args.models or ["resnet_dnn_50", "vit_ti", "alternet_50"]
  else:
    models = args.models or ["resnet_dnn_18", "resnet_dnn_smoothing_18", "resnet_mcdo_smoothing_18",
                             "resnet_dnn_smoothing_18:same"]
  rng = np.random.default_rng(0)
  batch = {"image": rng.normal(size=(args.batch_size, 32, 32, 3)).astype(np.float32),
           "label": rng.integers(0, 10, args.batch_size).astype(np.int32)}
  results, base = [], None
  for entry in models:
    name, _, variant = entry.partition(":")
    overrides = {} if args.width is None else {"width": args.width}
    if config.model_kwargs.get("stochastic_depth"):
      overrides["stochastic_depth"] = config.model_kwargs.stochastic_depth
    if variant == "same":
      overrides["blur_same"] = True
    elif variant == "plain":  # the iBNN reference's VGG: no BatchNorm, 512-512-C head
      overrides.update(batch_norm=False, classifier="mlp512")
    elif variant.startswith("K"):  # iBNN components
      overrides["num_components"] = int(variant[1:])
    seconds, flops = time_train_steps(name, overrides, config, batch, args.steps)
    base = base or (seconds, flops)
    row = {
        "model": entry,
        "step_seconds": seconds,
        "images_per_s": args.batch_size / seconds,
        "flops": flops,
        "time_ratio": seconds / base[0],
        "flop_ratio": flops / base[1],
        "overhead_beyond_flops": (seconds / base[0]) / (flops / base[1]) - 1.0
    }
    results.append(row)
    print(json.dumps(row), flush=True)

  pipeline = create_pipeline({"dataset": args.dataset, "batch_size": args.batch_size,
                              "randaugment": config.input.randaugment}, seed=0)
  iterator = pipeline.train_iterator()
  jax.block_until_ready(next(iterator))  # a resident pipeline's batches are computed on devices
  start = time.perf_counter()
  for _ in range(args.pipeline_batches):
    jax.block_until_ready(next(iterator))
  pipeline_ips = args.pipeline_batches * args.batch_size / (time.perf_counter() - start)
  loop = None
  if args.loop_steps:
    use_persistent_compilation_cache(tempfile.mkdtemp(prefix="bench_train_cache_"))
    config.input.batch_size = args.batch_size
    loop = loop_resident_vs_tfdata(config, args.dataset, models[0].partition(":")[0], args.width,
                                   args.loop_steps)
  print(
      json.dumps(
          {
              "benchmark":
                  "train_step_smoothing_overhead"
                  if args.recipe == "sgd" else "train_step_msa_models",
              "recipe":
                  args.recipe,
              "batch_size":
                  args.batch_size,
              "width":
                  args.width,
              "device":
                  str(jax.devices()[0]),
              "num_devices":
                  jax.device_count(),
              "models":
                  results,
              "pipeline_dataset":
                  args.dataset,
              "pipeline_images_per_s":
                  pipeline_ips,
              "pipeline_vs_fastest_step":
                  pipeline_ips / max(r["images_per_s"] for r in results),
              "train_loop": loop,
              "imagenet_jpeg_pipeline":
                  imagenet_jpeg_pipeline(args.jpeg_files, args.batch_size, args.pipeline_batches)
                  if args.jpeg_files else None
          },
          indent=2))


if __name__ == "__main__":
  main()
