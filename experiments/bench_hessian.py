"""Benchmark: top Hessian eigenvalues, ours (Lanczos and power iteration) against PyHessian.

Prints one JSON object measured in one run, on the SS reference ``resnet_dnn_18``
at random initialisation: the PyTorch transcription (``tests/torch_reference.py``)
gives the weights, ``convert.from_torch_state_dict`` loads the same weights into our
model, and both see the same CIFAR-10 batch (``--data``: an npz folder, else random
images), in eval mode, with plain cross-entropy over all parameters.

For k = 1 (``--seeds`` random starts each, medians compared) and k = 5 (``--seeds-top-k``, one
by default) it reports time (compiled; the linearisation included), HVPs, eigenvalues and
relative residuals ‖Hv − λv‖/|λ| of:

* ours, ``method="lanczos"``: block Lanczos (block k, partial reorthogonalisation), stops at a
  relative residual of ``--tol``; ``seconds_over_hvps``: its time over its HVPs × one linearised
  HVP, timed right after it; ``reorthogonalized_blocks``: the blocks it reorthogonalised;
* ours, ``method="power"``: PyHessian's rule (relative change < ``--tol``);
* PyHessian 0.1 ``hessian(...).eigenvalues(maxIter=--max-iters, tol=--tol, top_n=k)`` (needs
  ``pip install pyhessian`` next to torch; omitted without it), stopped by its own rule;
* PyHessian at equal accuracy (``pyhessian_at_residual``): the same call with the change
  tolerances of ``--pyhessian-tols`` in turn (``maxIter=--pyhessian-max-iters``) until every pair
  has a relative residual ≤ ``--tol``, then (``--pyhessian-budgets``) without its change rule for
  a fixed number of HVPs per eigenvalue; that run's time is PyHessian's time to the residual (the
  runs before it not counted), against our Lanczos's (``lanczos_speedup_at_equal_residual``).

PyHessian's residuals are measured with our HVP on its eigenvectors, mapped through the same
converter.  It also gives the seconds per HVP (ours: five ways of composing JAX's derivatives;
PyHessian's double backward), one gradient, and ``max_eigenvalue_spectrum`` of
``--spectrum-batches`` batches on 8 simulated CPU devices against 1 (``spectrum_8_vs_1_devices``).

  python experiments/bench_hessian.py                           # the issue's setting
  python experiments/bench_hessian.py --width 16 --top 1        # quick
  python experiments/bench_hessian.py --width 16 --spectrum-batches 0 --pyhessian-tols   # no 8 vs 1
  python experiments/bench_hessian.py --top 5 --solvers lanczos --spectrum-batches 0   # overhead
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.tree_util import Partial
from timing import alternate, median_seconds

from smoothing_jax.analysis.hessian import hvp, linearized_hvp, top_eigenvalues
from smoothing_jax.analysis.spectrum import training_loss
from smoothing_jax.convert import from_torch_state_dict
from smoothing_jax.data.dataset_spec import NORMALIZATION
from smoothing_jax.models import get_model

# tests.torch_reference, the PyTorch transcription, is imported from the repository root.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SOLVERS = ("lanczos", "power", "pyhessian")
DEFAULT_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "cifar10")


def cifar_batch(data: str, batch_size: int):
  """The first ``batch_size`` test images (normalised NHWC float32) and labels, or random ones."""
  path = os.path.join(data, "test.npz")
  if not os.path.exists(path):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(batch_size, 32, 32, 3)).astype(np.float32),
            np.arange(batch_size) % 10, "random normal images")
  with np.load(path) as arrays:
    images, labels = arrays["images"][:batch_size], arrays["labels"][:batch_size]
  mean, std = (np.asarray(c, np.float32) for c in NORMALIZATION["cifar10"])
  return (images.astype(np.float32) / 255.0 - mean) / std, labels.astype(np.int64), path


def reference_network(width: int):
  """The SS ``resnet_dnn_18`` in PyTorch, randomly initialised (eval mode), or None."""
  try:
    import torch
  except ImportError:
    return None
  from tests.torch_reference import ResNet
  torch.manual_seed(0)
  return ResNet((2, 2, 2, 2), False, 10, width=width).eval()


def reference_variables(width: int, images):
  """``(model, variables, net, state_dict)``: our ``resnet_dnn_18`` with the random weights of the
  PyTorch transcription ``net`` (eval mode; ``state_dict`` as numpy arrays), or without torch at
  our own random initialisation (``net`` and ``state_dict`` None)."""
  model = get_model("resnet_dnn_18", 10, width=width)
  net = reference_network(width)
  if net is None:
    return model, jax.jit(model.init)(jax.random.key(1), images[:1]), None, None
  state_dict = {k: v.numpy() for k, v in net.state_dict().items()}
  return model, from_torch_state_dict("resnet_dnn_18", state_dict, width=width), net, state_dict


def time_ours(loss_fn, params, k, method, tol, max_iters, rng):
  # Compile first: the same shapes, stopping at once; for Lanczos once more with full
  # reorthogonalisation, which compiles the reorthogonalisation a timed solve may need.
  top_eigenvalues(loss_fn, params, k=k, max_iters=max_iters, tol=1e9, rng=rng, method=method)
  if method == "lanczos":
    top_eigenvalues(loss_fn, params, k=k, max_iters=max_iters, tol=1e9, rng=rng, method=method,
                    reorthogonalization="full")
  start = time.perf_counter()
  result = top_eigenvalues(loss_fn, params, k=k, max_iters=max_iters, tol=tol, rng=rng,
                           method=method)
  jax.block_until_ready((result.eigenvalues, result.eigenvectors))
  return {
      "seconds": time.perf_counter() - start,
      "hvps": int(result.hvps),
      "eigenvalues": np.asarray(result.eigenvalues).tolist(),
      "relative_residuals": result.relative_residuals.tolist(),
      "reorthogonalized_blocks": result.reorthogonalized,
  }


def hvp_variants(loss_fn, params, vector, repeats):
  """Seconds of one HVP by each way of composing JAX's derivatives, on the same vector:
  forward-over-reverse (``hvp``), the same with ``grad(L)`` linearised once (what the solvers
  apply), the pullback of ``grad(L)`` taken once (reverse-over-reverse that keeps the gradient's
  graph, as PyHessian does; H is symmetric), reverse-over-forward (the gradient of the directional
  derivative) and reverse-over-reverse from scratch (the gradient of ∇L·v)."""
  linear = linearized_hvp(loss_fn, params)

  def reverse_over_forward(f, p, v):
    return jax.grad(lambda q: jax.jvp(f, (q,), (v,))[1])(p)

  def reverse_over_reverse(f, p, v):
    return jax.grad(lambda q: sum(jnp.vdot(g, t) for g, t in zip(
        jax.tree.leaves(jax.grad(f)(q)), jax.tree.leaves(v), strict=True)))(p)

  pullback = jax.jit(lambda f, p: jax.vjp(jax.grad(f), p)[1])(loss_fn, params)
  ways = {
      "jvp_of_grad": lambda: hvp(loss_fn, params, vector),
      "vjp_of_grad": functools.partial(jax.jit(lambda pull, v: pull(v)[0]), pullback, vector),
      "linearized": functools.partial(jax.jit(lambda lin, v: lin(v)), linear, vector),
      "grad_of_jvp": functools.partial(jax.jit(reverse_over_forward), loss_fn, params, vector),
      "grad_of_grad_dot": functools.partial(jax.jit(reverse_over_reverse), loss_fn, params,
                                            vector),
  }
  return alternating_medians(ways, repeats)


def alternating_medians(ways: dict, repeats: int) -> dict:
  """Median seconds of each ``ways[name]()``, the ways taking turns (``timing.alternate``)."""
  return {name: float(np.median(t)) for name, t in alternate(ways, repeats).items()}


def spectrum_on_devices(data: str, width: int, batches: int, batch_size: int, max_iters: int,
                        tol: float, repeats: int) -> dict:
  """``max_eigenvalue_spectrum`` (top-1 Lanczos, ``batches`` batches of ``batch_size`` images,
  ``resnet_dnn_18`` of ``width``) on a mesh of 8 simulated CPU devices against 1, in a child
  process on the CPU (the device count is fixed when JAX starts)."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
  child = subprocess.run(
      [sys.executable, os.path.abspath(__file__), "--spectrum-child", "--data", data,
       "--spectrum-width", str(width), "--spectrum-batches", str(batches), "--batch-size",
       str(batch_size), "--max-iters", str(max_iters), "--tol", str(tol), "--repeats",
       str(repeats)],
      env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}, capture_output=True,
      text=True, check=True)
  return json.loads(child.stdout)


