"""What conformal prediction costs beside the predictive it thresholds (issue 59's goal: ≤ 5% at
N = 10).

In one run, alternated round by round (``timing.alternate``): the MC-dropout predictive of
``resnet_mcdo_smoothing_18`` at N = 10 on ``--examples`` CIFAR-sized images (one compiled call
per batch of ``--batch_size``), and everything the ``conformal`` evaluator computes for one N on
those probabilities: for each α of (0.1, 0.05) and each score and variant (THR; APS and RAPS, each
randomised and not), the calibration scores of one half, q̂, the other half's sets and their
metrics.  Prints one JSON object (``--out`` also writes it): the seconds of each per round and
the per-round ratio conformal / predictive.

  python experiments/bench_conformal.py --out experiments/results/bench_conformal_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from timing import alternate, round_ratios  # noqa: E402

from smoothing_jax import conformal  # noqa: E402
from smoothing_jax.methods.mc_dropout import MCDropout  # noqa: E402
from smoothing_jax.models import get_model  # noqa: E402
from smoothing_jax.passes import mean_probs  # noqa: E402

VARIANTS = (("thr", False), ("aps", False), ("aps", True), ("raps", False), ("raps", True))


def conformal_sets(probs, labels, seed: int = 0) -> list:
  """The evaluator's work for one N: half calibrates, half is scored, every α and variant."""
  half = len(labels) // 2
  rng = np.random.default_rng(seed)
  cal_u, test_u = rng.uniform(size=half), rng.uniform(size=len(labels) - half)
  out = []
  for alpha in (0.1, 0.05):
    for score, randomized in VARIANTS:
      options = {"penalty": 0.1, "rank": 1}
      scores = conformal.label_scores(probs[:half], labels[:half], score,
                                      uniforms=cal_u if conformal.calibration_draws(
                                          score, randomized) else None, **options)
      qhat = conformal.conformal_quantile(scores, alpha)
      sets = conformal.prediction_sets(probs[half:], qhat, score, randomized=randomized,
                                       uniforms=test_u, **options)
      out.append(conformal.set_metrics(sets, labels[half:], alpha))
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--examples", type=int, default=1000)
  parser.add_argument("--batch_size", type=int, default=250)
  parser.add_argument("--num_samples", type=int, default=10)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="")
  args = parser.parse_args(argv)
  model = get_model("resnet_mcdo_smoothing_18", 10, width=args.width)
  variables = jax.jit(model.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                  jnp.zeros((1, 32, 32, 3)))
  method = MCDropout(model, num_samples=args.num_samples)
  images = jax.random.normal(jax.random.key(2), (args.examples, 32, 32, 3))
  labels = np.random.default_rng(0).integers(0, 10, args.examples)
  batches = [images[i:i + args.batch_size] for i in range(0, args.examples, args.batch_size)]
  predict = jax.jit(lambda v, x, key: mean_probs(method.sample_log_probs(v, x, key)))

  def predictive():
    return np.concatenate([np.asarray(predict(variables, x, jax.random.key(i)))
                           for i, x in enumerate(batches)])

  probs = predictive()
  first = {}
  times = alternate({"predictive": predictive, "conformal": lambda: conformal_sets(probs, labels)},
                    args.repeats, first)
  ratios = round_ratios(times["conformal"], times["predictive"])
  result = {"benchmark": "conformal_vs_predictive", "backend": jax.default_backend(),
            "device": str(jax.devices()[0]), "model": "resnet_mcdo_smoothing_18",
            "width": args.width, "examples": args.examples, "num_samples": args.num_samples,
            "variants_per_alpha": len(VARIANTS), "alphas": [0.1, 0.05],
            "seconds": times, "first_call_seconds": first,
            "conformal_over_predictive": ratios,
            "median_ratio": float(np.median(ratios)), "goal": "<= 0.05"}
  text = json.dumps(result, indent=1)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")
  return result


if __name__ == "__main__":
  main()
