"""One prepared accelerator check (about 14 minutes on an H200 in all, 2026-11-28: more than one
lease holds; ``--only`` runs some sections): one JSON object on stdout and,
when the environment variable OUT is set, in ``$OUT/device_check.json`` (rewritten after every
section, so a run cut short still leaves what it measured); progress lines on stderr.

Sections, in this order, each in its own try/except (a failure is recorded as
``{"error": ...}``); every compilation goes to a fresh persistent compilation cache:

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
* ``end_to_end``: ``train.train_and_evaluate`` on ``synthetic:50000x32x32x3:100`` with the SS
  CIFAR-100 ResNet-18 recipe (half precision, device-resident data, evaluation and checkpoint at
  the end) for 2 epochs, compilation and fixed costs excluded
  (``bench_train.train_loop_images_per_s``);
* ``hessian``: top-1 and top-5 Lanczos (``bench_hessian.time_ours``) of ``resnet_dnn_18`` at
  batch 128 against PyHessian on the same weights and batch (the PyTorch transcription's);
* ``landscape``: a 21×21 ``loss_surface`` of the same network on 2,048 images against the same
  grid point by point in PyTorch (weights set under ``torch.no_grad``), BatchNorm in eval mode
  on both sides;
* ``ood_scores``: ``bench_ood.measure``: the ``ood`` evaluator with every score at every nested N
  (1, 2, 5, 10) against MSP alone, MC-dropout ResNet-18 on random near/far sets; the ratios
  ``all_over_msp`` (the issue's target ≤ 1.5) and ``all_but_odin_over_msp``;
* ``methods``: ``bench_methods.measure``: every method at M = 4 (ResNet-18, stem width 64, batch
  128; the iBNN a WRN-28 at widen factor 1) against one network: parameters, training and
  prediction images/s, XLA's memory analysis of each compiled step and predictive, and the
  device's running peak bytes in use (the accelerator column of ``experiments/README.md``'s cost
  table);
* ``mc_predict``: ``bench_accelerator.mc_inference`` (N = 1, 10, 50 against a loop of single
  passes, batch 128);
* ``hessian_spectrum`` (last: it runs on the host's CPU cores): ``max_eigenvalue_spectrum`` of 8
  batches on 8 simulated CPU devices against 1 (``bench_hessian.spectrum_on_devices``, in a
  child process);

then ``goals``: pass/fail of the issue's targets (None where a part is missing).  Without torch
(or PyHessian) those parts record ``{"skipped": ...}``.

  python experiments/device_check.py            # the GPU check
  python experiments/device_check.py --smoke    # CPU, tiny sizes, minutes; exits 1 on an error
  python experiments/device_check.py --only landscape methods    # these sections alone
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import types

import jax
import jax.numpy as jnp
import numpy as np
from bench_accelerator import MODELS, mc_inference, train_step_row
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
from bench_train import recipe_config, train_loop_images_per_s, use_persistent_compilation_cache

from smoothing_jax.analysis.landscape import loss_surface, random_direction
from smoothing_jax.convert import to_torch_state_dict
from smoothing_jax.inference import mc_predict, sample_rngs
from smoothing_jax.models import get_model

FULL = types.SimpleNamespace(
    width=None, batch_sizes=(128, 512), steps=20,
    dataset="synthetic:50000x32x32x3:100", train_images=50_000, epochs=2, log_every_steps=100,
    num_samples=(1, 10, 50), mc_batch=128, repeats=3, ensemble_members=(8,),
    eval_samples=50, eval_batch=500, eval_batches=20,
    hessian_width=64, hessian_batch=128, max_iters=100, seeds=3,
    spectrum_width=16, spectrum_batch=32,
    grid=21, landscape_images=2048, torch_batch=512,
    ood_width=64, ood_sizes=(1, 2, 5, 10), ood_images=1000, ood_train=2000, ood_batch=500,
    methods_width=64, methods_batch=128, wrn_depth=28)
SMOKE = types.SimpleNamespace(
    width=8, batch_sizes=(16, 32), steps=2,
    dataset="synthetic:256x32x32x3:10", train_images=256, epochs=1, log_every_steps=5,
    num_samples=(1, 2), mc_batch=32, repeats=1, ensemble_members=(2,),
    eval_samples=2, eval_batch=32, eval_batches=2,
    hessian_width=8, hessian_batch=16, max_iters=8, seeds=1,
    spectrum_width=4, spectrum_batch=8,
    grid=3, landscape_images=64, torch_batch=32,
    ood_width=8, ood_sizes=(1, 2), ood_images=8, ood_train=64, ood_batch=8,
    methods_width=4, methods_batch=8, wrn_depth=10)
RECIPE = ("cifar_resnet", "resnet_dnn_18,cifar100")  # SS's CIFAR-100 ResNet-18
TOL = 1e-3  # Hessian: relative residual (Lanczos) / relative change (PyHessian)
GOALS = {"end_to_end_over_bare_step": 0.9, "projected_recipe_minutes": 10.0,
         "hessian_top1_speedup": 1.5, "landscape_speedup": 5.0, "ensemble_m8_speedup": 3.0,
         "ood_all_scores_over_msp": 1.5}
AT_MOST = ("projected_recipe_minutes", "ood_all_scores_over_msp")  # the other goals: at least
START = time.perf_counter()


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


def derived(result: dict) -> dict:
  """Ratios across sections, the projected recipe time, and the goals (None where missing)."""
  def section(name) -> dict:
    value = result.get(name)
    return value if isinstance(value, dict) and "error" not in value else {}

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
  best = max((v["vs_sequential"] for v in eight[0].values()
              if isinstance(v, dict) and "vs_sequential" in v), default=None) if eight else None
  measured = {"end_to_end_over_bare_step": e2e["images_per_s"] / bare if bare else None,
              "ensemble_m8_speedup": best,
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
                       "projection": "recipe epochs × training images / end-to-end images/s + "
                                     "one N-sample MC evaluation of 10,000 images (the "
                                     "periodic N = 1 evaluations not included)"},
          "goals": goals}


def to_builtin(value):
  if isinstance(value, (np.generic, jax.Array)):
    return np.asarray(value).tolist()
  if isinstance(value, np.ndarray):
    return value.tolist()
  return str(value)


def write(result: dict):
  if os.environ.get("OUT"):
    path = os.path.join(os.environ["OUT"], "device_check.json")
    with open(path + ".tmp", "w") as f:
      json.dump(result, f, indent=2, default=to_builtin)
    os.replace(path + ".tmp", path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes (CI)")
  parser.add_argument("--data", default=DEFAULT_DATA,
                      help="folder with CIFAR-10 test.npz for the Hessian and landscape batches "
                           "(else random images)")
  parser.add_argument("--only", nargs="+", metavar="SECTION",
                      help="run these sections alone, in the check's order (a lease too short "
                           "for all of them: the full check took about 14 minutes on an H200)")
  args = parser.parse_args(argv)
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  s = SMOKE if args.smoke else FULL
  # Every compilation goes to a fresh cache: repeated compilations (the end-to-end runs, the
  # landscape's second call) load the executable instead.
  cache_dir = tempfile.mkdtemp(prefix="device_check_jax_cache_")
  use_persistent_compilation_cache(cache_dir)

  import flax
  import jaxlib
  device = jax.devices()[0]
  result = {"check": "device", "mode": "smoke" if args.smoke else "full",
            "device": str(device), "device_kind": device.device_kind,
            "backend": jax.default_backend(), "num_devices": jax.device_count(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "flax": flax.__version__, "torch": None,
            "sizes": vars(s), "section_seconds": {}}
  tdevice = None
  if has_torch():
    import torch
    tdevice = torch_device(args.smoke)
    result.update(torch=torch.__version__, torch_device=tdevice)
  sections = {
      "mc_evaluation": lambda: mc_evaluation(s),
      "ensemble": lambda: bare_step_rows(s.width, s.batch_sizes[0], s.ensemble_members, s.repeats),
      "train_step": lambda: train_steps(s),
      "end_to_end": lambda: end_to_end(s),
      "hessian": lambda: hessian(s, args.data, tdevice),
      "landscape": lambda: landscape(s, args.data, tdevice),
      "ood_scores": lambda: ood_scores_ratio(s.ood_width, s.ood_sizes, s.ood_images, s.ood_train,
                                             s.ood_batch, s.repeats),
      "methods": lambda: methods_cost(4, s.methods_width, s.methods_batch, s.repeats,
                                      s.wrn_depth),
      "mc_predict": lambda: mc_inference(s.width, s.mc_batch, list(s.num_samples), s.repeats),
      "hessian_spectrum": lambda: hessian_spectrum(s, args.data),
  }
  if args.only:
    unknown = sorted(set(args.only) - set(sections))
    if unknown:
      parser.error(f"unknown section(s) {', '.join(unknown)}; the sections: {', '.join(sections)}")
    sections = {name: section for name, section in sections.items() if name in args.only}
  errors = []
  try:
    for name, section in sections.items():
      log(f"{name} ...")
      start = time.perf_counter()
      try:
        result[name] = section()
      except Exception as e:  # noqa: BLE001 -- record it, measure the rest
        traceback.print_exc(file=sys.stderr)
        result[name] = {"error": f"{type(e).__name__}: {e}"}
        errors.append(name)
      result["section_seconds"][name] = time.perf_counter() - start
      log(f"{name}: {result['section_seconds'][name]:.1f} s")
      write(result)
    try:
      result.update(derived(result))
    except Exception as e:  # noqa: BLE001
      traceback.print_exc(file=sys.stderr)
      result["goals"] = {"error": f"{type(e).__name__}: {e}"}
      errors.append("goals")
  finally:
    shutil.rmtree(cache_dir, ignore_errors=True)
  result["total_seconds"] = time.perf_counter() - START
  result["errors"] = errors
  write(result)
  print(json.dumps(result, indent=2, default=to_builtin))
  if args.smoke and errors:
    sys.exit(1)


if __name__ == "__main__":
  main()
