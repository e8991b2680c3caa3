"""HV ("How do vision transformers work?") analyses of trained ViT / AlterNet / ResNet workdirs.

  python experiments/msa_figures.py --out results/msa \
      --workdir "ResNet backbone=workdirs/backbone" --workdir "AlterNet=workdirs/alternet"

Figures (``--figures``, default all), each ``<figure>.png`` + ``<figure>.json`` under ``--out``:
  * ``spectra``: Hessian max-eigenvalue spectra incl. the most negative eigenvalue per batch;
  * ``fourier``: Δlog-amplitude curves per block and the high-frequency (π) value by depth,
    MSA blocks shaded;
  * ``variance``: feature-map (spatial) variance by depth, MSA blocks shaded;
  * ``lesion``: accuracy drop with each unit removed (table in ``lesion.md``);
  * ``similarity``: mini-batch linear CKA between every pair of blocks, one heat map per workdir,
    and ``similarity_cross.{png,json}`` between the blocks of the first two workdirs;
  * ``trajectory``: learning trajectories in polar coordinates about each optimum, for the
    workdirs trained with ``--config.trajectory_every_steps=k`` (the others are left out).
The printed JSON summary says, for each workdir, whether the slides' claims hold:
MSA blocks lower the high-frequency amplitude and the feature-map variance while
Conv blocks raise them, (against the first workdir) MSAs shrink the positive
max eigenvalues, and blocks of one stage are more alike than blocks of different
stages (the block structure of multi-stage networks), and (against the first workdir) the
trajectory is straighter (smaller path length / distance).  Sizes are CPU-scale by default;
``--size k=v`` overrides one.
"""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
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
from smoothing_jax.analysis.features import block_kinds  # noqa: E402
from smoothing_jax.analysis.lesion import lesion_table  # noqa: E402
from smoothing_jax.analysis.similarity import stage_block_structure  # noqa: E402
from smoothing_jax.analysis.spectrum import spectrum_caption  # noqa: E402
from smoothing_jax.experiment.workdir import workdir_path, write_atomically  # noqa: E402
from smoothing_jax.plots import (  # noqa: E402
  plot_by_depth,
  plot_delta_log_amplitude,
  plot_lesion,
  plot_similarity,
  plot_spectra,
  plot_trajectories,
)
from smoothing_jax.training.trajectory_recorder import TRAJECTORY_FILE  # noqa: E402

FIGURES = ("spectra", "fourier", "variance", "lesion", "similarity", "trajectory")
CPU_SIZES = {"hessian_batches": 8, "hessian_batch_size": 128, "hessian_k": 1, "hessian_iters": 20,
             "fourier_images": 256, "variance_images": 128, "lesion_images": 2000,
             "similarity_images": 512, "similarity_batch_size": 128}


def changes_by_kind(by_block: dict, kinds: dict) -> dict:
  """Mean change of a per-block value across blocks of each kind (value after − value
  before the block)."""
  names = list(by_block)
  out = {}
  for prev, name in zip(names, names[1:], strict=False):
    out.setdefault(kinds[name], []).append(float(by_block[name] - by_block[prev]))
  return {kind: float(np.mean(v)) for kind, v in out.items()}


def run_figure(name: str, models: dict, sizes: dict, out: str) -> dict:
  results, summary = {}, {}
  for label, m in models.items():
    if name == "spectra":
      r = trained.hessian_spectrum_study(m, num_batches=sizes["hessian_batches"],
                                         batch_size=sizes["hessian_batch_size"],
                                         k=sizes["hessian_k"], max_iters=sizes["hessian_iters"],
                                         negative=True, regularizer="sum_of_l2_norms")
      summary[label] = {
          "mean_positive_max_eigenvalue": r["mean_positive_max_eigenvalue"],
          "negative_fraction": r["negative_fraction"],
          "mean_min_eigenvalue": r["mean_min_eigenvalue"],
          "solver": spectrum_caption({label: r})
      }
    elif name == "fourier":
      r = trained.fourier_study(m, num_images=sizes["fourier_images"])
      high = {block: float(curve[-1]) for block, curve in r.items()}
      summary[label] = {
          "high_frequency_change_by_kind": changes_by_kind(high, block_kinds(m.model, high))
      }
    elif name == "variance":
      r = trained.variance_study(m, num_images=sizes["variance_images"], num_samples=1)
      spatial = {block: v["data"] for block, v in r.items()}
      summary[label] = {
          "variance_change_by_kind": changes_by_kind(spatial, block_kinds(m.model, spatial))
      }
    elif name == "similarity":
      r = trained.similarity_study(m, num_images=sizes["similarity_images"],
                                   batch_size=sizes["similarity_batch_size"])
      summary[label] = stage_block_structure(r)
    elif name == "trajectory":
      if not (workdir_path(m.workdir) / TRAJECTORY_FILE).exists():
        continue
      r = trained.trajectory_study(m)
      summary[label] = {"path_ratio": r["path_ratio"], "snapshots": int(len(r["steps"])),
                        "relative_error": r["relative_error"]}
    else:
      if not hasattr(m.model, "units"):
        continue
      r = trained.lesion_study(m, num_images=sizes["lesion_images"])
      drops = {}
      for row in r["units"]:
        drops.setdefault(row["kind"], []).append(row["drop"])
      summary[label] = {
          "accuracy": r["accuracy"],
          "mean_drop_by_kind": {
              k: float(np.mean(v)) for k, v in drops.items()
          }
      }
    results[label] = r
  write_json(out / f"{name}.json", results)
  fig = _plot(name, results, models, out)
  if fig is not None:
    save_figure(fig, out / f"{name}.png", dpi=150)
  if name == "lesion":
    write_atomically(out / "lesion.md", "\n\n".join(
        f"## {label}\n\n{lesion_table(r)}" for label, r in results.items()) + "\n")
  if name == "similarity" and len(models) > 1:
    _cross_similarity(models, sizes, out)
  return summary


