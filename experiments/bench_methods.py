"""Benchmark (issue 46, item 5): what every method costs against one network, in one run.

Each method at M = ``--members`` (4): MC dropout and BNN-VI with N = M samples, the deep ensemble
of M members trained as one job, BatchEnsemble, MIMO and Packed-Ensembles with M members, iBNN
with K = M components (one draw of each, N = K).  Every method is built and driven through its
:class:`~smoothing_jax.methods.base.Method` (``methods.resolve``), as a run is: its train state
(``Method.init_train_state``), its objective (``Method.loss``), the run's compiled step
(``steps.compile_steps``) and its predictive at N = M (``Method.predict``, jitted whole).

The networks are CIFAR ResNet-18s of stem width ``--width`` (``resnet_dnn_18``,
``resnet_mcdo_18``, ``resnet_batchensemble_18``, ``resnet_mimo_18``, ``resnet_packed_18`` and
``resnet_dnn_18`` with ``mean_field``: BNN-VI); ResNet has no iBNN variant, so the iBNN is
``wideresnet_ibnn_28_10`` at widen factor 1 and the same stem width (WRN-28-1 at 16), measured
against its own single network (``wideresnet_dnn_28_10``, same depth and width).  Weights are
initialised, not trained (the cost does not depend on them); the images random, 32×32.  Every
method's optimiser is its ``configs/cifar_resnet.py`` recipe's.

For every row: parameters (the deep ensemble's M members together); the training step on
``--batch`` new images (what ``config.input.batch_size`` counts: BatchEnsemble repeats each for
its M members, MIMO for its ``batch_repetitions`` 4, iBNN for its S = 2 draws; the deep
ensemble's members share the batch, ``deep_ensemble.shared_batches``) and the predictive on
``--batch`` test images, each compiled first (``compile_seconds``, XLA's FLOPs and its memory
analysis of the executable: temp, argument, output and alias bytes), then ``--repeats`` rounds,
every row's step and predictive called once in turn in each (``timing.alternate``);
medians, images/s, and ``vs_baseline``: the ratios against the single network of the row's
architecture in the same run (images/s > 1: faster).  ``process_peak_bytes`` is the device's
peak bytes in use after the row's first calls, a running peak over the rows built so far (null
where the backend does not report it, as the CPU).

One JSON object on stdout and in ``--out``.

  python experiments/bench_methods.py                    # CPU: width 16, batch 128, M = 4
  python experiments/bench_methods.py --smoke --out ""   # seconds: tiny sizes
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# This checkout's smoothing_jax, not an installed copy (before bench_train imports it).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import program_flops, recipe_config  # noqa: E402
from timing import alternate  # noqa: E402

from smoothing_jax.methods import resolve  # noqa: E402
from smoothing_jax.models import get_model  # noqa: E402
from smoothing_jax.parallel import create_mesh, shard_batch, shardings  # noqa: E402
from smoothing_jax.training.optim import create_learning_rate_schedule  # noqa: E402
from smoothing_jax.training.steps import (  # noqa: E402
    compile_steps,
    state_initializer,
    variables_of,
)

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                           "bench_methods_cpu.json")
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 10


def log(message: str):
  print(f"[bench_methods] {message}", file=sys.stderr, flush=True)


def rows_of(members: int, width: int, wrn_depth: int) -> dict:
  """``{row: (model, get_model overrides, samples S of the predictive or None, baseline row)}``,
  the baselines first.  S: ``Method.with_samples`` (N = S, an iBNN's N = K·S)."""
  resnet, wrn = {"width": width}, {"width": width, "widen_factor": 1, "depth": wrn_depth}
  return {
      "single": ("resnet_dnn_18", resnet, None, "single"),
      "mc_dropout": ("resnet_mcdo_18", resnet, members, "single"),
      "deep_ensemble": ("resnet_dnn_18", resnet, None, "single"),
      "batch_ensemble": ("resnet_batchensemble_18", {**resnet, "ensemble_size": members}, None,
                         "single"),
      "mimo": ("resnet_mimo_18", {**resnet, "mimo_members": members}, None, "single"),
      "packed": ("resnet_packed_18", {**resnet, "num_estimators": members}, None, "single"),
      "bnnvi": ("resnet_dnn_18", {**resnet, "mean_field": True}, members, "single"),
      "single_wrn": ("wideresnet_dnn_28_10", wrn, None, "single_wrn"),
      "ibnn": ("wideresnet_ibnn_28_10", {**wrn, "num_components": members}, 1, "single_wrn"),
  }


def compiled_memory(compiled) -> dict:
  """XLA's memory analysis of a compiled executable: ``{temp, argument, output, alias}_bytes``
  (empty where the backend gives none)."""
  memory = compiled.memory_analysis()
  return {f"{name}_bytes": int(getattr(memory, f"{name}_size_in_bytes"))
          for name in ("temp", "argument", "output", "alias")} if memory else {}


def compile_timed(fn, *args) -> tuple:
  """``(compiled executable, seconds its compilation took, FLOPs)`` of ``jit``-ed ``fn`` on
  ``args``."""
  start = time.perf_counter()
  lowered = fn.lower(*args)
  compiled = lowered.compile()
  return compiled, time.perf_counter() - start, program_flops(lowered)


class Row:
  """One method's train state, compiled step and compiled predictive on fixed batches."""

  def __init__(self, name: str, spec: tuple, members: int, batch_size: int, mesh):
    model_name, overrides, samples, self.baseline = spec
    config = recipe_config("cifar_resnet", f"{model_name},cifar10")
    config.input.batch_size = batch_size
    if name == "deep_ensemble":
      config.deep_ensemble.members = members
      config.deep_ensemble.shared_batches = True
    method = resolve(config, get_model(model_name, NUM_CLASSES, **overrides))
    predictive = method if samples is None else method.with_samples(samples)
    replicated, data = shardings(mesh)
    schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
    init_one = state_initializer(config, method, IMAGE_SHAPE, schedule)
    self.state = jax.device_put(method.init_train_state(config, init_one, mesh.devices.flat),
                                replicated)
    self.variables = jax.tree.map(jnp.copy, variables_of(self.state))  # the step donates state
    loss_fn = method.loss(config, num_train=50_000, steps_per_epoch=100)
    step, _ = compile_steps(method, schedule, mesh, config.ece_bins, loss_fn)
    self.rngs = method.train_keys(config)
    images = np.asarray(jax.random.normal(jax.random.key(1), (batch_size,) + IMAGE_SHAPE))
    self.batch = shard_batch({"image": images, "label": np.arange(batch_size) % NUM_CLASSES},
                             data)
    self.key = jax.random.key(2)
    predict = jax.jit(lambda v, x, r: predictive.predict(v, x, rng=r))
    self.step, step_seconds, step_flops = compile_timed(step, self.state, self.batch, self.rngs)
    self.predict, predict_seconds, predict_flops = compile_timed(
        predict, self.variables, self.batch["image"], self.key)
    self.info = {
        "model": model_name, "overrides": overrides, "method": method.describe(),
        "baseline": self.baseline, "draws": predictive.num_draws,
        "parameters": int(sum(x.size for x in jax.tree.leaves(self.state.params))),
        "train": {"compile_seconds": step_seconds, "flops": step_flops,
                  "compiled_memory": compiled_memory(self.step)},
        "predict": {"compile_seconds": predict_seconds, "flops": predict_flops,
                    "compiled_memory": compiled_memory(self.predict)}}

  def train(self):
    self.state, metrics = self.step(self.state, self.batch, self.rngs)
    return self.state, metrics

  def predictive(self):
    return self.predict(self.variables, self.batch["image"], self.key)


def peak_bytes():
  """The device's peak bytes in use so far (None where the backend does not say: the CPU)."""
  device = jax.devices()[0]
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return (stats or {}).get("peak_bytes_in_use")


def measure(members: int = 4, width: int = 16, batch_size: int = 128, repeats: int = 5,
            wrn_depth: int = 28) -> dict:
  """The benchmark's JSON object (module docstring)."""
  load_before = os.getloadavg()
  mesh = create_mesh()
  rows = {}
  for name, spec in rows_of(members, width, wrn_depth).items():
    rows[name] = Row(name, spec, members, batch_size, mesh)
    jax.block_until_ready((rows[name].train(), rows[name].predictive()))
    rows[name].info["process_peak_bytes"] = peak_bytes()
    log(f"{name}: {rows[name].info['method']}, {rows[name].info['parameters']} parameters, "
        f"compiled in {rows[name].info['train']['compile_seconds']:.1f} s (step) and "
        f"{rows[name].info['predict']['compile_seconds']:.1f} s (predictive)")
  calls = {(name, part): getattr(row, "train" if part == "train" else "predictive")
           for name, row in rows.items() for part in ("train", "predict")}
  times = alternate(calls, repeats)
  for (name, part), seconds in times.items():
    median = statistics.median(seconds)
    rows[name].info[part].update(seconds=seconds, median_seconds=median,
                                 images_per_s=batch_size / median)
  table = {name: row.info for name, row in rows.items()}
  for row in table.values():
    base = table[row["baseline"]]
    row["vs_baseline"] = {
        "parameters": row["parameters"] / base["parameters"],
        **{f"{part}_images_per_s": row[part]["images_per_s"] / base[part]["images_per_s"]
           for part in ("train", "predict")},
        **{f"{part}_flops": row[part]["flops"] / base[part]["flops"]
           for part in ("train", "predict") if row[part]["flops"] and base[part]["flops"]}}
    log(f"{row['method']}: train {row['train']['images_per_s']:.0f} images/s "
        f"(× {row['vs_baseline']['train_images_per_s']:.2f}), predict "
        f"{row['predict']['images_per_s']:.0f} images/s "
        f"(× {row['vs_baseline']['predict_images_per_s']:.2f})")
  device = jax.devices()[0]
  result = {"benchmark": "methods", "members": members, "width": width, "wrn_depth": wrn_depth,
            "batch_size": batch_size, "repeats": repeats, "weights": "initialised",
            "device": str(device), "device_kind": device.device_kind,
            "backend": jax.default_backend(), "num_devices": jax.device_count(),
            "jax": jax.__version__, "load_average_1_5_15": {"before": load_before,
                                                            "after": os.getloadavg()},
            "rows": table}
  return result


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--members", type=int, default=4, help="M (N, K) of every method")
  parser.add_argument("--width", type=int, default=16, help="stem width of every network")
  parser.add_argument("--batch", type=int, default=128, help="training and test images a call")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
  parser.add_argument("--wrn_depth", type=int, default=28, help="the iBNN's WRN depth (6n + 4)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes (width 4, batch 8, WRN-10, one round): seconds")
  parser.add_argument("--out", default=DEFAULT_OUT, help="JSON file ('': stdout only)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.width, args.batch, args.repeats, args.wrn_depth = 4, 8, 1, 10
  result = {"command": " ".join(["python", *sys.argv]),
            **measure(args.members, args.width, args.batch, args.repeats, args.wrn_depth)}
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
