"""Benchmark: seconds per Hessian-vector product and per top-1 eigenvalue vs one gradient step.

Prints one JSON object measured in one run: the gradient of the training
objective (NLL + L2, BatchNorm in inference mode, fixed dropout key), one HVP
(forward-over-reverse), and a top-1 eigenvalue by power iteration, for
``resnet_dnn_smoothing_18`` on CIFAR-shaped batches.  With PyTorch installed it
also times the double-backward HVP of an equivalent PyTorch network (the
``smoothing_jax.torch_reference`` re-implementation) as the peer comparison.

  python experiments/bench_hessian.py                               # batch 128, full width
  python experiments/bench_hessian.py --batch-size 32 --width 16 --max-iters 20   # quick
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import Partial

from timing import median_seconds

from smoothing_jax.analysis.hessian import hvp, top_eigenvalues
from smoothing_jax.analysis.spectrum import training_loss
from smoothing_jax.models import get_model


def torch_hvp_seconds(width, images, labels, repeats):
  """Double-backward HVP of the PyTorch re-implementation (None if torch is missing)."""
  try:
    import torch
  except ImportError:
    return None
  from smoothing_jax.torch_reference import ResNet, randomize
  device = "cuda" if torch.cuda.is_available() else "cpu"
  net = randomize(ResNet((2, 2, 2, 2), False, 10, width=width, smoothing=True)).to(device).eval()
  x = torch.from_numpy(np.asarray(images).transpose(0, 3, 1, 2)).to(device)
  y = torch.from_numpy(np.asarray(labels)).long().to(device)
  params = [p for p in net.parameters()]
  vector = [torch.randn_like(p) for p in params]

  def run():
    loss = torch.nn.functional.cross_entropy(net(x), y)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    dot = sum((g * v).sum() for g, v in zip(grads, vector))
    out = torch.autograd.grad(dot, params)
    if device == "cuda":
      torch.cuda.synchronize()
    return out

  run()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="resnet_dnn_smoothing_18")
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--width", type=int, default=None)
  parser.add_argument("--max-iters", type=int, default=100)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)

  overrides = {} if args.width is None else {"width": args.width}
  model = get_model(args.model, 10, **overrides)
  images = jax.random.normal(jax.random.key(0), (args.batch_size, 32, 32, 3))
  labels = jnp.arange(args.batch_size) % 10
  variables = jax.jit(model.init)(jax.random.key(1), images[:1])
  params = variables["params"]
  loss_fn = Partial(functools.partial(training_loss, model, 5e-4), variables["batch_stats"],
                    jax.random.key(2), images, labels)
  grad_fn = jax.jit(jax.grad(lambda p, f: f(p)))
  vector = jax.tree.map(lambda p: jax.random.normal(jax.random.key(3), p.shape), params)

  t_grad = median_seconds(lambda: grad_fn(params, loss_fn), args.repeats)
  t_hvp = median_seconds(lambda: hvp(loss_fn, params, vector), args.repeats)
  result = top_eigenvalues(loss_fn, params, k=1, max_iters=args.max_iters, rng=jax.random.key(4))
  jax.block_until_ready(result[0])
  start = time.perf_counter()
  result = top_eigenvalues(loss_fn, params, k=1, max_iters=args.max_iters, rng=jax.random.key(4))
  jax.block_until_ready(result[0])
  t_eig = time.perf_counter() - start
  t_torch = (torch_hvp_seconds(model.width, images, labels, args.repeats)
             if args.model == "resnet_dnn_smoothing_18" else None)
  print(
      json.dumps(
          {
              "benchmark": "hessian",
              "model": args.model,
              "overrides": overrides,
              "batch_size": args.batch_size,
              "num_params": int(sum(p.size for p in jax.tree.leaves(params))),
              "device": str(jax.devices()[0]),
              "gradient_seconds": t_grad,
              "hvp_seconds": t_hvp,
              "hvp_over_gradient": t_hvp / t_grad,
              "top1_eigenvalue": float(result.eigenvalues[0]),
              "top1_iterations": int(result.iterations[0]),
              "top1_seconds": t_eig,
              "top1_over_gradient": t_eig / t_grad,
              "torch_double_backward_hvp_seconds": t_torch,
              "jax_hvp_speedup_vs_torch": (t_torch / t_hvp) if t_torch else None
          },
          indent=2))


if __name__ == "__main__":
  main()
