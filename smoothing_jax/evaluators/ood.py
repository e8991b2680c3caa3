"""``ood``: out-of-distribution detection by each confidence score (``ranking.scores``: MSP,
−entropy, −mutual information) for each ensemble size N: AUROC, AUPR-In, AUPR-Out and FPR@95
(``ranking.detection_metrics``, in-distribution positive) against every OOD set.

OOD sets (``config.evals.ood.datasets``): any dataset name the data layer reads (TFDS,
``npz:<dir>``), ``"corruptions"`` for the 15 corruptions of the run's dataset at severity 5, or
nothing for the standard pairs (CIFAR-10: SVHN and CIFAR-100; CIFAR-100: SVHN and CIFAR-10, as
uncertainty-baselines).  Images are normalised as the run's own; a set of another image shape is
rejected with a message naming both.  Writes ``ood.{json,csv}`` and ``ood_<set>.png`` (ROC and
precision-recall curves).
"""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence

from smoothing_jax import ranking
from smoothing_jax.data import CORRUPTIONS, corruption_dataset
from smoothing_jax.data.datasets import BASES, check_available, parse_dataset
from smoothing_jax.evaluators.common import gather, predictive, ranking_step, write_results
from smoothing_jax.parallel import sharded_eval_step
from smoothing_jax.plots import plot_detection_curves

STANDARD_PAIRS = {"cifar10": ("svhn_cropped", "cifar100"), "cifar100": ("svhn_cropped", "cifar10")}


def resolve_ood_datasets(base: str, names: Sequence[str]) -> list:
  """The OOD set names of ``names`` (``"corruptions"`` expanded) for a run on ``base``; the
  standard pairs when ``names`` is empty."""
  names = list(names) or list(STANDARD_PAIRS.get(base, ()))
  if not names:
    raise ValueError(f"No standard OOD sets for {base!r}: name them with "
                     "--config.evals.ood.datasets='(\"npz:<dir>\",)' (any dataset name, or "
                     "\"corruptions\").")
  expanded = []
  for name in names:
    if name == "corruptions":
      if base not in BASES:
        raise ValueError("'corruptions' needs a dataset with corruption sets "
                         f"({', '.join(BASES)}), not {base!r}.")
      expanded += [corruption_dataset(base, c, 5) for c in CORRUPTIONS]
    else:
      expanded.append(name)
  return expanded


def evaluate(run, output_dir, *, datasets: Sequence[str] = (), sizes: Sequence[int] = (),
             members: Sequence[str] = (), seed: int = 0) -> list:
  """Rows ``{"ood_dataset", "ensemble_size", "score", "auroc", "aupr_in", "aupr_out",
  "fpr95_id_positive", "fpr95_ood_positive", "count_in", "count_out"}`` against each of the OOD
  sets ``datasets`` (empty: the standard pairs; :func:`resolve_ood_datasets`), for the ensemble
  sizes ``sizes`` (empty: ``config.ensemble_sizes``) of the run and the workdirs ``members``
  (the FPR@95 conventions: ``ranking``'s docstring)."""
  config = run.config
  names = resolve_ood_datasets(run.pipeline.dataset_spec.base, datasets)
  for name in names:  # a missing set fails now, not after the in-distribution pass
    spec = parse_dataset(name)
    check_available(spec, spec.eval_split, run.pipeline.data_dir, run.pipeline.download)
  pred = predictive(run, members, sizes)
  step = sharded_eval_step(ranking_step, run.mesh, pred.method, pred.sizes)
  inside = gather(step, pred.variables, run.mesh, run.eval_batches(), seed)
  rows = []
  for k, name in enumerate(names):
    outside = gather(step, pred.variables, run.mesh, run.eval_batches(name), seed + 1 + k)
    curves = {}
    for j, n in enumerate(pred.sizes):
      for score in ranking.SCORES:
        positive, negative = inside[score][:, j], outside[score][:, j]
        detection = ranking.detection_metrics(positive, negative)
        rows.append({"method": pred.method.name, "ood_dataset": name, "ensemble_size": n,
                     "score": score, **detection,
                     "count_in": len(positive), "count_out": len(negative), **pred.scored})
        fpr, tpr = ranking.roc_curve(positive, negative)
        recall, precision = ranking.precision_recall_curve(positive, negative)
        curves[f"{score}, N={n}"] = {
            "fpr": fpr, "tpr": tpr, "recall": recall, "precision": precision,
            **{k: detection[k] for k in ("fpr95_id_positive", "fpr95_ood_positive")}}
    file_name = f"ood_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name).strip('_')}.png"
    write_results(output_dir, "ood", rows, {file_name: functools.partial(
        plot_detection_curves, curves, f"{config.model} on {config.input.dataset} against {name}")})
  return rows


def _short(name: str) -> str:
  """A dataset name for a table column: ``npz:`` folders by their last part."""
  return f"npz:{os.path.basename(name[4:].rstrip('/'))}" if name.startswith("npz:") else name


def summary(rows: list, output_dir) -> str:
  lines = ["OOD set                | N  | score              | AUROC (%) | AUPR-In | AUPR-Out | "
           "FPR@95 (%) in+ | OOD+"]
  lines += [f"{_short(r['ood_dataset'])[:22]:22s} | {r['ensemble_size']:2d} | {r['score']:18s} | "
            f"{100 * r['auroc']:9.2f} | {r['aupr_in']:7.4f} | {r['aupr_out']:8.4f} | "
            f"{100 * r['fpr95_id_positive']:14.2f} | {100 * r['fpr95_ood_positive']:5.2f}"
            for r in rows]
  lines.append("FPR@95 in+: OOD accepted at 95% of in-distribution accepted (Hendrycks & Gimpel); "
               "OOD+: in-distribution flagged at 95% of OOD flagged (OpenOOD).")
  lines.append(f"Results: {output_dir}/ood.{{json,csv}}, {output_dir}/ood_*.png")
  return "\n".join(lines)
