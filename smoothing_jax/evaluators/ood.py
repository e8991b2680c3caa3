"""``ood``: out-of-distribution detection by confidence scores, for each ensemble size N:
AUROC, AUPR-In, AUPR-Out and FPR@95 in both conventions (``ranking.detection_metrics``,
in-distribution positive) against every OOD set, with the in-distribution test accuracy beside.

Two ways to name the OOD sets (any dataset name the data layer reads: TFDS, ``npz:<dir>``, an
``.npz`` file read as a test split):

* ``config.evals.ood.near`` / ``far``: OpenOOD v1.5's protocol (Jingkang50/OpenOOD at 3c35632,
  ``openood/evaluation_api/datasets.py``: CIFAR-10's near sets are CIFAR-100 and Tiny ImageNet,
  its far sets MNIST, SVHN, Textures and Places365).  Every score of :data:`SCORES`
  (``smoothing_jax.ood_scores``; ``scores`` picks some) per set and as each group's mean
  (the mean of its sets' metrics, as OpenOOD reports).  Grayscale sets are converted as OpenOOD
  preprocesses them (``data.datasets.as_model_images``).
* ``config.evals.ood.datasets``: ``"corruptions"`` for the 15 corruptions of the run's dataset at
  severity 5, or nothing for the standard pairs (CIFAR-10: SVHN and CIFAR-100; CIFAR-100: SVHN
  and CIFAR-10, as uncertainty-baselines); scored by MSP, −entropy and −mutual information
  (``ranking.SCORES``) unless ``scores`` says otherwise.

All scores of a set come from one forward pass per batch (``Method.sample_outputs``: every
draw's logits and penultimate features), ODIN adding its own backward and forward pass.  The
scores fitted on training features (MDS, RMDS, KNN, ViM) fit on one pass over the training split
(no augmentation), each draw on its own features, and are cached in ``output_dir``
(``ood_fitted.npz``, refitted when the checkpoint, method or settings differ).  Images are
normalised as the run's own; a colour set of another image shape is rejected with a message
naming both.  Writes ``ood.{json,csv}`` and ``ood_<set>.png`` (ROC and precision-recall curves).
"""
from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax import ood_scores, ranking
from smoothing_jax.data import CORRUPTIONS, corruption_dataset
from smoothing_jax.data.dataset_spec import BASES
from smoothing_jax.data.datasets import check_available, parse_dataset
from smoothing_jax.evaluators.common import gather, predictive, write_results
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.parallel import sharded_eval_step
from smoothing_jax.passes import default_chunk_size
from smoothing_jax.plots import plot_detection_curves

# Every score (``smoothing_jax.ood_scores``), and those fitted on training features.
SCORES = ("msp", "max_logit", "energy", "entropy", "mutual_information", "expected_pairwise_kl",
          "odin", "mds", "rmds", "knn", "vim")
# Scores of the first n draws' probabilities together (p̄, or the draws' spread about it).
OF_THE_PREDICTIVE = ("msp", "entropy", "mutual_information", "expected_pairwise_kl")
FITTED = ("mds", "rmds", "knn", "vim")
METRICS = ("auroc", "aupr_in", "aupr_out", "fpr95_id_positive", "fpr95_ood_positive")
STANDARD_PAIRS = {"cifar10": ("svhn_cropped", "cifar100"), "cifar100": ("svhn_cropped", "cifar10")}


def resolve_ood_datasets(base: str, names: Sequence[str]) -> list:
  """The OOD set names of ``names`` (``"corruptions"`` expanded) for a run on ``base``; the
  standard pairs when ``names`` is empty."""
  names = list(names) or list(STANDARD_PAIRS.get(base, ()))
  if not names:
    raise ValueError(f"No standard OOD sets for {base!r}: name them with "
                     "--config.evals.ood.datasets='(\"npz:<dir>\",)' (any dataset name, or "
                     "\"corruptions\").")
  expanded = []
  for name in names:
    if name == "corruptions":
      if base not in BASES:
        raise ValueError("'corruptions' needs a dataset with corruption sets "
                         f"({', '.join(BASES)}), not {base!r}.")
      expanded += [corruption_dataset(base, c, 5) for c in CORRUPTIONS]
    else:
      expanded.append(name)
  return expanded


