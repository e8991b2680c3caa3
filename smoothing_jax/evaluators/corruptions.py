"""``corruptions``: NLL / accuracy / ECE on every (corruption, severity 1–5) of CIFAR-100-C or
ImageNet-C, and the aggregates of paper Eqs. 34–36 (mCE, mCNLL, mCECE) against a baseline table
(default: the reference's AlexNet results, shipped in ``smoothing_jax/data/baselines``).

``corruptions.{json,csv}`` is rewritten after every (type, severity), so a failure late in the
sweep keeps what was computed; the aggregates go to ``corruption_aggregates.json``.
"""
from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence

import jax
import numpy as np
from etils import epath

from smoothing_jax.data import CORRUPTIONS, corruption_dataset
from smoothing_jax.evaluators.common import ensemble_metrics_step, predictive, write_table
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.parallel import evaluate_batches, sharded_eval_step, shardings

# The reference's AlexNet results (SS resources/results), shipped in smoothing_jax/data/baselines.
BASELINES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                             "baselines")
DEFAULT_BASELINES = {"cifar100": "cifar100_alexnet_dnn_corrupted.csv",
                     "imagenet2012": "imagenet_alexnet_dnn_corrupted.csv"}


def default_baseline(base: str) -> str | None:
  """Path of the shipped AlexNet baseline for a dataset (``cifar100``, ``imagenet2012``), else
  None."""
  return os.path.join(BASELINES_DIR, DEFAULT_BASELINES[base]) if base in DEFAULT_BASELINES else None


def read_corruption_table(path: str) -> dict:
  """Per-(type, severity) ``{"nll", "err", "ece"}`` from a corruption results CSV, in either layout:

  * the reference's (SS ``ops/tests.py::save_metrics``, e.g. the shipped AlexNet files): no
    header, rows ``severity, type, nll, cutoff_0, cutoff_1, acc_0, acc_1, unc_0, unc_1, iou_0,
    iou_1, freq_0, freq_1, top5, brier, ece[, ecse]`` in fractions (``acc_0`` = accuracy);
  * with a header naming ``type, severity, NLL, Acc, ECE`` (our ``corruptions.csv``); accuracies
    and ECEs given in percent (any accuracy above 1) are converted to fractions.
  """
  rows = [r for r in csv.reader(io.StringIO(epath.Path(path).read_text(), newline="")) if r]
  if rows and rows[0][0].strip().isdigit():
    bad = [
        i + 1 for i, r in enumerate(rows) if len(r) not in (16, 17) or not r[0].strip().isdigit()
    ]
    if bad:
      raise ValueError(
          f"{path}: rows {bad[:5]} do not have the reference layout (16 or 17 columns: "
          "severity, type, nll, cutoff_0, cutoff_1, acc_0, ..., brier, ece[, ecse]).")
    return {(r[1], int(r[0])): {"nll": float(r[2]), "err": 1.0 - float(r[5]), "ece": float(r[15])}
            for r in rows}
  header = rows[0] if rows else []
  if not {"type", "severity", "NLL", "Acc", "ECE"} <= set(header):
    raise ValueError(f"{path}: need a header with columns type, severity, NLL, Acc, ECE, or the "
                     f"reference's headerless rows (severity, type, nll, ...); got {header}.")
  records = [dict(zip(header, r, strict=False)) for r in rows[1:]]
  scale = 100.0 if any(float(r["Acc"]) > 1 for r in records) else 1.0
  return {(r["type"], int(float(r["severity"]))): {
      "nll": float(r["NLL"]), "err": 1.0 - float(r["Acc"]) / scale, "ece": float(r["ECE"]) / scale}
      for r in records}


