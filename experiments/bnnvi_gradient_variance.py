"""Gradient variance of Flipout against plain reparameterisation on one mean-field layer (why
``smoothing_jax.layers.mean_field`` uses Flipout; Wen et al. 2018, Fig. 1).

One ``MeanFieldDense`` (``--inputs`` → 10 classes) on a fixed batch of ``--batch`` inputs with
random labels, σ = ``--sigma`` everywhere.  The inputs are |N(0, 1)|, non-negative like the
post-ReLU features a classifier sees (``--gaussian_inputs``: N(0, 1), whose per-example gradients
are nearly orthogonal, so that decorrelating the examples buys less).  Over ``--draws`` noise
keys, the gradient of the mean cross-entropy with respect to μ and ρ by: Flipout (the layer: one
ε, random signs per example); plain reparameterisation (one W = μ + σ ∘ ε shared by the batch);
and one independent W per example (the variance floor Flipout approaches).  Reports the variance
over draws averaged over the parameters, and the ratios to plain reparameterisation.  Writes
``experiments/results/bnnvi_gradient_variance[_gaussian].json``.

  python experiments/bnnvi_gradient_variance.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from smoothing_jax.layers.mean_field import MeanFieldDense  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--inputs", type=int, default=256)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--draws", type=int, default=500)
  parser.add_argument("--sigma", type=float, nargs="+", default=[1e-3, 0.1])
  parser.add_argument("--gaussian_inputs", action="store_true")
  args = parser.parse_args(argv)
  key_x, key_y, key_p = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (args.batch, args.inputs))
  x = x if args.gaussian_inputs else jnp.abs(x)
  labels = jax.random.randint(key_y, (args.batch,), 0, 10)
  layer = MeanFieldDense(features=10)
  base = layer.init({"params": key_p, "noise": key_p}, x)["params"]

  def cross_entropy(logits):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  def flipout(params, key):
    return cross_entropy(layer.apply({"params": params}, x, rngs={"noise": key}))

  def shared(params, key):
    sigma = jax.nn.softplus(params["kernel_rho"])
    w = params["kernel"] + sigma * jax.random.normal(key, sigma.shape)
    return cross_entropy(x @ w + params["bias"])

  def per_example(params, key):
    sigma = jax.nn.softplus(params["kernel_rho"])
    w = params["kernel"] + sigma * jax.random.normal(key, (args.batch,) + sigma.shape)
    return cross_entropy(jnp.einsum("bi,bio->bo", x, w) + params["bias"])

  rows = []
  keys = jax.random.split(jax.random.key(1), args.draws)
  for sigma in args.sigma:
    params = {**base, "kernel_rho": jnp.full_like(base["kernel_rho"],
                                                  jnp.log(jnp.expm1(sigma)))}
    variances = {}
    for name, loss in (("reparameterisation", shared), ("flipout", flipout),
                       ("independent_per_example", per_example)):
      grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(params, keys)
      variances[name] = {p: float(jnp.mean(jnp.var(grads[p], axis=0)))
                         for p in ("kernel", "kernel_rho")}
    plain = variances["reparameterisation"]
    rows.append({"sigma": sigma, "variance": variances,
                 "ratio_to_reparameterisation": {
                     name: {p: v[p] / plain[p] for p in v} for name, v in variances.items()}})
  out = {"inputs": args.inputs, "batch": args.batch, "draws": args.draws,
         "input_distribution": "N(0, 1)" if args.gaussian_inputs else "|N(0, 1)|", "rows": rows}
  os.makedirs(RESULTS, exist_ok=True)
  name = "bnnvi_gradient_variance" + ("_gaussian" if args.gaussian_inputs else "")
  with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