def check_option_values(*, near=(), far=(), datasets=(), scores=(), combine="score_mean",
                        knn_k=ood_scores.KNN_K, odin_temperature=ood_scores.ODIN_TEMPERATURE,
                        odin_noise=ood_scores.ODIN_NOISE, **_) -> None:
  """ValueError (one line) for option values :func:`evaluate` cannot take; what
  ``evaluators.check_options`` asks before anything runs, and ``evaluate`` itself."""
  if (near or far) and datasets:
    raise ValueError("Name the OOD sets by config.evals.ood.near/far or by "
                     "config.evals.ood.datasets, not both.")
  for name in (*near, *far, *datasets):  # an unknown name is refused before anything runs
    if name != "corruptions":
      parse_dataset(name)
  if combine not in ood_scores.COMBINE:
    raise ValueError(f"combine must be one of {ood_scores.COMBINE}, got {combine!r}.")
  if not (isinstance(knn_k, int) and knn_k >= 1):
    raise ValueError(f"config.evals.ood.knn_k must be an integer >= 1, got {knn_k!r}.")
  if not (odin_temperature > 0 and odin_noise >= 0):
    raise ValueError("config.evals.ood.odin_temperature must be > 0 and odin_noise >= 0, got "
                     f"{odin_temperature!r} and {odin_noise!r}.")
  unknown = [s for s in scores if s not in SCORES]
  if unknown:
    raise ValueError(f"Unknown OOD scores {unknown}; the scores: {', '.join(SCORES)}.")


def evaluate(run, output_dir, *, datasets: Sequence[str] = (), near: Sequence[str] = (),
             far: Sequence[str] = (), scores: Sequence[str] = (), sizes: Sequence[int] = (),
             members: Sequence[str] = (), odin_temperature: float = ood_scores.ODIN_TEMPERATURE,
             odin_noise: float = ood_scores.ODIN_NOISE, knn_k: int = ood_scores.KNN_K,
             combine: str = "score_mean", seed: int = 0) -> list:
  """Rows ``{"ood_group", "ood_dataset", "ensemble_size", "score", "auroc", "aupr_in",
  "aupr_out", "fpr95_id_positive", "fpr95_ood_positive", "count_in", "count_out",
  "id_accuracy"}`` against each OOD set, and each group's mean (``ood_dataset``
  ``"<group> mean"``): the groups ``near`` and ``far`` or, without them, the sets ``datasets``
  (empty: the standard pairs; :func:`resolve_ood_datasets`), for the scores ``scores`` (empty:
  all of :data:`SCORES` with near/far, ``ranking.SCORES`` otherwise), the ensemble sizes
  ``sizes`` (empty: ``config.ensemble_sizes``) of the run and the workdirs ``members``.  ODIN
  at ``odin_temperature`` and ``odin_noise``, KNN with ``knn_k`` neighbours (OpenOOD's
  defaults; no search on a validation split: its ``APS_mode`` is not offered).  ``combine``:
  how max-logit, energy and ODIN combine draws (``ood_scores``: ``"score_mean"``, the mean of
  per-draw scores, or ``"mean"``, the score of the first n draws' mean logits / tempered
  softmax, one ODIN step per size); the predictive's scores always score p̄ and the fitted ones
  are always per draw.  The FPR@95 conventions: ``ranking``'s docstring."""
  check_option_values(near=near, far=far, datasets=datasets, scores=scores, combine=combine,
                      knn_k=knn_k, odin_temperature=odin_temperature, odin_noise=odin_noise)
  config = run.config
  base = run.pipeline.dataset_spec.base
  if near or far:
    groups = {"near": list(near), "far": list(far)}
  else:
    groups = {"": resolve_ood_datasets(base, datasets)}
  chosen = tuple(scores) or (SCORES if (near or far) else ranking.SCORES)
  names = [name for sets in groups.values() for name in sets]
  for name in names:  # a missing set fails now, not after the in-distribution pass
    spec = parse_dataset(name)
    check_available(spec, spec.eval_split, run.pipeline.data_dir, run.pipeline.download)
  pred = predictive(run, members, sizes)
  odin = ((float(odin_temperature), float(odin_noise), tuple(run.pipeline.std), combine,
           pred.sizes) if "odin" in chosen else None)
  step = sharded_eval_step(outputs_step, run.mesh, pred.method, odin)
  fitted = fit_scores(run, pred, output_dir, seed) if any(s in FITTED for s in chosen) else {}
  table = functools.partial(score_table, sizes=pred.sizes, chosen=chosen, fitted=fitted,
                            knn_k=knn_k, combine=combine)
  draws = f"{pred.method.name}, {max(pred.sizes)} draws"
  inside = table(gather(step, pred.variables, run.mesh, run.eval_batches(), seed,
                        f"ood: {draws}, in-distribution {run.config.input.dataset}"))
  rows, short_names = [], [_short(name) for name in names]
  for k, name in enumerate(names):
    outside = table(gather(step, pred.variables, run.mesh, run.eval_batches(name), seed + 1 + k,
                           f"ood: {draws}, set {k + 1}/{len(names)} {name}"))
    group = next(g for g, sets in groups.items() if name in sets)
    curves = {}
    for j, n in enumerate(pred.sizes):
      for score in chosen:
        positive, negative = inside[score][:, j], outside[score][:, j]
        detection = ranking.detection_metrics(positive, negative)
        rows.append({"method": pred.method.name, "ood_group": group, "ood_dataset": name,
                     "ensemble_size": n, "score": score, "combine": _combine_of(score, combine),
                     **detection,
                     "count_in": len(positive), "count_out": len(negative),
                     "id_accuracy": float(np.mean(inside["correct"][:, j])), **pred.scored})
        if n == pred.sizes[-1] or not (near or far):  # the protocol's curves: the largest N
          fpr, tpr = ranking.roc_curve(positive, negative)
          recall, precision = ranking.precision_recall_curve(positive, negative)
          curves[f"{score}, N={n}"] = {
              "fpr": fpr, "tpr": tpr, "recall": recall, "precision": precision,
              **{k: detection[k] for k in ("fpr95_id_positive", "fpr95_ood_positive")}}
    # The table's short name (not "_work_data_cifar100_"), unless another set shares it.
    label = name if short_names.count(short_names[k]) > 1 else short_names[k]
    file_name = f"ood_{re.sub(r'[^A-Za-z0-9_.-]+', '_', label).strip('_')}.png"
    rows_so_far = rows + group_means(rows, groups)
    write_results(output_dir, "ood", rows_so_far, {file_name: functools.partial(
        plot_detection_curves, curves, f"{config.model} on {config.input.dataset} against {name}")})
  return rows + group_means(rows, groups)