def spectrum_child(args) -> dict:
  """The child of :func:`spectrum_on_devices`: both meshes take turns (``--repeats`` rounds after
  one that compiles); the same eigenvalues from both, to rounding."""
  from smoothing_jax.analysis.spectrum import max_eigenvalue_spectrum
  from smoothing_jax.parallel import create_mesh
  count = args.spectrum_batches
  images, labels, source = cifar_batch(args.data, args.batch_size * count)
  model, variables, _, _ = reference_variables(args.spectrum_width, images)
  batches = [{"image": images[i::count], "label": labels[i::count]} for i in range(count)]
  results = {}

  def run(devices):
    results[devices] = max_eigenvalue_spectrum(
        model, variables, batches, k=1, weight_decay=0.0, max_iters=args.max_iters, tol=args.tol,
        rng=jax.random.key(4), mesh=create_mesh(devices))
    return results[devices]["eigenvalues"]

  seconds = alternating_medians({8: lambda: run(8), 1: lambda: run(1)}, args.repeats)
  return {
      "width": args.spectrum_width,
      "batches": f"{count} batches of {args.batch_size} images from {source}",
      "cpu_cores": os.cpu_count(),
      "seconds_1_device": seconds[1],
      "seconds_8_devices": seconds[8],
      "ratio_8_over_1": seconds[8] / seconds[1],
      "hvps": results[8]["hvps"].tolist(),
      "max_relative_difference": float(np.max(np.abs(results[8]["eigenvalues"] -
                                                     results[1]["eigenvalues"]) /
                                              np.abs(results[1]["eigenvalues"]))),
      "relative_residuals": results[8]["relative_residuals"].ravel().tolist(),
  }


