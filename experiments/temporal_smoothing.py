"""Temporal smoothing (VQ-BNN) on data streams of real test images, for trained classifiers.

  python experiments/temporal_smoothing.py --out results/temporal \
      --workdir "MC dropout=workdirs/resnet_mcdo_18" \
      --workdir "MC dropout + smoothing=workdirs/resnet_mcdo_smoothing_18"

Each test image becomes a clip of ``length`` frames translated by up to
``max_shift`` pixels (a camera drifting over a still scene).  For every workdir:
one pass per frame, MC dropout with ``num_samples`` passes and temporal smoothing
(one pass per frame, L = 5, λ = 0.8) — NLL, accuracy, ECE on the last frame and
consistency of the last two (the paper's Table E.4 layout; CamVid itself is
``python -m smoothing_jax.main ... --mode=streams``).  Writes ``temporal.json``,
``temporal.md`` and ``temporal.png``; ``--size k=v`` overrides a size.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
from figure_cli import (  # noqa: E402
  figure_parser,
  load_workdirs,
  output_dir,
  save_figure,
  sizes_with_overrides,
  write_json,
  write_report,
)

from smoothing_jax.analysis import trained  # noqa: E402
from smoothing_jax.experiment.workdir import write_atomically  # noqa: E402
from smoothing_jax.plots import plot_stream_table  # noqa: E402

SIZES = {"num_images": 1000, "length": 6, "max_shift": 3, "num_samples": 10}
COLUMNS = (("nll", "NLL", 1, ".4f"), ("acc", "Acc (%)", 100, ".2f"), ("ece", "ECE (%)", 100, ".2f"),
           ("consistency", "Cons (%)", 100, ".2f"))


def markdown_table(results: dict) -> str:
  lines = ["| model | method | passes/frame | " + " | ".join(c[1] for c in COLUMNS) + " |",
           "|---|---|---|" + "---|" * len(COLUMNS)]
  for label, rows in results.items():
    for r in rows:
      lines.append(f"| {label} | {r['method']} | {r['passes_per_frame']} | " +
                   " | ".join(f"{scale * r[key]:{fmt}}" for key, _, scale, fmt in COLUMNS) + " |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  parser = figure_parser(__doc__, ("temporal",), SIZES)
  args = parser.parse_args(argv)
  sizes = sizes_with_overrides(parser, args, SIZES)
  out = output_dir(args.out)
  models = load_workdirs(args.workdir)
  results = {label: trained.temporal_smoothing_study(m, **sizes) for label, m in models.items()}
  write_json(out / "temporal.json", results, indent=1)
  write_atomically(out / "temporal.md", markdown_table(results))
  save_figure(plot_stream_table(results, "translated test-image streams"), out / "temporal.png")
  summary = {}
  for label, rows in results.items():
    by_method = {r["method"]: r for r in rows}
    single, smooth = by_method["single"], by_method["temporal"]
    summary[label] = {"temporal_lowers_nll": smooth["nll"] < single["nll"],
                      "temporal_lowers_ece": smooth["ece"] < single["ece"],
                      "temporal_raises_consistency": smooth["consistency"] > single["consistency"]}
  write_report(args.out, summary, {}, models)


if __name__ == "__main__":
  main()