def group_means(rows: list, groups: dict) -> list:
  """For each named group with all its sets in ``rows``: a row per (N, score) whose metrics
  are the means of its sets' (``ood_dataset`` ``"<group> mean"``, ``count_out`` their sum)."""
  means = []
  for group, sets in groups.items():
    if not group or not sets:
      continue
    for (n, score) in dict.fromkeys((r["ensemble_size"], r["score"]) for r in rows):
      members = [r for r in rows if r["ood_group"] == group and r["ensemble_size"] == n
                 and r["score"] == score]
      if len(members) != len(sets):
        continue
      means.append({**members[0], "ood_dataset": f"{group} mean",
                    **{k: float(np.mean([r[k] for r in members])) for k in METRICS},
                    "count_out": sum(r["count_out"] for r in members)})
  return means


def _combine_of(score: str, combine: str) -> str:
  """How ``score`` combines draws in a row: ``"predictive"`` (p̄), ``"score_mean"`` or
  ``"mean"``."""
  if score in OF_THE_PREDICTIVE:
    return "predictive"
  return combine if score in ("max_logit", "energy", "odin") else "score_mean"


def outputs_step(method, odin, variables, batch, key):
  """Per example of one padded batch: every draw's ``logits`` ``[B, N, C]`` and penultimate
  ``features`` ``[B, N, D]`` (``Method.sample_outputs``), and where ``odin`` is
  ``(temperature, noise, input std, combine, sizes)``, ODIN's confidences ``odin``: each draw's
  ``[B, N]`` (``"score_mean"``), or at each size ``[B, S]`` (``"mean"``: the first n draws'
  mean, one step each), the same keys in every pass; with the batch's ``mask`` and
  ``label``.  With ODIN by ``"score_mean"``, the logits and features are those of the pass its
  input gradient is taken through (one forward pass for every score, not two)."""
  temperature, noise, std, combine, sizes = odin or (None,) * 5
  if odin is not None:
    method = vmapped_draws(method)
  settings = {"input_std": std, "temperature": temperature, "noise": noise, "combine": combine}
  if odin is not None and combine == "score_mean":  # ODIN's gradient pass is the shared pass
    draws, logits, features = ood_scores.odin_draws(
        lambda x: _logits_and_features(method.sample_outputs(variables, x, key)),
        batch["image"], num_draws=method.num_draws, has_aux=True, **settings)
    out = {"logits": logits, "features": features}
  else:
    out = method.sample_outputs(variables, batch["image"], key)
  result = {"logits": jnp.swapaxes(out["logits"], 0, 1),
            "features": jnp.swapaxes(out["features"], 0, 1),
            "mask": batch["mask"], "label": batch["label"]}
  if odin is not None:
    if combine == "mean":  # every draw sees the same input: draw it once from the first copy
      draws = jnp.concatenate([ood_scores.odin_draws(
          lambda x, n=n: method.sample_outputs(variables, x[0], key)["logits"][:n],
          batch["image"], num_draws=n, **settings) for n in sizes])
    result["odin"] = jnp.swapaxes(draws, 0, 1)
  return result


