"""Regenerate the spatial-smoothing paper's analysis figures from trained workdirs.

  python experiments/smoothing_figures.py --out results/figures \
      --workdir "MC dropout=workdirs/resnet_mcdo_18" \
      --workdir "MC dropout + smoothing=workdirs/resnet_mcdo_smoothing_18"

Figures (``--figures``, default all): ``spectra`` (Fig. 8), ``fourier`` (Fig. 6b),
``variance`` (Fig. 5), ``landscape`` (Fig. 7), ``frequency_noise`` (Fig. 6c),
``consistency`` (Table E.3 / Fig. E.3), ``adversarial``.  Each writes
``<figure>.png`` and ``<figure>.json`` under ``--out``; the script prints one JSON
summary comparing every workdir with the first (the baseline) in the direction the
paper predicts for smoothing, e.g. ``"spectra": {"smaller_max_eigenvalue": true}``.
Sizes default to a CPU-scale run; ``--full`` uses the paper's sizes.
"""
from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")
import numpy as np  # noqa: E402
from figure_cli import (  # noqa: E402
  chosen_figures,
  figure_parser,
  load_workdirs,
  output_dir,
  save_figure,
  sizes_with_overrides,
  write_json,
  write_report,
)

from smoothing_jax.analysis import trained  # noqa: E402
from smoothing_jax.analysis.spectrum import spectrum_caption  # noqa: E402
from smoothing_jax.plots import (  # noqa: E402
  plot_accuracy_vs_frequency,
  plot_attack_accuracy,
  plot_by_depth,
  plot_delta_log_amplitude,
  plot_relative_confidence,
  plot_spectra,
)

FIGURES = ("spectra", "fourier", "variance", "landscape", "frequency_noise", "consistency",
           "adversarial")
CPU_SIZES = dict(num_batches=8,
                 batch_size=128,
                 max_iters=20,
                 num_images=256,
                 num_samples=5,
                 grid=11,
                 frequencies=11,
                 sequences=100,
                 pgd_steps=10)
PAPER_SIZES = dict(num_batches=100,
                   batch_size=128,
                   max_iters=100,
                   num_images=1000,
                   num_samples=50,
                   grid=21,
                   frequencies=21,
                   sequences=1000,
                   pgd_steps=10)


def compute(name: str, model, sizes: dict) -> dict:
  """One figure's data for one trained model."""
  if name == "spectra":
    return trained.hessian_spectrum_study(model, num_batches=sizes["num_batches"],
                                          batch_size=sizes["batch_size"],
                                          max_iters=sizes["max_iters"])
  if name == "fourier":
    return trained.fourier_study(model, num_images=sizes["num_images"])
  if name == "variance":
    return trained.variance_study(model, num_images=sizes["num_images"] // 2,
                                  num_samples=sizes["num_samples"])
  if name == "landscape":
    return trained.landscape_study(model, num_points=sizes["grid"],
                                   batch_size=4 * sizes["batch_size"])
  if name == "frequency_noise":
    return trained.frequency_noise_study(model,
                                         tuple(np.linspace(0, 1, sizes["frequencies"])),
                                         num_images=4 * sizes["num_images"],
                                         num_samples=sizes["num_samples"])
  if name == "consistency":
    return trained.consistency_study(model, num_images=sizes["sequences"],
                                     num_samples=sizes["num_samples"])
  return trained.adversarial_study(model, num_images=sizes["num_images"],
                                   num_samples=sizes["num_samples"], pgd_steps=sizes["pgd_steps"])


def stage_ends(by_tap: dict) -> list:
  """Values of the last tap of every stage (taps are named ``layer<s>_<j>`` / ``smooth<s>_0``):
  what each stage hands to the next, with or without a smoothing layer at its end.  The stem
  (tap ``stem``, depth 0) ends no stage."""
  last = {}
  for tap, value in by_tap.items():
    stage = re.search(r"\d+", tap)
    if stage:
      last[stage.group()] = value
  return list(last.values())


