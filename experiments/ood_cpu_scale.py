"""The uncertainty evaluations at CPU scale (issue 26): CIFAR-10 classes 0–4 in distribution,
classes 5–9 out of distribution (no SVHN offline).

For each model (default ``resnet_mcdo_18`` and ``resnet_mcdo_smoothing_18``, the quickstart
recipe of ``configs/quickstart.py``: width 16, batch 64, SGD; ``--epochs`` 6 instead of 12), trains
on the in-distribution classes with 10% of the training split held out, then runs the ``ood``,
``calibration`` and ``selective`` evaluators for N = 1, 2, 10 and prints one JSON summary: per
model and N, the AUROC of each score, NLL and ECE before and after temperature scaling, AURC and
E-AURC by MSP.

  python experiments/ood_cpu_scale.py --data ../shared/data/cifar10 --root /tmp/ood_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from absl import logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from smoothing_jax import main  # noqa: E402
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10")
IN_CLASSES = (0, 1, 2, 3, 4)


def split_by_class(data: str, root: str) -> tuple:
  """``npz:`` directories of the in-distribution classes (train and test) and of the others
  (their test images: the OOD set), written once under ``root``."""
  inside, outside = os.path.join(root, "cifar10_0-4"), os.path.join(root, "cifar10_5-9")
  if not os.path.exists(os.path.join(outside, "test.npz")):
    for directory in (inside, outside):
      os.makedirs(directory, exist_ok=True)
    for split in ("train", "test"):
      with np.load(os.path.join(data, f"{split}.npz")) as f:
        images, labels = f["images"], f["labels"]
      kept = np.isin(labels, IN_CLASSES)
      np.savez(os.path.join(inside, f"{split}.npz"), images=images[kept], labels=labels[kept])
      np.savez(os.path.join(outside, f"{split}.npz"), images=images[~kept],
               labels=labels[~kept] - len(IN_CLASSES))
  return f"npz:{inside}", f"npz:{outside}"


def summarise(results: dict) -> dict:
  """Per N: AUROC of each score, NLL / ECE before and after temperature scaling, the temperature,
  AURC and E-AURC by MSP."""
  out = {}
  for row in results["ood"]:
    out.setdefault(row["ensemble_size"], {})[f"auroc_{row['score']}"] = row["auroc"]
  for row in results["calibration"]:
    out[row["ensemble_size"]].update({"nll_before": row["nll_before"],
                                      "ece_before": row["ece_before"],
                                      "accuracy": row["accuracy"]})
    out[row["ensemble_size"]].update({f"{k}_{row['placement']}": row[k] for k in (
        "temperature", "nll_after", "ece_after")})
  for row in results["selective"]:
    if row["score"] == "msp":
      out[row["ensemble_size"]].update(aurc=row["aurc"], excess_aurc=row["excess_aurc"])
  return out


def main_(argv=None):
  logging.set_verbosity(logging.INFO)  # the training's progress lines, not the libraries'
  show_only_our_info_lines()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=DEFAULT_DATA, help="CIFAR-10 as train.npz / test.npz")
  parser.add_argument("--root", default="/tmp/ood_cpu_scale", help="workdirs and split data")
  parser.add_argument("--models", nargs="+", default=["resnet_mcdo_18", "resnet_mcdo_smoothing_18"])
  parser.add_argument("--epochs", type=int, default=6,
                      help="training epochs after the warm-up one, the learning rate × 0.2 at "
                      "1/2 and 3/4 of them, as the quickstart's 12 (6: about 10 minutes a model "
                      "on 2 CPU cores)")
  parser.add_argument("--sizes", default="1,2,10", help="ensemble sizes N")
  args = parser.parse_args(argv)
  inside, outside = split_by_class(args.data, args.root)
  sizes = tuple(int(n) for n in args.sizes.split(","))
  summary = {}
  for model in args.models:
    overrides = {"model": model, "input.dataset": inside, "input.holdout_fraction": 0.1,
                 "ensemble_sizes": sizes,
                 "evals": {"ood": {"datasets": (outside,)}, "calibration": {}, "selective": {}}}
    overrides["num_epochs"] = args.epochs
    overrides["lr_milestones"] = (int(args.epochs / 2 + 0.5), int(3 * args.epochs / 4 + 0.5))
    config = config_lib.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                          "configs", "quickstart.py"), overrides)
    start = time.time()
    results = main.run(config, os.path.join(args.root, model), "train")
    summary[model] = {"seconds": round(time.time() - start), **summarise(results)}
  print(json.dumps({"in_distribution": inside, "ood": outside, "sizes": sizes,
                    "models": summary}, indent=1))


if __name__ == "__main__":
  main_()