def vmapped_draws(method):
  """``method`` evaluating its draws in one vmap where it would loop over them one by one
  (``chunk_size`` unset on CPU, ``passes.default_chunk_size``): ODIN's input gradient through
  ``lax.map``'s loop costs 8-10x a forward pass on XLA:CPU, through the vmap 1.8x
  (``experiments/README.md``, ``bench_ood.py``)."""
  if method.chunk_size is None and default_chunk_size() == 1:
    return dataclasses.replace(method, chunk_size=method.num_draws)
  return method


def _logits_and_features(outputs: dict) -> tuple:
  return outputs["logits"], outputs["features"]


def _nested_means(per_draw, sizes):
  """``[B, N]`` per-draw scores → ``[B, S]``: the mean of the first n draws for each n."""
  running = np.cumsum(np.asarray(per_draw, np.float64), axis=1)
  return np.stack([running[:, n - 1] / n for n in sizes], axis=1)


def score_table(out: dict, sizes, chosen, fitted: dict, knn_k: int, combine: str) -> dict:
  """``{score: [B, S]}`` for each score of ``chosen`` at each nested size, and ``correct
  [B, S]``, from :func:`outputs_step`'s gathered ``out`` and the fitted statistics ``fitted``
  (``{score: [per draw]}``).  The predictive's scores take the first n draws' logits; the others
  are per-draw scores averaged, or for max-logit, energy and ODIN with ``combine="mean"``, the
  score of the first n draws' mean."""
  logits = np.swapaxes(out["logits"], 0, 1)                        # [N, B, C]
  table = {}
  for score in chosen:
    if score in OF_THE_PREDICTIVE:
      fn = getattr(ood_scores, score)
      table[score] = np.stack([np.asarray(fn(logits[:n])) for n in sizes], axis=1)
      continue
    if combine == "mean" and score in ("max_logit", "energy", "odin"):
      table[score] = (np.asarray(out["odin"]) if score == "odin" else np.stack(
          [np.asarray(getattr(ood_scores, score)(logits[:n], combine="mean")) for n in sizes], 1))
      continue
    if score in ("max_logit", "energy"):
      fn = getattr(ood_scores, score)
      per_draw = np.asarray(jax.vmap(lambda f, fn=fn: fn(f[None]))(logits)).T  # [B, N]
    elif score == "odin":
      per_draw = out["odin"]
    else:
      per_draw = np.asarray(per_draw_fitted_scores(
          score, out["features"], jax.tree.map(lambda *a: np.stack(a), *fitted[score]),
          knn_k if score == "knn" else None)).T
    table[score] = _nested_means(per_draw, sizes)
  probs = np.asarray(jax.nn.softmax(logits), np.float64)
  table["correct"] = np.stack([np.argmax(probs[:n].mean(0), -1) == out["label"] for n in sizes],
                              axis=1)
  return table


@functools.partial(jax.jit, static_argnames=("score", "knn_k"))
def per_draw_fitted_scores(score: str, features, stats, knn_k: int | None = None):
  """``[N, B]``: the fitted ``score`` of each draw's ``features [B, N, D]`` under that draw's
  statistics (``stats``: the draws' stacked on a leading axis), one compiled call for all draws
  (draw by draw in eager calls, ``score_table`` took 0.70 s against 0.39–0.45 s now, CPU, 3,000
  images at N = 10; on an H200 the evaluator was host-bound before this change)."""
  options = {"k": knn_k} if knn_k is not None else {}
  return jax.vmap(lambda f, s: getattr(ood_scores, score)(f, s, **options), (1, 0))(features,
                                                                                     stats)