def has_pyhessian() -> bool:
  return importlib.util.find_spec("pyhessian") is not None


def time_pyhessian(net, images, labels, k, tol, max_iters, residual_of, seed, cuda=False):
  """PyHessian's power iteration, timed from its constructor (which takes the gradient); with
  ``cuda``, on the GPU (``net`` already there; PyHessian moves the batch)."""
  import pyhessian
  import torch
  pyhessian_module = sys.modules["pyhessian.hessian"]  # the package's name `hessian` is a class
  x = torch.from_numpy(images.transpose(0, 3, 1, 2).copy())
  y = torch.from_numpy(labels)
  original, calls = pyhessian_module.hessian_vector_product, [0]

  def counted(*args, **kwargs):
    calls[0] += 1
    return original(*args, **kwargs)

  pyhessian_module.hessian_vector_product = counted
  try:
    net.zero_grad(set_to_none=True)  # PyHessian reads .grad after its own backward()
    torch.manual_seed(seed)  # its start vectors: torch.randint_like(p, high=2)
    start = time.perf_counter()
    computer = pyhessian.hessian(net, torch.nn.CrossEntropyLoss(), data=(x, y), cuda=cuda)
    eigenvalues, eigenvectors = computer.eigenvalues(maxIter=max_iters, tol=tol, top_n=k)
    seconds = time.perf_counter() - start
  finally:
    pyhessian_module.hessian_vector_product = original
  names = [name for name, _ in net.named_parameters()]
  residuals = [
      residual_of(value, {n: t.detach().cpu().numpy() for n, t in zip(names, vector, strict=True)})
      for value, vector in zip(eigenvalues, eigenvectors, strict=True)
  ]
  return {"seconds": seconds, "hvps": calls[0], "eigenvalues": [float(e) for e in eigenvalues],
          "relative_residuals": residuals}


