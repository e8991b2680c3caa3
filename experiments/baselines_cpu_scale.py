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

``--part swag``: SWAG and SWA (Maddox et al. 2019), MultiSWAG (Wilson & Izmailov 2020),
last-layer Laplace (Daxberger et al. 2021) and snapshot ensembles (Huang et al. 2017) against one
network and a deep ensemble of 4 (issue 56): ``resnet_dnn_18`` at ``--width`` on
``configs/quickstart.py`` (batch 64, SGD, one warm-up epoch and ``--epochs``, the rate × 0.2 at
1/2 and 3/4 of them where the method keeps the recipe's schedule) on a class-balanced
``--train_fraction`` of CIFAR-10's training split.  Five trainings (``swag_trainings``): the
deterministic network, the deep ensemble of 4 (one job), SWAG and MultiSWAG of 2
(``method=swag``, its own schedule; rank = the models it collects, at most 20) and the snapshot
ensemble of 4 cycles.  The last-layer Laplace (KFAC, marginal-likelihood prior, probit) is fitted
on the deterministic run (``--mode=fit``), SWA is the SWAG run's mean, and the SWAG runs' last
iterates (scored as trained networks: Maddox et al.'s SGD of the same trajectory) are rows too:
no training of their own.  Every row (``swag_rows``) is scored by the same evaluators on the same
sets (``ood_near_far_cpu_scale.subsets``: the first ``--id_test`` test images, a seeded
``--ood_count`` of CIFAR-100 (near), Textures and MNIST (far)): ``ensemble_sizes`` (NLL,
accuracy, ECE (10 bins), Brier) and ``ood`` (MSP's near / far AUROC) at N = 1 and the row's
largest N (``--samples`` weight samples of SWAG and MultiSWAG), with the wall time of each
training, fit and evaluation.  Also writes ``<root>/swag_laplace_cpu_scale.png`` (NLL, accuracy,
ECE against N).

Writes ``<root>/<part>_cpu_scale.json`` (``swag_laplace_cpu_scale.json`` for ``--part swag``;
``--methods`` reruns some settings, keeping the other rows of an existing file) and prints the
Markdown table.

  python experiments/baselines_cpu_scale.py --part ibnn --root /tmp/baselines_cpu
  python experiments/baselines_cpu_scale.py --part batchensemble --root /tmp/baselines_cpu
  python experiments/baselines_cpu_scale.py --part swag --root /tmp/swag56 --train_fraction 0.05 \
      --epochs 9 --samples 10
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
from smoothing_jax import evaluators, main  # noqa: E402
from smoothing_jax.experiment import checkpoints  # noqa: E402
from smoothing_jax.experiment import config as config_lib  # noqa: E402
from smoothing_jax.experiment.config_base import with_method, with_model  # noqa: E402
from smoothing_jax.experiment.run import Run  # noqa: E402
from smoothing_jax.methods.swag import SWAG  # noqa: E402
from smoothing_jax.plots import close, plot_ensemble_sizes  # noqa: E402
from smoothing_jax.training.writers import show_only_our_info_lines  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DEFAULT_DATA = os.path.join(ROOT, "..", "shared", "data", "cifar10")
IBNN_COMPONENTS = 4
SWAG_MEMBERS = 4  # the deep ensemble's members and the snapshot ensemble's cycles
MULTISWAG_MEMBERS = 2


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
  # A config holds its own method's settings block alone: each model takes its method's keys.
  method_of = {"dnn": "deterministic", "mcdo": "mc_dropout", "bnnvi": "bnnvi",
               "bayesian": "bnnvi", "ibnn": "ibnn"}

  def own(overrides, name):
    return {k: v for k, v in overrides.items()
            if "." not in k or k.split(".")[0] in ("model_kwargs", method_of[name])}
  return {label: (f"vgg_{name}_16", own(adam if name == "bayesian" else common, name))
          for label, name in (("DNN", "dnn"), ("MC dropout", "mcdo"), ("BNN-VI", "bnnvi"),
                              ("BNN-VI (iBNN repository)", "bayesian"),
                              (f"iBNN-{IBNN_COMPONENTS}", "ibnn"))}


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


def swag_trainings(args) -> dict:
  """``{workdir name: (method, overrides)}`` of ``--part swag``'s five trainings, on one recipe
  (``configs/quickstart.py`` with ``resnet_dnn_18``); SWAG's rank is the number of models it
  collects (at most 20, its default): the paper's D̂ of K columns, all collected."""
  total = 1 + args.epochs  # the recipe's warm-up epoch, then --epochs
  rank = max(2, min(20, SWAG(None).collections(total)))
  return {"deterministic": ("deterministic", {}),
          "deep_ensemble": ("deterministic", {"deep_ensemble.members": SWAG_MEMBERS}),
          "swag": ("swag", {"swag.rank": rank}),
          "multiswag": ("swag", {"swag.rank": rank,
                                 "deep_ensemble.members": MULTISWAG_MEMBERS}),
          "snapshot_ensemble": ("snapshot_ensemble",
                                {"snapshot_ensemble.size": SWAG_MEMBERS})}


def swag_rows(args) -> dict:
  """``{label: (workdir name, evaluation method or None: the trained one, ensemble sizes)}`` of
  ``--part swag``'s rows; the Laplace row fits first.  The SWAG runs' last iterates (their
  networks at the end of training, scored as trained networks) are Maddox et al.'s SGD on the
  same trajectory, at the SWA rate."""
  n = args.samples
  return {"deterministic": ("deterministic", None, (1,)),
          "last-layer Laplace (KFAC, marglik, probit)": ("deterministic", "laplace", (1,)),
          f"deep ensemble of {SWAG_MEMBERS}": ("deep_ensemble", None, (1, SWAG_MEMBERS)),
          "SWA": ("swag", "swa", (1,)),
          "SWAG": ("swag", None, (1, n)),
          "SGD: the SWAG run's last iterate": ("swag", "deterministic", (1,)),
          f"MultiSWAG of {MULTISWAG_MEMBERS}": ("multiswag", None, (1, MULTISWAG_MEMBERS, n)),
          f"the MultiSWAG run's {MULTISWAG_MEMBERS} last iterates": (
              "multiswag", "deterministic", (1, MULTISWAG_MEMBERS)),
          f"snapshot ensemble of {SWAG_MEMBERS}": ("snapshot_ensemble", None,
                                                   (1, SWAG_MEMBERS))}


def swag_config(args, method: str, overrides: dict, dataset: str):
  """The training config of one of ``swag_trainings``: the quickstart recipe, ``resnet_dnn_18``,
  ``method`` (its settings block), no evaluation after training (timed on its own)."""
  config = config_lib.load(os.path.join(ROOT, "configs", "quickstart.py"))
  config = with_method(with_model(config, "resnet_dnn_18"), method)
  return config_lib.with_overrides(config, {
      **overrides, "model_kwargs.width": args.width, "input.dataset": dataset,
      "input.train_fraction": args.train_fraction, "num_epochs": args.epochs,
      "lr_milestones": (int(args.epochs / 2 + 0.5), int(3 * args.epochs / 4 + 0.5)),
      "eval_every_epochs": args.epochs + 2, "evals": {}})


def evaluate_row(workdir: str, method, sizes, near, far, results_dir: str) -> dict:
  """``{"ensemble_sizes": rows, "ood": rows}`` of ``workdir`` (as ``--mode=ensemble_sizes`` and
  ``--mode=ood``, in one opened run: one preparation of the predictive, e.g. SWAG's BatchNorm
  updates), scored by ``method`` (None: the trained one) at ``sizes``, OOD by MSP."""
  overrides = [("ensemble_sizes", repr(tuple(sizes))), ("evals.ensemble_sizes.seed", "0"),
               ("evals.ood.near", repr(tuple(near))), ("evals.ood.far", repr(tuple(far))),
               ("evals.ood.scores", "('msp',)")]
  if method is not None:
    overrides.append(("method", method))
  config = main.resolve_config("ood", workdir, None, overrides)
  os.makedirs(results_dir, exist_ok=True)
  with Run.for_evaluation(workdir, config) as run:
    return {name: result for name, (result, summary) in evaluators.run_evaluators(
        ("ensemble_sizes", "ood"), run, results_dir).items()}


def swag_row(label: str, workdir: str, results: dict, seconds: dict) -> dict:
  """One row of ``--part swag``'s results: per N the metrics and MSP's AUROC per group and set."""
  msp = [r for r in results["ood"] if r["score"] == "msp"]
  sizes = {}
  for r in results["ensemble_sizes"]:
    n = r["ensemble_size"]
    sizes[str(n)] = {
        **{k: r[k] for k in ("acc", "nll", "ece", "brier")},
        **{f"{o['ood_dataset'].split(' ')[0]}_auroc" if o["ood_dataset"].endswith(" mean")
           else f"auroc_{os.path.splitext(os.path.basename(o['ood_dataset']))[0]}": o["auroc"]
           for o in msp if o["ensemble_size"] == n}}
  return {"method": label, "workdir": workdir,
          "method_name": results["ensemble_sizes"][0]["method"], "sizes": sizes, **seconds}


def swag_table(rows: list) -> str:
  """The Markdown table of ``--part swag``: a line per row and N (N = 1 and its largest); a row
  scoring a run an earlier row trained (SWA, the Laplace) shows "(same run)" for its training."""
  lines = ["| method | N | accuracy (%) | NLL | ECE (%) | Brier | near AUROC | far AUROC | "
           "train (s) | fit (s) | eval (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  trained = set()
  for r in rows:
    shown = sorted(r["sizes"], key=int)
    train = "(same run)" if r["workdir"] in trained else r["train_seconds"]
    trained.add(r["workdir"])
    for i, n in enumerate(dict.fromkeys((shown[0], shown[-1]))):
      m = r["sizes"][n]
      times = [train, r.get("fit_seconds", "–"), r["eval_seconds"]] if i == 0 else ["", "", ""]
      lines.append(f"| {r['method'] if i == 0 else ''} | {n} | {100 * m['acc']:.2f} | "
                   f"{m['nll']:.4f} | {100 * m['ece']:.2f} | {m['brier']:.4f} | "
                   f"{100 * m['near_auroc']:.1f} | {100 * m['far_auroc']:.1f} | "
                   + " | ".join(str(t) for t in times) + " |")
  return "\n".join(lines)


def plot_swag(rows: list, path: str) -> None:
  """NLL, accuracy and ECE against N, a line per row."""
  series = {r["method"]: [{"ensemble_size": int(n), **m} for n, m in
                          sorted(r["sizes"].items(), key=lambda item: int(item[0]))]
            for r in rows}
  fig = plot_ensemble_sizes(series, "SWAG, Laplace, ensembles: ResNet-18 on CIFAR-10 (CPU scale)")
  fig.axes[0].get_legend().remove()  # nine rows: below the panels, not over the NLL
  fig.legend(*fig.axes[0].get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=8)
  fig.subplots_adjust(bottom=0.3)
  fig.set_size_inches(11, 4.6)
  fig.savefig(path, dpi=120)
  close(fig)


def swag_part(args, parser) -> None:
  """``--part swag``: train what ``swag_trainings`` lists (a complete workdir is kept), fit the
  Laplace, evaluate every row of ``swag_rows``; JSON after each row, then the table."""
  # Imported here: that script imports ``write`` from this one.
  from experiments.ood_near_far_cpu_scale import SHARED, subsets
  rows_of = swag_rows(args)
  unknown = set(args.methods or ()) - set(rows_of)
  if unknown:
    parser.error(f"unknown --methods {sorted(unknown)}; choose from {list(rows_of)}")
  path = os.path.join(args.root, "swag_laplace_cpu_scale.json")
  kept, trained = {}, {}
  if args.methods and os.path.exists(path):
    with open(path) as f:
      previous = json.load(f)
    kept = {row["method"]: row for row in previous["rows"]}
    trained = previous.get("train_seconds", {})
  dataset, near, far = subsets(args.data, SHARED, args.root, args.id_test, args.ood_count)
  trainings = swag_trainings(args)
  out = {"part": "swag", "data": args.data, "train_fraction": args.train_fraction,
         "epochs": args.epochs, "warmup_epochs": 1, "width": args.width,
         "samples": args.samples, "id_test": args.id_test, "ood_count": args.ood_count,
         "near": near, "far": far,
         "trainings": {k: {"method": m, **o} for k, (m, o) in trainings.items()},
         "train_seconds": trained, "rows": []}
  for label, (name, method, sizes) in rows_of.items():
    if args.methods and label not in args.methods:
      if label in kept:
        out["rows"].append(kept[label])
      continue
    workdir = os.path.join(args.root, "swag", name)
    if name not in trained or not checkpoints.has_checkpoint(workdir):
      start = time.time()
      main.run(swag_config(args, *trainings[name], dataset), workdir, "train")
      trained[name] = round(time.time() - start)
    seconds = {"train_seconds": trained[name]}
    if method == "laplace":
      start = time.time()
      main.run(main.resolve_config("fit", workdir, None, [("method", "laplace")]), workdir, "fit")
      seconds["fit_seconds"] = round(time.time() - start)
    start = time.time()
    results = evaluate_row(workdir, method, sizes, near, far,
                           os.path.join(workdir, f"results_{method or 'trained'}"))
    seconds["eval_seconds"] = round(time.time() - start)
    out["rows"].append(swag_row(label, name, results, seconds))
    write(path, out)  # after each row: a crash keeps the rows before it
  write(path, out)
  plot_swag(out["rows"], os.path.join(args.root, "swag_laplace_cpu_scale.png"))
  print(swag_table(out["rows"]))


def record(args, rows: list) -> dict:
  """The results file of ``rows`` under the settings ``args``."""
  return {"part": args.part, "data": args.data, "train_fraction": args.train_fraction,
          "epochs": args.epochs, "width": args.width, "lr_scale": args.lr_scale, "rows": rows}


def main_(argv=None):
  logging.set_verbosity(logging.INFO)
  show_only_our_info_lines()
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--part", choices=("ibnn", "batchensemble", "swag"), required=True)
  parser.add_argument("--data", default=DEFAULT_DATA, help="CIFAR-10 as train.npz / test.npz")
  parser.add_argument("--root", default="/tmp/baselines_cpu_scale", help="workdirs and results")
  parser.add_argument("--width", type=int, default=16)
  parser.add_argument("--epochs", type=int, default=6)
  parser.add_argument("--train_fraction", type=float, default=0.2)
  parser.add_argument("--samples", type=int,
                      help="predictions per stochastic method (default 8; swag: 10)")
  parser.add_argument("--methods", nargs="+", help="labels of the settings to run (default: all)")
  parser.add_argument("--lr_scale", type=float, default=1.0, help="ibnn: × λ₀ and λ₁")
  parser.add_argument("--id_test", type=int, default=2000, help="swag: test images scored")
  parser.add_argument("--ood_count", type=int, default=1000, help="swag: images of each OOD set")
  parser.add_argument("--table", action="store_true", help="swag: print the table of the JSON")
  args = parser.parse_args(argv)
  if args.samples is None:
    args.samples = 10 if args.part == "swag" else 8
  if args.part == "swag":
    if args.table:
      with open(os.path.join(args.root, "swag_laplace_cpu_scale.json")) as f:
        print(swag_table(json.load(f)["rows"]))
    else:
      swag_part(args, parser)
    return
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
