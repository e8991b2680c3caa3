"""What the evaluators share: the run's predictive (``predictive``), the sharded steps built on
it, gathering per-example outputs, and tables written atomically."""
from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath

from smoothing_jax import plots, ranking, temporal
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.checkpoints import load_variables
from smoothing_jax.inference import (
  batch_ensemble_predict,
  ensemble_predict,
  mc_predict,
  stack_variables,
)
from smoothing_jax.methods.ibnn import ibnn_predict
from smoothing_jax.metrics import UncertaintyMetrics
from smoothing_jax.models import is_batch_ensemble, is_ibnn, is_stochastic
from smoothing_jax.parallel import evaluate_batches, shardings

METRIC_COLUMNS = ("nll", "acc", "ece", "top5", "brier", "acc90", "unc90", "freq90", "iou", "iou90",
                  "ecse")
STREAM_COLUMNS = ("nll", "acc", "ece", "iou", "iou90", "acc90", "unc90", "freq90", "consistency")


def save_figure(fig, path) -> None:
  """``fig`` at ``path`` (``workdir.save_figure``: written atomically), then closed."""
  workdir_lib.save_figure(fig, path)
  plots.close(fig)


def write_results(output_dir, name: str, rows: list,
                  figures: Mapping[str, Callable] | None = None) -> None:
  """By process 0 (results are replicated): ``rows`` as ``<output_dir>/<name>.{json,csv}``
  (:func:`write_table`) and each ``{file name: function drawing the figure}``."""
  if jax.process_index() != 0:
    return
  output_dir = workdir_lib.workdir_path(output_dir)
  write_table(rows, output_dir, name)
  for file_name, draw in (figures or {}).items():
    save_figure(draw(), output_dir / file_name)


def write_table(rows: list, output_dir, name: str) -> None:
  """``rows`` as ``<output_dir>/<name>.json`` and ``.csv``, each written to a temporary file and
  renamed into place (``workdir.write_atomically``), so a reader (or a crash) never sees half a
  table.  ``output_dir`` may be local or ``gs://``."""
  output_dir = epath.Path(output_dir)
  workdir_lib.write_json(output_dir / f"{name}.json", rows)
  text = io.StringIO(newline="")
  writer = csv.DictWriter(text, fieldnames=list(rows[0]))
  writer.writeheader()
  writer.writerows(rows)
  workdir_lib.write_atomically(output_dir / f"{name}.csv", text.getvalue())


def nested_metrics(sample_probs, labels, mask, sizes, num_bins: int) -> tuple:
  """Metrics of the mean of the first n samples ``[N, B, C]``, for each n in ``sizes``."""
  cumulative = jnp.cumsum(sample_probs, axis=0)
  return tuple(
      UncertaintyMetrics.from_model_output(cumulative[n - 1] / n, labels, mask, num_bins=num_bins)
      for n in sizes)


@dataclasses.dataclass(frozen=True)
class Predictive:
  """How an evaluator samples a run's predictive: ``kind`` "mc" (``num_samples`` passes: MC
  dropout or BNN-VI weight samples), "ibnn" (``num_samples`` draws of each component,
  sample-major), "deep_ensemble" (the stacked ``variables`` of the members, one sample each) or
  "batch_ensemble" (the M members of one pass); ``sizes``: the nested ensemble sizes N reported
  (the first N samples)."""
  kind: str
  variables: Any
  sizes: tuple
  num_samples: int


def check_single_model(run, evaluator: str) -> None:
  """ValueError (one line) for an ensemble run given to an evaluator of one model's predictions."""
  if run.ensemble_members > 1:
    raise ValueError(f"The {evaluator} evaluator smooths one model's predictions over time; "
                     f"{run.workdir} holds an ensemble of {run.ensemble_members} members: "
                     "evaluate a member (Run.write_member(m, workdir), then --mode="
                     f"{evaluator} on that workdir).")


def predictive(run, members: Sequence[str] = (), sizes: Sequence[int] | None = None
               ) -> Predictive:
  """The run's predictive: an iBNN's K·S draws (S = ``config.ibnn.eval_samples``; sizes up to
  K·S), a BatchEnsemble's M members (sizes 1..M), a deep ensemble (sizes 1..M: the first N
  members) of the run and the workdirs ``members`` or of an ensemble run's M stacked members
  (``config.ensemble_members``), or MC samples of dropout or BNN-VI weights (``sizes``, default
  ``config.ensemble_sizes``; N = 1 for deterministic models).

  Members with MC dropout give one sample each (member m's dropout key ``split(key, M)[m]``), so
  N counts members, as in SS Fig. E.1's deep ensembles."""
  config, model = run.config, run.model
  if run.ensemble_members > 1:
    if members:
      raise ValueError(f"{run.workdir} holds an ensemble of {run.ensemble_members} members "
                       "already; --ensemble_workdirs joins single runs.")
    return Predictive("deep_ensemble", run.variables, tuple(range(1, run.ensemble_members + 1)),
                      1)
  if is_batch_ensemble(model):
    if members:
      raise ValueError("--ensemble_workdirs joins single networks; a BatchEnsemble holds "
                       f"{model.ensemble_size} members already.")
    return Predictive("batch_ensemble", run.variables, tuple(range(1, model.ensemble_size + 1)),
                      1)
  if is_ibnn(model):
    total = model.num_components * config.ibnn.eval_samples
    sizes = sorted({n for n in (sizes or config.ensemble_sizes) if n < total} | {total})
    return Predictive("ibnn", run.variables, tuple(sizes), config.ibnn.eval_samples)
  if members:
    variables = stack_variables([run.variables] +
                                [load_variables(w, run.mesh)[1] for w in members])
    return Predictive("deep_ensemble", variables, tuple(range(1, len(members) + 2)), 1)
  sizes = sorted(set(sizes or config.ensemble_sizes)) if is_stochastic(model) else [1]
  return Predictive("mc", run.variables, tuple(sizes), max(sizes))


