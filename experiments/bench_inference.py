"""Benchmark: N-sample MC dropout inference as one vmapped call vs a Python loop of passes.

Prints one JSON object: for each N, images/s of ``mc_predict`` (one jitted,
vmapped call) and of a loop of N single jitted passes, and the cost ratio
``t(N-sample call) / (N · t(single pass))`` (< 1 means batching the samples
beats N separate passes).  Everything is measured in the same run, on the same
device, after compilation; times are medians over ``--repeats``.

  python experiments/bench_inference.py                 # the issue's setting
  python experiments/bench_inference.py --batch-size 32 --num-samples 1 2 --width 16   # quick

It also times iBNN inference (``--ibnn-model``, K components × S samples): one
``ibnn_predict`` call against a loop of K·S single jitted passes.
"""
from __future__ import annotations

import argparse
import json

import jax
from timing import median_seconds

from smoothing_jax.inference import mc_predict
from smoothing_jax.methods.ibnn import ibnn_predict
from smoothing_jax.models import get_model
from smoothing_jax.passes import sample_rngs


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="resnet_mcdo_smoothing_18")
  parser.add_argument("--num-classes", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--image-size", type=int, default=32)
  parser.add_argument("--num-samples", type=int, nargs="+", default=[1, 2, 10, 50])
  parser.add_argument("--chunk-size", type=int, default=None,
                      help="mc_predict chunk_size: samples evaluated together (default: the "
                      "backend's, inference.default_chunk_size)")
  parser.add_argument("--width",
                      type=int,
                      default=None,
                      help="override the model width (quick runs)")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--ibnn-model", default="vgg_ibnn_16")
  parser.add_argument("--ibnn-components",
                      type=int,
                      default=4,
                      help="K (0 skips the iBNN measurement)")
  parser.add_argument("--ibnn-samples", type=int, default=5, help="S per component")
  args = parser.parse_args(argv)

  overrides = {} if args.width is None else {"width": args.width}
  model = get_model(args.model, args.num_classes, **overrides)
  images = jax.random.normal(jax.random.key(0),
                             (args.batch_size, args.image_size, args.image_size, 3))
  variables = jax.jit(model.init)({
      "params": jax.random.key(1),
      **sample_rngs(jax.random.key(2))
  }, images[:1])

  single_pass = jax.jit(lambda v, x, key: jax.nn.softmax(model.apply(v, x, rngs=sample_rngs(key))))

  def loop(n, rng):
    return sum(single_pass(variables, images, key) for key in jax.random.split(rng, n)) / n

  rng = jax.random.key(3)
  t_single = median_seconds(lambda: single_pass(variables, images, rng), args.repeats)
  results = []
  for n in args.num_samples:
    t_vmap = median_seconds(
        lambda n=n: mc_predict(
            model, variables, images, num_samples=n, rng=rng, chunk_size=args.chunk_size).
        mean_probs, args.repeats)
    t_loop = median_seconds(lambda n=n: loop(n, rng), args.repeats)
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
  ibnn = ibnn_benchmark(args, images) if args.ibnn_components else None
  print(json.dumps({
      "benchmark": "mc_predict_vs_python_loop", "model": args.model, "overrides": overrides,
      "batch_size": args.batch_size, "image_size": args.image_size, "chunk_size": args.chunk_size,
      "device": str(jax.devices()[0]), "num_devices": jax.device_count(),
      "single_pass_seconds": t_single, "single_pass_images_per_s": args.batch_size / t_single,
      "results": results, "ibnn": ibnn}, indent=2))


def ibnn_benchmark(args, images):
  """K×S iBNN predictions as one ``ibnn_predict`` call vs K×S single jitted passes."""
  overrides = {"num_components": args.ibnn_components}
  if args.width is not None:
    overrides["width"] = args.width
  model = get_model(args.ibnn_model, args.num_classes, **overrides)
  variables = jax.jit(model.init)({
      "params": jax.random.key(1),
      **sample_rngs(jax.random.key(2))
  }, images[:1])
  k, s = args.ibnn_components, args.ibnn_samples
  single_pass = jax.jit(
      lambda v, x, c, key: jax.nn.softmax(model.apply(v, x, components=c, rngs=sample_rngs(key))))
  rng = jax.random.key(3)
  components = [jax.numpy.full((images.shape[0],), i) for i in range(k)]

  def loop():
    keys = jax.random.split(rng, k * s)
    return sum(
        single_pass(variables, images, components[i % k], key)
        for i, key in enumerate(keys)) / (k * s)

  t_single = median_seconds(lambda: single_pass(variables, images, components[0], rng),
                            args.repeats)
  t_call = median_seconds(
      lambda: ibnn_predict(model, variables, images, num_samples=s, rng=rng).mean_probs,
      args.repeats)
  t_loop = median_seconds(loop, args.repeats)
  result = {
      "model": args.ibnn_model,
      "num_components": k,
      "samples_per_component": s,
      "predictions": k * s,
      "ibnn_predict_seconds": t_call,
      "python_loop_seconds": t_loop,
      "ibnn_predict_images_per_s": images.shape[0] / t_call,
      "python_loop_images_per_s": images.shape[0] / t_loop,
      "speedup_vs_loop": t_loop / t_call,
      "cost_ratio_vs_ks_single_passes": t_call / (k * s * t_single)
  }
  print(json.dumps(result), flush=True)
  return result


if __name__ == "__main__":
  main()
