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
  * end to end: images/s of the real training loop (``train.train_from_config``: data,
    augmentation, step, logging, evaluation and checkpoint at the end) for ``--loop-steps``
    steps of the first model, with the dataset on the devices (``data_pipeline="resident"``)
    and through tf.data (``"tfdata"``), and their ratio;
  * images/s of the ImageNet training augmentation on synthetic 375×500 JPEGs it writes to a
    temporary folder: decoding only each random crop (the pipeline's way) vs the whole file.

``--loop-breakdown`` instead measures where the training loop's time goes on the resident data
path (issue 57), four figures alternated in each round (``timing.alternate``), for each of
``--widths`` of ``resnet_dnn_18`` (default 4 and 16, batch 32), on a subset of an ``npz:``
dataset (``--dataset``; ``--train-images`` / ``--eval-images`` of it written to a temporary
folder), in images/s and as ratios against (2):
  1. ``bare_step``: the streamed compiled step (``compile_steps`` without a pipeline) on one fixed
     batch on the devices, ``--calls`` calls dispatched back to back, one wait at the end;
  2. ``resident_step``: the resident compiled step (``compile_steps`` with the pipeline of
     ``create_pipeline``, ``steps_per_call`` 1) called with count 1 the same way: the batch's
     gather and augmentation included;
  3. ``loop_k1``: ``train.train_from_config`` with ``steps_per_call`` 1;
  4. ``loop_default_k``: the same at the loop's default ``steps_per_call`` (0:
     ``train.resolved_steps_per_call``: 1 on the CPU, ``log_every_steps`` on an accelerator);
and, as diagnostics, ``loop_k_log_every_steps`` (the loop at K = ``log_every_steps``, the
accelerators' default) and ``resident_step_in_loop``: (2) in the program of that K, count 1 (one
step in ``steps.steps_in_one_call``'s ``fori_loop``: what the loop's program itself costs).  A
loop whose K equals another's is run once (``same_run_as``).
The loops' rates are those of :func:`train_loop_images_per_s`: each round runs the loop for
``--breakdown-steps`` steps and for one step in fresh workdirs (compiled programs read from the
persistent cache), the rate (steps − 1) · batch / (T_steps − T_one).  The ratios are medians of
the per-round ratios.  ``--out`` also writes the JSON (with the command and the commit).

  nice -n 5 python experiments/bench_train.py --loop-breakdown --dataset npz:<cifar10 dir>
      --out experiments/results/bench_train_loop_breakdown_cpu.json   # (one command line)

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
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from timing import alternate, round_ratios

from smoothing_jax.data import create_pipeline
from smoothing_jax.experiment import config as config_lib
from smoothing_jax.experiment import init_from
from smoothing_jax.experiment import spec as spec_lib
from smoothing_jax.methods import resolve
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shard_batch, shardings
from smoothing_jax.training import train
from smoothing_jax.training.optim import create_learning_rate_schedule
from smoothing_jax.training.steps import (
  compile_steps,
  create_train_state,
  state_initializer,
  train_batch_sharding,
)

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


def loop_run_seconds(config, num_train_steps: int) -> tuple:
  """``(seconds, steps trained)`` of ``train.train_from_config(config)`` for
  ``num_train_steps`` in a fresh temporary workdir (``config.num_train_steps`` is set)."""
  config.num_train_steps = num_train_steps
  with tempfile.TemporaryDirectory(prefix="bench_train_loop_") as workdir:
    start = time.perf_counter()
    state = train.train_from_config(config, workdir)
    jax.block_until_ready(state.params)
    return time.perf_counter() - start, int(state.step)


def train_loop_images_per_s(config, log=print) -> dict:
  """images/s of ``train.train_from_config(config)`` without compilation and fixed costs.

  Runs in fresh workdirs, the persistent compilation cache on
  (:func:`use_persistent_compilation_cache`): one step (it compiles), one step twice more (T1,
  their mean: the fixed costs of building the run, one evaluation and one checkpoint; the pair
  shows their noise), then ``config.num_train_steps`` (T2; -1: the configured epochs).  The rate
  is (steps − 1) · batch / (T2 − T1).
  """
  run = functools.partial(loop_run_seconds, config)
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


