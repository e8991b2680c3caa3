"""Benchmark for accelerators: train steps in float32 and bfloat16 against PyTorch, MC inference
against a loop, and the input pipeline; one JSON object, all on the same device in one run.

* train-step images/s of ``resnet_dnn_18`` and ``resnet_mcdo_smoothing_18`` (CIFAR 32×32, the
  paper's SGD recipe) for each ``--batch-sizes``, float32 and ``half_precision`` (bfloat16
  compute), with the achieved TFLOP/s from XLA's cost analysis and, on a chip in ``PEAK_TFLOPS``,
  the fraction of its peak;
* the same step in PyTorch (``tests/torch_reference.py``, SGD + cross-entropy) in float32
  and under ``torch.autocast(bfloat16)``, the faster of NCHW and channels-last (skipped without
  torch);
* ``mc_predict`` at N = 1, 10, 50 against a Python loop of N single jitted passes;
* the training input pipeline's images/s (``--dataset``) next to the bfloat16 step.

  python experiments/bench_accelerator.py                     # a GPU: the issue's setting
  python experiments/bench_accelerator.py --width 8 --batch-sizes 32 --steps 2 --mc-batch 16 \\
      --num-samples 1 2   # a CPU check (minutes)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_train import DEFAULT_DATA, recipe_config, time_train_steps
from timing import median_seconds

from smoothing_jax.data import create_pipeline
from smoothing_jax.inference import mc_predict
from smoothing_jax.models import get_model
from smoothing_jax.passes import sample_rngs

# tests.torch_reference, the PyTorch transcription, is imported from the repository root.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# Dense peak TFLOP/s (bfloat16, and float32 as XLA runs it: TF32 tensor cores on NVIDIA GPUs).
PEAK_TFLOPS = {
    "H100 80GB HBM3": {"bfloat16": 989.4, "float32": 494.7},  # SXM
    "H100 PCIe": {"bfloat16": 756.0, "float32": 378.0},
    "H200": {"bfloat16": 989.4, "float32": 494.7},
    "A100": {"bfloat16": 312.0, "float32": 156.0},
    "TPU v4": {"bfloat16": 275.0, "float32": 275.0},
    "TPU v5 lite": {"bfloat16": 197.0, "float32": 197.0},
    "TPU v5p": {"bfloat16": 459.0, "float32": 459.0},
}
MODELS = {"resnet_dnn_18": dict(smoothing=False, mcdo=False),
          "resnet_mcdo_smoothing_18": dict(smoothing=True, mcdo=True)}


def peak_tflops(dtype: str):
  kind = jax.devices()[0].device_kind
  for name, peaks in PEAK_TFLOPS.items():
    if name in kind:
      return peaks[dtype]
  return None


def jax_train_step(name, width, batch_size, half, steps):
  config = recipe_config("cifar_resnet", f"{name},cifar10")  # the SGD recipe
  rng = np.random.default_rng(0)
  batch = {"image": rng.normal(size=(batch_size, 32, 32, 3)).astype(np.float32),
           "label": rng.integers(0, 10, batch_size).astype(np.int32)}
  overrides = {"dtype": jnp.bfloat16 if half else jnp.float32}
  if width:
    overrides["width"] = width
  seconds, flops = time_train_steps(name, overrides, config, batch, steps)
  dtype = "bfloat16" if half else "float32"
  peak = peak_tflops(dtype)
  tflops = flops / seconds / 1e12
  return {"images_per_s": batch_size / seconds, "step_seconds": seconds,
          "tflops": tflops, "fraction_of_peak": tflops / peak if peak else None}


def torch_train_step(name, width, batch_size, half, steps):
  """images/s of SGD steps of the PyTorch transcription (the faster memory format)."""
  try:
    import torch
  except ImportError:
    return None
  from tests.torch_reference import ResNet
  device = "cuda" if torch.cuda.is_available() else "cpu"
  best = None
  for channels_last in (False, True):
    torch.manual_seed(0)
    net = ResNet((2, 2, 2, 2), False, 10, width=width or 64, **MODELS[name]).to(device).train()
    x = torch.randn(batch_size, 3, 32, 32, device=device)
    if channels_last:
      net, x = net.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch_size,), device=device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    def step(net=net, x=x, y=y, optimizer=optimizer):  # this iteration's (B023)
      with torch.autocast(device, dtype=torch.bfloat16, enabled=half):
        loss = torch.nn.functional.cross_entropy(net(x), y)
      optimizer.zero_grad(set_to_none=True)
      loss.backward()
      optimizer.step()
      if device == "cuda":
        torch.cuda.synchronize()

    step()
    step()
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      step()
      times.append(time.perf_counter() - start)
    result = {"images_per_s": batch_size / statistics.median(times),
              "channels_last": channels_last}
    if best is None or result["images_per_s"] > best["images_per_s"]:
      best = result
  return best


def train_step_row(name, width, batch_size, steps):
  """One model and batch: JAX and PyTorch (None without torch) steps in float32 and bfloat16,
  with the ratios bfloat16/float32 (JAX) and JAX/PyTorch."""
  row = {"model": name, "batch_size": batch_size}
  for half, label in ((False, "float32"), (True, "bfloat16")):
    row[f"jax_{label}"] = jax_train_step(name, width, batch_size, half, steps)
    row[f"torch_{label}"] = torch_train_step(name, width, batch_size, half, steps)
  row["bfloat16_over_float32"] = (row["jax_bfloat16"]["images_per_s"] /
                                  row["jax_float32"]["images_per_s"])
  for label in ("float32", "bfloat16"):
    if row[f"torch_{label}"]:
      row[f"jax_over_torch_{label}"] = (row[f"jax_{label}"]["images_per_s"] /
                                        row[f"torch_{label}"]["images_per_s"])
  return row


def mc_inference(width, batch_size, num_samples, repeats):
  model = get_model("resnet_mcdo_smoothing_18", 10, **({"width": width} if width else {}))
  images = jax.random.normal(jax.random.key(0), (batch_size, 32, 32, 3))
  variables = jax.jit(model.init)({"params": jax.random.key(1), **sample_rngs(jax.random.key(2))},
                                  images[:1])
  single = jax.jit(lambda v, x, key: jax.nn.softmax(model.apply(v, x, rngs=sample_rngs(key))))
  rng = jax.random.key(3)
  rows = []
  for n in num_samples:
    t_call = median_seconds(
        lambda n=n: mc_predict(model, variables, images, num_samples=n, rng=rng).mean_probs,
        repeats)
    t_loop = median_seconds(
        lambda n=n: sum(single(variables, images, k) for k in jax.random.split(rng, n)) / n,
        repeats)
    rows.append({"num_samples": n, "mc_predict_images_per_s": batch_size / t_call,
                 "loop_images_per_s": batch_size / t_loop, "speedup_vs_loop": t_loop / t_call})
  return rows


def pipeline_images_per_s(dataset, batch_size, num_batches):
  pipeline = create_pipeline({"dataset": dataset, "batch_size": batch_size}, seed=0)
  iterator = pipeline.train_iterator()
  next(iterator)
  start = time.perf_counter()
  for _ in range(num_batches):
    next(iterator)
  return num_batches * batch_size / (time.perf_counter() - start)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128, 512])
  parser.add_argument("--width", type=int, default=None, help="model width (quick CPU runs)")
  parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
  parser.add_argument("--num-samples", type=int, nargs="+", default=[1, 10, 50])
  parser.add_argument("--mc-batch", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dataset",
                      default=f"npz:{DEFAULT_DATA}" if os.path.isdir(DEFAULT_DATA) else "digits")
  parser.add_argument("--pipeline-batches", type=int, default=50)
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  result = {"benchmark": "accelerator", "device": str(device), "device_kind": device.device_kind,
            "num_devices": jax.device_count(), "width": args.width, "train_step": []}
  for name in MODELS:
    for batch_size in args.batch_sizes:
      row = train_step_row(name, args.width, batch_size, args.steps)
      result["train_step"].append(row)
      print(json.dumps(row), flush=True)
  result["mc_predict"] = mc_inference(args.width, args.mc_batch, args.num_samples, args.repeats)
  pipeline = pipeline_images_per_s(args.dataset, max(args.batch_sizes), args.pipeline_batches)
  fastest_bf16 = max(r["jax_bfloat16"]["images_per_s"] for r in result["train_step"])
  result["pipeline"] = {"dataset": args.dataset, "images_per_s": pipeline,
                        "over_fastest_bfloat16_step": pipeline / fastest_bf16}
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
