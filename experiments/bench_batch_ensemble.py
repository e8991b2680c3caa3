"""BatchEnsemble against the deep ensemble trained as one job, at the same M, width and batch, in
the same run: the train step and the predictive at N = M.

* ``train``: the compiled train step of each method (``steps.compile_steps``, the loop's own),
  on one host-made batch of ``--batch_size`` new images: the deep ensemble's M members
  (``resnet_dnn_18``, ``deep_ensemble.members`` M, every member on that batch) against the
  BatchEnsemble's one pass over the batch repeated M times (``resnet_batchensemble_18``,
  ``ensemble_size`` M).  The CIFAR recipe with one schedule for both (SGD, momentum 0.9 without
  Nesterov, weight decay 5e-4), as ``baselines_cpu_scale.py --part batchensemble``; the
  BatchEnsemble keeps its fast-weight rules.
* ``predict``: each method's ``sample_log_probs`` on ``--eval_batch_size`` images, all M members.

Each pair is timed alternately, one call of each per round, after a compiling call: other work on
the machine then slows both alike.  The ratios are BatchEnsemble / deep ensemble seconds (< 1: the
BatchEnsemble is faster), the median of the per-round ratios; the goal is ≤ 1.1 (issue 46, as
uncertainty-baselines' WRN-28-10 on TPUs).  One JSON object on stdout.

  python experiments/bench_batch_ensemble.py --width 16 --members 4   # CPU (minutes)
  python experiments/bench_batch_ensemble.py                          # GPU: full width

The JSON's ``smoothing_jax`` is the package the run imported: a script under ``experiments/``
imports the installed one, which for an editable install shared by several checkouts (git
worktrees on one venv) is another checkout's code; run those with ``PYTHONPATH=.``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import numpy as np
from bench_train import recipe_config
from timing import alternate, round_ratios

import smoothing_jax
from smoothing_jax.methods import resolve
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shard_batch, shardings
from smoothing_jax.training.optim import create_learning_rate_schedule
from smoothing_jax.training.steps import compile_steps, state_initializer

GOAL = 1.1  # BatchEnsemble seconds / deep ensemble seconds, train step and predictive


def log(message: str):
  print(f"[bench_batch_ensemble] {message}", file=sys.stderr, flush=True)


def method_of(name: str, members: int, width):
  """``(config, method)`` of the deep ensemble (``resnet_dnn_18``, M members) or the
  BatchEnsemble (``resnet_batchensemble_18``, M = ``ensemble_size``) on one schedule."""
  config = recipe_config("cifar_resnet", f"{name},cifar10")
  config.nesterov, config.weight_decay = False, 5e-4
  kwargs = {"width": width} if width else {}
  if name == "resnet_batchensemble_18":
    kwargs["ensemble_size"] = members
  else:
    config.deep_ensemble.members = members
  if width:
    config.model_kwargs.width = width
  return config, resolve(config, get_model(name, 10, **kwargs))


def train_call(config, method, batch, mesh):
  """``call()``: one compiled train step of ``method`` on ``batch``, the state carried over;
  and the seconds its compilation took."""
  replicated, _ = shardings(mesh)
  schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
  init_one = state_initializer(config, method, batch["image"].shape[1:], schedule)
  state = jax.device_put(method.init_train_state(config, init_one), replicated)
  loss_fn = method.loss(config, num_train=50000, steps_per_epoch=100)
  step_fn, _ = compile_steps(method, schedule, mesh, config.ece_bins, loss_fn)
  rng = method.train_keys(config)
  start = time.perf_counter()
  compiled = step_fn.lower(state, batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  holder = [state]

  def call():
    holder[0], metrics = compiled(holder[0], batch, rng)
    return metrics
  return call, compile_seconds


def predict_call(config, method, images):
  """``call()``: the predictive's M members' log-probabilities on ``images``."""
  schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
  state = method.init_train_state(config, state_initializer(config, method, images.shape[1:],
                                                            schedule))
  variables = {"params": state.params, "batch_stats": state.batch_stats}
  return lambda: method.sample_log_probs(variables, images, None)


def summary(times: dict, batch_size: int, members: int) -> dict:
  """Median seconds and images/s of each, and the median per-round BatchEnsemble / deep
  ensemble ratio."""
  out = {name: {"seconds": statistics.median(t),
                "images_per_s": batch_size / statistics.median(t)} for name, t in times.items()}
  ratios = round_ratios(times["batch_ensemble"], times["deep_ensemble"])
  return {**out, "members": members, "batch_size": batch_size,
          "batch_ensemble_vs_deep_ensemble": statistics.median(ratios),
          "ratios_per_round": [round(r, 3) for r in ratios]}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--width", type=int, default=None, help="ResNet width (default: 64)")
  parser.add_argument("--members", type=int, default=4)
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--eval_batch_size", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip_train", action="store_true")
  parser.add_argument("--skip_predict", action="store_true")
  args = parser.parse_args(argv)
  mesh = create_mesh()
  _, data = shardings(mesh)
  methods = {"deep_ensemble": method_of("resnet_dnn_18", args.members, args.width),
             "batch_ensemble": method_of("resnet_batchensemble_18", args.members, args.width)}
  device = jax.devices()[0]
  result = {"benchmark": "batch_ensemble", "device_kind": device.device_kind,
            "backend": jax.default_backend(), "num_devices": jax.device_count(),
            "jax": jax.__version__, "width": args.width, "members": args.members,
            # the code timed: an editable install shared by several checkouts imports its own
            "smoothing_jax": os.path.dirname(smoothing_jax.__file__)}

  if not args.skip_train:
    images = np.asarray(jax.random.normal(jax.random.key(1), (args.batch_size, 32, 32, 3)))
    batch = shard_batch({"image": images, "label": np.arange(args.batch_size) % 10}, data)
    calls, compile_seconds = {}, {}
    for name, (config, method) in methods.items():
      calls[name], compile_seconds[name] = train_call(config, method, batch, mesh)
      log(f"{name}: {method.describe()}, train step compiled in {compile_seconds[name]:.1f} s")
    result["train"] = {**summary(alternate(calls, args.repeats), args.batch_size, args.members),
                       "compile_seconds": compile_seconds}
    calls.clear()  # frees the train states
    log(json.dumps(result["train"]))

  if not args.skip_predict:
    eval_images = jax.random.normal(jax.random.key(2), (args.eval_batch_size, 32, 32, 3))
    calls = {name: predict_call(config, method, eval_images)
             for name, (config, method) in methods.items()}
    result["predict"] = summary(alternate(calls, args.repeats), args.eval_batch_size,
                                args.members)
    log(json.dumps(result["predict"]))
  result["goals"] = {f"{part}_le_{GOAL}": result[part]["batch_ensemble_vs_deep_ensemble"] <= GOAL
                     for part in ("train", "predict") if part in result}
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