def summarize(name: str, r: dict):
  """The number the paper's ordering is about, for one model's results of figure ``name``."""
  if name == "spectra":
    return r["mean_positive_max_eigenvalue"]
  if name == "fourier":  # Δlog-amplitude at π of each stage's output, averaged over stages
    return float(np.mean([curve[-1] for curve in stage_ends(r)]))
  if name == "variance":  # feature-map variance of each stage's output, averaged over stages
    return {kind: float(np.mean([v[kind] for v in stage_ends(r)])) for kind in ("data", "model")}
  if name == "landscape":  # mean rise of the NLL over the grid: smaller = flatter
    loss = np.asarray(r["loss"])
    return float(loss.mean() - loss[loss.shape[0] // 2, loss.shape[1] // 2])
  if name == "frequency_noise":  # accuracy lost to noise at frequencies >= 0.5π
    return r["clean_accuracy"] - float(
        np.mean(np.asarray(r["accuracy"])[np.asarray(r["frequencies"]) >= 0.5]))
  if name == "consistency":
    return {k: r[k] for k in ("consistency", "cec", "relative_confidence")}
  return float(np.mean([row["accuracy"] for row in r["attacks"]]))


def run_figure(name: str, models: dict, sizes: dict, out: str) -> dict:
  """Compute one figure for every model, save PNG + JSON, return the per-model summary numbers."""
  results = {label: compute(name, model, sizes) for label, model in models.items()}
  write_json(out / f"{name}.json", results, indent=1)
  save_figure(_plot(name, results), out / f"{name}.png")
  return {label: summarize(name, r) for label, r in results.items()}


def _plot(name: str, results: dict):
  import matplotlib.pyplot as plt
  if name == "spectra":
    return plot_spectra({label: r["max_eigenvalues"] for label, r in results.items()},
                        caption=spectrum_caption(results))
  if name == "fourier":
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.2), squeeze=False)
    for ax, (label, curves) in zip(axes[0], results.items(), strict=True):
      plot_delta_log_amplitude(curves, label, ax=ax)
    fig.tight_layout()
    return fig
  if name == "variance":
    return plot_by_depth(
        {
            f"{label} ({kind})": {
                b: v[kind] for b, v in r.items()
            } for label, r in results.items() for kind in ("data", "model")
        }, "feature-map variance")
  if name == "landscape":
    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.8))
    for ax, (label, r) in zip(np.atleast_1d(axes), results.items(), strict=True):
      a, b = np.meshgrid(r["alphas"], r["betas"], indexing="ij")
      ax.clabel(ax.contour(a, b, r["loss"], levels=15), fontsize=6)
      ax.set_title(f"{label}: NLL")
    fig.tight_layout()
    return fig
  if name == "frequency_noise":
    return plot_accuracy_vs_frequency({
        label: (r["frequencies"], r["accuracy"]) for label, r in results.items()
    })
  if name == "consistency":
    return plot_relative_confidence({
        label: r["relative_confidence_curve"] for label, r in results.items()
    })
  return plot_attack_accuracy({label: r["attacks"] for label, r in results.items()})


def orderings(summaries: dict) -> dict:
  """Does each model differ from the first in the direction the paper reports for smoothing?"""
  checks = {
      "spectra": ("smaller_mean_max_eigenvalue", lambda s, b: s < b),
      "fourier": ("lower_high_frequency_amplitude", lambda s, b: s < b),
      "variance": ("lower_feature_variance",
                   lambda s, b: s["data"] < b["data"] and s["model"] <= b["model"]),
      "landscape": ("flatter_landscape", lambda s, b: s < b),
      "frequency_noise": ("smaller_accuracy_drop_under_high_frequency_noise", lambda s, b: s < b),
      "consistency": ("more_consistent", lambda s, b: s["consistency"] > b["consistency"]),
      "adversarial": ("more_adversarially_robust", lambda s, b: s > b)
  }
  out = {}
  for name, per_model in summaries.items():
    key, holds = checks[name]
    base_label, *others = list(per_model)
    out[name] = {
        label: {
            key: bool(holds(per_model[label], per_model[base_label]))
        } for label in others
    }
  return out


def main(argv=None):
  parser = figure_parser(__doc__, FIGURES, CPU_SIZES)
  parser.add_argument("--full",
                      action="store_true",
                      help="the paper's sizes instead of CPU-scale ones")
  args = parser.parse_args(argv)
  figures = chosen_figures(parser, args, FIGURES)
  sizes = sizes_with_overrides(parser, args, PAPER_SIZES if args.full else CPU_SIZES)
  models = load_workdirs(args.workdir)
  out = output_dir(args.out)
  summaries = {name: run_figure(name, models, sizes, out) for name in figures}
  write_report(args.out, summaries, orderings(summaries), models)


if __name__ == "__main__":
  main()
