"""The prepared accelerator check: one JSON object on stdout and, given an output folder
(``--out``, default ``$OUT`` when set), in ``<out>/device_check.json`` (``device_check_<plan>.json``
for a plan), rewritten after every section so that a run cut short still leaves what it
measured; progress lines on stderr.

What runs (``--only`` and ``--plan`` exclude each other):

* ``--plan perf`` (the first to run on a lent GPU): ``loop_breakdown``, ``command_buffer``,
  ``mfu``, ``ensemble_bf16``, ``torch_anchor``;
* ``--plan coverage``: ``mc_predict``, ``landscape``, ``methods``, ``ood_scores``, at sizes where
  the GPU's work, not the host's, is what is timed;
* ``--only A B C``: those sections, in that order;
* neither: the first check's ten sections, ``mc_evaluation`` to ``hessian_spectrum`` (about 14
  minutes on an H200, 2026-11-28: more than one lease).

Each plan is projected at most 8 minutes on one H200, compilation included
(``PROJECTED_H200_SECONDS``, from ``experiments/results/device_check_h200_2026-11-28.json``).
``--budget-s S``: before each section, the section is skipped when its projected H200 seconds
exceed what is left of S seconds since the script's imports (its first seconds not counted:
leave them to the command's own limit); a skipped section records
``{"skipped": reason}`` and is listed in ``skipped_sections`` with its reason.

Given an output folder, XLA's GPU autotuning results are dumped to ``<out>/autotune.textproto``
(after every compilation, by this process and its child processes) and, when the file of
``--autotune-from`` exists (default: that same file), loaded first: carry the file of one GPU
run to the next and pass ``--autotune-from`` its path (``--autotune-from ''``: load none).
The child processes (``command_buffer``, ``ensemble_bf16``: XLA_FLAGS are read once, when a
backend starts) run this script with ``--child``, their variant's flags, and 20% of the GPU's
memory (``CHILD_MEMORY_FRACTION``; this process keeps JAX's 75% meanwhile).

Sections, each in its own try/except (a failure is recorded as ``{"error": ...}``); every
compilation goes to a fresh persistent compilation cache:

* ``mc_evaluation``: ``mc_predict`` of ``resnet_mcdo_smoothing_18`` (bfloat16, as the
  half-precision run below evaluates) at N = 50 on 20 batches of 500 (10,000 test images),
  compiled first; XLA's memory analysis of that call and the device's peak bytes in use (run
  first, so the peak is this evaluation's);
* ``ensemble``: ``bench_ensemble``'s bare steps: M = 8 members of ``resnet_dnn_18`` (batch 128)
  trained as one job, unrolled, vmapped and in vmapped pairs, against 8 single-model steps one
  after another (and M = 1), with each first call's (compiling) time;
* ``train_step``: ``bench_accelerator``'s JAX and PyTorch steps of ``resnet_dnn_18`` and
  ``resnet_mcdo_smoothing_18``, batch 128 and 512, float32 and bfloat16, TFLOP/s, fraction of
  peak, ratios bfloat16/float32 and JAX/PyTorch;
* ``end_to_end``: ``train.train_from_config`` on ``synthetic:50000x32x32x3:100`` with the SS
  CIFAR-100 ResNet-18 recipe (half precision, device-resident data, evaluation and checkpoint at
  the end) for 2 epochs, compilation and fixed costs excluded
  (``bench_train.train_loop_images_per_s``);
* ``hessian``: top-1 and top-5 Lanczos (``bench_hessian.time_ours``) of ``resnet_dnn_18`` at
  batch 128 against PyHessian on the same weights and batch (the PyTorch transcription's);
* ``landscape``: a 21×21 ``loss_surface`` of the same network on 2,048 images against the same
  grid point by point in PyTorch (weights set under ``torch.no_grad``), BatchNorm in eval mode
  on both sides;
* ``ood_scores``: ``bench_ood.measure``: the ``ood`` evaluator with every score at every nested N
  (1, 2, 5, 10) against MSP alone, MC-dropout ResNet-18 on random near/far sets of 5,000 images
  (batches of 1,000; 10,000 training images for the fitted scores); the ratios
  ``all_over_msp`` (the issue's target ≤ 1.5) and ``all_but_odin_over_msp``;
* ``methods``: ``bench_methods.measure``: every method at M = 4 (ResNet-18, stem width 64, batch
  512; the iBNN a WRN-28 at widen factor 1) against one network: parameters, training and
  prediction images/s, XLA's memory analysis of each compiled step and predictive, and the
  device's running peak bytes in use (the accelerator column of ``experiments/README.md``'s cost
  table);
* ``mc_predict``: ``bench_accelerator.mc_inference`` (N = 1, 10, 50 against a loop of single
  passes, batch 1,000);
* ``hessian_spectrum`` (it runs on the host's CPU cores): ``max_eigenvalue_spectrum`` of 8
  batches on 8 simulated CPU devices against 1 (``bench_hessian.spectrum_on_devices``, in a
  child process);
* ``loop_breakdown``: where the training loop's time goes, ``resnet_dnn_18`` in bfloat16 with the
  SS CIFAR-100 recipe at batch 128 and 512, each images/s and its ratio to the first: the bare
  step queued (``compile_steps`` on one fixed batch, ``queued_steps`` calls, one wait), the
  resident step alone (the device-resident step that gathers and augments its batch, one step a
  call, queued), the resident call of K = ``log_every_steps`` steps alone, and the real loop
  (``train.train``: ``steps_per_call`` 1 and 0, the default: K on an accelerator, 1 on the
  CPU), timed between its first and last metric summaries (no compilation, evaluation or
  checkpoint); each with its MFU;
* ``command_buffer``: the loop at K = ``log_every_steps`` (batch 128) in two child processes,
  XLA's command buffers without and with ``WHILE``/``CONDITIONAL`` (the whole K-step loop one
  CUDA graph): ``COMMAND_BUFFER_VARIANTS``;
* ``mfu``: at batch 512, FLOPs per step from the lowered bare step (XLA's count before the
  backend's passes, ``bench_train.program_flops``) × steps/s over the chip's dense bfloat16 peak
  (``bench_accelerator.PEAK_TFLOPS``: 989.4 TFLOP/s for an H200); ``loop_breakdown``'s figures
  when it ran, else the bare step measured here;
* ``ensemble_bf16``: M = 8 members of ``resnet_dnn_18`` in bfloat16 (batch 128), one job
  unrolled against 8 single-model steps one after another, in two child processes: XLA's
  defaults and ``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT``
  (``ENSEMBLE_VARIANTS``);
* ``torch_anchor``: the PyTorch transcription's SGD step of ResNet-18 (bfloat16 autocast,
  channels-last, batch 128 and 512, queued like the bare step): ``torch.compile`` (inductor)
  and eager;

then ``goals``: pass/fail of the issue's targets (None where a part is missing).  Without torch
(or PyHessian) those parts record ``{"skipped": ...}``.

  python experiments/device_check.py --plan perf --budget-s 480     # the first GPU lease
  python experiments/device_check.py --plan coverage --budget-s 480 --data .devdata/cifar10
  python experiments/device_check.py --only landscape methods    # these sections, this order
  python experiments/device_check.py --plan perf --smoke    # CPU, tiny sizes; exits 1 on an error
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
from bench_accelerator import MODELS, mc_inference, peak_tflops, train_step_row
from bench_ensemble import bare_step_rows
from bench_hessian import (
  DEFAULT_DATA,
  batch_loss,
  cifar_batch,
  has_pyhessian,
  pyhessian_residual,
  reference_variables,
  spectrum_on_devices,
  time_ours,
  time_pyhessian,
)
from bench_methods import compiled_memory
from bench_methods import measure as methods_cost
from bench_ood import measure as ood_scores_ratio
from bench_train import (
  program_flops,
  recipe_config,
  train_loop_images_per_s,
  use_persistent_compilation_cache,
)
from timing import alternate, round_ratios

from smoothing_jax.analysis.landscape import loss_surface, random_direction
from smoothing_jax.convert import to_torch_state_dict
from smoothing_jax.experiment.run import Run, check_config
from smoothing_jax.inference import mc_predict
from smoothing_jax.methods.deep_ensemble import ensemble_train_step
from smoothing_jax.methods.losses import class_weights, supervised_loss
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shard_batch, shardings
from smoothing_jax.passes import sample_rngs
from smoothing_jax.training import train
from smoothing_jax.training.callbacks import Callback
from smoothing_jax.training.optim import create_learning_rate_schedule
from smoothing_jax.training.steps import (
  compile_steps,
  create_train_state,
  state_initializer,
  train_batch_sharding,
  train_step,
)

FULL = types.SimpleNamespace(
    width=None, batch_sizes=(128, 512), steps=20,
    dataset="synthetic:50000x32x32x3:100", train_images=50_000, epochs=2, log_every_steps=100,
    num_samples=(1, 10, 50), mc_batch=1000, repeats=3, ensemble_members=(8,),
    eval_samples=50, eval_batch=500, eval_batches=20,
    hessian_width=64, hessian_batch=128, max_iters=100, seeds=3,
    spectrum_width=16, spectrum_batch=32,
    grid=21, landscape_images=2048, torch_batch=512,
    ood_width=64, ood_sizes=(1, 2, 5, 10), ood_images=5000, ood_train=10_000, ood_batch=1000,
    methods_members=4, methods_width=64, methods_batch=512, wrn_depth=28,
    loop_batch_sizes=(128, 512), loop_logs=4, queued_steps=100, command_buffer_batch=128,
    torch_compile_backend="inductor")
SMOKE = types.SimpleNamespace(
    width=8, batch_sizes=(16,), steps=2,
    dataset="synthetic:256x32x32x3:10", train_images=256, epochs=1, log_every_steps=5,
    num_samples=(1, 2), mc_batch=32, repeats=1, ensemble_members=(2,),
    eval_samples=2, eval_batch=32, eval_batches=2,
    hessian_width=8, hessian_batch=16, max_iters=8, seeds=1,
    spectrum_width=4, spectrum_batch=8,
    grid=3, landscape_images=64, torch_batch=32,
    ood_width=8, ood_sizes=(1, 2), ood_images=8, ood_train=64, ood_batch=8,
    methods_members=2, methods_width=4, methods_batch=8, wrn_depth=10,
    loop_batch_sizes=(16,), loop_logs=2, queued_steps=3, command_buffer_batch=16,
    torch_compile_backend="aot_eager")  # no C++/Triton code generation on a CPU runner
RECIPE = ("cifar_resnet", "resnet_dnn_18,cifar100")  # SS's CIFAR-100 ResNet-18
TOL = 1e-3  # Hessian: relative residual (Lanczos) / relative change (PyHessian)
# Issue 57's GPU goals (the first check's, issue 23's, where they still stand: the Hessian,
# the landscape and the OOD scores).  The loop and the ensemble goals replace the first check's
# "end to end >= 0.9x the bare step" and "M = 8 >= 3x" (experiments/README.md: the ceiling of a
# one-job ensemble is one network at batch M*B).
GOALS = {"loop_over_resident_step_queued": 0.95, "loop_images_per_s_bf16_128": 45_000,
         "loop_images_per_s_bf16_512": 80_000, "ensemble_m8_speedup": 1.3,
         "projected_recipe_minutes": 5.5, "jax_over_torch_compiled": 1.0,
         "hessian_top1_speedup": 1.5, "landscape_speedup": 5.0, "ood_all_scores_over_msp": 1.5}
AT_MOST = ("projected_recipe_minutes", "ood_all_scores_over_msp")  # the other goals: at least

# The first check's ten sections, in its order (no --plan, no --only).
FULL_CHECK = ("mc_evaluation", "ensemble", "train_step", "end_to_end", "hessian", "landscape",
              "ood_scores", "methods", "mc_predict", "hessian_spectrum")
PLANS = {"perf": ("loop_breakdown", "command_buffer", "mfu", "ensemble_bf16", "torch_anchor"),
         # the never-measured, cheaper ones first: a section cut by --budget-s is the last
         "coverage": ("mc_predict", "landscape", "methods", "ood_scores")}
# Seconds of each section on one H200, compilation included, at FULL's sizes (--budget-s and the
# plans' projections).  "Measured": section_seconds of the first check,
# experiments/results/device_check_h200_2026-11-28.json; the others are sums of that JSON's parts
# (first-call and compile seconds, step rates), with the estimates said.
PROJECTED_H200_SECONDS = {
    "mc_evaluation": 30,  # measured 30.1 s
    "ensemble": 110,  # measured 110.4 s
    "train_step": 126,  # measured 125.9 s
    "end_to_end": 38,  # measured 38.0 s
    "hessian": 60,  # the cut section's log lines: about 60 s before its CPU spectrum (now apart)
    "hessian_spectrum": 90,  # the log lines: over 80 s on the H200 machine's 16 cores
    # 97.5 s measured at 1,000 images a set (58 s of it first calls); 5,000 images a set and
    # 10,000 training images add about 4 evaluations × 5 s of forward and ODIN passes
    # (forward_seconds 0.025 per 500 × 10 draws, vjp 2.4× that) and 2 s of fitting.
    "ood_scores": 120,
    # 6 of its 9 rows compiled in 65 s (methods.compile_seconds); the other 3 (BNN-VI, the two
    # WRN-28s) about 35 s more; then 4 rounds of 18 calls at batch 512 (≈ 30 ms each), 20 s.
    "methods": 120,
    # one mc_predict program compiled in 18 s (mc_evaluation.compile_seconds, N = 50): 3 of them
    # and the single pass about 45 s; 4 × 2 calls of N = 50 at batch 1,000 (50,000 forward
    # passes ≈ 0.4 s each) 4 s.
    "mc_predict": 50,
    # Not measured: the one-point program like one mc_predict compile (18 s), 441 points × 2,048
    # images forward (≈ 900,000 images at ~100,000/s in float32: 9 s), the PyTorch grid (as
    # many images, one point at a time: ~15 s), the transcription and batch 5 s.
    "landscape": 60,
    # Per batch size: 3 compiled programs (bare, resident 1 step, resident K steps) at ≈ 15 s
    # each (train_step: 8 compilations and their timing in 126 s), the loop at K = 1 (its step
    # read back from the compilation cache; data, evaluation compile, 400 steps, checkpoint:
    # ≈ 12 s, from end_to_end's 21.7 s first run less its compile) and at the default K (≈ 8 s).
    "loop_breakdown": 130,
    # 2 child processes × (start and CUDA initialisation ≈ 8 s + a loop's first run, its
    # compilation included: end_to_end's first_run_seconds 21.7 s + 400 steps and evaluation).
    "command_buffer": 80,
    "mfu": 25,  # 0 after loop_breakdown (its figures); alone, one bare step's compile and calls
    # 2 child processes × (start ≈ 8 s + the ensemble section's first calls at M = 8: sequential
    # 15.9 s, unrolled 36.5 s (float32) + 3 rounds ≈ 1 s).
    "ensemble_bf16": 125,
    # Not measured on a GPU: torch.compile (inductor) of the training step, an estimated 50 s for
    # each batch size; the eager rows ≈ 3 s each (train_step's PyTorch parts).
    "torch_anchor": 110,
}
STARTUP_SECONDS = 15  # imports, CUDA initialisation, the first device query (an estimate)
# XLA flags of each child process (XLA_FLAGS is read once, when the backend starts).
COMMAND_BUFFER_VARIANTS = {
    "without_while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL",
    "with_while": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL,WHILE,"
                  "CONDITIONAL"}
ENSEMBLE_VARIANTS = {"default": "",
                     "concurrent": "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"}
AUTOTUNE_FILE = "autotune.textproto"
# A child process's share of the GPU's memory: the parent holds JAX's default 75% meanwhile
# (16 GB of an 80 GB H100, 28 GB of an H200: M = 8 ResNet-18s at batch 128 need a few GB).
CHILD_MEMORY_FRACTION = "0.2"
START = time.perf_counter()
# The XLA_FLAGS this process was started with (children get them, and their variant's).
INHERITED_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")


def log(message: str):
  print(f"[device_check {time.perf_counter() - START:7.1f} s] {message}", file=sys.stderr,
        flush=True)


def has_torch() -> bool:
  return importlib.util.find_spec("torch") is not None


def skipped(what: str = "torch") -> dict:
  return {"skipped": f"{what} not installed"}


def torch_device(smoke: bool) -> str:
  """The device of the PyTorch parts; on the CPU with one thread (after JAX has run on the CPU,
  torch's threads compete with XLA's and its steps run about ten times slower on 2 cores)."""
  import torch
  if torch.cuda.is_available() and not smoke:
    return "cuda"
  torch.set_num_threads(1)
  return "cpu"


def mc_evaluation(s) -> dict:
  """N-sample MC evaluation of ``resnet_mcdo_smoothing_18``: time of ``eval_batches`` batches,
  compiled memory and the device's peak bytes in use."""
  model = get_model("resnet_mcdo_smoothing_18", 100, dtype=jnp.bfloat16,
                    **({"width": s.width} if s.width else {}))
  images = jax.random.normal(jax.random.key(0), (s.eval_batch, 32, 32, 3))
  variables = jax.jit(model.init)({"params": jax.random.key(1), **sample_rngs(jax.random.key(2))},
                                  images[:1])
  evaluate = jax.jit(
      lambda v, x, key: mc_predict(model, v, x, num_samples=s.eval_samples, rng=key).mean_probs)
  start = time.perf_counter()
  compiled = evaluate.lower(variables, images, jax.random.key(3)).compile()
  compile_seconds = time.perf_counter() - start
  # The compiler's autotuning may allocate from the same pool: its peak, before any run.
  compile_peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  jax.block_until_ready(compiled(variables, images, jax.random.key(3)))
  start = time.perf_counter()
  jax.block_until_ready([compiled(variables, images, jax.random.key(4 + i))
                         for i in range(s.eval_batches)])
  seconds = time.perf_counter() - start
  parts = compiled_memory(compiled)
  stats = jax.devices()[0].memory_stats() or {}
  return {"model": "resnet_mcdo_smoothing_18", "dtype": "bfloat16", "num_samples": s.eval_samples,
          "batch_size": s.eval_batch, "batches": s.eval_batches, "compile_seconds": compile_seconds,
          "seconds": seconds, "images_per_s": s.eval_batch * s.eval_batches / seconds,
          "compiled_memory": {**parts, "temp_argument_output_bytes": sum(
              parts.get(f"{n}_bytes", 0) for n in ("temp", "argument", "output")) or None},
          "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
          "peak_bytes_in_use_after_compile": compile_peak}


