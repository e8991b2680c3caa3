"""Benchmark: frames/s of U-Net inference — deterministic, MC dropout (N passes) and VQ-BNN
(one pass/frame).

Prints one JSON object with frames/s of

* ``deterministic``: one forward pass per frame (``dropout_rate=0``, same weights);
* ``mc_dropout``: ``mc_predict`` with N samples per frame (one vmapped call);
* ``vq_bnn_scan``: :func:`smoothing_jax.temporal.vq_bnn_predict` over a clip of
  ``--frames`` frames (one ``lax.scan``: one stochastic pass per frame + smoothing);
* ``vq_bnn_stream``: the jitted per-frame step :func:`~smoothing_jax.temporal.stream_predict`
  called once per frame, as a live stream would;

and each one's throughput relative to ``deterministic`` (measured in the same run,
on the same device, after compilation; medians over ``--repeats``).  The SS
slides report VQ-BNN at 93% and MC dropout at 3% of deterministic throughput.

  # paper size: 360×480, width 64, N = 50
  python experiments/bench_segmentation.py
  # quick
  python experiments/bench_segmentation.py --height 96 --width 128 --unet-width 16 --num-samples 5
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from timing import median_seconds

from smoothing_jax import temporal
from smoothing_jax.inference import mc_predict
from smoothing_jax.models import get_model
from smoothing_jax.passes import sample_rngs


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="unet_mcdo_smoothing")
  parser.add_argument("--num-classes", type=int, default=11)
  parser.add_argument("--batch-size",
                      type=int,
                      default=1,
                      help="parallel streams (frames per call)")
  parser.add_argument("--height", type=int, default=360)
  parser.add_argument("--width", type=int, default=480)
  parser.add_argument("--unet-width",
                      type=int,
                      default=None,
                      help="override the U-Net's first-level channels")
  parser.add_argument("--frames", type=int, default=10, help="clip length of the VQ-BNN scan")
  parser.add_argument("--num-samples", type=int, default=50, help="MC dropout N")
  parser.add_argument("--chunk-size",
                      type=int,
                      default=10,
                      help="mc_predict chunk_size (bounds memory)")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)

  overrides = {} if args.unet_width is None else {"width": args.unet_width}
  model = get_model(args.model, args.num_classes, **overrides)
  deterministic = model.clone(dropout_rate=0.0)
  frames = jax.random.normal(jax.random.key(0),
                             (args.frames, args.batch_size, args.height, args.width, 3))
  variables = jax.jit(model.init)({
      "params": jax.random.key(1),
      **sample_rngs(jax.random.key(2))
  }, frames[0, :1])
  rng = jax.random.key(3)
  frame = frames[0]

  det_pass = jax.jit(lambda v, x: jax.nn.softmax(deterministic.apply(v, x)))
  t_det = median_seconds(lambda: det_pass(variables, frame), args.repeats)
  t_mc = median_seconds(
      lambda: mc_predict(model,
                         variables,
                         frame,
                         num_samples=args.num_samples,
                         rng=rng,
                         chunk_size=args.chunk_size).mean_probs, args.repeats)
  t_scan = median_seconds(lambda: temporal.vq_bnn_predict(model, variables, frames, rng=rng)[1],
                          args.repeats)

  empty = temporal.init_stream(temporal.prediction_shape(model, variables, frame.shape))

  def stream():
    state = empty
    for t in range(args.frames):
      state, probs = temporal.stream_predict(model, variables, state, frames[t], rng=rng)
    return probs

  t_stream = median_seconds(stream, args.repeats)
  clip = args.frames * args.batch_size
  fps = {"deterministic": args.batch_size / t_det, "mc_dropout": args.batch_size / t_mc,
         "vq_bnn_scan": clip / t_scan, "vq_bnn_stream": clip / t_stream}
  print(
      json.dumps(
          {
              "device": jax.devices()[0].device_kind,
              "model": args.model,
              "unet_width": model.width,
              "image": [args.height, args.width],
              "batch_size": args.batch_size,
              "num_samples": args.num_samples,
              "frames": args.frames,
              "frames_per_s": fps,
              "throughput_vs_deterministic": {
                  k: v / fps["deterministic"] for k, v in fps.items()
              },
              "parameters": int(sum(x.size for x in jax.tree.leaves(variables["params"]))),
              "dtype": str(jnp.result_type(frames)),
          },
          indent=2))


if __name__ == "__main__":
  main()
