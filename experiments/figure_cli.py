"""Command-line plumbing shared by the figure scripts in ``experiments/`` (they import it as
``figure_cli``: a script's directory is on ``sys.path``; the tests add ``experiments/`` too).

``--workdir LABEL=DIR`` (repeatable; the first is the baseline), ``--figures`` (a
subset), ``--out`` and ``--size KEY=INT`` overrides; results go to JSON files with
numpy values converted, and a ``summary.json`` that is also printed.
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
from etils import epath

from smoothing_jax.analysis import trained
from smoothing_jax.experiment import workdir as workdir_lib


def jsonable(x):
  """``x`` with numpy arrays/scalars as lists/numbers and dict keys as strings."""
  if isinstance(x, dict):
    return {str(k): jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [jsonable(v) for v in x]
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x).tolist()
  return x


def figure_parser(description: str, figures, size_names) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=description,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", action="append", required=True, metavar="LABEL=DIR",
                      help="a trained workdir; the first one is the baseline")
  parser.add_argument("--figures", default=",".join(figures),
                      help="comma-separated subset of " + ", ".join(figures))
  parser.add_argument("--out", required=True)
  parser.add_argument("--size", action="append", default=[], metavar="KEY=INT",
                      help="override one size (" + ", ".join(size_names) + ")")
  return parser


def chosen_figures(parser, args, figures) -> list:
  """The ``--figures`` list; unknown names exit with the valid ones."""
  chosen = args.figures.split(",")
  unknown = set(chosen) - set(figures)
  if unknown:
    parser.error(f"unknown figures {sorted(unknown)}; choose from {', '.join(figures)}")
  return chosen


def sizes_with_overrides(parser, args, sizes: dict) -> dict:
  """``sizes`` with each ``--size KEY=INT`` applied; a bad item exits with the valid keys."""
  sizes = dict(sizes)
  for item in args.size:
    key, _, value = item.partition("=")
    if key not in sizes or not value.isdigit():
      parser.error(f"--size {item!r}: expected KEY=INT with KEY one of {', '.join(sizes)}")
    sizes[key] = int(value)
  return sizes


def load_workdirs(specs) -> dict:
  """``{label: Run}`` (``trained.load_trained``) from ``LABEL=DIR`` (or ``DIR``, labelled by its
  name), in order."""
  pairs = [w.split("=", 1) if "=" in w else (os.path.basename(w.rstrip("/")), w) for w in specs]
  return {label: trained.load_trained(path) for label, path in pairs}


def write_json(path, data, indent=None):
  """``data`` (numpy included) as JSON at ``path``, local or ``gs://`` (written atomically)."""
  workdir_lib.write_json(path, jsonable(data), indent=indent)


def save_figure(fig, path, dpi: int = 120):
  """``fig`` as a PNG at ``path``, local or ``gs://``; then closed."""
  import matplotlib.pyplot as plt
  workdir_lib.save_figure(fig, path, dpi=dpi)
  plt.close(fig)


def output_dir(out) -> epath.Path:
  """The ``--out`` folder (local or ``gs://``), created."""
  path = epath.Path(out)
  path.mkdir(parents=True, exist_ok=True)
  return path


def write_report(out: str, summaries: dict, orderings: dict, models: dict) -> None:
  """``out/summary.json`` (summaries, orderings, checkpoint steps), also printed."""
  checkpoints = {label: {"workdir": m.workdir, "step": m.step} for label, m in models.items()}
  report = jsonable({"summary": summaries, "orderings": orderings, "checkpoints": checkpoints})
  write_json(epath.Path(out) / "summary.json", report, indent=1)
  print(json.dumps(report, indent=1))
