"""Benchmark (issue 46, item 5): what every method costs against one network, in one run.

Each method at M = ``--members`` (4): MC dropout and BNN-VI with N = M samples, the deep ensemble
of M members trained as one job, BatchEnsemble, MIMO and Packed-Ensembles with M members, iBNN
with K = M components (one draw of each, N = K), and SNGP (``resnet_sngp_18``: spectral
normalisation, the GP output layer, the mean-field predictive; its goals, issue 59: a step
≤ 1.15× and the predictive ≤ 1.2× one network's, in ``rows.sngp.goals``).  Every method is
built and driven through its :class:`~smoothing_jax.methods.base.Method` (``methods.resolve``),
as a run is: its train state (``Method.init_train_state``), its objective (``Method.loss``), the
run's compiled step (``steps.compile_steps``) and its predictive at N = M (``Method.predict``,
jitted whole).

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

The ``costs`` section (issue 56, item 7): three figures of the methods that act beside training,
each a ratio against a baseline timed in the same run, alternated with it, at stem width
``--width`` and batch ``--batch`` (``resnet_dnn_18``), each with its goal and whether it is met:

* ``swag_collection_epoch_overhead`` (goal ≤ 0.03): SWAG's moments collected in the compiled
  train step (``SWAG.after_step``'s ``lax.cond``) against the deterministic method's step, over
  one epoch of ``--epoch_steps`` steps (default: CIFAR-10's 50,000 / ``--batch``) in which exactly
  one step, the epoch's last, collects (the step counter set inside the collection phase; the
  moments' count checked to rise by one).  The two methods' steps alternate step by step; the
  figure is (S − 1 + c)·median(SWAG's non-collecting step) / (S·median(deterministic step)) − 1,
  c the collecting step's time over a non-collecting one's, both timed alone in
  ``--step_rounds`` alternated rounds (counter reset before each); the epoch's summed times
  beside it.
* ``laplace_kron_fit_vs_forward`` (goal ≤ 1.5): ``LastLayerLaplace.fit`` (KFAC, marglik prior)
  over ``--laplace_batches`` batches against a jitted forward pass (``inference.pass_outputs``)
  over the same batches.
* ``swag_predictive_vs_n_passes`` (goal ≤ 1.2): SWAG's ``sample_log_probs`` at N = ``--samples``
  (jitted, on a test batch) against N calls of one network's jitted pass; and
  ``swag_bn_update_vs_n_k_passes`` (the same bound): ``SWAG.prediction_variables`` (N weight
  samples, each one's BatchNorm statistics recomputed over K = ``--bn_batches`` training
  batches) against N·K jitted training-mode passes of one network, in ``--prep_rounds`` rounds.

The headline ratios are the medians of alternated rounds after a first call of each side; those
first calls (each compiling what it needs, as a fresh process does) are timed apart
(``first_call``), and the seconds every call of the fit and the preparation spends compiling
are logged (JAX's monitoring events), with the ratio without them and projected onto the whole
CIFAR-10 split (``projected_cifar10_split``: what a call compiles does not grow with the split).

The SWAG moments are those the timed steps collected; weights initialised, images random.

One JSON object on stdout and in ``--out``.

  python experiments/bench_methods.py                    # CPU: width 16, batch 128, M = 4
  python experiments/bench_methods.py --sections costs   # the three cost figures only
  python experiments/bench_methods.py --smoke --out ""   # tiny sizes
  python experiments/bench_methods.py --sections rows --rows sngp --out \
      experiments/results/bench_methods_sngp_cpu.json    # SNGP against one network
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

# This checkout's smoothing_jax, not an installed copy (before bench_train imports it).
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_train import program_flops, recipe_config  # noqa: E402
from timing import alternate, round_ratios  # noqa: E402

from smoothing_jax.experiment.config_base import with_method  # noqa: E402
from smoothing_jax.methods import resolve  # noqa: E402
from smoothing_jax.methods.base import PredictionData  # noqa: E402
from smoothing_jax.models import get_model  # noqa: E402
from smoothing_jax.parallel import create_mesh, shard_batch, shardings  # noqa: E402
from smoothing_jax.passes import ensemble_log_probs, log_probs, pass_outputs  # noqa: E402
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
      "sngp": ("resnet_sngp_18", resnet, None, "single"),
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
    if not (predictive.needs_training_data or predictive.fit_name):  # what a run predicts with
      self.variables = predictive.prediction_variables(self.variables, None)
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
            wrn_depth: int = 28, only: tuple = ()) -> dict:
  """The benchmark's JSON object (module docstring); ``only``: these rows and their baselines."""
  load_before = os.getloadavg()
  mesh = create_mesh()
  rows = {}
  specs = rows_of(members, width, wrn_depth)
  wanted = set(only) | {specs[name][3] for name in only}
  for name, spec in specs.items():
    if only and name not in wanted:
      continue
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
  if "sngp" in table:  # issue 59's goals: a step ≤ 1.15×, the predictive ≤ 1.2× one network's
    ratios = table["sngp"]["vs_baseline"]
    table["sngp"]["goals"] = {
        "train_step_vs_single": goal(1 / ratios["train_images_per_s"], 1.15, "issue 59"),
        "predictive_vs_one_pass": goal(1 / ratios["predict_images_per_s"], 1.2, "issue 59")}
  result = {"benchmark": "methods", "members": members, "width": width, "wrn_depth": wrn_depth,
            "batch_size": batch_size, "repeats": repeats, "weights": "initialised",
            **environment(), "load_average_1_5_15": {"before": load_before,
                                                     "after": os.getloadavg()},
            "rows": table}
  return result


