"""``ensemble_sizes``: clean test metrics against the ensemble size N (paper Fig. 3 layout).

MC dropout: the first n of N_max samples drawn in one ``mc_predict`` call (nested ensembles);
iBNN: the first n of the S·K predictions (sample-major, so n = K is one draw of every
component), up to all K·S with S = ``config.ibnn.eval_samples``; deep ensembles: the first M of
the run and its ``members`` (other workdirs of the same architecture).  Writes
``ensemble_sizes.{json,csv,png}`` and ``reliability.png`` (the largest ensemble).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax

from smoothing_jax.evaluators.common import (
  METRIC_COLUMNS,
  ensemble_metrics_step,
  predictive,
  write_results,
)
from smoothing_jax.parallel import evaluate_batches, sharded_eval_step, shardings
from smoothing_jax.plots import plot_ensemble_sizes, plot_reliability_diagram


def evaluate(run, output_dir, *, sizes: Sequence[int] = (), members: Sequence[str] = (),
             seed: int = 0) -> list:
  """One row per ensemble size ``{"ensemble_size", "count", "nll", "acc", "ece", ...}`` of
  ``run`` (MC dropout or iBNN, ``sizes`` empty: ``config.ensemble_sizes``), or of the deep
  ensemble of ``run`` and the workdirs ``members``."""
  config = run.config
  pred = predictive(run, members, sizes)
  sizes = pred.sizes
  step = sharded_eval_step(ensemble_metrics_step, run.mesh, pred.method, sizes, config.ece_bins)
  totals = evaluate_batches(step, pred.variables, run.eval_batches(), shardings(run.mesh)[1],
                            jax.random.key(seed), label=f"ensemble_sizes: {pred.method.name}, "
                            f"{max(sizes)} draws, {run.config.input.dataset}")
  rows = [{"method": pred.method.name, "ensemble_size": n,
           **{k: m[k] for k in ("count",) + METRIC_COLUMNS}, **pred.scored}
          for n, m in zip(sizes, (t.compute() for t in totals), strict=True)]
  name = f"{config.model} ({pred.method.describe()})"
  write_results(output_dir, "ensemble_sizes", rows, {
      "ensemble_sizes.png": lambda: plot_ensemble_sizes(rows, f"{name} on {config.input.dataset}"),
      "reliability.png": lambda: plot_reliability_diagram(
          totals[-1], f"{name}, N={sizes[-1]}: ECE {100 * rows[-1]['ece']:.2f}%")})
  return rows


def summary(rows: list, output_dir) -> str:
  nlls = [f"{r['nll']:.4f}" for r in rows]
  width = max(6, *map(len, nlls))  # an NLL of 10 or more (an untrained model) keeps the columns
  lines = [f"method: {rows[0]['method']}",
           f"ensemble size | {'NLL':{width}} | Acc (%) | ECE (%)"]
  lines += [f"{r['ensemble_size']:13d} | {nll:>{width}} | {100 * r['acc']:7.2f} | "
            f"{100 * r['ece']:7.2f}" for r, nll in zip(rows, nlls, strict=True)]
  lines.append(f"Results: {output_dir}/ensemble_sizes.{{json,csv,png}}, "
               f"{output_dir}/reliability.png")
  return "\n".join(lines)
