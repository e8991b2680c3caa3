"""Evaluation of trained checkpoints: ensemble-size tables and corruption robustness.

* ``evaluate_ensemble_sizes``: clean test metrics for MC ensembles of size N
  (nested: the first N of N_max samples drawn in one ``mc_predict`` call), or for
  deep ensembles of the first M of several workdirs; JSON, CSV and a plot of
  NLL / accuracy / ECE against N (paper Fig. 3 layout) plus a reliability diagram.
* ``evaluate_corruptions``: per-(type, severity) NLL / accuracy / ECE on the
  corruption sets and the aggregates of paper Eqs. 34–36 against a baseline table.
* ``evaluate_streams``: segmentation on video clips (CamVid): one pass per frame,
  MC dropout with N passes, and temporal smoothing (VQ-BNN) with one pass per
  frame; per-pixel metrics and temporal consistency (paper Table E.4).
"""
from __future__ import annotations

import csv
import functools
import io
import os
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from smoothing_jax.data import CORRUPTIONS, corruption_dataset, create_pipeline
from smoothing_jax.ibnn import ibnn_predict
from smoothing_jax.inference import ensemble_predict, mc_predict, stack_variables
from smoothing_jax import temporal, train
from smoothing_jax.metrics import UncertaintyMetrics, class_iou
from smoothing_jax import workdir as workdir_lib
from smoothing_jax.models import is_ibnn
from smoothing_jax.parallel import create_mesh, eval_batch_size, evaluate_batches, shardings
from smoothing_jax.plots import (plot_ensemble_sizes, plot_reliability_diagram,
                                 plot_stream_examples, plot_stream_table)

METRIC_COLUMNS = ("nll", "acc", "ece", "top5", "brier", "acc90", "unc90", "freq90", "iou", "iou90",
                  "ecse")
STREAM_COLUMNS = ("nll", "acc", "ece", "iou", "iou90", "acc90", "unc90", "freq90", "consistency")


def _evaluation_pipeline(config):
  return create_pipeline(config.dataset, config.batch_size, config.seed, config.data_dir,
                         config.download, eval_cache=config.get("eval_cache", ""),
                         data_pipeline=config.get("data_pipeline", "auto"),
                         mesh=create_mesh(config.num_devices))


def _evaluation_setup(workdir: str, config=None):
  """``(config, model, variables, pipeline, replicated, batch-sharded)`` of a trained workdir;
  ``config`` (evaluation settings) replaces the recorded one.  A workdir without checkpoints
  evaluates ``config.init_from``: ``config`` and its ``model_spec`` are recorded there first
  (``workdir.load`` then reads the variables from ``init_from``)."""
  pipeline = None
  if (config is not None and config.get("init_from") and not workdir_lib.has_checkpoint(workdir)
      and not workdir_lib.has_run(workdir)):
    pipeline = record_init_from(workdir, config)
  config, model, variables = workdir_lib.load(workdir, config)
  pipeline = pipeline or _evaluation_pipeline(config)
  return (config, model, variables, pipeline) + shardings(create_mesh(config.num_devices))


def record_init_from(workdir: str, config):
  """Record ``config`` and its model spec in ``workdir`` (no checkpoint of its own), which then
  stands for the variables of ``config.init_from`` (``workdir.load``); returns the evaluation
  pipeline."""
  pipeline = _evaluation_pipeline(config)
  workdir_lib.record_run(workdir, config, {**train.model_spec(config, pipeline),
                                           workdir_lib.EVALUATES_INIT_FROM: True})
  return pipeline


def _nested_metrics(sample_probs, labels, mask, sizes, num_bins):
  """Metrics of the mean of the first n samples, for each n in ``sizes``."""
  cumulative = jnp.cumsum(sample_probs, axis=0)
  return tuple(
      UncertaintyMetrics.from_model_output(cumulative[n - 1] / n, labels, mask, num_bins=num_bins)
      for n in sizes)


def _write_table(rows: list, output_dir, name: str):
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