def environment() -> dict:
  """The device, backend and versions a result was measured on."""
  device = jax.devices()[0]
  return {"device": str(device), "device_kind": device.device_kind,
          "backend": jax.default_backend(), "num_devices": jax.device_count(),
          "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", "")}


# --- The costs section (module docstring): SWAG's collection, the Laplace fit, SWAG's predictive.

CIFAR10_TRAIN = 50_000  # the training split whose epoch --epoch_steps defaults to
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


class CompileSeconds:
  """The seconds JAX spends tracing, lowering and compiling (its monitoring events), per jitted
  function: ``timed(fn, log)`` appends each call's ``{function: seconds}`` to ``log``.  A jitted
  function traced inside another counts its tracing in both (tenths of a second here)."""
  _instance = None

  def __new__(cls):
    if cls._instance is None:
      cls._instance = super().__new__(cls)
      cls._instance.seconds = {}
      jax.monitoring.register_event_duration_secs_listener(cls._instance._listen)
    return cls._instance

  def _listen(self, event, duration, fun_name="?", **kwargs):
    if event in COMPILE_EVENTS:
      name = str(fun_name).removeprefix("jit(").removesuffix(")")
      self.seconds[name] = self.seconds.get(name, 0.0) + duration

  def timed(self, fn, log: list, outputs: list | None = None):
    """``fn`` that appends the compile seconds of each of its calls to ``log`` (and its output
    to ``outputs``)."""
    def call():
      before = dict(self.seconds)
      out = jax.block_until_ready(fn())
      log.append({name: seconds - before.get(name, 0.0) for name, seconds in self.seconds.items()
                  if seconds - before.get(name, 0.0) > 0})
      if outputs is not None:
        outputs[:] = [out]
      return out
    return call


def first_call(first: dict, compiles: dict, name: str, baseline: str) -> dict:
  """The first calls of ``name`` and its ``baseline`` (each compiling what it needs, as in a
  fresh process): seconds, seconds compiling, and the ratio."""
  return {"seconds": first, "compile_seconds": {n: sum(compiles[n][0].values())
                                                for n in (name, baseline)},
          "compiles": largest(compiles[name][0]), "ratio": first[name] / first[baseline]}


def compile_totals(log: list) -> list:
  """The seconds each call of a :meth:`CompileSeconds.timed` log spent compiling."""
  return [sum(call.values()) for call in log]


