"""``temporal``: temporal smoothing on data streams made of test images (paper Table E.4 layout,
for classifiers): each image becomes a clip of ``length`` frames shifted by up to ``max_shift``
pixels (``temporal.translate_sequences``); one pass per frame, MC dropout with N passes and
VQ-BNN with one pass per frame, on the last frame, with the consistency of the last two.
Writes ``temporal.{json,csv,png}``.
"""
from __future__ import annotations

import jax
import numpy as np

from smoothing_jax import temporal
from smoothing_jax.evaluators.common import (
  check_single_model,
  stream_metrics_step,
  stream_rows,
  stream_table,
  write_results,
)
from smoothing_jax.parallel import evaluate_batches, sharded_eval_step, shardings
from smoothing_jax.plots import plot_stream_table


def evaluate(run, output_dir, *, num_images: int = 1000, length: int = 6, max_shift: int = 3,
             num_samples: int = 0, num_frames: int = temporal.NUM_FRAMES,
             decay_rate: float = temporal.DECAY_RATE, batch_size: int = 250,
             seed: int = 0) -> list:
  """Rows ``{"method", "passes_per_frame", "count", "nll", "acc", "ece", ..., "consistency"}`` on
  the first ``num_images`` evaluation images (``num_samples`` 0: the largest
  ``config.ensemble_sizes``); clips in batches of ``batch_size`` (at most the number of clips,
  rounded up to the mesh)."""
  check_single_model(run, "temporal")
  pipeline = run.pipeline
  if pipeline.eval_images is None:
    raise ValueError("The temporal evaluator needs an in-memory evaluation split (CIFAR, npz or "
                     "digits datasets).")
  num_samples = num_samples or max(run.config.ensemble_sizes)
  images = np.asarray(pipeline.eval_images[:num_images])
  labels = np.asarray(pipeline.eval_labels[:num_images], np.int32)
  videos = temporal.translate_sequences(images, length, max_shift, seed)
  size = -(-min(batch_size, len(videos)) // run.mesh.size) * run.mesh.size

  def batches():  # padded to whole batches; padding is masked
    for start in range(0, len(videos), size):
      n = min(size, len(videos) - start)
      batch = {"frames": np.zeros((size,) + videos.shape[1:], np.float32),
               "label": np.zeros((size,), np.int32), "mask": np.zeros((size,), np.float32)}
      batch["frames"][:n] = run.normalize(videos[start:start + n])
      batch["label"][:n], batch["mask"][:n] = labels[start:start + n], 1.0
      yield batch

  step = sharded_eval_step(stream_metrics_step, run.mesh, run.method, num_samples, num_frames,
                           decay_rate, run.config.ece_bins)
  totals, _ = evaluate_batches(step, run.prediction_variables(run.method.with_samples(
      num_samples)), batches(), shardings(run.mesh)[1], jax.random.key(seed),
      label=f"temporal: {run.method.name}, {num_samples} draws, {len(videos)} shifted streams")
  rows = stream_rows(totals, num_samples, run)
  if output_dir is not None:  # None: the rows only (the analyses)
    write_results(output_dir, "temporal", rows, {"temporal.png": lambda: plot_stream_table(
        rows, f"{run.config.model}: shifted test-image streams")})
  return rows


def summary(rows: list, output_dir) -> str:
  return stream_table(rows) + f"\nResults: {output_dir}/temporal.{{json,csv,png}}"
