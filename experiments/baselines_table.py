"""The field's baselines table from one command (issue 59): every method trained and evaluated on
the same data, split and evaluators, one row each, as uncertainty-baselines'
``baselines/cifar/README.md`` lays out its WRN-28-10 table.

Rows: deterministic, MC dropout, spatial smoothing (MC dropout + ``Smooth``), a deep ensemble of
4, BatchEnsemble (4), MIMO (3), Packed-Ensembles (4), BNN-VI, iBNN (K = 4), SWAG, MultiSWAG (2
members), last-layer Laplace (KFAC, probit; fitted on the deterministic run), SNGP (mean-field)
and test-time augmentation (the deterministic run on the image and its flip).  Columns: NLL,
accuracy, ECE, Brier (``ensemble_sizes`` at the row's N), near / far AUROC by MSP and by the
row's best score (``ood``: near CIFAR-100, far Textures and MNIST), the coverage and mean size of
THR sets at α = 0.1 (``conformal``, calibrated on a seeded half of the test images), the training
time, the prediction time per example (``Run.predict`` of the test images at N, compiled), and
the parameters (a deep ensemble's members together).

``--scale cpu`` (default): ResNet-18s at stem width ``--width`` (the iBNN a WRN-10-1 at that
width, ResNet having no iBNN variant) on ``configs/quickstart.py``'s recipe (batch 64, SGD, one
warm-up epoch, then ``--epochs`` with the rate × 0.2 at 1/2 and 3/4; methods with a schedule of
their own keep it), trained on a class-balanced ``--train_fraction`` of CIFAR-10, scored on its
first ``--id_test`` test images and ``--ood_count`` images of each OOD set
(``ood_near_far_cpu_scale.subsets``).  ``--scale paper`` runs the same rows on each method's
own recipe config (ResNet-18, the VI, SWAG and iBNN papers' WRN-28-10 and VGG-16, their epochs)
on the whole of ``--data`` and of the OOD sets; ``--plan`` prints the trainings and, at the
papers' scale, their projected GPU time, and runs nothing.

It resumes: a row whose results are in ``<root>/rows/`` is not trained or scored again, and a
training whose workdir holds its final checkpoint is not run again.  Writes
``<root>/baselines_table.json`` and prints the Markdown table.

  python experiments/baselines_table.py --root /tmp/baselines_table
  python experiments/baselines_table.py --scale paper --plan
  python experiments/baselines_table.py --scale paper --root workdirs/table   # on a GPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np
from absl import logging

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from experiments.baselines_cpu_scale import write  # noqa: E402
from experiments.ood_near_far_cpu_scale import SHARED, subsets  # noqa: E402
from smoothing_jax import evaluators, main  # noqa: E402
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.experiment.config_base import with_method, with_model  # noqa: E402
from smoothing_jax.experiment.run import Run  # noqa: E402
from smoothing_jax.methods.swag import SWAG  # noqa: E402
from smoothing_jax.models import get_model, implied_method  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_DATA = os.path.join(ROOT, "..", "shared", "data", "cifar10")
MEMBERS = 4
OOD_SCORES = ("msp", "max_logit", "energy", "entropy", "mutual_information", "mds", "knn")
# uncertainty-baselines' CIFAR-10 WRN-28-10 rows (baselines/cifar/README.md at 054e27f): test NLL,
# accuracy, ECE, train hours (8 TPUv2 cores; ensembles 32), test ms / example (compute).
UB_CIFAR10 = {
    "deterministic": (0.159, 0.960, 0.0231, 1.2, 0.079),
    "MC dropout": (0.160, 0.959, 0.0241, 1.2, 0.082),
    "deep ensemble of 4": (0.114, 0.966, 0.010, 1.2, 0.317),
    "BatchEnsemble": (0.136, 0.963, 0.0177, 5.4, 0.319),
    "MIMO": (0.123, 0.964, 0.010, None, 0.080),
    "BNN-VI": (0.211, 0.947, 0.029, 5.5, 0.220),
    "SNGP": (0.134, 0.960, 0.007, 2.6, 0.378),
}


def trainings(args) -> dict:
  """``{workdir name: (model, method, overrides)}`` of the CPU-scale trainings."""
  rank = max(2, min(20, SWAG(None).collections(1 + args.epochs)))
  wrn = {"model_kwargs.depth": 10, "model_kwargs.widen_factor": 1}
  return {
      "deterministic": ("resnet_dnn_18", "deterministic", {}),
      "mc_dropout": ("resnet_mcdo_18", "mc_dropout", {}),
      "smoothing": ("resnet_mcdo_smoothing_18", "mc_dropout", {}),
      "deep_ensemble": ("resnet_dnn_18", "deterministic", {"deep_ensemble.members": MEMBERS}),
      "batch_ensemble": ("resnet_batchensemble_18", "batch_ensemble", {}),
      "mimo": ("resnet_mimo_18", "mimo", {}),
      "packed": ("resnet_packed_18", "packed_ensemble", {}),
      "bnnvi": ("resnet_dnn_18", "bnnvi", {"model_kwargs.mean_field": True}),
      "ibnn": ("wideresnet_ibnn_28_10", "ibnn", {**wrn, "ibnn.eval_samples": 1}),
      "swag": ("resnet_dnn_18", "swag", {"swag.rank": rank}),
      "multiswag": ("resnet_dnn_18", "swag", {"swag.rank": rank, "deep_ensemble.members": 2}),
      "sngp": ("resnet_sngp_18", "sngp", {}),
  }


def rows(args) -> dict:
  """``{label: (training, evaluation overrides, N)}``: the Laplace and TTA rows score the
  deterministic run (the Laplace after its fit)."""
  n = args.samples
  return {
      "deterministic": ("deterministic", {}, 1),
      "MC dropout": ("mc_dropout", {}, n),
      "spatial smoothing": ("smoothing", {}, n),
      f"deep ensemble of {MEMBERS}": ("deep_ensemble", {}, MEMBERS),
      "BatchEnsemble": ("batch_ensemble", {}, MEMBERS),
      "MIMO": ("mimo", {}, 3),
      "Packed-Ensembles": ("packed", {}, MEMBERS),
      "BNN-VI": ("bnnvi", {}, n),
      "iBNN": ("ibnn", {}, 4),
      "SWAG": ("swag", {}, n),
      "MultiSWAG": ("multiswag", {}, n),
      "last-layer Laplace": ("deterministic", {"method": "laplace"}, 1),
      "SNGP": ("sngp", {}, 1),
      "TTA": ("deterministic", {"tta.augmentations": ("flip",)}, 2),
  }


def training_config(args, model: str, method: str, overrides: dict, dataset: str):
  """The CPU-scale recipe: quickstart's, with ``model`` and ``method`` (its settings block)."""
  config = config_lib.load(os.path.join(ROOT, "configs", "quickstart.py"))
  config = with_method(with_model(config, model), method)
  return config_lib.with_overrides(config, {
      **overrides, "model_kwargs.width": args.width, "input.dataset": dataset,
      "input.train_fraction": args.train_fraction, "num_epochs": args.epochs,
      "lr_milestones": (int(args.epochs / 2 + 0.5), int(3 * args.epochs / 4 + 0.5)),
      "eval_every_epochs": args.epochs + 2, "evals": {}})


