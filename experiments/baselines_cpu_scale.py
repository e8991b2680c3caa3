"""The baselines' comparisons at CPU scale, each setting on one short schedule (issue 33).

``--part ibnn``: the iBNN paper's comparison (Figs. 5–7) on CIFAR-10 at a narrow VGG-16
(``--width``): DNN, MC dropout, BNN-VI (uncertainty-baselines' ``vgg_bnnvi_16`` and the iBNN
repository's ``vgg_bayesian_16``, with its Adam) and iBNN (K = 4) under ``configs/cifar_ibnn.py``'s
protocol, shortened to ``--epochs`` (λ₀ flat for half, then linear to 0.01·λ₀ at 90%; β
annealed over the first 2/3 of the epochs, as 200 of 300), both learning rates (λ₀ and iBNN's
λ₁) × ``--lr_scale``, on a class-balanced ``--train_fraction`` of the training split; test error,
NLL and ECE (15 bins) of the whole test split with ``--samples`` predictions per method (iBNN:
``samples / K`` draws of each component).  A run whose loss turns non-finite is a row of its own
(``diverged``).

``--part batchensemble``: BatchEnsemble of 4 (``resnet_batchensemble_18``), MIMO of 4
(``resnet_mimo_18``, uncertainty-baselines' batch repetitions 4) and Packed-Ensembles of 4
(``resnet_packed_18``, α = 2, γ = 2) against a deep ensemble of 4 trained as one job
(``resnet_dnn_18`` with ``deep_ensemble.members=4``) and a single ``resnet_dnn_18``, all at
``--width`` on ``configs/cifar_resnet.py`` shortened to ``--epochs`` after one warm-up epoch
(lr × 0.2 at 1/2 and 3/4), with each job's wall time.

Writes ``<root>/<part>_cpu_scale.json`` (``--methods`` reruns some settings, keeping the other
rows of an existing file) and prints the Markdown table.

  python experiments/baselines_cpu_scale.py --part ibnn --root /tmp/baselines_cpu
  python experiments/baselines_cpu_scale.py --part batchensemble --root /tmp/baselines_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from absl import logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from configs import cifar_ibnn  # noqa: E402
from smoothing_jax import main  # noqa: E402
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_DATA = os.path.join(ROOT, "..", "shared", "data", "cifar10")
IBNN_COMPONENTS = 4


def ibnn_settings(args) -> dict:
  """``{label: (config argument, overrides)}`` of the iBNN comparison."""
  anneal = max(1, round(2 * args.epochs / 3))
  vgg_cifar10 = cifar_ibnn.TABLE_2[("vgg", "cifar10")]
  common = {"num_epochs": args.epochs, "model_kwargs.width": args.width,
            "learning_rate": args.lr_scale * vgg_cifar10[0],
            "ibnn.variational_lr": args.lr_scale * vgg_cifar10[1],
            "ensemble_sizes": (1, args.samples), "ibnn.kl_anneal_epochs": anneal,
            "bnnvi.kl_anneal_epochs": anneal,
            "ibnn.eval_samples": max(1, args.samples // IBNN_COMPONENTS)}
  # The iBNN repository's BNN-VI trains with its own Adam (lr 1e-3, configs/cifar_ibnn.py), not
  # the SGD rate λ₀: its learning rate is left as the protocol sets it.
  adam = {k: v for k, v in common.items() if k != "learning_rate"}
  return {label: (f"vgg_{name}_16", adam if name == "bayesian" else common) for label, name in
          (("DNN", "dnn"), ("MC dropout", "mcdo"), ("BNN-VI", "bnnvi"),
           ("BNN-VI (iBNN repository)", "bayesian"), (f"iBNN-{IBNN_COMPONENTS}", "ibnn"))}


def batchensemble_settings(args) -> dict:
  """``{label: (config argument, overrides)}`` of the BatchEnsemble comparison: one schedule."""
  common = {"model_kwargs.width": args.width, "num_epochs": args.epochs, "warmup_epochs": 1,
            "lr_milestones": (round(args.epochs / 2), round(3 * args.epochs / 4)),
            "nesterov": False, "weight_decay": 5e-4, "ensemble_sizes": (1,)}
  return {"single ResNet-18": ("resnet_dnn_18", common),
          "deep ensemble of 4 (one job)": ("resnet_dnn_18", {**common, "deep_ensemble.members": 4}),
          "BatchEnsemble of 4": ("resnet_batchensemble_18", common),
          "MIMO of 4": ("resnet_mimo_18", {**common, "model_kwargs.mimo_members": 4}),
          "Packed-Ensembles of 4": ("resnet_packed_18", common)}


def record(args, rows: list) -> dict:
  """The results file of ``rows`` under the settings ``args``."""
  return {"part": args.part, "data": args.data, "train_fraction": args.train_fraction,
          "epochs": args.epochs, "width": args.width, "lr_scale": args.lr_scale, "rows": rows}


def main_(argv=None):
  logging.set_verbosity(logging.INFO)
  show_only_our_info_lines()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--part", choices=("ibnn", "batchensemble"), required=True)
  parser.add_argument("--data", default=DEFAULT_DATA, help="CIFAR-10 as train.npz / test.npz")
  parser.add_argument("--root", default="/tmp/baselines_cpu_scale", help="workdirs and results")
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--train_fraction", type=float, default=0.2)
  parser.add_argument("--samples", type=int, default=8, help="predictions per stochastic method")
  parser.add_argument("--methods", nargs="+", help="labels of the settings to run (default: all)")
  parser.add_argument("--lr_scale", type=float, default=1.0, help="ibnn: × λ₀ and λ₁")
  args = parser.parse_args(argv)
  dataset = f"npz:{os.path.abspath(args.data)}"
  if args.part == "ibnn":
    recipe, settings = "cifar_ibnn.py", ibnn_settings(args)
  else:
    recipe, settings = "cifar_resnet.py", batchensemble_settings(args)
  path = os.path.join(args.root, f"{args.part}_cpu_scale.json")
  kept = {}
  if args.methods and os.path.exists(path):
    with open(path) as f:
      kept = {row["method"]: row for row in json.load(f)["rows"]}
  unknown = set(args.methods or ()) - set(settings)
  if unknown:
    parser.error(f"unknown --methods {sorted(unknown)}; choose from {list(settings)}")
  rows = []
  for label, (model, overrides) in settings.items():
    if args.methods and label not in args.methods:
      if label in kept:
        rows.append(kept[label])
      continue
    config = config_lib.load(
        os.path.join(ROOT, "configs", f"{recipe}:{model},{dataset}"),
        {**overrides, "input.train_fraction": args.train_fraction,
         "eval_every_epochs": args.epochs + 1,
         "evals": {"ensemble_sizes": {}}})
    workdir = os.path.join(args.root, args.part, label.split(" (")[0].replace(" ", "_"))
    start = time.time()
    try:
      results = main.run(config, workdir, "train")
    except FloatingPointError as error:  # a diverged run is a result too
      rows.append({"method": label, "model": model, "diverged": str(error).split(".")[0],
                   "seconds": round(time.time() - start)})
    else:
      last = results["ensemble_sizes"][-1]
      rows.append({"method": label, "model": model, "predictions": last["ensemble_size"],
                   "error": 1.0 - last["acc"], "nll": last["nll"], "ece": last["ece"],
                   "seconds": round(time.time() - start)})
    write(path, record(args, rows))  # after each run: a crash keeps the rows before it
  write(path, record(args, rows))  # with the kept rows after the last run
  print("| method | predictions | error (%) | NLL | ECE (%) | wall time (s) |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    if "diverged" in r:
      print(f"| {r['method']} | {r['diverged']} | | | | {r['seconds']} |")
    else:
      print(f"| {r['method']} | {r['predictions']} | {100 * r['error']:.2f} | {r['nll']:.4f} | "
            f"{100 * r['ece']:.2f} | {r['seconds']} |")


def write(path: str, out: dict) -> None:
  """``out`` as JSON at ``path``."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main_()