def train_steps(s) -> list:
  rows = []
  for name in MODELS:
    for batch_size in s.batch_sizes:
      row = train_step_row(name, s.width, batch_size, s.steps)
      for label in ("float32", "bfloat16"):
        row[f"torch_{label}"] = row[f"torch_{label}"] or skipped()
      log(json.dumps(row, default=to_builtin))
      rows.append(row)
  return rows


def end_to_end(s) -> dict:
  """The real training loop for ``s.epochs`` epochs of the SS recipe
  (``bench_train.train_loop_images_per_s``: compilation and fixed costs excluded)."""
  config = recipe_config(*RECIPE)
  recipe_epochs = config.warmup_epochs + config.num_epochs  # what the loop runs
  config.input.dataset = s.dataset
  config.input.batch_size = s.batch_sizes[0]
  config.num_epochs = s.epochs
  config.warmup_epochs = 0
  config.half_precision = True
  config.eval_every_epochs = 10 ** 6  # evaluation only after the last step
  config.checkpoint_every_steps = 10 ** 9  # checkpoint only after the last step
  config.log_every_steps = s.log_every_steps
  if s.width:
    config.model_kwargs.width = s.width
  config.eval_batch_size = s.eval_batch
  config.num_train_steps = -1
  return {"recipe": ":".join(RECIPE), "recipe_epochs": recipe_epochs, "dataset": s.dataset,
          "epochs": s.epochs, "half_precision": True, **train_loop_images_per_s(config, log)}