def npz_subset(dataset: str, train_images: int, eval_images: int) -> str:
  """``npz:<folder>`` holding the first ``train_images`` / ``eval_images`` examples of the
  ``npz:<dir>`` dataset's train.npz / test.npz (0: all of the split), written to a new temporary
  folder: short runs that load little."""
  if not dataset.startswith("npz:"):
    raise ValueError(f"--loop-breakdown reads an npz:<dir> dataset, got {dataset!r}.")
  folder = tempfile.mkdtemp(prefix="bench_train_data_")
  for split, count in (("train", train_images), ("test", eval_images)):
    with np.load(os.path.join(dataset.removeprefix("npz:"), f"{split}.npz")) as data:
      images, labels = data["images"], data["labels"]
    if count:
      images, labels = images[:count], labels[:count]
    np.savez(os.path.join(folder, f"{split}.npz"), images=images, labels=labels)
  return f"npz:{folder}"


def breakdown_config(dataset: str, width: int, batch_size: int):
  """The CIFAR SGD recipe for ``resnet_dnn_18`` at ``width`` and ``batch_size`` on ``dataset``,
  device-resident, evaluated and checkpointed after the last step only."""
  config = recipe_config("cifar_resnet", "resnet_dnn_18,cifar10")
  config.model, config.input.dataset = "resnet_dnn_18", dataset
  config.input.data_pipeline, config.input.batch_size = "resident", batch_size
  config.model_kwargs.width = width
  config.eval_every_epochs = 10 ** 6
  config.checkpoint_every_steps = 10 ** 9
  return config


def queued_steps(config, calls: int, looped_k: int) -> dict:
  """``{"bare_step", "resident_step", "resident_step_in_loop"}``: each a call running ``calls``
  compiled steps of ``config``'s run dispatched back to back (the state donated from call to
  call), returning the last state and metrics; the loop's pieces (``create_pipeline``, the run's
  model, method, schedule, loss, keys and ``compile_steps``) built as ``train._train`` builds
  them.  The bare step is the streamed one on one fixed batch on the devices; the resident one
  gathers and augments its batch inside (``steps_per_call`` 1, count 1); the one in a loop is the
  resident program of ``steps_per_call`` = ``looped_k`` called with count 1
  (``steps.steps_in_one_call``'s ``fori_loop`` of one step: what the loop's program costs)."""
  mesh = create_mesh(config.num_devices)
  pipeline = create_pipeline(config.input, config.seed, mesh)
  model = spec_lib.build_model(
      config, spec_lib.model_spec(config, pipeline, init_from.model_options(config)))
  method = resolve(config, model)
  steps_per_epoch, num_steps = pipeline.steps_per_epoch, 10 ** 6
  schedule = method.schedule(config, create_learning_rate_schedule(config, steps_per_epoch),
                             num_steps=num_steps, steps_per_epoch=steps_per_epoch)
  init_one = state_initializer(config, method, pipeline.image_shape, schedule)
  replicated, _ = shardings(mesh)
  batch_sharding = train_batch_sharding(config, mesh)
  loss_fn = method.loss(config, num_train=pipeline.num_train, steps_per_epoch=steps_per_epoch)
  rng = method.train_keys(config)
  compiled = {
      name: compile_steps(method, schedule, mesh, config.ece_bins, loss_fn,
                          config.grad_accum_steps, batch_sharding, pipeline=p, num_steps=num_steps,
                          steps_per_call=k)[0]
      for name, p, k in (("bare_step", None, 1), ("resident_step", pipeline, 1),
                         ("resident_step_in_loop", pipeline, looped_k))}
  batch = jax.block_until_ready(next(pipeline.train_iterator()))  # augmented, on the devices
  order = pipeline.device_order(0)
  held = {name: [jax.device_put(method.init_train_state(config, init_one, mesh.devices.flat),
                                replicated)] for name in compiled}

  def bare():
    fn, state = compiled["bare_step"], held["bare_step"]
    for _ in range(calls):
      state[0], metrics = fn(state[0], batch, rng)
    return state[0], metrics

  def resident(name):
    def call():
      fn, state, count = compiled[name], held[name], np.int32(1)
      for _ in range(calls):
        state[0], metrics, _ = fn(state[0], pipeline.arrays, order, rng, count)
      return state[0], metrics
    return call

  return {"bare_step": bare, "resident_step": resident("resident_step"),
          "resident_step_in_loop": resident("resident_step_in_loop")}