def largest(call: dict, count: int = 5) -> dict:
  """The ``count`` functions that took longest to compile in one call (seconds, rounded)."""
  return {name: round(seconds, 3) for name, seconds in
          sorted(call.items(), key=lambda item: -item[1])[:count]}


def medians(times: dict) -> dict:
  return {name: statistics.median(seconds) for name, seconds in times.items()}


def goal(value: float, bound: float, what: str) -> dict:
  """A figure: its value, its goal ``≤ bound`` and whether it is met."""
  return {"value": value, "goal": f"<= {bound:g} ({what})", "met": bool(value <= bound)}


class Training:
  """One method's compiled train step of ``resnet_dnn_18`` on a fixed batch, built as a run
  builds it (``Method.schedule``, ``state_initializer``, ``Method.loss``, ``compile_steps`` with
  the training split's ``steps_per_epoch`` and the run's ``num_steps``)."""

  def __init__(self, config, model, mesh, batch, steps_per_epoch: int, num_steps: int):
    self.method = resolve(config, model)
    self.replicated = shardings(mesh)[0]
    schedule = self.method.schedule(
        config, create_learning_rate_schedule(config, steps_per_epoch), num_steps=num_steps,
        steps_per_epoch=steps_per_epoch)
    init_one = state_initializer(config, self.method, IMAGE_SHAPE, schedule)
    self.state = jax.device_put(self.method.init_train_state(config, init_one,
                                                             mesh.devices.flat), self.replicated)
    loss_fn = self.method.loss(config, num_train=steps_per_epoch * config.input.batch_size,
                               steps_per_epoch=steps_per_epoch)
    # A streamed pipeline's stand-in: what compile_steps and after_step's clock read of it.
    pipeline = types.SimpleNamespace(steps_per_epoch=steps_per_epoch, resident=False)
    step, _ = compile_steps(self.method, schedule, mesh, config.ece_bins, loss_fn,
                            pipelines=[pipeline], num_steps=num_steps)
    self.rngs = self.method.train_keys(config)
    self.batch = batch
    self.step, self.compile_seconds, _ = compile_timed(step, self.state, batch, self.rngs)

  def set_counter(self, step: int):
    """The step counter ``step`` (the step after it is ``step + 1``)."""
    self.state = self.state.replace(
        step=jax.device_put(jnp.asarray(step, jnp.int32), self.replicated))

  def train(self):
    self.state, metrics = self.step(self.state, self.batch, self.rngs)
    return self.state, metrics

  def timed_step(self) -> float:
    start = time.perf_counter()
    jax.block_until_ready(self.train())
    return time.perf_counter() - start

  def collected(self) -> int:
    return int(self.state.method_state["swag"]["count"])


