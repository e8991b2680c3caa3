"""``streams``: segmentation on CamVid video clips (``camvid/clips``) by each inference method
(paper Table E.4): one pass per frame, MC dropout with N passes, and temporal smoothing (VQ-BNN)
with one pass per frame; per-pixel metrics and temporal consistency.
"""
from __future__ import annotations

import jax
import numpy as np

from smoothing_jax import temporal
from smoothing_jax.evaluators.common import (
  check_single_model,
  save_figure,
  scored,
  stream_metrics_step,
  stream_rows,
  stream_table,
  write_table,
)
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.metrics import class_iou
from smoothing_jax.parallel import eval_batch_size, evaluate_batches, sharded_eval_step, shardings
from smoothing_jax.plots import plot_stream_examples, plot_stream_table


def evaluate(run, output_dir, *, num_samples: int = 0,
             num_frames: int = temporal.NUM_FRAMES, decay_rate: float = temporal.DECAY_RATE,
             split: str = "test", seed: int = 0) -> list:
  """Segmentation on CamVid clips (``camvid/clips``) by each inference method (paper Table E.4).

  Every clip is a labelled frame and the frames before it at 30 Hz.  Rows: one pass
  per frame (``single``), MC dropout with ``num_samples`` passes (``mc``, dropout
  models only) and temporal smoothing (``temporal``, VQ-BNN / VQ-DNN: one pass per
  frame); columns: NLL, accuracy, ECE, mIoU, IoU-90, Acc-90, Unc-90, Freq-90 (per
  pixel, void masked, on the labelled frame) and consistency (argmax agreement of
  the last two frames).  ``num_samples`` 0: the largest ``config.ensemble_sizes``.  Writes
  ``streams.{json,csv,png}``, per-class IoU in ``streams_class_iou.json`` and
  ``stream_examples.png``.
  """
  check_single_model(run, "streams")
  from smoothing_jax.data.sources.tfds import import_tfds
  import_tfds("camvid/clips")  # one line naming what to install where TensorFlow is missing
  from smoothing_jax.data import camvid
  output_dir = workdir_lib.workdir_path(output_dir)
  config = run.config
  num_samples = num_samples or max(config.ensemble_sizes)
  data_sharding = shardings(run.mesh)[1]
  frames_uint8, labels, _ = camvid.load_clips(split, config.input.data_dir)
  if frames_uint8.shape[1] < num_frames + 1:
    raise ValueError(
        f"Clips of {frames_uint8.shape[1]} frames are too short for num_frames={num_frames} "
        "(need num_frames + 1 to smooth the last two frames fully).")

  step = sharded_eval_step(stream_metrics_step, run.mesh, run.method, num_samples, num_frames,
                           decay_rate, config.ece_bins)
  batch_size = eval_batch_size(config,
                               data_sharding.mesh) // jax.process_count()  # this process's rows
  num_batches = -(-camvid.num_examples("clips", split, config.input.data_dir) //
                  jax.process_count() // batch_size)

  def clip_batches():  # the same count on every process; missing rows are padding
    for start in range(0, num_batches * batch_size, batch_size):
      n = max(0, min(batch_size, len(labels) - start))
      batch = {"frames": np.zeros((batch_size,) + frames_uint8.shape[1:], np.float32),
               "label": np.full((batch_size,) + labels.shape[1:], camvid.VOID, np.int32),
               "mask": np.zeros((batch_size,), np.float32)}
      batch["frames"][:n] = run.normalize(frames_uint8[start:start + n])
      batch["label"][:n], batch["mask"][:n] = labels[start:start + n], 1.0
      yield batch

  variables = run.prediction_variables(run.method.with_samples(num_samples))
  totals, examples = evaluate_batches(step, variables, clip_batches(), data_sharding,
                                      jax.random.key(seed), label=f"streams: {run.method.name}, "
                                      f"{num_samples} draws, CamVid {split} clips")
  examples = jax.device_get(examples)  # the first batch's predictions
  rows = stream_rows(totals, num_samples, run)
  if jax.process_index() == 0:  # results are replicated; one process writes them
    write_table(rows, output_dir, "streams")
    workdir_lib.write_json(output_dir / "streams_class_iou.json", {
        **{r["method"]: dict(zip(camvid.CLASSES,
                                 class_iou(totals[r["method"]][0].confusion).tolist(),
                                 strict=False))
           for r in rows},
        **scored(run)})
    save_figure(plot_stream_table(rows, f"{config.model} on CamVid {split} clips"),
                            output_dir / "streams.png")
    save_figure(
        plot_stream_examples(frames_uint8[0], labels[0],
                             {r["method"]: examples[r["method"]] for r in rows}, camvid.palette(),
                             f"{config.model}: first {split} clip"),
        output_dir / "stream_examples.png")
  return rows


def summary(rows: list, output_dir) -> str:
  return (stream_table(rows) + f"\nResults: {output_dir}/streams.{{json,csv,png}}, "
          f"{output_dir}/stream_examples.png")
