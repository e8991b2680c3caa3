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
from smoothing_jax.experiment import fits
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.checkpoints import load_variables
from smoothing_jax.methods import Method
from smoothing_jax.methods.deep_ensemble import DeepEnsemble
from smoothing_jax.metrics import UncertaintyMetrics
from smoothing_jax.parallel import evaluate_batches, shardings
from smoothing_jax.passes import stack_variables

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


def nested_means(sample_probs, sizes) -> tuple:
  """The mean of the first n samples of ``sample_probs [N, B, C]`` (``[B, C]``), for each n in
  ``sizes``: the nested ensembles' predictives."""
  cumulative = jnp.cumsum(sample_probs, axis=0)
  return tuple(cumulative[n - 1] / n for n in sizes)


def nested_metrics(sample_probs, labels, mask, sizes, num_bins: int) -> tuple:
  """Metrics of the mean of the first n samples ``[N, B, C]``, for each n in ``sizes``."""
  return tuple(UncertaintyMetrics.from_model_output(probs, labels, mask, num_bins=num_bins)
               for probs in nested_means(sample_probs, sizes))


def scored(run, members: Sequence[str] = ()) -> dict:
  """``{"step", "checkpoint"}`` of what an evaluation of ``run`` scores, recorded in every row
  (and JSON) it writes and named in the printed table's first line: the run's step, and its
  checkpoint (``Run.checkpoint``) followed by ``members`` (the checkpoints of a deep ensemble's
  other workdirs), joined by " + "."""
  return {"step": run.step, "checkpoint": " + ".join((run.checkpoint, *members))}


@dataclasses.dataclass(frozen=True)
class Predictive:
  """What an evaluator scores: the ``method`` (drawing enough for every size), its
  ``variables`` (a deep ensemble's stacked), the nested ensemble sizes N reported
  (``sizes``: the first N draws; ``Method.nested``), and the step and checkpoints they come
  from (``scored``: :func:`scored`)."""
  method: Method
  variables: Any
  sizes: tuple
  scored: dict


def check_single_model(run, evaluator: str) -> None:
  """ValueError (one line) for a run whose method is not one model's (``Method.one_model``)."""
  run.method.one_model(f"The {evaluator} evaluator", run.workdir)


def predictive(run, members: Sequence[str] = (), sizes: Sequence[int] | None = None
               ) -> Predictive:
  """The run's predictive at the nested sizes ``sizes`` (default ``config.ensemble_sizes``;
  ``Method.nested`` says which a method reports: MC samples of dropout or BNN-VI weights, an
  iBNN's K·S draws, every member of an ensemble), or the deep ensemble of the run and the
  workdirs ``members`` (sizes 1..M: the first N members; ``DeepEnsemble.wrap``, which refuses
  what cannot be a member)."""
  if not members:
    method, nested = run.method.nested(tuple(sizes or run.config.ensemble_sizes))
    return Predictive(method, run.prediction_variables(method), nested, scored(run))
  method = DeepEnsemble.wrap(run.method, size=len(members) + 1)
  # Each its newest intact step, with its method's collections where the run has them.
  with_state = bool(set(run.variables) - {"params", "batch_stats"})
  loaded = [load_variables(w, run.mesh, method_state=with_state) for w in members]
  variables = stack_variables([run.variables] + [v for _, v in loaded])
  checkpoints = [str(workdir_lib.checkpoint_dir(w) / str(step))
                 for w, (step, _) in zip(members, loaded, strict=True)]
  method, nested = method.nested(tuple(sizes or run.config.ensemble_sizes))
  # Each workdir's own fit of its step (a post-hoc stage, e.g. Laplace), stacked as the members.
  steps = [(run.workdir, run.step)] + [(w, step) for w, (step, _) in zip(members, loaded,
                                                                          strict=True)]
  data = run.prediction_data()._replace(fit=lambda name: stack_variables(
      [fits.load_fit(w, name, step, run.mesh) for w, step in steps]))
  variables = method.prediction_variables(variables, data)
  return Predictive(method, variables, nested, scored(run, checkpoints))