def evaluate_ensemble_sizes(workdirs: Sequence[str], output_dir: str, config=None,
                            sizes: Optional[Sequence[int]] = None, seed: int = 0) -> list:
  """Test metrics against ensemble size for one MC-dropout or iBNN workdir, or several
  deep-ensemble workdirs.

  iBNN: the first n of the S·K predictions (sample-major, so n = K is one draw of
  every component), up to all K·S with S = ``config.ibnn.eval_samples``.

  Returns one dict per ensemble size; writes ``ensemble_sizes.{json,csv,png}`` and
  ``reliability.png`` (the largest ensemble) into ``output_dir``.
  """
  output_dir = workdir_lib.workdir_path(output_dir)
  config, model, first, pipeline, replicated, data_sharding = _evaluation_setup(workdirs[0], config)
  members = [first] + [workdir_lib.load_checkpoint(w, config)[2] for w in workdirs[1:]]
  rng = jax.random.key(seed)

  if is_ibnn(model):  # iBNN: S draws of each of the K components
    total = model.num_components * config.ibnn.eval_samples
    sizes = sorted({n for n in (sizes or config.ensemble_sizes) if n < total} | {total})
    variables = first

    def predict(v, images, key):
      return ibnn_predict(model, v, images, num_samples=config.ibnn.eval_samples,
                          rng=key).sample_probs
  elif len(members) > 1:  # deep ensemble: sizes 1..M, one sample per member
    sizes = list(range(1, len(members) + 1))
    variables = stack_variables(members)

    def predict(v, images, key):
      return ensemble_predict(model, v, images, rng=key).sample_probs
  else:
    sizes = sorted(set(sizes or config.ensemble_sizes)) if model.dropout_rate > 0 else [1]
    variables = first

    def predict(v, images, key):
      return mc_predict(model, v, images, num_samples=max(sizes), rng=key,
                        chunk_size=config.eval_chunk_size).sample_probs

  @functools.partial(jax.jit,
                     in_shardings=(replicated, data_sharding, replicated),
                     out_shardings=replicated)
  def step(v, batch, key):
    return _nested_metrics(predict(v, batch["image"], key), batch["label"], batch["mask"], sizes,
                           config.ece_bins)

  totals = evaluate_batches(step, variables,
                            pipeline.eval_batches(eval_batch_size(config, data_sharding.mesh)),
                            data_sharding, rng)
  rows = [{"ensemble_size": n, **{k: m[k] for k in ("count",) + METRIC_COLUMNS}}
          for n, m in zip(sizes, (t.compute() for t in totals))]
  if jax.process_index() == 0:  # results are replicated; one process writes them
    _write_table(rows, output_dir, "ensemble_sizes")
    kind = "deep ensemble" if len(members) > 1 else config.model
    workdir_lib.save_figure(plot_ensemble_sizes(rows, f"{kind} on {config.dataset}"),
                            output_dir / "ensemble_sizes.png")
    workdir_lib.save_figure(
        plot_reliability_diagram(totals[-1],
                                 f"{kind}, N={sizes[-1]}: ECE {100 * rows[-1]['ece']:.2f}%"),
        output_dir / "reliability.png")
  return rows


# The reference's AlexNet results (SS resources/results), shipped in smoothing_jax/data/baselines.
BASELINES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "baselines")
DEFAULT_BASELINES = {"cifar100": "cifar100_alexnet_dnn_corrupted.csv",
                     "imagenet2012": "imagenet_alexnet_dnn_corrupted.csv"}


def default_baseline(base: str) -> Optional[str]:
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
  records = [dict(zip(header, r)) for r in rows[1:]]
  scale = 100.0 if any(float(r["Acc"]) > 1 for r in records) else 1.0
  return {(r["type"], int(float(r["severity"]))): {
      "nll": float(r["NLL"]), "err": 1.0 - float(r["Acc"]) / scale, "ece": float(r["ECE"]) / scale}
      for r in records}