def hessian(s, data: str, device: str) -> dict:
  images, labels, source = cifar_batch(data, s.hessian_batch)
  model, variables, net, state_dict = reference_variables(s.hessian_width, images)
  params = variables["params"]
  loss_fn = batch_loss(model, variables, images, labels)
  result = {"model": "resnet_dnn_18", "width": s.hessian_width,
            "batch": f"{s.hessian_batch} images from {source}",
            "weights": "PyTorch transcription" if net else "ours (no torch)",
            "num_params": int(sum(p.size for p in jax.tree.leaves(params))), "tol": TOL,
            "max_iters": s.max_iters}
  if net is not None and has_pyhessian():
    net = net.to(device)
    residual_of = pyhessian_residual(loss_fn, params, state_dict, s.hessian_width)
  for k in (1, 5):
    seeds = range(s.seeds if k == 1 else 1)  # top-1: medians over random starts
    ours = [time_ours(loss_fn, params, k, "lanczos", TOL, s.max_iters, jax.random.key(4 + seed))
            for seed in seeds]
    result[f"ours_lanczos_top{k}"] = ours
    result[f"ours_lanczos_top{k}_median_seconds"] = float(np.median([r["seconds"] for r in ours]))
    if net is None or not has_pyhessian():
      result[f"pyhessian_top{k}"] = skipped("torch" if net is None else "pyhessian")
      continue
    theirs = [time_pyhessian(net, images, labels, k, TOL, s.max_iters, residual_of, seed,
                             cuda=device == "cuda") for seed in seeds]
    result[f"pyhessian_top{k}"] = theirs
    result[f"pyhessian_top{k}_median_seconds"] = float(np.median([r["seconds"] for r in theirs]))
    result[f"speedup_vs_pyhessian_top{k}"] = (result[f"pyhessian_top{k}_median_seconds"] /
                                              result[f"ours_lanczos_top{k}_median_seconds"])
    log(f"hessian top-{k}: ours {result[f'ours_lanczos_top{k}_median_seconds']:.2f} s, "
        f"PyHessian {result[f'pyhessian_top{k}_median_seconds']:.2f} s")
  return result


def hessian_spectrum(s, data: str) -> dict:
  """``max_eigenvalue_spectrum`` of 8 batches on 8 simulated CPU devices against 1 (a child
  process on the host's cores: on the H200's 16 cores it took over 80 s, hence its own section)."""
  spectrum = spectrum_on_devices(data, s.spectrum_width, 8, s.spectrum_batch, s.max_iters, TOL,
                                 s.repeats)
  log(f"hessian spectrum of 8 batches: 8 simulated devices / 1 = {spectrum['ratio_8_over_1']:.2f}")
  return spectrum