def swag_collection(config, model, mesh, batch, epoch_steps: int, step_rounds: int) -> tuple:
  """``(figure, swag, deterministic)``: SWAG's collection overhead on one epoch (module
  docstring) and the two trainings (SWAG's moments are what its timed steps collected)."""
  num_steps = (config.warmup_epochs + config.num_epochs) * epoch_steps  # train.py's run length
  swag = Training(with_method(config, "swag"), model, mesh, batch, epoch_steps, num_steps)
  det = Training(with_method(config, "deterministic"), model, mesh, batch, epoch_steps,
                 num_steps)
  num_epochs = num_steps // epoch_steps
  first = swag.method.start_epoch(num_epochs) + 1  # an epoch of the collection phase
  # Warm-up: each step once, SWAG's the collecting step (the end of epoch `first`).
  swag.set_counter((first + 1) * epoch_steps - 1)
  jax.block_until_ready((swag.train(), det.train()))
  log(f"costs: train steps compiled in {swag.compile_seconds:.1f} s (swag) and "
      f"{det.compile_seconds:.1f} s (deterministic); one epoch of {epoch_steps} steps each, "
      "alternated step by step")

  # One epoch: from the counter at the start of epoch `first + 1`, S steps, the last of which
  # ends the epoch and collects; the two methods' steps alternate, each one in turn first.
  swag.set_counter((first + 1) * epoch_steps)
  count_before = swag.collected()
  epoch = {"swag": [], "deterministic": []}
  for i in range(epoch_steps):
    pair = (("swag", swag), ("deterministic", det))
    for name, training in pair if i % 2 == 0 else pair[::-1]:
      epoch[name].append(training.timed_step())
  collections_in_epoch = swag.collected() - count_before
  if collections_in_epoch != 1 or int(swag.state.step) % epoch_steps:
    raise RuntimeError(f"The timed epoch collected {collections_in_epoch} times (expected 1).")

  # The collecting step alone against a non-collecting one and the deterministic step.
  collect_counter, plain_counter = (first + 2) * epoch_steps - 1, (first + 2) * epoch_steps
  count_before = swag.collected()
  calls = {"swag_collecting": lambda: (swag.set_counter(collect_counter), swag.train())[1],
           "swag_not_collecting": lambda: (swag.set_counter(plain_counter), swag.train())[1],
           "deterministic": det.train}
  steps = alternate(calls, step_rounds)
  collected_alone = swag.collected() - count_before
  if collected_alone != step_rounds + 1:  # each collecting call, the untimed first included
    raise RuntimeError(f"{collected_alone} collections in {step_rounds + 1} collecting steps.")
  step_medians = medians(steps)
  plain = statistics.median(epoch["swag"][:-1])
  det_median = statistics.median(epoch["deterministic"])
  # The collecting step at the epoch's pace: a non-collecting one times the ratio of the two
  # timed alone (the rounds alone ran under another load than the epoch).
  alone = step_medians["swag_collecting"] / step_medians["swag_not_collecting"]
  overhead = ((epoch_steps - 1) * plain + alone * plain) / (epoch_steps * det_median) - 1
  summed = sum(epoch["swag"]) / sum(epoch["deterministic"]) - 1
  figure = {
      **goal(overhead, 0.03, "SWAG's epoch with its one collection / the deterministic epoch "
             "- 1"),
      "steps_per_epoch": epoch_steps, "num_steps": num_steps, "method": swag.method.describe(),
      "collections_in_epoch": collections_in_epoch,
      "epoch_counter_start": (first + 1) * epoch_steps,
      "computed_as": "(S - 1 + c) * median(swag step in the epoch, the collecting one left "
                     "out) / (S * median(deterministic step in the epoch)) - 1, c = median("
                     "collecting step alone) / median(non-collecting step alone)",
      "epoch_median_seconds": {"swag_not_collecting": plain,
                               "swag_collecting_in_epoch": epoch["swag"][-1],
                               "deterministic": det_median},
      "epoch_summed_seconds": {name: sum(t) for name, t in epoch.items()},
      "epoch_summed_overhead": summed,
      "epoch_not_collecting_vs_deterministic": plain / det_median,
      "per_step_ratio_median": statistics.median(round_ratios(epoch["swag"],
                                                              epoch["deterministic"])),
      "step_alone": {"rounds": step_rounds, "seconds": steps, "median_seconds": step_medians,
                     "collecting_vs_not_collecting": alone,
                     "not_collecting_vs_deterministic": step_medians["swag_not_collecting"]
                     / step_medians["deterministic"],
                     "collection_seconds": step_medians["swag_collecting"]
                     - step_medians["swag_not_collecting"]},
      "compile_seconds": {"swag": swag.compile_seconds, "deterministic": det.compile_seconds}}
  return figure, swag, det


def projected(compile_seconds: float, steady_seconds: float, baseline_seconds: float,
              batches: list) -> dict:
  """The ratio projected onto CIFAR-10's training split: what a call compiles does not grow with
  the split, the rest and the baseline do (with the batches)."""
  full = CIFAR10_TRAIN // len(batches[0]["label"])
  scale = full / len(batches)
  return {"batches": full,
          "ratio": (compile_seconds + scale * steady_seconds) / (scale * baseline_seconds),
          "how": "(median compile seconds + batches x the rest per batch) / (batches x the "
                 "baseline per batch), per batch from this run's medians"}


