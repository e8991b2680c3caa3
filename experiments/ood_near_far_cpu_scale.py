"""OpenOOD v1.5's near/far protocol at CPU scale (issue 45): every score of the ``ood`` evaluator
at N = 1 and the largest N, for six methods trained on one short schedule.

The methods (``METHODS``): ResNet-18 at width 16, deterministic, MC dropout, each with and
without spatial smoothing, a deep ensemble of ``--members`` trained as one job
(``deep_ensemble.members``) and a BatchEnsemble of ``--members``.  The schedule is the quickstart
recipe's (``configs/quickstart.py``: batch 64, SGD, one warm-up epoch, ``--epochs`` after it with
the learning rate × 0.2 at 1/2 and 3/4 of them, as ``ood_cpu_scale.py``) on a class-balanced
``--train_fraction`` of CIFAR-10's training split (``../shared/data/cifar10``).  The
in-distribution test set is the first ``--id_test`` images of its test split (the split is
shuffled: a prefix is about class-balanced); the OOD sets (``NEAR``, ``FAR``, from
``../shared/data``) are a seeded ``--ood_count`` of each, written once under ``<root>/data``.
After training, the ``ood`` evaluator with ``near`` / ``far`` (its defaults: every score,
ODIN T = 1000 and noise 0.0014, KNN K = 50, ``combine="score_mean"``) at N = 1 and ``--samples``.

Writes ``<root>/ood_near_far_cpu_scale.json`` after every method (``--methods`` reruns some,
keeping the other rows of an existing file; ``--table`` only prints the table of that file) and
prints the Markdown table: per method and score, near / far AUROC and FPR@95 (OpenOOD's
convention, OOD positive) at N = 1 and the largest N.

  python experiments/ood_near_far_cpu_scale.py --root /tmp/ood_near_far
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

from experiments.baselines_cpu_scale import write  # noqa: E402
from experiments.ood_cpu_scale import DEFAULT_DATA  # noqa: E402
from smoothing_jax import main  # noqa: E402
from smoothing_jax.evaluators.ood import SCORES  # noqa: E402
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SHARED = os.path.join(ROOT, "..", "shared", "data")
NEAR = {"cifar100": "cifar100/test_jpeg75.npz"}
FAR = {"textures": "textures/test.npz", "mnist": "mnist/test.npz"}


def methods(members: int) -> dict:
  """``{label: overrides}`` of the six methods."""
  return {"deterministic": {"model": "resnet_dnn_18"},
          "MC dropout": {"model": "resnet_mcdo_18"},
          "deterministic + smoothing": {"model": "resnet_dnn_smoothing_18"},
          "MC dropout + smoothing": {"model": "resnet_mcdo_smoothing_18"},
          f"deep ensemble of {members}": {"model": "resnet_dnn_18",
                                          "deep_ensemble.members": members},
          f"BatchEnsemble of {members}": {"model": "resnet_batchensemble_18"}}


def subsets(data: str, shared: str, root: str, id_test: int, ood_count: int) -> tuple:
  """``(in-distribution npz: dir, near files, far files)``: the training split linked, the first
  ``id_test`` test images, and a ``default_rng(0)`` sample of ``ood_count`` of each OOD set (all
  of a smaller one), written once under ``<root>/data``."""
  out = os.path.join(root, "data")
  inside = os.path.join(out, "cifar10")
  os.makedirs(inside, exist_ok=True)
  if not os.path.exists(os.path.join(inside, "train.npz")):
    os.symlink(os.path.abspath(os.path.join(data, "train.npz")), os.path.join(inside, "train.npz"))
  test = os.path.join(inside, "test.npz")
  if not os.path.exists(test):
    with np.load(os.path.join(data, "test.npz")) as f:
      np.savez(test, images=f["images"][:id_test], labels=f["labels"][:id_test])
  files = {}
  for name, relative in {**NEAR, **FAR}.items():
    path = files[name] = os.path.join(out, f"{name}.npz")
    if not os.path.exists(path):
      with np.load(os.path.join(shared, relative)) as f:
        images, labels = f["images"], f["labels"]
      keep = np.sort(np.random.default_rng(0).permutation(len(labels))[:ood_count])
      np.savez(path, images=images[keep], labels=labels[keep])
  return (f"npz:{inside}", tuple(files[n] for n in NEAR), tuple(files[n] for n in FAR))


def summarise(rows: list) -> dict:
  """``{score: {N: {group: {"auroc", "fpr95"}}}}`` of the group means of the ``ood`` rows (FPR@95
  in OpenOOD's convention: OOD positive), with ``"id_accuracy"`` per N."""
  out = {}
  for row in rows:
    if row["ood_dataset"].endswith(" mean"):
      cell = out.setdefault(row["score"], {}).setdefault(str(row["ensemble_size"]), {})
      cell[row["ood_group"]] = {"auroc": row["auroc"], "fpr95": row["fpr95_ood_positive"]}
      out.setdefault("id_accuracy", {})[str(row["ensemble_size"])] = row["id_accuracy"]
  return out


def table(rows: list) -> str:
  """The Markdown table: per method and score, near / far AUROC and FPR@95 (%) as "N = 1 → the
  largest N" (one number for a method of one draw; the mutual information, 0 at N = 1, only at
  the largest N)."""
  lines = ["| method (N; ID accuracy %) | score | near AUROC | far AUROC | near FPR@95 | "
           "far FPR@95 |", "|---|---|---|---|---|---|"]
  for r in rows:
    sizes = sorted(r["summary"]["id_accuracy"], key=int)
    acc = " / ".join(f"{100 * r['summary']['id_accuracy'][n]:.1f}" for n in sizes)
    label = f"{r['method']} ({' / '.join(sizes)}; {acc})"
    for score in SCORES:
      cells = []
      for metric in ("auroc", "fpr95"):
        for group in ("near", "far"):
          shown = [n for n in dict.fromkeys(("1", sizes[-1]))
                   if not (score == "mutual_information" and n == "1")]
          values = [r["summary"].get(score, {}).get(n, {}).get(group, {}).get(metric)
                    for n in shown]
          cells.append(" → ".join("–" if v is None else f"{100 * v:.1f}" for v in values) or "–")
      lines.append(f"| {label} | {score} | " + " | ".join(cells) + " |")
      label = ""
  return "\n".join(lines)


def main_(argv=None):
  logging.set_verbosity(logging.INFO)
  show_only_our_info_lines()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--data", default=DEFAULT_DATA, help="CIFAR-10 as train.npz / test.npz")
  parser.add_argument("--shared", default=SHARED, help="the folder of the OOD sets")
  parser.add_argument("--root", default="/tmp/ood_near_far_cpu_scale", help="workdirs, results")
  parser.add_argument("--members", type=int, default=4, help="deep ensemble, BatchEnsemble")
  parser.add_argument("--samples", type=int, default=4, help="MC dropout's largest N")
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--train_fraction", type=float, default=0.1)
  parser.add_argument("--id_test", type=int, default=2000)
  parser.add_argument("--ood_count", type=int, default=1000)
  parser.add_argument("--methods", nargs="+", help="labels of the methods to run (default: all)")
  parser.add_argument("--table", action="store_true", help="print the table of the JSON")
  args = parser.parse_args(argv)
  path = os.path.join(args.root, "ood_near_far_cpu_scale.json")
  if args.table:
    with open(path) as f:
      print(table(json.load(f)["rows"]))
    return
  settings = methods(args.members)
  unknown = set(args.methods or ()) - set(settings)
  if unknown:
    parser.error(f"unknown --methods {sorted(unknown)}; choose from {list(settings)}")
  inside, near, far = subsets(args.data, args.shared, args.root, args.id_test, args.ood_count)
  kept = {}
  if args.methods and os.path.exists(path):
    with open(path) as f:
      kept = {row["method"]: row for row in json.load(f)["rows"]}
  rows = []
  for label, overrides in settings.items():
    if args.methods and label not in args.methods:
      if label in kept:
        rows.append(kept[label])
      continue
    config = config_lib.load(os.path.join(ROOT, "configs", "quickstart.py"), {
        **overrides, "input.dataset": inside, "input.train_fraction": args.train_fraction,
        "num_epochs": args.epochs, "eval_every_epochs": args.epochs + 1,
        "lr_milestones": (int(args.epochs / 2 + 0.5), int(3 * args.epochs / 4 + 0.5)),
        "ensemble_sizes": (1, max(args.samples, args.members)),
        "evals": {"ood": {"near": near, "far": far}}})
    workdir = os.path.join(args.root, label.replace(" + ", "_").replace(" ", "_"))
    start = time.time()
    results = main.run(config, workdir, "train")
    rows.append({"method": label, "model": config.model, "seconds": round(time.time() - start),
                 "summary": summarise(results["ood"]), "ood_rows": results["ood"]})
    write(path, {"data": args.data, "near": near, "far": far, "train_fraction":
                 args.train_fraction, "epochs": args.epochs, "id_test": args.id_test,
                 "ood_count": args.ood_count, "rows": rows})
  print(table(rows))


if __name__ == "__main__":
  main_()