def score(workdir: str, overrides: dict, n: int, near, far, results_dir: str) -> dict:
  """One row's columns: the evaluators on the run at N = ``n`` (``overrides`` on its config), the
  prediction time per example and the parameters."""
  settings = {**overrides, "ensemble_sizes": (n,), "evals.ensemble_sizes.seed": 0,
              "evals.ood.near": tuple(near), "evals.ood.far": tuple(far),
              "evals.ood.scores": OOD_SCORES, "evals.conformal.alphas": (0.1,),
              "evals.conformal.scores": ("thr",), "evals.conformal.randomized": (False,)}
  # As the command line gives them: a method by its name, every other value as Python text.
  config = main.resolve_config("ood", workdir, None, [(k, v if k == "method" else repr(v))
                                                     for k, v in settings.items()])
  os.makedirs(results_dir, exist_ok=True)
  with Run.for_evaluation(workdir, config) as run:
    results = {name: result for name, (result, _) in evaluators.run_evaluators(
        ("ensemble_sizes", "ood", "conformal"), run, results_dir).items()}
    pixels = run.pipeline.eval_images
    run.predict(pixels, num_samples=n)  # compiles
    start = time.perf_counter()
    jax.block_until_ready(run.predict(pixels, num_samples=n))
    ms_per_example = 1000 * (time.perf_counter() - start) / len(pixels)
    parameters = int(sum(x.size for x in jax.tree.leaves(run.variables["params"])))
  metrics = max(results["ensemble_sizes"], key=lambda r: r["ensemble_size"])
  ood = [r for r in results["ood"] if r["ood_dataset"].endswith(" mean")
         and r["ensemble_size"] == max(o["ensemble_size"] for o in results["ood"])]
  out = {"method": metrics["method"], "n": metrics["ensemble_size"],
         **{k: metrics[k] for k in ("nll", "acc", "ece", "brier")},
         "ms_per_example": ms_per_example, "parameters": parameters}
  for group in ("near", "far"):
    by_score = {r["score"]: r["auroc"] for r in ood if r["ood_group"] == group}
    best = max(by_score, key=by_score.get)
    out.update({f"{group}_auroc_msp": by_score["msp"], f"{group}_auroc_best": by_score[best],
                f"{group}_best_score": best})
  (thr,) = [r for r in results["conformal"] if r["ensemble_size"] == metrics["ensemble_size"]]
  out.update(coverage=thr["coverage"], set_size=thr["mean_size"])
  return out