def synthetic_batches(count: int, batch_size: int, seed: int) -> list:
  """``count`` padded-split-like batches (``image``, ``label``, ``mask`` all 1) on the host."""
  rng = np.random.default_rng(seed)
  return [{"image": rng.standard_normal((batch_size,) + IMAGE_SHAPE, np.float32),
           "label": rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32),
           "mask": np.ones(batch_size, np.float32)} for _ in range(count)]


def laplace_fit(config, model, variables, batches: list, repeats: int) -> dict:
  """``LastLayerLaplace.fit`` (KFAC) over ``batches`` against a jitted forward pass over them."""
  method = resolve(with_method(config, "laplace"), model)
  if method.structure != "kron":
    raise RuntimeError(f"The recipe's Laplace is {method.describe()}, not KFAC.")
  forward = jax.jit(lambda v, images: pass_outputs(model, v, images))
  # The seconds each fit spends compiling are logged per call (what it compiles again on a
  # later call: the prior fit's scan), and the ratio projected onto the whole split.
  compiles = {"fit": [], "forward": []}
  clock = CompileSeconds()
  calls = {"fit": clock.timed(lambda: method.fit(variables, lambda: iter(batches)),
                              compiles["fit"]),
           "forward": clock.timed(lambda: [forward(variables, b["image"]) for b in batches],
                                  compiles["forward"])}
  first = {}
  times = alternate(calls, repeats, first)
  m = medians(times)
  fit_compile = compile_totals(compiles["fit"][1:])  # the rounds' (the first call's apart)
  steady = [t - c for t, c in zip(times["fit"], fit_compile, strict=True)]
  ratio = m["fit"] / m["forward"]
  return {**goal(ratio, 1.5, "fit over the split / one jitted forward pass over it"),
          "method": method.describe(), "batches": len(batches),
          "batch_size": len(batches[0]["label"]), "rounds": repeats, "seconds": times,
          "median_seconds": m, "round_ratios": round_ratios(times["fit"], times["forward"]),
          "first_call": first_call(first, compiles, "fit", "forward"),
          "fit_compile_seconds": fit_compile,
          "fit_compiles_of_the_last_round": largest(compiles["fit"][-1]),
          "fit_without_compile_vs_forward": statistics.median(steady) / m["forward"],
          "projected_cifar10_split": projected(statistics.median(fit_compile),
                                               statistics.median(steady), m["forward"],
                                               batches)}