def torch_loss_grid(net, d1, d2, coords, images, labels, batch_size, device) -> np.ndarray:
  """Mean cross-entropy at θ + α·d1 + β·d2 for every (α, β) of ``coords`` × ``coords``, one grid
  point at a time (``d1``, ``d2``: our parameter pytrees, mapped to the transcription's names)."""
  import torch
  params = dict(net.named_parameters())
  directions = [{k: torch.tensor(v, device=device)
                 for k, v in to_torch_state_dict({"params": d}).items()} for d in (d1, d2)]
  if set(directions[0]) != set(params):
    raise ValueError(f"directions do not match the network's parameters: "
                     f"{sorted(set(directions[0]) ^ set(params))[:5]}")
  theta = {k: p.detach().clone() for k, p in params.items()}
  x = torch.from_numpy(images.transpose(0, 3, 1, 2).copy()).to(device)
  y = torch.from_numpy(np.asarray(labels, np.int64)).to(device)
  losses = []
  with torch.no_grad():
    for a in coords:
      for b in coords:
        for k, p in params.items():
          p.copy_(theta[k] + float(a) * directions[0][k] + float(b) * directions[1][k])
        total = sum(torch.nn.functional.cross_entropy(net(x[i:i + batch_size]),
                                                      y[i:i + batch_size], reduction="sum")
                    for i in range(0, len(x), batch_size))
        losses.append(total / len(x))
    for k, p in params.items():
      p.copy_(theta[k])
  return torch.stack(losses).cpu().numpy().reshape(len(coords), len(coords))


def landscape(s, data: str, device: str) -> dict:
  images, labels, source = cifar_batch(data, s.landscape_images)
  model, variables, net, _ = reference_variables(s.hessian_width, images)
  params = variables["params"]
  loss_fn = batch_loss(model, variables, images, labels)
  d1, d2 = (random_direction(params, jax.random.key(k)) for k in (5, 6))
  coords = np.linspace(-1.0, 1.0, s.grid, dtype=np.float32)
  start = time.perf_counter()
  loss_surface(loss_fn, params, d1, d2, coords[:1], coords[:1])  # fills the compilation cache
  first_seconds = time.perf_counter() - start
  start = time.perf_counter()
  surface = loss_surface(loss_fn, params, d1, d2, coords, coords)
  seconds = time.perf_counter() - start
  result = {"model": "resnet_dnn_18", "width": s.hessian_width, "grid": [s.grid, s.grid],
            "images": f"{s.landscape_images} from {source}",
            "batch_norm": "eval mode (running statistics) on both sides",
            "jax_seconds": seconds, "jax_one_point_compile_seconds": first_seconds,
            "loss_range": [float(surface["loss"].min()), float(surface["loss"].max())]}
  if net is None:
    return {**result, "torch": skipped()}
  net = net.to(device)
  torch_loss_grid(net, d1, d2, coords[:1], images[:s.torch_batch], labels[:s.torch_batch],
                  s.torch_batch, device)  # warm-up (cuDNN)
  start = time.perf_counter()
  grid = torch_loss_grid(net, d1, d2, coords, images, labels, s.torch_batch, device)
  torch_seconds = time.perf_counter() - start
  difference = np.abs(grid - surface["loss"])
  return {**result, "torch_seconds": torch_seconds, "torch_batch": s.torch_batch,
          "torch_device": device, "speedup": torch_seconds / seconds,
          "max_abs_loss_difference": float(difference.max()),
          "max_relative_loss_difference": float((difference / np.abs(grid)).max())}


# --- the perf plan ------------------------------------------------------------------------------


class CallClock(Callback):
  """The host's time at the end of each call of the loop (``on_step``: just after it is
  dispatched; with K steps a call, ``step`` is the call's last)."""

  def __init__(self):
    self.times = {}

  def on_step(self, step: int, state) -> None:
    self.times[step] = time.perf_counter()


class CacheHits:
  """Counts the persistent compilation cache's hits (one listener for the process)."""
  count = 0

  @classmethod
  def listen(cls):
    def on_event(event, **kwargs):
      if event == "/jax/compilation_cache/cache_hits":
        cls.count += 1
    jax.monitoring.register_event_listener(on_event)


def loop_config(s, batch_size: int, steps_per_call: int):
  """The SS CIFAR-100 ResNet-18 recipe in bfloat16 on ``s.dataset``, device-resident data,
  ``s.loop_logs`` metric summaries ``s.log_every_steps`` apart, evaluation and checkpoint only
  after the last step; ``steps_per_call`` steps a host call (0: ``log_every_steps``)."""
  config = recipe_config(*RECIPE)
  config.input.dataset = s.dataset
  config.input.batch_size = batch_size
  config.input.data_pipeline = "resident"
  config.half_precision = True
  config.eval_every_epochs = 10 ** 6
  config.checkpoint_every_steps = 10 ** 9
  config.log_every_steps = s.log_every_steps
  config.num_train_steps = s.loop_logs * s.log_every_steps
  config.steps_per_call = steps_per_call
  config.eval_batch_size = s.eval_batch
  if s.width:
    config.model_kwargs.width = s.width
  return config


def loop_images_per_s(config) -> dict:
  """images/s of the real loop (``train.train`` of ``Run.from_config``, what
  ``train.train_from_config`` runs) between the calls that end at its first and its last metric
  summary: each summary waits for the calls before it, so the interval holds the steps between
  them with their data, metrics and summaries, and no compilation, evaluation or checkpoint."""
  clock, hits = CallClock(), CacheHits.count
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="device_check_loop_") as workdir:
    check_config(config)
    with Run.from_config(config, workdir) as run:
      train.train(run, callbacks=[clock])
  run_seconds = time.perf_counter() - start
  every, batch_size = config.log_every_steps, config.input.batch_size
  logged = sorted(step for step in clock.times if step % every == 0)
  if len(logged) < 2:
    raise ValueError(f"{config.num_train_steps} steps hold fewer than two summaries")
  steps, seconds = logged[-1] - logged[0], clock.times[logged[-1]] - clock.times[logged[0]]
  ends = [0, *sorted(clock.times)]
  return {"steps_per_call_setting": config.steps_per_call,  # 0: the loop's default
          "steps_per_call": max(b - a for a, b in itertools.pairwise(ends)),  # the longest call
          "steps": config.num_train_steps, "calls": len(clock.times), "timed_steps": steps,
          "seconds": seconds,
          "step_seconds": seconds / steps, "images_per_s": steps * batch_size / seconds,
          "run_seconds": run_seconds, "compilation_cache_hits": CacheHits.count - hits}


def queued(call, steps_per_call: int, batch_size: int, s) -> dict:
  """``call()`` (``steps_per_call`` steps) once (compiling), then ``s.repeats`` times a queue of
  ``s.queued_steps`` steps' calls and one wait: the median seconds per step."""
  start = time.perf_counter()
  jax.block_until_ready(call())
  first = time.perf_counter() - start
  calls = max(1, s.queued_steps // steps_per_call)
  times = []
  for _ in range(s.repeats):
    start = time.perf_counter()
    for _ in range(calls):
      out = call()
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / (calls * steps_per_call))
  seconds = statistics.median(times)
  return {"steps_per_call": steps_per_call, "steps": calls * steps_per_call,
          "first_call_seconds": first, "step_seconds": seconds,
          "images_per_s": batch_size / seconds}


