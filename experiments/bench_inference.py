"""Benchmark: N-sample MC dropout inference as one vmapped call vs a Python loop of passes.

Prints one JSON object: for each N, images/s of ``mc_predict`` (one jitted,
vmapped call) and of a loop of N single jitted passes, and the cost ratio
``t(N-sample call) / (N · t(single pass))`` (< 1 means batching the samples
beats N separate passes).  Everything is measured in the same run, on the same
device, after compilation; times are medians over ``--repeats``.

  python experiments/bench_inference.py                 # the issue's setting
  python experiments/bench_inference.py --batch-size 32 --num-samples 1 2 --width 16   # quick
"""
from __future__ import annotations

import argparse
import json

import jax

from timing import median_seconds

from smoothing_jax.inference import mc_predict
from smoothing_jax.models import get_model


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="resnet_mcdo_smoothing_18")
  parser.add_argument("--num-classes", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--num-samples", type=int, nargs="+", default=[1, 2, 10, 50])
  parser.add_argument("--chunk-size", type=int, default=10,
                      help="mc_predict chunk_size: samples evaluated together (bounds memory)")
  parser.add_argument("--width", type=int, default=None, help="override the model width (quick runs)")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)

  overrides = {} if args.width is None else {"width": args.width}
  model = get_model(args.model, args.num_classes, **overrides)
  images = jax.random.normal(jax.random.key(0), (args.batch_size, args.image_size, args.image_size, 3))
  variables = jax.jit(model.init)({"params": jax.random.key(1), "dropout": jax.random.key(2)}, images[:1])

  single_pass = jax.jit(lambda v, x, key: jax.nn.softmax(model.apply(v, x, rngs={"dropout": key})))

  def loop(n, rng):
    return sum(single_pass(variables, images, key) for key in jax.random.split(rng, n)) / n

  rng = jax.random.key(3)
  t_single = median_seconds(lambda: single_pass(variables, images, rng), args.repeats)
  results = []
  for n in args.num_samples:
    t_vmap = median_seconds(
        lambda: mc_predict(model, variables, images, num_samples=n, rng=rng, chunk_size=args.chunk_size).mean_probs,
        args.repeats)
    t_loop = median_seconds(lambda: loop(n, rng), args.repeats)
    results.append({
        "num_samples": n,
        "mc_predict_images_per_s": args.batch_size / t_vmap,
        "python_loop_images_per_s": args.batch_size / t_loop,
        "mc_predict_seconds": t_vmap,
        "python_loop_seconds": t_loop,
        "speedup_vs_loop": t_loop / t_vmap,
        "cost_ratio_vs_n_single_passes": t_vmap / (n * t_single),
    })
    print(json.dumps(results[-1]), flush=True)
  print(json.dumps({
      "benchmark": "mc_predict_vs_python_loop", "model": args.model, "overrides": overrides,
      "batch_size": args.batch_size, "image_size": args.image_size, "chunk_size": args.chunk_size,
      "device": str(jax.devices()[0]), "num_devices": jax.device_count(),
      "single_pass_seconds": t_single, "single_pass_images_per_s": args.batch_size / t_single,
      "results": results}, indent=2))


if __name__ == "__main__":
  main()