def sample_probs(method: Method, variables, images, key):
  """``[N, B, C]`` probabilities of ``method``'s N draws on ``images``."""
  return jnp.exp(method.sample_log_probs(variables, images, key))


def ensemble_metrics_step(method, sizes, num_bins, variables, batch, key):
  """Metrics of every nested ensemble size in ``sizes`` on one padded, masked batch."""
  probs = sample_probs(method, variables, batch["image"], key)
  return nested_metrics(probs, batch["label"], batch["mask"], sizes, num_bins)


def ranking_step(method, sizes, variables, batch, key):
  """Per example of one padded batch, for each nested size in ``sizes``: the confidences of
  ``ranking.scores`` (``[B, S]`` each) and whether the prediction is right (``correct [B, S]``);
  with the batch's ``mask`` and ``label``."""
  probs = sample_probs(method, variables, batch["image"], key)
  per_size = [ranking.scores(probs[:n]) for n in sizes]
  out = {name: jnp.stack([s[name] for s in per_size], axis=1) for name in ranking.SCORES}
  predictions = jnp.stack([jnp.argmax(jnp.mean(probs[:n], axis=0), -1) for n in sizes], axis=1)
  return {**out, "correct": predictions == batch["label"][:, None], "mask": batch["mask"],
          "label": batch["label"]}


def sample_log_probs_step(method, variables, batch, key):
  """Per-sample log-probabilities ``[B, N, C]`` of one padded batch (floored at the smallest
  normal float32, so that a probability that underflowed stays finite), with its ``mask`` and
  ``label``."""
  log_probs = jnp.maximum(method.sample_log_probs(variables, batch["image"], key),
                          jnp.log(jnp.finfo(jnp.float32).tiny))
  return {"log_probs": jnp.swapaxes(log_probs, 0, 1), "mask": batch["mask"],
          "label": batch["label"]}


def gather(step, variables, mesh, batches, seed: int, label: str = "") -> dict:
  """Every example's outputs of ``step`` (example-major arrays, from a
  ``parallel.sharded_eval_step`` on ``mesh``) over ``batches``, joined, padding dropped (numpy;
  exact: every example of every process); ``label`` names the pass in progress lines."""
  out = evaluate_batches(step, variables, batches, shardings(mesh)[1], jax.random.key(seed),
                         concatenate=True, label=label)
  keep = out.pop("mask") > 0
  return {k: v[keep] for k, v in out.items()}


def stream_metrics_step(method, num_samples, num_frames, decay_rate, num_bins, variables, batch,
                        key):
  """Per-method statistics (``temporal.stream_statistics``: one pass per frame, MC dropout,
  VQ-BNN) of one padded, masked batch of clips ``[B, T, H, W, C]``, and the first clip's last
  predictions."""
  frames = jnp.swapaxes(batch["frames"], 0, 1)  # [T, B, H, W, 3]
  predictions = temporal.stream_predictions(method, variables, frames, rng=key,
                                            num_samples=num_samples, num_frames=num_frames,
                                            decay_rate=decay_rate)
  return (temporal.stream_statistics(predictions, batch["label"], batch["mask"], num_bins),
          {k: p[-1, 0] for k, p in predictions.items()})


def stream_rows(totals: dict, num_samples: int, run) -> list:
  """The rows of :func:`stream_metrics_step`'s merged statistics (paper Table E.4 layout), with
  what ``run`` scored (:func:`scored`)."""
  columns = ("method", "passes_per_frame", "count") + STREAM_COLUMNS
  return [{**{k: row[k] for k in columns}, **scored(run)}
          for row in temporal.statistics_rows(totals, num_samples)]


def stream_table(rows: list) -> str:
  """The console table of :func:`stream_rows`."""
  lines = ["method   | passes | NLL    | Acc (%) | ECE (%) | mIoU (%) | Cons (%)"]
  lines += [f"{r['method']:8s} | {r['passes_per_frame']:6d} | {r['nll']:.4f} | "
            f"{100 * r['acc']:7.2f} | {100 * r['ece']:7.2f} | {100 * r['iou']:8.2f} | "
            f"{100 * r['consistency']:8.2f}" for r in rows]
  return "\n".join(lines)