def corruption_aggregates(table: dict, baseline: Optional[dict] = None,
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


def evaluate_corruptions(workdir: str,
                         output_dir: str,
                         baseline_csv: Optional[str] = None,
                         num_samples: int = 1,
                         config=None,
                         corruptions: Sequence[str] = CORRUPTIONS,
                         seed: int = 0) -> dict:
  """NLL / accuracy / ECE on every (corruption, severity 1–5).

  ``corruptions.{json,csv}`` is rewritten after every (type, severity), so a failure late
  in the sweep keeps what was computed.  ``baseline_csv`` None takes the shipped AlexNet
  baseline of CIFAR-100-C / ImageNet-C (:func:`default_baseline`); the aggregates go to
  ``corruption_aggregates.json``.
  """
  output_dir = workdir_lib.workdir_path(output_dir)
  config, model, variables, pipeline, replicated, data_sharding = _evaluation_setup(workdir, config)
  baseline_csv = baseline_csv or default_baseline(pipeline.spec.base)
  baseline = read_corruption_table(baseline_csv) if baseline_csv else None  # bad files fail first
  num_samples = num_samples if model.dropout_rate > 0 else 1

  @functools.partial(jax.jit,
                     in_shardings=(replicated, data_sharding, replicated),
                     out_shardings=replicated)
  def step(v, batch, key):
    pred = mc_predict(model,
                      v,
                      batch["image"],
                      num_samples=num_samples,
                      rng=key,
                      chunk_size=config.eval_chunk_size)
    return UncertaintyMetrics.from_model_output(pred.mean_probs, batch["label"], batch["mask"],
                                                num_bins=config.ece_bins)

  rows, table = [], {}
  for corruption in corruptions:
    for severity in range(1, 6):
      name = corruption_dataset(pipeline.spec.base, corruption, severity)
      batches = pipeline.eval_batches(eval_batch_size(config, data_sharding.mesh), name)
      m = evaluate_batches(step, variables, batches, data_sharding, jax.random.key(seed)).compute()
      table[(corruption, severity)] = {"nll": m["nll"], "err": 1.0 - m["acc"], "ece": m["ece"]}
      rows.append({
          "type": corruption,
          "severity": severity,
          "NLL": m["nll"],
          "Acc": m["acc"],
          "ECE": m["ece"],
          "count": m["count"]
      })
      if jax.process_index() == 0:
        _write_table(rows, output_dir, "corruptions")
  aggregates = corruption_aggregates(table, baseline, corruptions)
  if jax.process_index() == 0:
    workdir_lib.write_json(output_dir / "corruption_aggregates.json", aggregates)
  return aggregates


def evaluate_streams(workdir: str, output_dir: str, config=None, *, num_samples: int = 50,
                     num_frames: int = temporal.NUM_FRAMES, decay_rate: float = temporal.DECAY_RATE,
                     split: str = "test", seed: int = 0) -> list:
  """Segmentation on CamVid clips (``camvid/clips``) by each inference method (paper Table E.4).

  Every clip is a labelled frame and the frames before it at 30 Hz.  Rows: one pass
  per frame (``single``), MC dropout with ``num_samples`` passes (``mc``, dropout
  models only) and temporal smoothing (``temporal``, VQ-BNN / VQ-DNN: one pass per
  frame); columns: NLL, accuracy, ECE, mIoU, IoU-90, Acc-90, Unc-90, Freq-90 (per
  pixel, void masked, on the labelled frame) and consistency (argmax agreement of
  the last two frames).  Writes ``streams.{json,csv,png}``, per-class IoU in
  ``streams_class_iou.json`` and ``stream_examples.png``.
  """
  from smoothing_jax.data.datasets import import_tfds
  import_tfds("camvid/clips")  # one line naming what to install where TensorFlow is missing
  from smoothing_jax.data import camvid
  output_dir = workdir_lib.workdir_path(output_dir)
  config, model, variables, pipeline, replicated, data_sharding = _evaluation_setup(workdir, config)
  frames_uint8, labels, _ = camvid.load_clips(split, config.data_dir)
  if frames_uint8.shape[1] < num_frames + 1:
    raise ValueError(
        f"Clips of {frames_uint8.shape[1]} frames are too short for num_frames={num_frames} "
        "(need num_frames + 1 to smooth the last two frames fully).")

  @functools.partial(jax.jit,
                     in_shardings=(replicated, data_sharding, replicated),
                     out_shardings=replicated)
  def step(v, batch, key):
    frames = jnp.swapaxes(batch["frames"], 0, 1)  # [T, B, H, W, 3]
    predictions = temporal.stream_predictions(model, v, frames, rng=key, num_samples=num_samples,
                                              num_frames=num_frames, decay_rate=decay_rate,
                                              chunk_size=config.eval_chunk_size)
    return temporal.stream_statistics(predictions, batch["label"], batch["mask"],
                                      config.ece_bins), {
                                          k: p[-1, 0] for k, p in predictions.items()
                                      }

  batch_size = eval_batch_size(config,
                               data_sharding.mesh) // jax.process_count()  # this process's rows
  num_batches = -(-camvid.num_examples("clips", split, config.data_dir) // jax.process_count() //
                  batch_size)

  def clip_batches():  # the same count on every process; missing rows are padding
    for start in range(0, num_batches * batch_size, batch_size):
      n = max(0, min(batch_size, len(labels) - start))
      batch = {"frames": np.zeros((batch_size,) + frames_uint8.shape[1:], np.float32),
               "label": np.full((batch_size,) + labels.shape[1:], camvid.VOID, np.int32),
               "mask": np.zeros((batch_size,), np.float32)}
      batch["frames"][:n] = pipeline.normalize(frames_uint8[start:start + n])
      batch["label"][:n], batch["mask"][:n] = labels[start:start + n], 1.0
      yield batch

  totals, examples = evaluate_batches(step, variables, clip_batches(), data_sharding,
                                      jax.random.key(seed))
  examples = jax.device_get(examples)  # the first batch's predictions
  columns = ("method", "passes_per_frame", "count") + STREAM_COLUMNS
  rows = [{k: row[k] for k in columns} for row in temporal.statistics_rows(totals, num_samples)]
  if jax.process_index() == 0:  # results are replicated; one process writes them
    _write_table(rows, output_dir, "streams")
    workdir_lib.write_json(output_dir / "streams_class_iou.json", {
        r["method"]: dict(zip(camvid.CLASSES, class_iou(totals[r["method"]][0].confusion).tolist()))
        for r in rows
    })
    workdir_lib.save_figure(plot_stream_table(rows, f"{config.model} on CamVid {split} clips"),
                            output_dir / "streams.png")
    workdir_lib.save_figure(
        plot_stream_examples(frames_uint8[0], labels[0],
                             {r["method"]: examples[r["method"]] for r in rows}, camvid.palette(),
                             f"{config.model}: first {split} clip"),
        output_dir / "stream_examples.png")
  return rows
