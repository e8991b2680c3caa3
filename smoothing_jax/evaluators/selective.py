"""``selective``: selective prediction — keep the most confident test predictions by each score
(``ranking.scores``: MSP, −entropy, −mutual information) for each ensemble size N: AURC, E-AURC
(excess over the oracle) and the coverage at 95% and 99% accuracy
(``ranking.selective_metrics``).  Writes ``selective.{json,csv}`` and ``selective.png`` (the
accuracy–rejection curves).
"""
from __future__ import annotations

from collections.abc import Sequence

from smoothing_jax import ranking
from smoothing_jax.evaluators.common import gather, predictive, ranking_step, write_results
from smoothing_jax.parallel import sharded_eval_step
from smoothing_jax.plots import plot_accuracy_rejection


def evaluate(run, output_dir, *, sizes: Sequence[int] = (), members: Sequence[str] = (),
             seed: int = 0) -> list:
  """Rows ``{"ensemble_size", "score", "aurc", "excess_aurc", "accuracy", "coverage_at_95",
  "coverage_at_99", "count"}``."""
  config = run.config
  pred = predictive(run, members, sizes)
  step = sharded_eval_step(ranking_step, run.mesh, pred.method, pred.sizes)
  test = gather(step, pred.variables, run.mesh, run.eval_batches(), seed,
                f"selective: {pred.method.name}, {max(pred.sizes)} draws")
  rows, curves = [], {}
  for j, n in enumerate(pred.sizes):
    for score in ranking.SCORES:
      confidence, correct = test[score][:, j], test["correct"][:, j]
      rows.append({"method": pred.method.name, "ensemble_size": n, "score": score,
                   **ranking.selective_metrics(confidence, correct), "count": len(correct),
                   **pred.scored})
      curves[f"{score}, N={n}"] = ranking.selective_curve(confidence, correct)
  write_results(output_dir, "selective", rows, {"selective.png": lambda: plot_accuracy_rejection(
      curves, f"{config.model} on {config.input.dataset}")})
  return rows


def summary(rows: list, output_dir) -> str:
  lines = ["N  | score              | AURC (%) | E-AURC (%) | Acc (%) | cov@95 (%) | cov@99 (%)"]
  lines += [f"{r['ensemble_size']:2d} | {r['score']:18s} | {100 * r['aurc']:8.2f} | "
            f"{100 * r['excess_aurc']:10.2f} | {100 * r['accuracy']:7.2f} | "
            f"{100 * r['coverage_at_95']:10.2f} | {100 * r['coverage_at_99']:10.2f}" for r in rows]
  lines.append(f"Results: {output_dir}/selective.{{json,csv,png}}")
  return "\n".join(lines)
