"""SS Fig. E.1 at CPU scale: deep ensembles with and without spatial smoothing, each trained as
one job of M members (``config.deep_ensemble.members``), evaluated at N = 1..M.

For each model (default ``resnet_dnn_18`` and ``resnet_dnn_smoothing_18``, the quickstart recipe
of ``configs/quickstart.py``: width 16, batch 64, SGD, ``--epochs`` after one warm-up epoch, the
learning rate × 0.2 at 1/2 and 3/4 of them) on a class-balanced ``--train_fraction`` of CIFAR-10's
training split (``../shared/data/cifar10``), trains one single run (M = 1, for its wall time) and
one ensemble of ``--members``, then the ``ensemble_sizes`` evaluator on the whole test split.
Writes ``<root>/ensemble_cpu_scale.{json,png}``: NLL, accuracy and ECE against N, and each job's
wall time.

  python experiments/ensemble_cpu_scale.py --root /tmp/ensemble_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from absl import logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from smoothing_jax import main  # noqa: E402
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.plots import close, plot_ensemble_sizes  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10")


def plot(summary: dict, path: str):
  """NLL, accuracy and ECE against the ensemble size, one line per model (SS Fig. E.1 layout)."""
  rows = {model: result["ensemble"]["rows"] for model, result in summary.items()}
  fig = plot_ensemble_sizes(rows, "Deep ensembles trained as one job (CPU scale)")
  fig.savefig(path, dpi=120)
  close(fig)


def main_(argv=None):
  logging.set_verbosity(logging.INFO)
  show_only_our_info_lines()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=DEFAULT_DATA, help="CIFAR-10 as train.npz / test.npz")
  parser.add_argument("--root", default="/tmp/ensemble_cpu_scale", help="workdirs and results")
  parser.add_argument("--models", nargs="+", default=["resnet_dnn_18", "resnet_dnn_smoothing_18"])
  parser.add_argument("--members", type=int, default=4)
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--train_fraction", type=float, default=0.1)
  args = parser.parse_args(argv)
  summary = {}
  for model in args.models:
    summary[model] = {}
    for label, members in (("single", 1), ("ensemble", args.members)):
      overrides = {"model": model, "input.dataset": f"npz:{os.path.abspath(args.data)}",
                   "input.train_fraction": args.train_fraction, "deep_ensemble.members": members,
                   "num_epochs": args.epochs, "eval_every_epochs": args.epochs + 1,
                   "lr_milestones": (int(args.epochs / 2 + 0.5), int(3 * args.epochs / 4 + 0.5)),
                   "evals": {"ensemble_sizes": {}} if members > 1 else {}}
      config = config_lib.load(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                            "configs", "quickstart.py"), overrides)
      workdir = os.path.join(args.root, f"{model}_{label}")
      start = time.time()
      results = main.run(config, workdir, "train")
      summary[model][label] = {"members": members, "seconds": round(time.time() - start)}
      if members > 1:
        summary[model][label]["rows"] = [
            {k: row[k] for k in ("ensemble_size", "nll", "acc", "ece")}
            for row in results["ensemble_sizes"]]
  out = {"data": args.data, "train_fraction": args.train_fraction, "epochs": args.epochs,
         "models": summary}
  with open(os.path.join(args.root, "ensemble_cpu_scale.json"), "w") as f:
    json.dump(out, f, indent=1)
  plot(summary, os.path.join(args.root, "ensemble_cpu_scale.png"))
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main_()