def table(rows_out: list) -> str:
  head = ("| method | N | NLL | acc (%) | ECE (%) | Brier | near AUROC MSP / best | far AUROC "
          "MSP / best | coverage α=0.1 (%) | set size | train (s) | ms / example | parameters |")
  lines = [head, "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows_out:
    lines.append(
        f"| {r['label']} | {r['n']} | {r['nll']:.3f} | {100 * r['acc']:.1f} | {100 * r['ece']:.1f}"
        f" | {r['brier']:.3f} | {100 * r['near_auroc_msp']:.1f} / {100 * r['near_auroc_best']:.1f}"
        f" ({r['near_best_score']}) | {100 * r['far_auroc_msp']:.1f} / "
        f"{100 * r['far_auroc_best']:.1f} ({r['far_best_score']}) | {100 * r['coverage']:.1f} | "
        f"{r['set_size']:.2f} | {r['train_seconds']} | {r['ms_per_example']:.2f} | "
        f"{r['parameters']:,} |")
  return "\n".join(lines)


# The papers' scale (``--scale paper``): each training on its method's own recipe config, full
# CIFAR-10: ``{training: (config argument, overrides)}``.
PAPER = {
    "deterministic": ("cifar_resnet.py:resnet_dnn_18", {}),
    "mc_dropout": ("cifar_resnet.py:resnet_mcdo_18", {}),
    "smoothing": ("cifar_resnet.py:resnet_mcdo_smoothing_18", {}),
    "deep_ensemble": ("cifar_resnet.py:resnet_dnn_18", {"deep_ensemble.members": MEMBERS}),
    "batch_ensemble": ("cifar_resnet.py:resnet_batchensemble_18", {}),
    "mimo": ("cifar_resnet.py:resnet_mimo_18", {}),
    "packed": ("cifar_resnet.py:resnet_packed_18", {}),
    "bnnvi": ("cifar_resnet.py:wideresnet_bnnvi_28_10", {}),
    "ibnn": ("cifar_ibnn.py:vgg_ibnn_16", {}),
    "swag": ("cifar_swag.py:wideresnet_dnn_28_10", {}),
    "multiswag": ("cifar_swag.py:wideresnet_dnn_28_10", {"deep_ensemble.members": MEMBERS}),
    "sngp": ("cifar_sngp.py:resnet_sngp_18", {}),
}
# Forward FLOPs per CIFAR image relative to ResNet-18 (0.56 G): WRN-28-10 5.25 G, VGG-16 0.31 G.
FLOPS_VS_RESNET18 = {"wideresnet": 5.25 / 0.56, "vgg": 0.31 / 0.56}


def paper_config(name: str, dataset: str):
  """Training ``name``'s config at the papers' scale on ``dataset``."""
  arg, overrides = PAPER[name]
  return config_lib.load(os.path.join(ROOT, "configs", f"{arg},{dataset}"),
                         {**overrides, "evals": {}})


def paper_plan(dataset: str) -> str:
  """The papers' scale: each training's command and its projected H200 time, epochs × 50,000
  images at ``resnet_dnn_18``'s measured 23,115 images/s (``device_check_h200_2026-11-28.json``,
  ``end_to_end``, bf16) over each method's training-speed ratio to one network measured on the
  CPU (``bench_methods_cpu.json``; 1 where not measured) and the architecture's FLOPs against
  ResNet-18's (:data:`FLOPS_VS_RESNET18`)."""
  results = os.path.join(ROOT, "experiments", "results")
  with open(os.path.join(results, "device_check_h200_2026-11-28.json")) as f:
    base = json.load(f)["end_to_end"]["images_per_s"]
  with open(os.path.join(results, "bench_methods_cpu.json")) as f:
    ratios = {r["method"].split(" of ")[0]: r["vs_baseline"]["train_images_per_s"]
              for r in json.load(f)["rows"].values()}
  lines, total = [], 0.0
  for name, (arg, overrides) in PAPER.items():
    config = paper_config(name, dataset)
    kind = ("deep_ensemble" if config.deep_ensemble.members > 1 else config.method
            or implied_method(get_model(config.model, 10, **{
                k: v for k, v in config.model_kwargs.items() if v is not None})))
    ratio = 1.0 if name == "deterministic" else ratios.get(kind or "", 1.0)
    flops = FLOPS_VS_RESNET18.get(config.model.split("_")[0], 1.0)
    epochs = config.num_epochs + config.warmup_epochs
    hours = epochs * 50_000 * flops / (base * ratio) / 3600
    total += hours
    flags = "".join(f" --config.{k}={v}" for k, v in overrides.items())
    lines.append(f"{name}: --config=configs/{arg},{dataset}{flags}   # {epochs} epochs, "
                 f"~{hours:.1f} h on an H200")
  lines.append(f"total ~{total:.1f} h of H200 time (projected: resnet_dnn_18's measured rate, the "
               "CPU's ratios for the other methods, FLOPs for other architectures); the Laplace "
               "and TTA rows score the deterministic run")
  return "\n".join(lines)


def main_(argv=None):
  logging.set_verbosity(logging.INFO)
  show_only_our_info_lines()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--scale", choices=("cpu", "paper"), default="cpu")
  parser.add_argument("--data", default=DEFAULT_DATA, help="CIFAR-10 as train.npz / test.npz")
  parser.add_argument("--root", default="/tmp/baselines_table", help="workdirs and results")
  parser.add_argument("--width", type=int, default=8)
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--train_fraction", type=float, default=0.1)
  parser.add_argument("--samples", type=int, default=4, help="N of the sampling methods")
  parser.add_argument("--id_test", type=int, default=1000)
  parser.add_argument("--ood_count", type=int, default=500)
  parser.add_argument("--plan", action="store_true",
                      help="print the trainings' commands (and at --scale paper their projected "
                           "GPU time), run nothing")
  args = parser.parse_args(argv)
  paper = args.scale == "paper"
  if paper:  # the whole test split and OOD sets
    args.id_test, args.ood_count = 10_000, 10**9
  if args.plan:
    dataset = f"npz:{os.path.abspath(args.data)}"
    print(paper_plan(dataset) if paper else "\n".join(
        f"{name}: {model}, method {method}, {overrides}"
        for name, (model, method, overrides) in trainings(args).items()))
    return
  dataset, near, far = subsets(args.data, SHARED, args.root, args.id_test, args.ood_count)
  done_dir = os.path.join(args.root, "rows")
  plan, out = trainings(args), []
  trained = set()
  for label, (name, overrides, n) in rows(args).items():
    done = os.path.join(done_dir, f"{label.replace(' ', '_')}.json")
    if os.path.exists(done):  # resumes: a row already scored is kept
      with open(done) as f:
        out.append(json.load(f))
      continue
    workdir = os.path.join(args.root, name)
    seconds_file = os.path.join(workdir, "train_seconds.json")
    if name not in trained and not os.path.exists(seconds_file):
      start = time.time()
      config = (paper_config(name, dataset) if paper
                else training_config(args, *plan[name], dataset))
      main.run(config, workdir, "train")
      write(seconds_file, {"seconds": round(time.time() - start)})
    trained.add(name)
    with open(seconds_file) as f:
      train_seconds = json.load(f)["seconds"]
    if overrides.get("method") == "laplace":
      main.run(main.resolve_config("fit", workdir, None, [("method", "laplace")]), workdir, "fit")
    row = {"label": label, "training": name, "train_seconds": train_seconds,
           **score(workdir, overrides, n, near, far,
                   os.path.join(args.root, "results", label.replace(" ", "_")))}
    write(done, row)
    out.append(row)
  write(os.path.join(args.root, "baselines_table.json"), {
      "scale": args.scale, "data": args.data, "width": args.width, "epochs": args.epochs,
      "warmup_epochs": 1, "train_fraction": args.train_fraction, "samples": args.samples,
      "id_test": args.id_test, "ood_count": args.ood_count, "near": near, "far": far,
      "ood_scores": OOD_SCORES, "uncertainty_baselines_cifar10": UB_CIFAR10, "rows": out})
  print(table(out))
  print("\nAccuracy order here:   " + " > ".join(
      r["label"] for r in sorted(out, key=lambda r: -r["acc"])))
  print("NLL order here:        " + " < ".join(
      r["label"] for r in sorted(out, key=lambda r: r["nll"])))
  print("NLL order, u-b WRN-28-10: " + " < ".join(
      k for k, v in sorted(UB_CIFAR10.items(), key=lambda kv: kv[1][0])))


if __name__ == "__main__":
  np.set_printoptions(precision=4)
  main_()