def loop_breakdown(dataset: str, width: int, batch_size: int, steps: int, calls: int,
                   rounds: int, target_seconds: float, log=print) -> dict:
  """The figures of ``--loop-breakdown`` (module docstring) for one width, alternated over
  ``rounds`` (``timing.alternate``); ``steps`` (0: about ``target_seconds`` of the resident
  step) steps of each loop, ``calls`` (0: ``steps``) queued calls of each step."""
  config = breakdown_config(dataset, width, batch_size)
  log_every = config.log_every_steps
  default_k = train.resolved_steps_per_call(config)  # the loop's own default on this backend
  probe = queued_steps(config, 5, log_every)
  jax.block_until_ready(probe["resident_step"]())  # compiles
  step_seconds = min(timed_seconds(probe["resident_step"]) / 5 for _ in range(2))
  del probe
  steps = steps or int(np.clip(round(target_seconds / step_seconds), 20, 5000))
  calls = calls or steps
  log(f"width {width}: resident step {1e3 * step_seconds:.1f} ms; {steps} loop steps, "
      f"{calls} queued calls, {rounds} rounds, default steps_per_call {default_k}")
  queued = queued_steps(config, calls, log_every)

  def loop(k: int, num_steps: int):
    loop_config = breakdown_config(dataset, width, batch_size)
    loop_config.steps_per_call = k
    return lambda: loop_run_seconds(loop_config, num_steps)[0]

  # The loops at K = 1, the default K and K = log_every_steps, each K run once (the default is
  # one of the others: 1 on the CPU, log_every_steps on an accelerator).
  loops = {"loop_k1": 1, "loop_default_k": default_k, "loop_k_log_every_steps": log_every}
  distinct = {}
  for name, k in loops.items():
    distinct.setdefault(k, name)
  runs = dict(queued)
  for k, name in distinct.items():
    runs[name], runs[f"{name}_one_step"] = loop(k, steps), loop(k, 1)
  load_before = os.getloadavg()
  times = alternate(runs, rounds)
  load_after = os.getloadavg()
  per_round = {name: [calls * batch_size / t for t in times[name]] for name in queued}
  from_medians = {name: calls * batch_size / statistics.median(times[name]) for name in queued}
  for name in distinct.values():
    per_round[name] = [(steps - 1) * batch_size / (t - one) for t, one in
                       zip(times[name], times[f"{name}_one_step"], strict=True)]
    from_medians[name] = (steps - 1) * batch_size / (
        statistics.median(times[name]) - statistics.median(times[f"{name}_one_step"]))
  figures = {}
  for name, rates in per_round.items():
    ratios = round_ratios(rates, per_round["resident_step"])
    figures[name] = {"images_per_s": from_medians[name],
                     "images_per_s_per_round": [round(r, 2) for r in rates],
                     "over_resident_step": statistics.median(ratios),
                     "over_resident_step_per_round": [round(r, 4) for r in ratios]}
    if name in queued:
      figures[name]["seconds"] = [round(t, 4) for t in times[name]]
    else:
      figures[name]["steps_per_call"] = loops[name]
      figures[name]["run_seconds"] = [round(t, 3) for t in times[name]]
      figures[name]["one_step_run_seconds"] = [round(t, 3) for t in times[f"{name}_one_step"]]
  for name, k in loops.items():
    if name not in figures:
      figures[name] = {"same_run_as": distinct[k], **figures[distinct[k]], "steps_per_call": k}
  entry = {"model": "resnet_dnn_18", "width": width, "batch_size": batch_size,
           "loop_steps": steps, "queued_calls": calls, "rounds": rounds,
           "default_steps_per_call": default_k, "log_every_steps": log_every,
           "probe_resident_step_ms": 1e3 * step_seconds,
           "load_average_before_after": [round(x, 2) for x in load_before + load_after],
           **figures}
  log(json.dumps({k: entry[k] for k in ("width", "loop_steps")} | {
      name: (round(figures[name]["images_per_s"], 1), round(figures[name]["over_resident_step"], 3))
      for name in figures}))
  return entry


