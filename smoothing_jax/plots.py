"""Every figure of the library, one ``plot_*`` function per figure; each returns the matplotlib
``Figure`` (save it with ``fig.savefig("name.png")``).

The inputs are plain results: an :class:`~smoothing_jax.metrics.UncertaintyMetrics` accumulator,
the evaluators' rows (:mod:`smoothing_jax.evaluators`), iBNN OOD curves, or what the ``*_study``
functions of :mod:`smoothing_jax.analysis.trained` (and the analysis modules under them) return.

matplotlib is imported when a figure is drawn, not when this module is imported, so importing
:mod:`smoothing_jax.evaluators` does not need it; choose a backend (``matplotlib.use("Agg")``)
before the first figure where there is no display.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
  from smoothing_jax.metrics import UncertaintyMetrics

SMALL = (5, 3.2)  # the size of a one-axes figure
# The metric panels of the evaluation figures: key → (axis label, scale of the stored value).
METRIC_PANELS = {"nll": ("NLL", 1), "acc": ("Accuracy (%)", 100), "ece": ("ECE (%)", 100),
                 "consistency": ("Consistency (%)", 100)}


def _pyplot():
  import matplotlib.pyplot as plt
  return plt


def _axes(figsize=SMALL, ax=None):
  """``(fig, ax)``: a new one-axes figure, or ``ax`` (if given) and its figure."""
  return _pyplot().subplots(figsize=figsize) if ax is None else (ax.figure, ax)


def _finish(fig, ax, xlabel: str, ylabel: str, title: str | None = None, **legend):
  """Axis labels, the title (unless None) and a legend (``legend``: its options); laid out."""
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title is not None:
    ax.set_title(title)
  ax.legend(**legend)
  fig.tight_layout()
  return fig


def _metric_panels(keys, figsize):
  """One axes per metric of ``keys`` (see ``METRIC_PANELS``), in a row: ``fig`` and
  ``[(ax, key, label, scale)]``."""
  fig, axes = _pyplot().subplots(1, len(keys), figsize=figsize)
  return fig, [(ax, key) + METRIC_PANELS[key] for ax, key in zip(axes, keys, strict=True)]


def _with_suptitle(fig, title: str):
  fig.suptitle(title)
  fig.tight_layout()
  return fig


# ----------------------------------------------------------------------------- evaluation

def plot_reliability_diagram(metrics: UncertaintyMetrics, title: str | None = None):
  """Reliability diagram (accuracy per confidence bin) above a confidence histogram.

  Returns the matplotlib ``Figure``; save it with ``fig.savefig("reliability.png")``.
  """
  rel = metrics.reliability()
  edges = rel["edges"]
  centers, width = (edges[:-1] + edges[1:]) / 2, edges[1] - edges[0]
  fig, (top, bottom) = _pyplot().subplots(2, 1, figsize=(4.5, 6), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1]})
  top.bar(centers, rel["accuracy"], width=width, edgecolor="black", color="tab:blue",
          label="accuracy")
  top.bar(centers, rel["confidence"] - rel["accuracy"], bottom=rel["accuracy"], width=width,
          edgecolor="tab:red", color="tab:red", alpha=0.3, label="gap")
  top.plot([0, 1], [0, 1], "k--", linewidth=1)
  top.set_ylabel("accuracy")
  top.set_ylim(0, 1)
  stats = metrics.compute()
  top.set_title(title or f"ECE {100 * stats['ece']:.2f}%  Acc {100 * stats['acc']:.2f}%")
  top.legend(loc="upper left")
  bottom.bar(centers, rel["count"] / max(rel["count"].sum(), 1.0), width=width, edgecolor="black",
             color="gray")
  bottom.set_xlabel("confidence")
  bottom.set_ylabel("fraction")
  bottom.set_xlim(0, 1)
  fig.tight_layout()
  return fig


def plot_ensemble_sizes(rows, title: str = ""):
  """NLL, accuracy and ECE against ensemble size (paper Fig. 3 layout), of one list of rows or of
  ``{label: rows}`` (one line each, e.g. SS Fig. E.1's ensembles with and without smoothing);
  returns the Figure."""
  series = rows if isinstance(rows, dict) else {None: rows}
  sizes = sorted({r["ensemble_size"] for rows in series.values() for r in rows})
  fig, panels = _metric_panels(("nll", "acc", "ece"), (11, 3.2))
  for ax, key, label, scale in panels:
    for name, rows in series.items():
      ax.plot([r["ensemble_size"] for r in rows], [scale * r[key] for r in rows], "o-",
              label=name)
    if len(series) > 1 and key == "nll":
      ax.legend()
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("ensemble size")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  return _with_suptitle(fig, title)


def plot_stream_table(results, title: str = ""):
  """NLL, ECE, accuracy and consistency bars for each inference method: ``results`` is one model's
  rows (``[{"method", "nll", ...}]``) or ``{model label: rows}``; returns the Figure."""
  results = {"": results} if isinstance(results, list) else results
  bars = [(f"{label}\n{r['method']}".strip(), r) for label, rows in results.items() for r in rows]
  colours = _pyplot().cm.tab10(np.arange(len(bars)) % 10)
  fig, panels = _metric_panels(("nll", "ece", "acc", "consistency"),
                               (3.5 + 1.1 * len(bars) * 4 / 3, 3.6))
  for ax, key, label, scale in panels:
    values = [scale * r[key] for _, r in bars]
    ax.bar(range(len(bars)), values, color=colours)
    low, high = min(values), max(values)
    ax.set_ylim(max(0.0, low - 0.5 * (high - low + 1e-3)), high + 0.25 * (high - low + 1e-3))
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=60, ha="right", fontsize=7)
    ax.set_title(label)
  return _with_suptitle(fig, title)


def plot_stream_examples(frames, labels, predictions: dict, palette, title: str = ""):
  """One clip: the labelled frame, its ground truth, and per method the predicted classes and
  confidence (max probability).  ``frames [T, H, W, 3]`` uint8, ``labels [H, W]``,
  ``predictions {method: probs [H, W, C]}``, ``palette [C + 1, 3]`` (last row: void)."""
  palette = np.asarray(palette, np.uint8)
  num_classes = palette.shape[0] - 1
  columns = 1 + len(predictions)
  fig, axes = _pyplot().subplots(2, columns, figsize=(3.2 * columns, 5.2), squeeze=False)
  axes[0, 0].imshow(frames[-1])
  axes[0, 0].set_title("frame")
  axes[1, 0].imshow(palette[np.where((labels >= 0) & (labels < num_classes), labels, num_classes)])
  axes[1, 0].set_title("ground truth")
  for col, (method, probs) in enumerate(predictions.items(), start=1):
    axes[0, col].imshow(palette[np.argmax(probs, -1)])
    axes[0, col].set_title(f"{method}: prediction")
    image = axes[1, col].imshow(np.max(probs, -1), vmin=0, vmax=1, cmap="viridis")
    axes[1, col].set_title(f"{method}: confidence")
  fig.colorbar(image, ax=axes[1, :].tolist(), fraction=0.02)
  for ax in axes.flat:
    ax.axis("off")
  fig.suptitle(title)
  return fig


def plot_ood_curves(curves: dict, title: str = ""):
  """Total, aleatoric and epistemic entropy against the corruption level (iBNN); returns the
  Figure."""
  fig, ax = _axes()
  for key, style in (("total", "k-"), ("aleatoric", "b--"), ("epistemic", "r-.")):
    ax.plot(curves["levels"], curves[key], style, label=key)
  return _finish(fig, ax, "corruption level", "entropy (nats)", title)


# ----------------------------------------------------------------------------- analyses

def close(fig) -> None:
  """Free a figure that was only saved (an evaluator's): pyplot keeps every figure it made, and a
  notebook would show them all."""
  _pyplot().close(fig)


def _curve_style(label: str) -> dict:
  """The line style of a score in a curve's label (MSP solid, entropy dashed, MI dotted)."""
  for score, style in (("mutual_information", ":"), ("entropy", "--")):
    if score in label:
      return {"linestyle": style}
  return {"linestyle": "-"}


def plot_detection_curves(curves: dict, title: str = ""):
  """OOD detection: ROC (left) and precision-recall with in-distribution positive (right) of
  each ``{label: {"fpr", "tpr", "recall", "precision"}}`` (``ranking.roc_curve`` /
  ``precision_recall_curve``), with the operating points of FPR@95 in both conventions where a
  curve carries ``fpr95_id_positive`` / ``fpr95_ood_positive``: ○ at 95% of in-distribution
  accepted, × at 95% of OOD rejected (``ranking.detection_metrics``)."""
  fig, (roc, pr) = _pyplot().subplots(1, 2, figsize=(10, 4))
  # One colour per curve, all distinct (the default cycle repeats after 10; every OOD score is 11).
  cm, n = _pyplot().cm, len(curves)
  colours = (cm.tab10(np.arange(n)) if n <= 10 else cm.tab20(np.arange(n)) if n <= 20
             else cm.turbo(np.linspace(0, 1, n)))
  for (label, c), colour in zip(curves.items(), colours, strict=True):
    roc.plot(c["fpr"], c["tpr"], label=label, color=colour, **_curve_style(label))
    if "fpr95_id_positive" in c:
      roc.plot(c["fpr95_id_positive"], 0.95, "o", color=colour, fillstyle="none")
      roc.plot(0.05, 1 - c["fpr95_ood_positive"], "x", color=colour)
    pr.plot(c["recall"], c["precision"], label=label, color=colour, **_curve_style(label))
  roc.plot([0, 1], [0, 1], color="0.7", linewidth=0.8)
  roc.set(xlabel="False-positive rate (OOD accepted)", ylabel="True-positive rate (in accepted)",
          title="ROC")
  pr.set(xlabel="Recall (in-distribution)", ylabel="Precision", title="Precision-recall (In)")
  pr.legend(fontsize=7)
  return _with_suptitle(fig, title)


def plot_accuracy_rejection(curves: dict, title: str = ""):
  """Selective prediction: accuracy of the kept predictions against the rejected share, for each
  ``{label: (coverage, accuracy)}`` (``ranking.selective_curve``)."""
  fig, ax = _axes((6, 4))
  for label, (coverage, accuracy) in curves.items():
    ax.plot(1 - np.asarray(coverage), 100 * np.asarray(accuracy), label=label,
            **_curve_style(label))
  return _finish(fig, ax, "Rejected share", "Accuracy of the kept predictions (%)", title,
                 fontsize=7)


def plot_set_sizes(rows: list, title: str = ""):
  """Conformal prediction: mean set size against ensemble size N, one panel per α and one line
  per score and variant (rows of the ``conformal`` evaluator); returns the Figure."""
  alphas = sorted({r["alpha"] for r in rows}, reverse=True)
  sizes = sorted({r["ensemble_size"] for r in rows})
  fig, axes = _pyplot().subplots(1, len(alphas), figsize=(4.5 * len(alphas) + 1.8, 3.6),
                                 squeeze=False)
  for ax, alpha in zip(axes[0], alphas, strict=True):
    lines = {}
    for r in rows:
      if r["alpha"] == alpha:
        lines.setdefault(r["score"] + (", randomised" if r["randomized"] else ""), []).append(r)
    for label, line in lines.items():
      ax.plot([r["ensemble_size"] for r in line], [r["mean_size"] for r in line], "o-",
              label=label)
    ax.set_xscale("log")
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set(xlabel="ensemble size N", ylabel="mean set size",
           title=f"α = {alpha} (target coverage {100 * (1 - alpha):g}%)")
    ax.grid(alpha=0.3)
  axes[0, -1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  return _with_suptitle(fig, title)


def plot_spectra(spectra: dict, bins: int = 40, caption: str | None = None):
  """Overlaid histograms of pooled eigenvalues, ``{label: eigenvalues array}``; ``caption``
  (e.g. ``analysis.spectrum.spectrum_caption``) names the solver; returns the Figure."""
  fig, ax = _axes()
  values = np.concatenate([np.ravel(v) for v in spectra.values()])
  edges = np.linspace(values.min(), values.max(), bins + 1)
  for label, v in spectra.items():
    ax.hist(np.ravel(v), bins=edges, alpha=0.5, density=True, label=label)
  if caption:
    ax.set_title(caption, fontsize=8)
  return _finish(fig, ax, "Hessian eigenvalue (top-k per mini-batch)", "density")


def plot_surface(surface: dict, key: str = "loss", title: str | None = None):
  """Contour and 3-D plots of ``surface[key]``; returns the Figure."""
  a, b = np.meshgrid(surface["alphas"], surface["betas"], indexing="ij")
  z = surface[key]
  fig = _pyplot().figure(figsize=(9, 3.8))
  ax = fig.add_subplot(1, 2, 1)
  contour = ax.contour(a, b, z, levels=20)
  ax.clabel(contour, fontsize=6)
  ax.set_xlabel("α")
  ax.set_ylabel("β")
  ax3 = fig.add_subplot(1, 2, 2, projection="3d")
  ax3.plot_surface(a, b, z, cmap="viridis")
  return _with_suptitle(fig, title or key)


def plot_by_depth(values: dict, ylabel: str, title: str = "", kinds: dict | None = None):
  """Line plot of ``{label: {block: value}}`` against normalised depth; returns the Figure.

  ``kinds`` ``{label: {block: kind}}`` (:func:`smoothing_jax.analysis.features.block_kinds`)
  shades the MSA blocks grey, as HV's figures do.
  """
  fig, ax = _axes()
  for label, by_block in values.items():
    depth = np.linspace(0, 1, len(by_block))
    line, = ax.plot(depth, list(by_block.values()), "o-", label=label, markersize=3)
    label_kinds = (kinds or {}).get(label, {})
    msa = [(d, value) for d, (block, value) in zip(depth, by_block.items(), strict=True)
           if label_kinds.get(block) == "msa"]
    if msa:
      half = 0.5 / max(len(by_block) - 1, 1)
      for d, _ in msa:
        ax.axvspan(d - half, d + half, color="0.85", zorder=0)
      ax.plot(*zip(*msa, strict=True), "s", color=line.get_color(), markersize=6,
              markerfacecolor="white")
  return _finish(fig, ax, "normalised depth", ylabel, title)


def plot_similarity(result: dict,
                    title: str = "",
                    ax=None,
                    xlabel: str = "block index",
                    ylabel: str = "block index"):
  """Heat map of a mini-batch CKA result
  (:func:`smoothing_jax.analysis.similarity.feature_similarity` or ``cross_model_similarity``):
  column blocks on x, row blocks on y (from the bottom), colour bar 0–1 (HV Sec. 4.1).

  Each resolution change (``resolution_changes`` of ``rows``/``cols``) is a dashed white line
  before its block, lettered on the top and right edges: E at block 0 (stem / patch embedding),
  P elsewhere (pooling, patch merging, strided stage start). MSA blocks are grey bands along the
  top and right edges, as :func:`plot_by_depth` shades them. Draws on ``ax`` if given; returns the
  Figure.
  """
  fig, ax = _axes((5.4, 4.4), ax)
  image = ax.imshow(np.asarray(result["cka"]), origin="lower", vmin=0, vmax=1, cmap="magma",
                    interpolation="nearest", aspect="auto")
  fig.colorbar(image, ax=ax, label="CKA", pad=0.08)
  for blocks, line, band, edge in ((result["cols"], ax.axvline, ax.axvspan,
                                    ax.get_xaxis_transform()),
                                   (result["rows"], ax.axhline, ax.axhspan,
                                    ax.get_yaxis_transform())):
    for i in blocks["resolution_changes"]:
      line(i - 0.5, color="white", linestyle="--", linewidth=0.8)
      along, across = (i - 0.5, 1.05) if band == ax.axvspan else (1.05, i - 0.5)
      ax.text(along, across, "E" if i == 0 else "P", transform=edge, ha="center", va="center",
              fontsize=7)
    for i, kind in enumerate(blocks["kinds"]):
      if kind == "msa":
        band(i - 0.5, i + 0.5, 1.0, 1.025, color="0.5", clip_on=False)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, pad=20)  # above the letters
  fig.tight_layout()
  return fig


def plot_delta_log_amplitude(curves: dict, title: str = "", ax=None):
  """Δlog-amplitude from 0 to π for each block, ``{block: curve}``, coloured by depth (HV Fourier
  plot).

  Draws on ``ax`` if given; returns the Figure.
  """
  fig, ax = _axes(ax=ax)
  colors = _pyplot().cm.plasma(np.linspace(0, 0.9, len(curves)))
  for color, (block, curve) in zip(colors, curves.items(), strict=True):
    ax.plot(np.linspace(0, 1, len(curve)), curve, color=color, label=block)
  return _finish(fig, ax, "frequency (×π)", "Δ log amplitude", title, fontsize=6, ncol=2)


def plot_accuracy_vs_frequency(results: dict, title: str = ""):
  """Accuracy against noise frequency, ``{label: (frequencies, accuracies)}`` (paper Fig. 6c)."""
  fig, ax = _axes()
  for label, (freqs, acc) in results.items():
    ax.plot(freqs, 100 * np.asarray(acc), "o-", label=label)
  return _finish(fig, ax, "noise frequency (×π)", "accuracy (%)", title)


def plot_relative_confidence(curves: dict, title: str = ""):
  """Relative confidence along one sequence, ``{label: array [T]}`` (paper Fig. E.3); returns the
  Figure."""
  fig, ax = _axes()
  for label, values in curves.items():
    ax.plot(np.arange(len(values)), values, "o-", ms=3, label=label)
  ax.set_ylim(0, 1.05)
  return _finish(fig, ax, "frame", "relative confidence", title)


def plot_attack_accuracy(results: dict, title: str = ""):
  """Accuracy against ε (pixels ×255) per attack,
  ``{label: [{"attack", "eps", "accuracy"}, …]}``; returns the Figure."""
  fig, ax = _axes()
  for label, rows in results.items():
    for attack, style in (("fgsm", "o--"), ("pgd", "s-")):
      picked = [r for r in rows if r["attack"] == attack]
      ax.plot([255 * r["eps"] for r in picked], [100 * r["accuracy"] for r in picked], style,
              label=f"{label} ({attack.upper()})")
  return _finish(fig, ax, "ε (×1/255)", "accuracy (%)", title, fontsize=7)


def plot_lesion(results: dict, title: str = ""):
  """Accuracy drop per unit index, ``{label: lesion result}`` (a
  :func:`smoothing_jax.analysis.lesion.lesion_accuracy_drops` result); MSA units hatched.
  Returns the Figure."""
  fig, ax = _axes((6, 3.2))
  width = 0.8 / max(len(results), 1)
  for j, (label, result) in enumerate(results.items()):
    rows = result["units"]
    index = np.array([r["index"] for r in rows]) + (j - (len(results) - 1) / 2) * width
    drops = np.array([100 * r["drop"] for r in rows])
    bars = ax.bar(index, drops, width, label=label)
    for bar, r in zip(bars, rows, strict=True):
      if r["kind"] == "msa":
        bar.set_hatch("//")
        bar.set_edgecolor("black")
  return _finish(fig, ax, "unit index (hatched: MSA)", "accuracy drop (pp)", title)


def plot_trajectories(trajectories: dict, title: str = "", relative: bool = True):
  """Learning trajectories in polar coordinates about each run's optimum (HV Fig. 1b),
  ``{label: polar trajectory}`` (:func:`smoothing_jax.analysis.trajectory.polar_trajectory`):
  angle φ_t, radius r_t (÷ r_0 with ``relative``, so runs of any size start at 1); the legend
  gives each path length / straight distance (1: straight).  Returns the Figure."""
  fig, ax = _pyplot().subplots(figsize=(5, 4.2), subplot_kw={"projection": "polar"})
  max_angle = 0.0
  for label, polar in trajectories.items():
    radius = polar["radius"] / (polar["distance"] if relative else 1.0)
    ax.plot(polar["angle"], radius, "o-", markersize=2,
            label=f"{label} (path / distance {polar['path_ratio']:.2f})")
    max_angle = max(max_angle, float(np.max(polar["angle"])))
  ax.set_thetamin(0)
  ax.set_thetamax(min(180, max(90, 10 * np.ceil(np.degrees(max_angle) / 10))))
  ax.set_title(title or ("r / r₀ against the angle to θ₀ − θ_T" if relative else
                         "‖θ_t − θ_T‖ against the angle to θ₀ − θ_T"), fontsize=9)
  ax.legend(loc="upper right", fontsize=7)
  fig.tight_layout()
  return fig