def corruption_aggregates(table: dict, baseline: dict | None = None,
                          corruptions: Sequence[str] = CORRUPTIONS) -> dict:
  """Paper Eqs. 34–36: per corruption Σ_s value(c, s) / Σ_s baseline(c, s), averaged over
  corruptions.

  ``table`` and ``baseline`` map ``(type, severity)`` to ``{"nll", "err", "ece"}``.
  Only the types in ``corruptions`` (default: the 15 standard ones) count.  Always returns the
  unnormalised means over them (``mean_err``, ``mean_nll``, ``mean_ece``); with a baseline also
  ``mCE``, ``mCNLL`` and ``mCECE``.
  """
  counted = [v for (t, _), v in table.items() if t in corruptions]
  if not counted:
    raise ValueError(f"No results for the corruptions {tuple(corruptions)}; the table has "
                     f"{sorted({t for t, _ in table})}.")
  out = {f"mean_{k}": float(np.mean([v[k] for v in counted])) for k in ("err", "nll", "ece")}
  if baseline is not None:
    for key, name in (("err", "mCE"), ("nll", "mCNLL"), ("ece", "mCECE")):
      ratios = []
      for c in corruptions:
        severities = sorted(s for (t, s) in table if t == c)
        missing = [s for s in severities if (c, s) not in baseline]
        if not severities or missing:
          raise ValueError(
              f"Corruption {c!r}: results for severities {severities}, baseline lacks {missing}.")
        ratios.append(
            sum(table[(c, s)][key] for s in severities) /
            sum(baseline[(c, s)][key] for s in severities))
      out[name] = float(np.mean(ratios))
  return out


def evaluate(run, output_dir, *, baseline_csv: str = "", num_samples: int = 1,
             corruptions: Sequence[str] = CORRUPTIONS, seed: int = 0) -> dict:
  """The sweep for ``run``: ``num_samples`` MC samples per prediction for MC dropout and BNN-VI
  models (default 1), every member of a deep ensemble or BatchEnsemble, K·S
  draws of an iBNN; returns the aggregates (:func:`corruption_aggregates`)."""
  config = run.config
  output_dir = workdir_lib.workdir_path(output_dir)
  base = run.pipeline.dataset_spec.base
  baseline_csv = baseline_csv or default_baseline(base)
  baseline = read_corruption_table(baseline_csv) if baseline_csv else None  # bad files fail first
  # num_samples MC samples, or every member / component draw.
  sampled = predictive(run, sizes=(num_samples,))
  size = max(sampled.sizes)
  step = sharded_eval_step(ensemble_metrics_step, run.mesh, sampled.method, (size,),
                           config.ece_bins)
  rows, table = [], {}
  for c, corruption in enumerate(corruptions):
    for severity in range(1, 6):
      name = corruption_dataset(base, corruption, severity)
      (m,) = evaluate_batches(step, sampled.variables, run.eval_batches(name),
                              shardings(run.mesh)[1], jax.random.key(seed),
                              label=f"corruptions: set {5 * c + severity}/{5 * len(corruptions)} "
                              f"{name}, {size} draws")
      m = m.compute()
      table[(corruption, severity)] = {"nll": m["nll"], "err": 1.0 - m["acc"], "ece": m["ece"]}
      rows.append({"method": sampled.method.name, "type": corruption, "severity": severity,
                   "NLL": m["nll"], "Acc": m["acc"],
                   "ECE": m["ece"], "count": m["count"], **sampled.scored})
      if jax.process_index() == 0:
        write_table(rows, output_dir, "corruptions")
  aggregates = {**corruption_aggregates(table, baseline, corruptions), **sampled.scored}
  if jax.process_index() == 0:
    workdir_lib.write_json(output_dir / "corruption_aggregates.json", aggregates)
  return aggregates


def summary(aggregates: dict, output_dir) -> str:
  scores = {k: v for k, v in aggregates.items() if k not in ("step", "checkpoint")}
  return (f"Corruption robustness: {scores}\nTables in {output_dir}/corruptions.{{json,csv}}, "
          f"{output_dir}/corruption_aggregates.json")