def swag_predictive(config, model, swag_variables, variables, batches: list, test_images,
                    samples: int, repeats: int, prep_rounds: int) -> tuple:
  """``(predictive figure, BatchNorm figure)``: SWAG's predictive at N = ``samples`` against N
  passes of one network (``repeats`` rounds), and its ``prediction_variables`` over ``batches``
  against N·K training-mode passes (``prep_rounds`` rounds)."""
  swag = resolve(with_method(config, "swag"), model).with_samples(samples)
  data = PredictionData(lambda: iter(batches), fit=None)
  clock = CompileSeconds()
  compiles = {"prediction_variables": [], "n_k_train_passes": []}

  @jax.jit
  def train_pass(v, images):  # BatchNorm in training mode: the statistics of the batch
    _, updated = model.apply(v, images, train=True, mutable=["batch_stats"])
    return updated["batch_stats"]

  def n_k_passes():
    return [train_pass(variables, b["image"]) for _ in range(samples) for b in batches]

  prepared = []
  calls = {"prediction_variables": clock.timed(
               lambda: swag.prediction_variables(swag_variables, data),
               compiles["prediction_variables"], prepared),
           "n_k_train_passes": clock.timed(n_k_passes, compiles["n_k_train_passes"])}
  first = {}
  times = alternate(calls, prep_rounds, first)
  m = medians(times)
  pv_compile = compile_totals(compiles["prediction_variables"][1:])
  steady = [t - c for t, c in zip(times["prediction_variables"], pv_compile, strict=True)]
  bn = {**goal(m["prediction_variables"] / m["n_k_train_passes"], 1.2,
               "N weight samples with their BatchNorm statistics over K batches / N*K "
               "training-mode passes of one network"),
        "method": swag.describe(), "samples": samples, "bn_batches": len(batches),
        "batch_size": len(batches[0]["label"]), "rounds": prep_rounds, "seconds": times,
        "median_seconds": m,
        "round_ratios": round_ratios(times["prediction_variables"], times["n_k_train_passes"]),
        "first_call": first_call(first, compiles, "prediction_variables", "n_k_train_passes"),
        "prediction_variables_compile_seconds": pv_compile,
        "compiles_of_the_last_round": largest(compiles["prediction_variables"][-1]),
        "without_compile_vs_n_k_passes": statistics.median(steady) / m["n_k_train_passes"],
        "projected_cifar10_split": projected(statistics.median(pv_compile),
                                             statistics.median(steady), m["n_k_train_passes"],
                                             batches)}

  prepared = prepared[0]
  key = jax.random.key(3)
  predictive = jax.jit(lambda v, x: swag.sample_log_probs(v, x, key))
  one_pass = jax.jit(lambda v, x: log_probs(model, v, x))
  stacked = jax.tree.map(lambda x: jnp.stack([x] * samples), variables)
  ensemble = jax.jit(lambda v, x: ensemble_log_probs(model, v, x, None, swag.chunk_size))
  predictive, swag_seconds, _ = compile_timed(predictive, prepared, test_images)
  one_pass, pass_seconds, _ = compile_timed(one_pass, variables, test_images)
  ensemble, ensemble_seconds, _ = compile_timed(ensemble, stacked, test_images)
  compiled = {"swag": swag_seconds, "one_pass": pass_seconds,
              "deep_ensemble_stacked": ensemble_seconds}
  calls = {"swag": lambda: predictive(prepared, test_images),
           "n_passes": lambda: [one_pass(variables, test_images) for _ in range(samples)],
           "deep_ensemble_stacked": lambda: ensemble(stacked, test_images)}
  times = alternate(calls, repeats)
  m = medians(times)
  predict = {**goal(m["swag"] / m["n_passes"], 1.2, "SWAG's sample_log_probs at N / N jitted "
                    "passes of one network"),
             "method": swag.describe(), "samples": samples,
             "test_batch": int(test_images.shape[0]), "rounds": repeats, "seconds": times,
             "median_seconds": m, "round_ratios": round_ratios(times["swag"], times["n_passes"]),
             "vs_deep_ensemble_stacked": m["swag"] / m["deep_ensemble_stacked"],
             "compile_seconds": compiled}
  return predict, bn