def _cross_similarity(models: dict, sizes: dict, out) -> None:
  """``similarity_cross.{json,png}``: CKA between the blocks of the first two workdirs."""
  (label_a, a), (label_b, b) = list(models.items())[:2]
  r = trained.similarity_study(a, num_images=sizes["similarity_images"],
                               batch_size=sizes["similarity_batch_size"], other=b)
  write_json(out / "similarity_cross.json", {f"{label_a} vs {label_b}": r})
  save_figure(plot_similarity(r, f"{label_a} vs {label_b}", xlabel=f"{label_b} block",
                              ylabel=f"{label_a} block"), out / "similarity_cross.png", dpi=150)


def _plot(name: str, results: dict, models: dict, out: str):
  if not results:
    return None
  if name == "spectra":
    return plot_spectra({label: np.concatenate([r["eigenvalues"].ravel(), r["min_eigenvalues"]])
                         for label, r in results.items()}, caption=spectrum_caption(results))
  if name == "lesion":
    return plot_lesion(results, "lesion study")
  if name == "trajectory":
    return plot_trajectories(results)
  if name == "similarity":
    fig, axes = plt.subplots(1, len(results), figsize=(5.4 * len(results), 4.4), squeeze=False)
    for ax, (label, r) in zip(axes[0], results.items(), strict=True):
      plot_similarity(r, label, ax=ax)
    fig.tight_layout()
    return fig
  if name == "fourier":
    fig, axes = plt.subplots(1, len(results) + 1, figsize=(5 * (len(results) + 1), 3.4))
    for ax, (label, curves) in zip(axes, results.items(), strict=False):  # + one by-depth panel
      plot_delta_log_amplitude(curves, label, ax=ax)
    high = {
        label: {b: float(c[-1]) for b, c in curves.items()} for label, curves in results.items()
    }
    kinds = {label: block_kinds(models[label].model, by_block) for label, by_block in high.items()}
    depth_fig = plot_by_depth(high, "Δ log amplitude at π",
                              "high-frequency amplitude (MSA shaded)", kinds)
    save_figure(depth_fig, out / "fourier_by_depth.png", dpi=150)
    fig.tight_layout()
    return fig
  spatial = {label: {b: v["data"] for b, v in r.items()} for label, r in results.items()}
  kinds = {label: block_kinds(models[label].model, by_block) for label, by_block in spatial.items()}
  return plot_by_depth(spatial, "feature-map variance", "spatial variance (MSA shaded)", kinds)


def orderings(summaries: dict, labels: list) -> dict:
  """Whether each of the slides' claims holds, per workdir."""
  out = {}
  for label in labels:
    checks = {}
    fourier = summaries.get("fourier", {}).get(label, {}).get("high_frequency_change_by_kind", {})
    if "msa" in fourier:
      checks["msa_lowers_high_frequencies"] = fourier["msa"] < 0
    if "conv" in fourier:
      checks["conv_raises_high_frequencies"] = fourier["conv"] > 0
    variance = summaries.get("variance", {}).get(label, {}).get("variance_change_by_kind", {})
    if "msa" in variance:
      checks["msa_reduces_variance"] = variance["msa"] < 0
    if "conv" in variance:
      checks["conv_increases_variance"] = variance["conv"] > 0
    structure = summaries.get("similarity", {}).get(label, {})
    if "across_stages_mean_cka" in structure:
      checks["blocks_of_a_stage_are_more_alike"] = (structure["within_stage_mean_cka"]
                                                    > structure["across_stages_mean_cka"])
    trajectory = summaries.get("trajectory", {})
    if label != labels[0] and label in trajectory and labels[0] in trajectory:
      checks["straighter_trajectory_than_" + labels[0]] = (trajectory[label]["path_ratio"]
                                                           < trajectory[labels[0]]["path_ratio"])
    spectra = summaries.get("spectra", {})
    if label != labels[0] and label in spectra and labels[0] in spectra:
      checks["smaller_positive_max_eigenvalue_than_" +
             labels[0]] = (spectra[label]["mean_positive_max_eigenvalue"]
                           < spectra[labels[0]]["mean_positive_max_eigenvalue"])
    out[label] = checks
  return out


def main(argv=None):
  parser = figure_parser(__doc__, FIGURES, CPU_SIZES)
  args = parser.parse_args(argv)
  figures = chosen_figures(parser, args, FIGURES)
  sizes = sizes_with_overrides(parser, args, CPU_SIZES)
  models = load_workdirs(args.workdir)
  out = output_dir(args.out)
  summaries = {name: run_figure(name, models, sizes, out) for name in figures}
  write_report(args.out, summaries, orderings(summaries, list(models)), models)


if __name__ == "__main__":
  main()