def sample_probs(kind, model, num_samples, chunk_size, variables, images, key):
  """``[N, B, C]`` sample probabilities of :class:`Predictive` ``kind`` on ``images``."""
  if kind == "ibnn":
    return ibnn_predict(model, variables, images, num_samples=num_samples, rng=key).sample_probs
  if kind == "deep_ensemble":
    return ensemble_predict(model, variables, images, rng=key).sample_probs
  if kind == "batch_ensemble":
    return batch_ensemble_predict(model, variables, images, rng=key).sample_probs
  return mc_predict(model, variables, images, num_samples=num_samples, rng=key,
                    chunk_size=chunk_size).sample_probs


def ensemble_metrics_step(kind, model, sizes, num_samples, chunk_size, num_bins, variables, batch,
                          key):
  """Metrics of every nested ensemble size in ``sizes`` on one padded, masked batch."""
  probs = sample_probs(kind, model, num_samples, chunk_size, variables, batch["image"], key)
  return nested_metrics(probs, batch["label"], batch["mask"], sizes, num_bins)


def ranking_step(kind, model, sizes, num_samples, chunk_size, variables, batch, key):
  """Per example of one padded batch, for each nested size in ``sizes``: the confidences of
  ``ranking.scores`` (``[B, S]`` each) and whether the prediction is right (``correct [B, S]``);
  with the batch's ``mask`` and ``label``."""
  probs = sample_probs(kind, model, num_samples, chunk_size, variables, batch["image"], key)
  per_size = [ranking.scores(probs[:n]) for n in sizes]
  out = {name: jnp.stack([s[name] for s in per_size], axis=1) for name in ranking.SCORES}
  predictions = jnp.stack([jnp.argmax(jnp.mean(probs[:n], axis=0), -1) for n in sizes], axis=1)
  return {**out, "correct": predictions == batch["label"][:, None], "mask": batch["mask"],
          "label": batch["label"]}


def sample_log_probs_step(kind, model, num_samples, chunk_size, variables, batch, key):
  """Per-sample log-probabilities ``[B, N, C]`` of one padded batch (floored at the smallest
  normal float32, so that a probability that underflowed stays finite), with its ``mask`` and
  ``label``."""
  probs = sample_probs(kind, model, num_samples, chunk_size, variables, batch["image"], key)
  log_probs = jnp.log(jnp.maximum(probs, jnp.finfo(jnp.float32).tiny))
  return {"log_probs": jnp.swapaxes(log_probs, 0, 1), "mask": batch["mask"],
          "label": batch["label"]}


def gather(step, variables, mesh, batches, seed: int) -> dict:
  """Every example's outputs of ``step`` (example-major arrays, from a
  ``parallel.sharded_eval_step`` on ``mesh``) over ``batches``, joined, padding dropped (numpy;
  exact: every example of every process)."""
  out = evaluate_batches(step, variables, batches, shardings(mesh)[1], jax.random.key(seed),
                         concatenate=True)
  keep = out.pop("mask") > 0
  return {k: v[keep] for k, v in out.items()}


def stream_metrics_step(model, num_samples, num_frames, decay_rate, chunk_size, num_bins, variables,
                 batch, key):
  """Per-method statistics (``temporal.stream_statistics``: one pass per frame, MC dropout,
  VQ-BNN) of one padded, masked batch of clips ``[B, T, H, W, C]``, and the first clip's last
  predictions."""
  frames = jnp.swapaxes(batch["frames"], 0, 1)  # [T, B, H, W, 3]
  predictions = temporal.stream_predictions(model, variables, frames, rng=key,
                                            num_samples=num_samples, num_frames=num_frames,
                                            decay_rate=decay_rate, chunk_size=chunk_size)
  return (temporal.stream_statistics(predictions, batch["label"], batch["mask"], num_bins),
          {k: p[-1, 0] for k, p in predictions.items()})


def stream_rows(totals: dict, num_samples: int) -> list:
  """The rows of :func:`stream_metrics_step`'s merged statistics (paper Table E.4 layout)."""
  columns = ("method", "passes_per_frame", "count") + STREAM_COLUMNS
  return [{k: row[k] for k in columns} for row in temporal.statistics_rows(totals, num_samples)]


def stream_table(rows: list) -> str:
  """The console table of :func:`stream_rows`."""
  lines = ["method   | passes | NLL    | Acc (%) | ECE (%) | mIoU (%) | Cons (%)"]
  lines += [f"{r['method']:8s} | {r['passes_per_frame']:6d} | {r['nll']:.4f} | "
            f"{100 * r['acc']:7.2f} | {100 * r['ece']:7.2f} | {100 * r['iou']:8.2f} | "
            f"{100 * r['consistency']:8.2f}" for r in rows]
  return "\n".join(lines)