def pyhessian_to_residual(net, images, labels, k, args, residual_of, seed) -> dict:
  """PyHessian at equal accuracy: :func:`time_pyhessian` with each change tolerance of
  ``args.pyhessian_tols`` in turn (``maxIter=args.pyhessian_max_iters``), then without its
  stopping rule (``tol=0``: every one of ``maxIter`` HVPs per eigenvalue) for each budget of
  ``args.pyhessian_budgets``, until every pair's relative residual is ≤ ``args.tol``; the run
  that got there (``reached``), else the last."""
  tries = [(tol, args.pyhessian_max_iters) for tol in args.pyhessian_tols]
  tries += [(0.0, budget) for budget in args.pyhessian_budgets]
  for tol, budget in tries:
    run = time_pyhessian(net, images, labels, k, tol, budget, residual_of, seed)
    run.update(change_tol=tol, max_iters=budget,
               reached=max(run["relative_residuals"]) <= args.tol)
    if run["reached"]:
      break
  return run


def batch_loss(model, variables, images, labels) -> Partial:
  """``loss_fn(params)``: cross-entropy of one batch, BatchNorm in eval mode, no weight decay."""
  return Partial(functools.partial(training_loss, model, 0.0), variables["batch_stats"],
                 jax.random.key(2), jnp.asarray(images), jnp.asarray(labels, jnp.int32))


def pyhessian_residual(loss_fn, params, state_dict, width):
  """``residual_of(value, torch_params)``: ‖Hv − λv‖/|λ| of a PyHessian pair, with v (named like
  ``state_dict``) mapped onto our ``resnet_dnn_18`` parameters."""
  def residual_of(value, torch_params):
    v = from_torch_state_dict("resnet_dnn_18", {**state_dict, **torch_params},
                              width=width)["params"]
    hv = ravel_pytree(hvp(loss_fn, params, v))[0]
    return float(jnp.linalg.norm(hv - value * ravel_pytree(v)[0]) / abs(value))
  return residual_of


