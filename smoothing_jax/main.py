"""Command line: ``python -m smoothing_jax.main --config=configs/<file>.py[:args] --workdir=<dir>``.

Modes:
  train (default)  train (resuming from ``workdir``), then evaluate ensemble sizes
  evaluate         ensemble-size table of ``--workdir`` (or of several ``--ensemble_workdirs``)
  corruptions      corruption robustness (``--baseline_csv`` for mCE / mCNLL / mCECE)
  streams          segmentation on CamVid video clips: one pass, MC dropout (N = the largest
                   ``config.ensemble_sizes``) and temporal smoothing (VQ-BNN), with consistency
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from smoothing_jax import evaluate, train  # noqa: E402

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Experiment config file (ml_collections get_config()).",
                                lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and results.")
flags.DEFINE_enum("mode", "train", ["train", "evaluate", "corruptions", "streams"], "What to run.")
flags.DEFINE_list("ensemble_workdirs", [], "evaluate: workdirs of deep-ensemble members.")
flags.DEFINE_string("baseline_csv", None, "corruptions: baseline table (type, severity, NLL, Acc, ECE).")
flags.DEFINE_integer("num_samples", 1, "corruptions: MC dropout samples per prediction.")
flags.DEFINE_bool("multihost", False, "Call jax.distributed.initialize() (multi-host TPU/GPU jobs).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  if FLAGS.multihost:
    jax.distributed.initialize()
  config = FLAGS.config
  results_dir = os.path.join(FLAGS.workdir, "results")
  logging.info("JAX devices: %d (%s), processes: %d", jax.device_count(), jax.devices()[0].platform,
               jax.process_count())
  if FLAGS.mode == "train":
    train.train_and_evaluate(config, FLAGS.workdir)
    rows = evaluate.evaluate_ensemble_sizes([FLAGS.workdir], results_dir, config)
  elif FLAGS.mode == "streams":
    rows = evaluate.evaluate_streams(FLAGS.workdir, results_dir, config, num_samples=max(config.ensemble_sizes))
    print("\nmethod   | passes | NLL    | Acc (%) | ECE (%) | mIoU (%) | Cons (%)")
    for r in rows:
      print(f"{r['method']:8s} | {r['passes_per_frame']:6d} | {r['nll']:.4f} | {100 * r['acc']:7.2f} | "
            f"{100 * r['ece']:7.2f} | {100 * r['iou']:8.2f} | {100 * r['consistency']:8.2f}")
    print(f"\nResults: {results_dir}/streams.{{json,csv,png}}, {results_dir}/stream_examples.png")
    return
  elif FLAGS.mode == "evaluate":
    rows = evaluate.evaluate_ensemble_sizes(FLAGS.ensemble_workdirs or [FLAGS.workdir], results_dir, config)
  else:
    aggregates = evaluate.evaluate_corruptions(FLAGS.workdir, results_dir, FLAGS.baseline_csv, FLAGS.num_samples,
                                               config)
    print(f"Corruption robustness: {aggregates}\nTables in {results_dir}/corruptions.{{json,csv}}")
    return
  print("\nensemble size | NLL    | Acc (%) | ECE (%)")
  for r in rows:
    print(f"{r['ensemble_size']:13d} | {r['nll']:.4f} | {100 * r['acc']:7.2f} | {100 * r['ece']:7.2f}")
  print(f"\nResults: {results_dir}/ensemble_sizes.{{json,csv,png}}, {results_dir}/reliability.png; "
        f"TensorBoard: tensorboard --logdir {FLAGS.workdir}")


if __name__ == "__main__":
  app.run(main)