def step_parts(config, s, resident: bool = True) -> dict:
  """The loop's compiled steps outside it, built as ``train._train`` builds them (so that the
  loop of the same config reads them back from the compilation cache): the bare step on one
  fixed batch (``compile_steps`` without a pipeline), and, ``resident``, the device-resident
  call of 1 and of K = ``log_every_steps`` steps; each queued (:func:`queued`)."""
  batch_size, k = config.input.batch_size, config.log_every_steps
  with tempfile.TemporaryDirectory(prefix="device_check_steps_") as workdir, \
      Run.from_config(config, workdir) as run:
    pipeline, mesh, method = run.pipeline, run.mesh, run.method
    replicated, _ = shardings(mesh)
    steps_per_epoch, num_steps = pipeline.steps_per_epoch, config.num_train_steps
    schedule = method.schedule(config, create_learning_rate_schedule(config, steps_per_epoch),
                               num_steps=num_steps, steps_per_epoch=steps_per_epoch)
    init_one = state_initializer(config, method, pipeline.image_shape, schedule)
    rngs = method.train_keys(config)
    loss_fn = method.loss(config, num_train=pipeline.num_train, steps_per_epoch=steps_per_epoch,
                          class_weights=class_weights(config, run.model, pipeline))
    batch_sharding = train_batch_sharding(config, mesh)

    def fresh_state():
      return jax.device_put(method.init_train_state(config, init_one, mesh.devices.flat),
                            replicated)

    bare, _ = compile_steps(method, schedule, mesh, config.ece_bins, loss_fn,
                            config.grad_accum_steps, batch_sharding, num_steps=num_steps)
    rng = np.random.default_rng(0)
    batch = shard_batch({"image": rng.normal(size=(batch_size,) + tuple(pipeline.image_shape))
                         .astype(np.float32),
                         "label": np.arange(batch_size, dtype=np.int32) % 10}, batch_sharding)
    holder = [fresh_state()]
    flops = program_flops(bare.lower(holder[0], batch, rngs))

    def bare_call():
      holder[0], metrics = bare(holder[0], batch, rngs)
      return metrics

    parts = {"flops_per_step": flops,
             "bare_step_queued": queued(bare_call, 1, batch_size, s)}
    log(f"batch {batch_size}: bare step queued {parts['bare_step_queued']['images_per_s']:.0f} "
        "images/s")
    if not resident:
      return parts
    pipelines = method.train_pipelines(config, pipeline)
    order = pipelines[0].device_order(0)
    for name, steps_per_call in (("resident_step_alone", 1), ("resident_call_alone", k)):
      step_fn, _ = compile_steps(method, schedule, mesh, config.ece_bins, loss_fn,
                                 config.grad_accum_steps, batch_sharding, pipeline, pipelines,
                                 num_steps, steps_per_call)
      holder[0] = fresh_state()

      def resident_call(step_fn=step_fn, count=steps_per_call):  # this one's (B023)
        holder[0], metrics, first_bad = step_fn(holder[0], pipeline.arrays, order, rngs,
                                                np.int32(count))
        return metrics, first_bad

      parts[name] = queued(resident_call, steps_per_call, batch_size, s)
      log(f"batch {batch_size}: {name} (K = {steps_per_call}) "
          f"{parts[name]['images_per_s']:.0f} images/s")
    return parts


def with_mfu(entry: dict, flops, batch_size: int, peak) -> dict:
  """``entry`` with its TFLOP/s and fraction of ``peak`` (None where either is unknown)."""
  tflops = flops * entry["images_per_s"] / batch_size / 1e12 if flops else None
  return {**entry, "tflops": tflops, "mfu": tflops / peak if tflops and peak else None}


LOOP_PARTS = ("bare_step_queued", "resident_step_alone", "resident_call_alone", "loop_k1",
              "loop_default_k")


def loop_breakdown(s) -> list:
  """Per batch size: :func:`step_parts`, then the loop at K = 1 and at the default K (each
  :func:`loop_images_per_s`), their MFU, and each images/s over the bare step's."""
  peak = peak_tflops("bfloat16")
  rows = []
  for batch_size in s.loop_batch_sizes:
    row = {"model": "resnet_dnn_18", "recipe": ":".join(RECIPE), "dtype": "bfloat16",
           "batch_size": batch_size, "dataset": s.dataset, "peak_tflops": peak}
    row.update(step_parts(loop_config(s, batch_size, 1), s))
    for name, k in (("loop_k1", 1), ("loop_default_k", 0)):
      row[name] = loop_images_per_s(loop_config(s, batch_size, k))
      log(f"batch {batch_size}: {name} (K = {row[name]['steps_per_call']}) "
          f"{row[name]['images_per_s']:.0f} images/s")
    for name in LOOP_PARTS:
      row[name] = with_mfu(row[name], row["flops_per_step"], batch_size, peak)
    bare = row["bare_step_queued"]["images_per_s"]
    row["over_bare_step_queued"] = {name: row[name]["images_per_s"] / bare
                                    for name in LOOP_PARTS[1:]}
    log(json.dumps(row, default=to_builtin))
    rows.append(row)
  return rows


def mfu(s, result: dict) -> dict:
  """MFU at the largest loop batch in bfloat16: ``loop_breakdown``'s figures when it ran, else
  the bare step queued, measured here."""
  batch_size, peak = max(s.loop_batch_sizes), peak_tflops("bfloat16")
  rows = result.get("loop_breakdown")
  row = next((r for r in rows if r["batch_size"] == batch_size), None) if isinstance(
      rows, list) else None
  source = "loop_breakdown"
  if row is None:
    source = "the bare step queued, measured in this section"
    parts = step_parts(loop_config(s, batch_size, 1), s, resident=False)
    row = {"flops_per_step": parts["flops_per_step"],
           "bare_step_queued": with_mfu(parts["bare_step_queued"], parts["flops_per_step"],
                                        batch_size, peak)}
  return {"model": "resnet_dnn_18", "dtype": "bfloat16", "batch_size": batch_size,
          "source": source, "flops_per_step": row["flops_per_step"],
          "flops_from": "XLA's cost analysis of the lowered bare step (bench_train.program_flops)",
          "peak_tflops": peak,
          "peak_from": "bench_accelerator.PEAK_TFLOPS, dense bfloat16 (H200: 989.4 TFLOP/s)",
          **{name: {k: row[name][k] for k in ("images_per_s", "tflops", "mfu")}
             for name in LOOP_PARTS if name in row}}


def command_buffer_loop(s) -> dict:
  """(A child process's part.)  The loop at K = ``log_every_steps`` (an accelerator's default;
  set, so that the CPU's smoke mode runs the loop of K steps too), batch
  ``s.command_buffer_batch``."""
  return loop_images_per_s(loop_config(s, s.command_buffer_batch, s.log_every_steps))