def timed_seconds(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def git_commit() -> dict:
  """``{"commit": HEAD, "dirty": uncommitted changes}`` of the repository of this script."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

  def git(*args):
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()
  return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}


def main_loop_breakdown(args):
  """``--loop-breakdown``: :func:`loop_breakdown` for each of ``args.widths``; one JSON object
  printed (and written to ``args.out``)."""
  commit = git_commit()  # the code this process runs (imported now)
  started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
  use_persistent_compilation_cache(tempfile.mkdtemp(prefix="bench_train_cache_"))
  dataset = npz_subset(args.dataset, args.train_images, args.eval_images)
  batch_size = args.batch_size or 32
  steps = args.breakdown_steps + [args.breakdown_steps[-1]] * len(args.widths)
  calls = args.calls + [args.calls[-1]] * len(args.widths)
  log = lambda message: print(f"[bench_train] {message}", file=sys.stderr, flush=True)  # noqa
  entries = [loop_breakdown(dataset, width, batch_size, n, c, args.rounds, args.breakdown_seconds,
                            log)
             for width, n, c in zip(args.widths, steps, calls, strict=False)]
  result = {
      "benchmark": "train_loop_breakdown",
      "command": shlex.join(["python", "experiments/bench_train.py", *args.argv]),
      **commit, "started": started,
      "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
      "device": str(jax.devices()[0]), "num_devices": jax.device_count(),
      "jax": jax.__version__, "dataset": args.dataset, "train_images": args.train_images,
      "eval_images": args.eval_images, "entries": entries,
      "goal": {"loop_default_k_ge_0.95_resident_step": {
          str(e["width"]): e["loop_default_k"]["over_resident_step"] >= 0.95 for e in entries}}}
  text = json.dumps(result, indent=2)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return result


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
  parser.add_argument("--batch-size", type=int, default=None, help="default 128 (32: breakdown)")
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
  breakdown = parser.add_argument_group("--loop-breakdown (the module docstring)")
  breakdown.add_argument("--loop-breakdown", action="store_true",
                         help="only the loop breakdown: step, resident step, loop at K=1 and "
                         "at the default K (batch default 32)")
  breakdown.add_argument("--widths", type=int, nargs="+", default=[4, 16])
  breakdown.add_argument("--breakdown-steps", type=int, nargs="+", default=[0],
                         help="loop steps per width (0: about --breakdown-seconds of the step)")
  breakdown.add_argument("--breakdown-seconds", type=float, default=20.0)
  breakdown.add_argument("--calls", type=int, nargs="+", default=[0],
                         help="queued calls of each step per round, per width (0: the loop's "
                         "steps)")
  breakdown.add_argument("--rounds", type=int, default=5)
  breakdown.add_argument("--train-images", type=int, default=10000,
                         help="first examples of train.npz used (0: all)")
  breakdown.add_argument("--eval-images", type=int, default=1000,
                         help="first examples of test.npz used (0: all)")
  breakdown.add_argument("--out", default=None, help="also write the JSON here")
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  if args.loop_breakdown:
    return main_loop_breakdown(args)
  args.batch_size = args.batch_size or 128

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