def pyhessian_hvp_seconds(net, images, labels, repeats):
  if net is None or not has_pyhessian():
    return None
  import pyhessian
  import torch
  from pyhessian.utils import hessian_vector_product
  x, y = torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), torch.from_numpy(labels)
  net.zero_grad(set_to_none=True)
  computer = pyhessian.hessian(net, torch.nn.CrossEntropyLoss(), data=(x, y), cuda=False)
  vector = [torch.randn_like(p) for p in computer.params]
  hessian_vector_product(computer.gradsH, computer.params, vector)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    hessian_vector_product(computer.gradsH, computer.params, vector)
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--data", default=DEFAULT_DATA, help="folder with test.npz (CIFAR-10)")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--top", type=int, nargs="+", default=[1, 5], help="values of k")
  parser.add_argument("--tol", type=float, default=1e-3)
  parser.add_argument("--max-iters", type=int, default=100)
  parser.add_argument("--repeats", type=int, default=3, help="timings of one HVP / gradient")
  parser.add_argument("--seeds", type=int, default=3, help="random starts of the top-1 runs")
  parser.add_argument("--seeds-top-k", type=int, default=1,
                      help="random starts of the top-k runs for k > 1 (minutes each)")
  parser.add_argument("--solvers", nargs="+", choices=SOLVERS, default=list(SOLVERS),
                      help="the solvers run for each k (e.g. lanczos alone: its overhead over "
                           "its HVPs at k = 5 in minutes, without PyHessian's long runs)")
  parser.add_argument("--pyhessian-tols", type=float, nargs="*", default=[1e-4, 1e-5, 1e-6],
                      help="PyHessian's change tolerances tried in turn for the equal-accuracy "
                           "runs (none: skip them)")
  parser.add_argument("--pyhessian-max-iters", type=int, default=1000)
  parser.add_argument("--pyhessian-budgets", type=int, nargs="*", default=[],
                      help="then, for the equal-accuracy runs, PyHessian without its change rule "
                           "(tol 0) for this many HVPs per eigenvalue, each in turn")
  parser.add_argument("--spectrum-batches", type=int, default=8,
                      help="batches of the spectrum on 8 devices against 1 (0: skip)")
  parser.add_argument("--spectrum-width", type=int, default=16)
  parser.add_argument("--spectrum-child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.spectrum_child:
    print(json.dumps(spectrum_child(args)))
    return

  images, labels, source = cifar_batch(args.data, args.batch_size)
  model, variables, net, state_dict = reference_variables(args.width, images)
  params = variables["params"]
  loss_fn = batch_loss(model, variables, images, labels)

  grad_fn = jax.jit(jax.grad(lambda p, f: f(p)))
  vector = jax.tree.map(lambda p: jax.random.normal(jax.random.key(3), p.shape), params)
  variants = hvp_variants(loss_fn, params, vector, args.repeats)
  result = {
      "benchmark": "hessian",
      "model": "resnet_dnn_18",
      "width": args.width,
      "batch": f"{args.batch_size} images from {source}",
      "num_params": int(sum(p.size for p in jax.tree.leaves(params))),
      "device": str(jax.devices()[0]),
      "tol": args.tol,
      "max_iters": args.max_iters,
      "gradient_seconds": median_seconds(lambda: grad_fn(params, loss_fn), args.repeats),
      "hvp_seconds": variants["jvp_of_grad"],
      "linearized_hvp_seconds": variants["linearized"],
      "hvp_variants_seconds": variants,
      "pyhessian_hvp_seconds": pyhessian_hvp_seconds(net, images, labels, args.repeats),
  }

  linear = linearized_hvp(loss_fn, params)
  one_hvp = functools.partial(jax.jit(lambda lin, v: lin(v)), linear, vector)
  for k in args.top:
    # Both libraries start from a random vector, and the HVPs a run needs depend on it: runs
    # repeat over --seeds starts (top-1) or --seeds-top-k (k > 1: minutes each) and compare
    # medians.
    seeds = range(args.seeds if k == 1 else args.seeds_top_k)
    runs = {}
    ours = [method for method in ("lanczos", "power") if method in args.solvers]
    for method in ours:
      runs[f"ours_{method}"] = []
      for seed in seeds:
        run = time_ours(loss_fn, params, k, method, args.tol, args.max_iters,
                        jax.random.key(4 + seed))
        # The solve's time over its HVPs' alone, one linearised HVP timed right after it.
        run["hvp_seconds_after"] = median_seconds(one_hvp, args.repeats)
        run["seconds_over_hvps"] = run["seconds"] / (run["hvps"] * run["hvp_seconds_after"])
        runs[f"ours_{method}"].append(run)
    if "pyhessian" in args.solvers and net is not None and has_pyhessian():
      residual_of = pyhessian_residual(loss_fn, params, state_dict, args.width)
      runs["pyhessian"] = [time_pyhessian(net, images, labels, k, args.tol, args.max_iters,
                                          residual_of, seed) for seed in seeds]
      if args.pyhessian_tols or args.pyhessian_budgets:
        runs["pyhessian_at_residual"] = [
            pyhessian_to_residual(net, images, labels, k, args, residual_of, seed)
            for seed in seeds]
    median = {name: float(np.median([r["seconds"] for r in rs])) for name, rs in runs.items()}
    for name, rs in runs.items():
      result[f"{name}_top{k}"] = rs if len(rs) > 1 else rs[0]
      result[f"{name}_top{k}_median_seconds"] = median[name]
    for method in ours:
      result[f"{method}_top{k}_median_seconds_over_hvps"] = float(np.median(
          [r["seconds_over_hvps"] for r in runs[f"ours_{method}"]]))
    if "pyhessian" in runs:
      for method in ours:
        result[f"{method}_speedup_vs_pyhessian_top{k}"] = (median["pyhessian"] /
                                                           median[f"ours_{method}"])
    if "pyhessian_at_residual" in runs and "ours_lanczos" in runs:
      reached = all(r["reached"] for r in runs["pyhessian_at_residual"])
      result[f"lanczos_speedup_at_equal_residual_top{k}"] = (
          median["pyhessian_at_residual"] / median["ours_lanczos"] if reached else None)
      result[f"max_relative_residual_top{k}"] = {
          name: float(max(max(r["relative_residuals"]) for r in runs[name]))
          for name in ("ours_lanczos", "pyhessian", "pyhessian_at_residual")}
  if args.spectrum_batches:
    result["spectrum_8_vs_1_devices"] = spectrum_on_devices(
        args.data, args.spectrum_width, args.spectrum_batches, args.batch_size, args.max_iters,
        args.tol, args.repeats)
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  main()