def ensemble_one_job(s) -> dict:
  """(A child process's part.)  M = ``s.ensemble_members[-1]`` members of ``resnet_dnn_18`` in
  bfloat16 on one batch of ``s.batch_sizes[0]``: one job unrolled against M single-model steps
  one after another (``bench_ensemble.bare_step_rows``'s calls, alternated)."""
  members, batch_size, width = s.ensemble_members[-1], s.batch_sizes[0], s.width
  config = recipe_config("cifar_resnet", "resnet_dnn_18,cifar10")
  if width:
    config.model_kwargs.width = width
  model = get_model("resnet_dnn_18", 10, dtype=jnp.bfloat16, **({"width": width} if width else {}))
  mesh = create_mesh()
  replicated, data = shardings(mesh)
  schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
  step = functools.partial(train_step, schedule, supervised_loss(model))
  images = jax.random.normal(jax.random.key(1), (batch_size, 32, 32, 3))
  batch = shard_batch({"image": np.asarray(images), "label": np.arange(batch_size) % 10}, data)
  rng = jax.random.key(2)
  single = jax.jit(step, in_shardings=(replicated, data, replicated),
                   out_shardings=(replicated, replicated), donate_argnums=(0,))
  init = jax.jit(lambda key: create_train_state(config, model, key, (32, 32, 3), schedule))
  states = [jax.device_put(init(jax.random.key(m)), replicated) for m in range(members)]

  log(f"ensemble: {members} single states made")

  def sequential():
    for m in range(members):
      states[m], _ = single(states[m], batch, rng)
    return states[-1].params

  # The one job's state: the members' stacked, its step counter shared (what
  # DeepEnsemble.init_train_state makes, without compiling a second initialisation).
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  holder = [stacked.replace(step=jnp.copy(states[0].step))]
  rngs = jax.random.split(rng, members)
  one_job = jax.jit(lambda st, b, r: ensemble_train_step(step, 1, st, lambda m: b, r, shared=True),
                    in_shardings=(replicated, data, replicated),
                    out_shardings=(replicated, replicated), donate_argnums=(0,))

  log("ensemble: the one job's state made")

  def unrolled():
    holder[0], _ = one_job(holder[0], batch, rngs)
    return holder[0].params

  calls = {"sequential": sequential, "unrolled": unrolled}
  first = {}
  for name, call in calls.items():
    start = time.perf_counter()
    jax.block_until_ready(call())
    first[name] = time.perf_counter() - start
    log(f"ensemble: {name} first call {first[name]:.1f} s")
  times = alternate(calls, s.repeats)
  log("ensemble: timed")
  row = {"members": members, "batch_size": batch_size, "width": width, "dtype": "bfloat16"}
  for name in calls:
    seconds = statistics.median(times[name])
    row[name] = {"seconds_per_step": seconds, "first_call_seconds": first[name],
                 "images_per_s_per_member": batch_size * members / seconds}
  row["unrolled"]["vs_sequential"] = statistics.median(round_ratios(times["sequential"],
                                                                    times["unrolled"]))
  return row


CHILD_PARTS = {"command_buffer": command_buffer_loop, "ensemble_bf16": ensemble_one_job}


def in_children(section: str, variants: dict, args, budget_left) -> dict:
  """Runs ``CHILD_PARTS[section]`` in one child process per variant of ``variants`` (``{name:
  XLA flags}``, added to the flags this process was started with): ``{"variants": {name:
  result or {"error": ...}}}``, and ``"error"`` when any failed."""
  out, failed = {"variants": {}}, []
  for variant, flags in variants.items():
    left = budget_left()
    timeout = 600 if left is None else max(1.0, left)
    command = [sys.executable, os.path.abspath(__file__), "--child", section,
               "--autotune-from", args.autotune_from or ""]
    command += ["--smoke"] if args.smoke else []
    command += ["--out", args.out] if args.out else []
    # This process keeps its pool (JAX preallocates 75% of the GPU's memory): the child takes
    # CHILD_MEMORY_FRACTION of the rest.
    env = dict(os.environ, XLA_FLAGS=" ".join(f for f in (INHERITED_XLA_FLAGS, flags) if f),
               XLA_PYTHON_CLIENT_MEM_FRACTION=CHILD_MEMORY_FRACTION)
    log(f"{section}, {variant}: a child process with XLA_FLAGS={env['XLA_FLAGS']!r}")
    start = time.perf_counter()
    try:
      done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
      lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
      if done.returncode or not lines:
        raise RuntimeError(f"the child process exited with {done.returncode} (its stderr above)")
      value = json.loads(lines[-1])
    except Exception as e:  # noqa: BLE001 -- record it, run the other variant
      value = {"error": f"{type(e).__name__}: {e}"}
      failed.append(variant)
    out["variants"][variant] = {**value, "xla_flags_added": flags,
                                "process_seconds": time.perf_counter() - start}
    log(f"{section}, {variant}: {json.dumps(out['variants'][variant], default=to_builtin)}")
  if failed:
    out["error"] = f"variant(s) {', '.join(failed)} failed"
  return out


def command_buffer(s, args, budget_left) -> dict:
  out = {"model": "resnet_dnn_18", "dtype": "bfloat16", "batch_size": s.command_buffer_batch,
         "steps_per_call": s.log_every_steps,
         **in_children("command_buffer", COMMAND_BUFFER_VARIANTS, args, budget_left)}
  rates = {k: v.get("images_per_s") for k, v in out["variants"].items()}
  if rates.get("with_while") and rates.get("without_while"):
    out["with_while_over_without"] = rates["with_while"] / rates["without_while"]
  return out


def ensemble_bf16(s, args, budget_left) -> dict:
  out = {"model": "resnet_dnn_18", "dtype": "bfloat16", "members": s.ensemble_members[-1],
         "batch_size": s.batch_sizes[0],
         **in_children("ensemble_bf16", ENSEMBLE_VARIANTS, args, budget_left)}
  steps = {k: v.get("unrolled", {}).get("seconds_per_step") for k, v in out["variants"].items()}
  if steps.get("default") and steps.get("concurrent"):
    out["concurrent_over_default_unrolled"] = steps["default"] / steps["concurrent"]
  return out