def cost_figures(width: int = 16, batch_size: int = 128, repeats: int = 5, epoch_steps: int = 0,
                 step_rounds: int = 10, laplace_batches: int = 20, bn_batches: int = 10,
                 samples: int = 10, prep_rounds: int = 3) -> dict:
  """The costs section's JSON object (module docstring)."""
  load_before = os.getloadavg()
  epoch_steps = epoch_steps or CIFAR10_TRAIN // batch_size
  mesh = create_mesh()
  config = recipe_config("cifar_resnet", "resnet_dnn_18,cifar10")
  config.input.batch_size = batch_size
  model = get_model("resnet_dnn_18", NUM_CLASSES, width=width)
  images = np.asarray(jax.random.normal(jax.random.key(1), (batch_size,) + IMAGE_SHAPE))
  batch = shard_batch({"image": images, "label": np.arange(batch_size) % NUM_CLASSES},
                      shardings(mesh)[1])
  collection, swag, det = swag_collection(config, model, mesh, batch, epoch_steps, step_rounds)
  log(f"costs: SWAG's collection adds {collection['value']:+.2%} to an epoch of {epoch_steps} "
      f"steps (goal <= 3%: {'met' if collection['met'] else 'MISSED'}); the collecting step "
      f"{collection['step_alone']['collecting_vs_not_collecting']:.3f}x a non-collecting one")
  swag_variables = jax.tree.map(jnp.copy, variables_of(swag.state))
  variables = jax.tree.map(jnp.copy, variables_of(det.state))
  laplace = laplace_fit(config, model, variables, synthetic_batches(laplace_batches, batch_size,
                                                                    0), repeats)
  log(f"costs: Laplace KFAC fit {laplace['value']:.2f}x a forward pass over {laplace_batches} "
      f"batches (goal <= 1.5x: {'met' if laplace['met'] else 'MISSED'}; "
      f"{laplace['fit_without_compile_vs_forward']:.2f}x without its compilation)")
  predict, bn = swag_predictive(config, model, swag_variables, variables,
                                synthetic_batches(bn_batches, batch_size, 1), images, samples,
                                repeats, prep_rounds)
  log(f"costs: SWAG predictive at N = {samples} {predict['value']:.2f}x N passes (goal <= 1.2x: "
      f"{'met' if predict['met'] else 'MISSED'}); BatchNorm preparation {bn['value']:.2f}x "
      f"N*K = {samples * bn_batches} training-mode passes ({'met' if bn['met'] else 'MISSED'}; "
      f"{bn['without_compile_vs_n_k_passes']:.2f}x without its compilation)")
  return {"model": "resnet_dnn_18", "width": width, "batch_size": batch_size, "repeats": repeats,
          "weights": "initialised, then the timed SWAG steps", "images": "random",
          "load_average_1_5_15": {"before": load_before, "after": os.getloadavg()},
          "swag_collection_epoch_overhead": collection,
          "laplace_kron_fit_vs_forward": laplace,
          "swag_predictive_vs_n_passes": predict,
          "swag_bn_update_vs_n_k_passes": bn}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--members", type=int, default=4, help="M (N, K) of every method")
  parser.add_argument("--width", type=int, default=16, help="stem width of every network")
  parser.add_argument("--batch", type=int, default=128, help="training and test images a call")
  parser.add_argument("--repeats", type=int, default=5, help="timed rounds")
  parser.add_argument("--wrn_depth", type=int, default=28, help="the iBNN's WRN depth (6n + 4)")
  parser.add_argument("--sections", nargs="+", choices=("rows", "costs"),
                      default=["rows", "costs"],
                      help="rows: every method against one network; costs: SWAG's collection, "
                           "the Laplace fit and SWAG's predictive")
  parser.add_argument("--rows", nargs="+", default=(),
                      help="only these rows (and their baselines), e.g. --rows sngp")
  parser.add_argument("--epoch_steps", type=int, default=0,
                      help="steps of the epoch SWAG's collection is timed on (0: CIFAR-10's "
                           "50,000 / --batch)")
  parser.add_argument("--step_rounds", type=int, default=10,
                      help="rounds of the collecting step timed alone")
  parser.add_argument("--laplace_batches", type=int, default=20,
                      help="training batches of the Laplace fit")
  parser.add_argument("--bn_batches", type=int, default=10,
                      help="K: training batches of SWAG's BatchNorm statistics")
  parser.add_argument("--samples", type=int, default=10, help="N of SWAG's predictive")
  parser.add_argument("--prep_rounds", type=int, default=3,
                      help="rounds of SWAG's prediction_variables (each compiles again)")
  parser.add_argument("--smoke", action="store_true",
                      help="tiny sizes (width 4, batch 8, WRN-10, one round, epochs of 4 steps, "
                           "2 batches)")
  parser.add_argument("--out", default=DEFAULT_OUT, help="JSON file ('': stdout only)")
  args = parser.parse_args(argv)
  if args.smoke:
    args.width, args.batch, args.repeats, args.wrn_depth = 4, 8, 1, 10
    args.epoch_steps, args.step_rounds, args.laplace_batches, args.bn_batches = 4, 2, 2, 2
    args.prep_rounds = 1
  result = {"command": " ".join(["python", *sys.argv])}
  if "rows" in args.sections:
    result.update(measure(args.members, args.width, args.batch, args.repeats, args.wrn_depth,
                          tuple(args.rows)))
  else:
    result.update({"benchmark": "methods", **environment()})
  if "costs" in args.sections:
    result["costs"] = cost_figures(args.width, args.batch, args.repeats, args.epoch_steps,
                                   args.step_rounds, args.laplace_batches, args.bn_batches,
                                   args.samples, args.prep_rounds)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=2)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