def fit_scores(run, pred, output_dir, seed: int) -> dict:
  """``{score: [statistics of draw d]}`` of MDS, RMDS, KNN and ViM, fitted on each draw's
  features of the training split (one pass), read from ``<output_dir>/ood_fitted.npz`` when it
  was fitted for the same checkpoint, method and settings, written there otherwise."""
  key = json.dumps({"checkpoint": pred.scored["checkpoint"], "method": pred.method.describe(),
                    "draws": pred.method.num_draws, "vim_dim": ood_scores.VIM_DIM,
                    "seed": seed})
  path = workdir_lib.workdir_path(output_dir) / "ood_fitted.npz"
  if path.exists():
    with path.open("rb") as f, np.load(f) as cached:
      if str(cached["key"]) == key:
        return _unflatten(dict(cached))
  step = sharded_eval_step(outputs_step, run.mesh, pred.method, None)  # no ODIN pass
  out = gather(step, pred.variables, run.mesh, run.train_eval_batches(), seed,
               "ood: the training split's features (mds, rmds, knn, vim)")
  num_classes = out["logits"].shape[-1]
  fitted = {name: [] for name in FITTED}
  for d in range(out["features"].shape[1]):
    features, logits = out["features"][:, d], out["logits"][:, d]
    fitted["mds"].append(ood_scores.fit_mds(features, out["label"], num_classes))
    fitted["rmds"].append(ood_scores.fit_rmds(features, out["label"], num_classes))
    fitted["knn"].append(ood_scores.fit_knn(features))
    fitted["vim"].append(ood_scores.fit_vim(features, *ood_scores.affine_head(features, logits),
                                            ood_scores.vim_dim(features.shape[1])))
  if jax.process_index() == 0:
    buffer = io.BytesIO()
    np.savez(buffer, key=key, **_flatten(fitted))
    workdir_lib.write_atomically(path, buffer.getvalue())
  return fitted


def _flatten(fitted: dict) -> dict:
  return {f"{score}/{d}/{name}": value for score, draws in fitted.items()
          for d, stats in enumerate(draws) for name, value in stats.items()}


def _unflatten(arrays: dict) -> dict:
  fitted = {}
  for flat, value in arrays.items():
    if flat == "key":
      continue
    score, d, name = flat.split("/")
    draws = fitted.setdefault(score, [])
    while len(draws) <= int(d):
      draws.append({})
    draws[int(d)][name] = value
  return fitted


def _short(name: str) -> str:
  """A dataset name for a table column: ``npz:`` folders by their last part, ``.npz`` files by
  their folder and name."""
  if name.endswith(".npz"):
    path = name[4:] if name.startswith("npz:") else name
    return "/".join(path.split("/")[-2:])
  return f"npz:{os.path.basename(name[4:].rstrip('/'))}" if name.startswith("npz:") else name


def summary(rows: list, output_dir) -> str:
  """The rows as an aligned text table: every column as wide as its widest cell (set names whole,
  however long)."""
  header = ("OOD set", "N", "score", "AUROC (%)", "AUPR-In", "AUPR-Out", "FPR@95 (%) in+",
            "OOD+", "ID acc (%)")
  cells = [(_short(r["ood_dataset"]), f"{r['ensemble_size']}", r["score"],
            f"{100 * r['auroc']:.2f}", f"{r['aupr_in']:.4f}", f"{r['aupr_out']:.4f}",
            f"{100 * r['fpr95_id_positive']:.2f}", f"{100 * r['fpr95_ood_positive']:.2f}",
            f"{100 * r['id_accuracy']:.2f}") for r in rows]
  widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
  lines = [" | ".join(text.ljust(w) if i < 3 else text.rjust(w)
                      for i, (text, w) in enumerate(zip(row, widths, strict=True)))
           for row in [header, *cells]]
  lines.append("FPR@95 in+: OOD accepted at 95% of in-distribution accepted (Hendrycks & Gimpel); "
               "OOD+: in-distribution flagged at 95% of OOD flagged (OpenOOD).  '<group> mean': "
               "the mean of the group's sets.")
  lines.append(f"Results: {output_dir}/ood.{{json,csv}}, {output_dir}/ood_*.png")
  return "\n".join(lines)