def torch_queued_steps(batch_size: int, s, device: str, compiled: bool) -> dict:
  """images/s of the PyTorch transcription's SGD step of ResNet-18 (100 classes, bfloat16
  autocast, channels-last) on one batch, queued like the bare JAX step (:func:`queued`), eager or
  ``torch.compile``-d (``s.torch_compile_backend``, static shapes)."""
  import torch

  from tests.torch_reference import ResNet
  torch.manual_seed(0)
  net = ResNet((2, 2, 2, 2), False, 100, width=s.width or 64, **MODELS["resnet_dnn_18"])
  net = net.to(device).train().to(memory_format=torch.channels_last)
  x = torch.randn(batch_size, 3, 32, 32, device=device).to(memory_format=torch.channels_last)
  y = torch.randint(0, 100, (batch_size,), device=device)
  optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
  forward = torch.compile(net, backend=s.torch_compile_backend, dynamic=False) if compiled else net
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def step():
    with torch.autocast(device, dtype=torch.bfloat16):
      loss = torch.nn.functional.cross_entropy(forward(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()

  start = time.perf_counter()
  step()
  sync()
  first = time.perf_counter() - start
  step()
  sync()
  times = []
  for _ in range(s.repeats):
    start = time.perf_counter()
    for _ in range(s.queued_steps):
      step()
    sync()
    times.append((time.perf_counter() - start) / s.queued_steps)
  seconds = statistics.median(times)
  return {"compiled": compiled, "backend": s.torch_compile_backend if compiled else None,
          "first_call_seconds": first, "step_seconds": seconds,
          "images_per_s": batch_size / seconds}


def torch_anchor(s, device: str) -> dict:
  """:func:`torch_queued_steps` at each loop batch size, compiled (first row) and eager."""
  if not has_torch():
    return skipped()
  import torch
  rows, failed = [], []
  for batch_size in s.loop_batch_sizes:
    row = {"model": "resnet_dnn_18 (tests/torch_reference)", "batch_size": batch_size,
           "precision": "bfloat16 autocast", "memory_format": "channels_last", "device": device}
    for label in ("eager", "compiled"):  # eager first: a failed compile leaves it measured
      try:
        row[label] = torch_queued_steps(batch_size, s, device, label == "compiled")
      except Exception as e:  # noqa: BLE001 -- record it, measure the rest
        traceback.print_exc(file=sys.stderr)
        row[label] = {"error": f"{type(e).__name__}: {e}"}
        failed.append(f"{label} at batch {batch_size}")
    row = {k: row[k] for k in ("model", "batch_size", "precision", "memory_format", "device",
                               "compiled", "eager")}
    if "images_per_s" in row["compiled"] and "images_per_s" in row["eager"]:
      row["compiled_over_eager"] = row["compiled"]["images_per_s"] / row["eager"]["images_per_s"]
    log(json.dumps(row, default=to_builtin))
    rows.append(row)
  out = {"torch": torch.__version__, "rows": rows}
  if failed:
    out["error"] = f"failed: {', '.join(failed)}"
  return out


def derived(result: dict) -> dict:
  """Ratios across sections, the projected recipe time, and the goals (None where missing)."""
  def section(name) -> dict:
    value = result.get(name)
    return value if isinstance(value, dict) and not {"error", "skipped"} & set(value) else {}

  e2e, steps = section("end_to_end"), result.get("train_step")
  bare = mcdo = None
  if isinstance(steps, list) and e2e:
    rate = {r["model"]: r["jax_bfloat16"]["images_per_s"] for r in steps
            if r["batch_size"] == e2e["batch_size"]}
    bare, mcdo = rate.get("resnet_dnn_18"), rate.get("resnet_mcdo_smoothing_18")
  eval_seconds = section("mc_evaluation").get("seconds")
  minutes = minutes_mcdo = None
  if e2e and eval_seconds is not None:
    train_images = e2e["recipe_epochs"] * result["sizes"]["train_images"]
    minutes = (train_images / e2e["images_per_s"] + eval_seconds) / 60
    if bare and mcdo:  # the MC-dropout smoothing model trains slower by the bare steps' ratio
      minutes_mcdo = (train_images / (e2e["images_per_s"] * mcdo / bare) + eval_seconds) / 60
  ensemble_rows = result.get("ensemble")
  eight = [r for r in ensemble_rows if r["members"] == 8] if isinstance(ensemble_rows, list) else []
  speedups = [v["vs_sequential"] for v in (eight[0].values() if eight else ())
              if isinstance(v, dict) and "vs_sequential" in v]
  one_job = section("ensemble_bf16")
  bf16_speedups = {name: v["unrolled"]["vs_sequential"]
                   for name, v in one_job.get("variants", {}).items()
                   if one_job.get("members") == 8 and "unrolled" in v}
  loops = result.get("loop_breakdown")
  loops = {r["batch_size"]: r for r in loops} if isinstance(loops, list) else {}
  anchor = {r["batch_size"]: r for r in section("torch_anchor").get("rows", [])}
  jax_over_torch = {}
  for batch_size, row in loops.items():
    torch_row = anchor.get(batch_size, {})
    for label in ("compiled", "eager"):
      rate = torch_row.get(label, {}).get("images_per_s")
      if rate:
        jax_over_torch[f"bare_step_queued_over_torch_{label}_{batch_size}"] = (
            row["bare_step_queued"]["images_per_s"] / rate)
        jax_over_torch[f"loop_default_k_over_torch_{label}_{batch_size}"] = (
            row["loop_default_k"]["images_per_s"] / rate)
  recipe_batch = loops.get(min(loops)) if loops else None
  over_resident = {b: r["over_bare_step_queued"]["loop_default_k"]
                   / r["over_bare_step_queued"]["resident_step_alone"] for b, r in loops.items()}
  loop_rate = {b: r["loop_default_k"]["images_per_s"] for b, r in loops.items()
               if r.get("dtype") == "bfloat16"}
  if recipe_batch and eval_seconds is None:  # no end_to_end: the loop's rate at the recipe's
    minutes = 200 * 50_000 / recipe_batch["loop_default_k"]["images_per_s"] / 60
  torch_compiled = [v for k, v in jax_over_torch.items()
                    if k.startswith("bare_step_queued_over_torch_compiled")]
  measured = {"loop_over_resident_step_queued": over_resident.get(min(loops)) if loops else None,
              "loop_images_per_s_bf16_128": loop_rate.get(128),
              "loop_images_per_s_bf16_512": loop_rate.get(512),
              "jax_over_torch_compiled": min(torch_compiled, default=None),
              "end_to_end_over_bare_step": e2e["images_per_s"] / bare if bare else None,
              "ensemble_m8_speedup": max(speedups + list(bf16_speedups.values()), default=None),
              "projected_recipe_minutes": minutes,
              "hessian_top1_speedup": section("hessian").get("speedup_vs_pyhessian_top1"),
              "hessian_spectrum_8_over_1_devices": section("hessian_spectrum").get(
                  "ratio_8_over_1"),
              "landscape_speedup": section("landscape").get("speedup"),
              "ood_all_scores_over_msp": section("ood_scores").get("all_over_msp")}
  goals = {}
  for name, target in GOALS.items():
    value, at_most = measured[name], name in AT_MOST
    goals[f"{name}_{'le' if at_most else 'ge'}_{target:g}"] = None if value is None else bool(
        value <= target if at_most else value >= target)
  return {"measured": {**measured, "bare_bfloat16_step_images_per_s": bare,
                       "projected_recipe_minutes_mcdo_smoothing": minutes_mcdo,
                       "ood_all_but_odin_over_msp": section("ood_scores").get(
                           "all_but_odin_over_msp"),
                       "loop_over_bare_step_queued_by_batch": {
                           b: r["over_bare_step_queued"] for b, r in loops.items()},
                       "loop_over_resident_step_queued_by_batch": over_resident,
                       "mfu": {k: v["mfu"] for k, v in section("mfu").items()
                               if isinstance(v, dict) and "mfu" in v},
                       "ensemble_m8_bf16_unrolled_vs_sequential": bf16_speedups or None,
                       "command_buffer_with_while_over_without": section(
                           "command_buffer").get("with_while_over_without"),
                       **jax_over_torch,
                       "projection": "recipe epochs × training images / end-to-end images/s + "
                                     "one N-sample MC evaluation of 10,000 images (the "
                                     "periodic N = 1 evaluations not included); without the "
                                     "end_to_end and mc_evaluation sections, 200 epochs of "
                                     "50,000 images at loop_breakdown's default-K loop rate at "
                                     "its smallest batch, training only"},
          "goals": goals}


def to_builtin(value):
  if isinstance(value, (np.generic, jax.Array)):
    return np.asarray(value).tolist()
  if isinstance(value, np.ndarray):
    return value.tolist()
  return str(value)


def write(result: dict, out: str | None, plan: str | None):
  """``result`` to ``<out>/device_check[_<plan>].json`` (nothing without ``out``)."""
  if out:
    path = os.path.join(out, f"device_check_{plan}.json" if plan else "device_check.json")
    with open(path + ".tmp", "w") as f:
      json.dump(result, f, indent=2, default=to_builtin)
    os.replace(path + ".tmp", path)


def projected_seconds(name: str, result: dict) -> float:
  """The section's projected H200 seconds (``mfu``: none after ``loop_breakdown``)."""
  if name == "mfu" and isinstance(result.get("loop_breakdown"), list):
    return 0.0
  return PROJECTED_H200_SECONDS[name]


def plan_projection(names) -> dict:
  """Projected H200 seconds of running ``names`` in order (``mfu`` after ``loop_breakdown``
  free), with the start."""
  seconds, done = {}, {}
  for name in names:
    seconds[name] = projected_seconds(name, done)
    done[name] = [] if name == "loop_breakdown" else {}
  total = STARTUP_SECONDS + sum(seconds.values())
  return {"sections": seconds, "startup": STARTUP_SECONDS, "total_seconds": total,
          "total_minutes": total / 60}


def set_xla_flags(args) -> dict:
  """Adds the autotuning flags to XLA_FLAGS (before any backend starts): dump to
  ``<out>/autotune.textproto``, load ``--autotune-from`` when that file exists."""
  added = []
  dump = os.path.join(args.out, AUTOTUNE_FILE) if args.out else None
  if dump:
    added.append(f"--xla_gpu_dump_autotune_results_to={dump}")
  load = args.autotune_from
  loaded = load if load and os.path.isfile(load) and os.path.getsize(load) > 0 else None
  if loaded:
    added.append(f"--xla_gpu_load_autotune_results_from={loaded}")
  if added:
    os.environ["XLA_FLAGS"] = " ".join(f for f in (INHERITED_XLA_FLAGS, *added) if f)
  return {"dump_to": dump, "loaded_from": loaded, "load_asked": load or None}


def child_main(args):
  """A child process's part (``--child``): its JSON on the last line of stdout."""
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  s = SMOKE if args.smoke else FULL
  log(f"child {args.child}: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
      f"{jax.devices()[0].device_kind}")
  value = CHILD_PARTS[args.child](s)
  print(json.dumps({**value, "device_kind": jax.devices()[0].device_kind,
                    "xla_flags": os.environ.get("XLA_FLAGS", ""),
                    "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")},
                   default=to_builtin), flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (CI)")
  parser.add_argument("--data", default=DEFAULT_DATA,
                      help="folder with CIFAR-10 test.npz for the Hessian and landscape batches "
                           "(else random images)")
  chosen = parser.add_mutually_exclusive_group()
  chosen.add_argument("--plan", choices=sorted(PLANS),
                      help="a named plan, projected at most 8 minutes on an H200: perf "
                           f"({', '.join(PLANS['perf'])}; run it first) or coverage "
                           f"({', '.join(PLANS['coverage'])})")
  chosen.add_argument("--only", nargs="+", metavar="SECTION",
                      help="run these sections alone, in the order given")
  parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                      help="skip a section whose projected H200 seconds exceed what is left of "
                           "S seconds since the start (PROJECTED_H200_SECONDS)")
  parser.add_argument("--out", default=os.environ.get("OUT") or None,
                      help="output folder: the JSON and XLA's autotuning results (default: $OUT "
                           "when set; none: stdout only)")
  parser.add_argument("--autotune-from", default=None, metavar="FILE",
                      help="XLA autotuning results to load when the file exists (default: "
                           f"<out>/{AUTOTUNE_FILE}; '': none)")
  parser.add_argument("--child", choices=sorted(CHILD_PARTS), help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
  if args.autotune_from is None and args.out:
    args.autotune_from = os.path.join(args.out, AUTOTUNE_FILE)
  autotune = set_xla_flags(args)  # before the first device query starts a backend
  if args.child:
    return child_main(args)
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  s = SMOKE if args.smoke else FULL
  # Every compilation goes to a fresh cache: repeated compilations (the end-to-end runs, the
  # landscape's second call, the loops after their steps alone) load the executable instead.
  cache_dir = tempfile.mkdtemp(prefix="device_check_jax_cache_")
  use_persistent_compilation_cache(cache_dir)
  CacheHits.listen()

  import flax
  import jaxlib
  device = jax.devices()[0]
  result = {"check": "device", "mode": "smoke" if args.smoke else "full", "plan": args.plan,
            "device": str(device), "device_kind": device.device_kind,
            "backend": jax.default_backend(), "num_devices": jax.device_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "torch": None,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "autotune": autotune,
            "budget_s": args.budget_s, "sizes": vars(s),
            "section_seconds": {}, "skipped_sections": {}}
  tdevice = None
  if has_torch():
    import torch
    tdevice = torch_device(args.smoke)
    result.update(torch=torch.__version__, torch_device=tdevice)

  def budget_left():
    return None if args.budget_s is None else args.budget_s - (time.perf_counter() - START)

  sections = {
      "mc_evaluation": lambda: mc_evaluation(s),
      "ensemble": lambda: bare_step_rows(s.width, s.batch_sizes[0], s.ensemble_members, s.repeats),
      "train_step": lambda: train_steps(s),
      "end_to_end": lambda: end_to_end(s),
      "hessian": lambda: hessian(s, args.data, tdevice),
      "landscape": lambda: landscape(s, args.data, tdevice),
      "ood_scores": lambda: ood_scores_ratio(s.ood_width, s.ood_sizes, s.ood_images, s.ood_train,
                                             s.ood_batch, s.repeats),
      "methods": lambda: methods_cost(s.methods_members, s.methods_width, s.methods_batch,
                                      s.repeats, s.wrn_depth),
      "mc_predict": lambda: mc_inference(s.width, s.mc_batch, list(s.num_samples), s.repeats),
      "hessian_spectrum": lambda: hessian_spectrum(s, args.data),
      "loop_breakdown": lambda: loop_breakdown(s),
      "command_buffer": lambda: command_buffer(s, args, budget_left),
      "mfu": lambda: mfu(s, result),
      "ensemble_bf16": lambda: ensemble_bf16(s, args, budget_left),
      "torch_anchor": lambda: torch_anchor(s, tdevice),
  }
  assert set(sections) == set(PROJECTED_H200_SECONDS), "every section needs its projection"
  if args.only:
    unknown = [name for name in args.only if name not in sections]
    if unknown:
      parser.error(f"unknown section(s) {', '.join(unknown)}; the sections: {', '.join(sections)}")
    order = list(dict.fromkeys(args.only))  # the order given, each once
  else:
    order = list(PLANS[args.plan] if args.plan else FULL_CHECK)
  result["sections"] = order
  result["projected_h200"] = plan_projection(order)
  log(f"sections {', '.join(order)}: projected {result['projected_h200']['total_seconds']:.0f} s "
      f"on an H200{'' if args.budget_s is None else f', budget {args.budget_s:.0f} s'}")
  errors = []
  try:
    for name in order:
      left, need = budget_left(), projected_seconds(name, result)
      if left is not None and need > left:
        reason = (f"budget: projected {need:.0f} s on an H200 > {max(left, 0):.0f} s left of "
                  f"--budget-s {args.budget_s:g}")
        result[name] = {"skipped": reason}
        result["skipped_sections"][name] = reason
        log(f"{name}: skipped ({reason})")
        write(result, args.out, args.plan)
        continue
      log(f"{name} ...")
      start = time.perf_counter()
      try:
        result[name] = sections[name]()
      except Exception as e:  # noqa: BLE001 -- record it, measure the rest
        traceback.print_exc(file=sys.stderr)
        result[name] = {"error": f"{type(e).__name__}: {e}"}
      if isinstance(result[name], dict) and "error" in result[name]:
        errors.append(name)
      result["section_seconds"][name] = time.perf_counter() - start
      log(f"{name}: {result['section_seconds'][name]:.1f} s (projected {need:.0f} s on an H200)")
      write(result, args.out, args.plan)
    try:
      result.update(derived(result))
    except Exception as e:  # noqa: BLE001
      traceback.print_exc(file=sys.stderr)
      result["goals"] = {"error": f"{type(e).__name__}: {e}"}
      errors.append("goals")
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  if autotune["dump_to"]:
    autotune["written_bytes"] = (os.path.getsize(autotune["dump_to"])
                                 if os.path.isfile(autotune["dump_to"]) else None)
  result["total_seconds"] = time.perf_counter() - START
  result["errors"] = errors
  write(result, args.out, args.plan)
  print(json.dumps(result, indent=2, default=to_builtin))
  if args.smoke and errors:
    sys.exit(1)


if __name__ == "__main__":
  main()
