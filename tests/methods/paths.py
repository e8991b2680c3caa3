"""What each method's tests check on its one trained tiny workdir: ``Run.predict``, the
``ensemble_sizes`` evaluator and the training's periodic evaluation score one predictive (the
same draws, batches and key), and the method's predictive against an explicit loop."""
from __future__ import annotations

import contextlib

import jax
import numpy as np

from smoothing_jax.evaluators import ensemble_sizes
from smoothing_jax.experiment.run import Run
from smoothing_jax.parallel import evaluate_batches, shardings
from smoothing_jax.training.steps import training_eval_step


def nll_and_accuracy(probs, labels):
  """Mean −log p(y) and accuracy of ``probs [B, C]`` (numpy)."""
  probs = np.asarray(probs, np.float64)
  return (float(-np.mean(np.log(probs[np.arange(len(labels)), labels]))),
          float(np.mean(probs.argmax(-1) == labels)))


def three_paths(workdir, output_dir, num_samples: int = 1, overrides=None,
                data=contextlib.nullcontext) -> dict:
  """``{path: (NLL, accuracy)}`` on the evaluation split of ``workdir`` for ``Run.predict`` with
  ``num_samples`` draws, ``ensemble_sizes`` at the N that makes (``Method.with_samples``) and, at
  ``num_samples`` 1, the training's evaluation (``training.steps.training_eval_step``), each with
  key ``key(0)``; ``data``: the context the dataset loads in (e.g. TFDS mock data)."""
  key = jax.random.key(0)
  with data():
    run = Run.from_workdir(workdir, overrides)
    batches = list(run.eval_batches())
    labels, mask = (np.concatenate([b[k] for b in batches]) for k in ("label", "mask"))
    keep = mask > 0
    # The evaluation split's pixels (Run.predict normalises them) in the batches' order, padded
    # as the batches are: the same shapes draw the same dropout masks.
    pixels = run.pipeline.eval_images
    assert keep[:len(pixels)].all() and not keep[len(pixels):].any()
    images = np.concatenate([pixels, np.zeros((len(mask) - len(pixels),) + pixels.shape[1:],
                                              pixels.dtype)])
    probs = run.predict(images, num_samples=num_samples, rng=key,
                        batch_size=len(batches[0]["image"]))
    out = {"predict": nll_and_accuracy(probs[keep], labels[keep])}
    n = run.method.with_samples(num_samples).num_draws
    rows = ensemble_sizes.evaluate(run, output_dir, sizes=(n,), seed=0)
    (row,) = [r for r in rows if r["ensemble_size"] == n]  # (an ensemble reports 1..M)
    assert row["method"] == run.method.name
    out["ensemble_sizes"] = (row["nll"], row["acc"])
    if num_samples == 1:
      step = training_eval_step(run.method, run.mesh, run.config.ece_bins)
      metrics = evaluate_batches(step, run.variables, batches, shardings(run.mesh)[1], key)
      whole = metrics[""].compute()
      out["training"] = (whole["nll"], whole["acc"])
  return out


def assert_paths_agree(paths: dict, tolerance: float = 1e-6) -> None:
  """Every path's NLL and accuracy within ``tolerance`` of ``Run.predict``'s."""
  reference = paths["predict"]
  for name, values in paths.items():
    np.testing.assert_allclose(values, reference, rtol=0, atol=tolerance, err_msg=name)


def assert_every_evaluator_reports(results: dict, method: str) -> None:
  """``results`` of :func:`tests.helpers.train_resume_and_evaluate` for a 2-member ``method``:
  every evaluator at N = 1 and 2, finite corruption errors, VQ-BNN rows and the method's name."""
  assert [r["ensemble_size"] for r in results["ensemble_sizes"]] == [1, 2]
  for name in ("calibration", "selective", "ood"):
    assert {r["ensemble_size"] for r in results[name]} == {1, 2}, name
  assert np.isfinite(results["corruptions"]["mean_err"])
  assert {r["method"] for r in results["temporal"]} >= {"single", "temporal"}
  assert {r["method"] for r in results["ensemble_sizes"]} == {method}
