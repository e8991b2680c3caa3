"""Lesion study (HV Sec. 4.1): remove one unit of a trained network at test time, measure the
accuracy drop.

A unit is one residual block (ViT: an MSA or an MLP unit; AlterNet: a Conv or MSA
block); removing it sets its residual branch to zero, x ↦ x, through the models'
``block_mask``.  All lesions share one compiled forward pass (the mask is an argument).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp

from smoothing_jax.passes import sample_rngs


@functools.partial(jax.jit, static_argnums=0)
def _correct(model, variables, images, labels, block_mask, rng):
  logits = model.apply(variables, images, train=False, block_mask=block_mask, rngs=sample_rngs(rng))
  return jnp.sum(jnp.argmax(logits, -1) == labels)


def lesion_accuracy_drops(model, variables, batches: Iterable[dict], rng=None) -> dict:
  """Accuracy with each unit removed.

  Args:
    model: a model with ``units()`` and a ``block_mask`` argument (ViT, AlterNet).
    batches: evaluation batches ``{"image", "label"}`` (normalised images).

  Returns ``{"accuracy": float, "units": [{"index", "name", "kind", "accuracy", "drop"}]}``,
  drop = full-model accuracy − accuracy without the unit (percentage points ×0.01).
  """
  if not hasattr(model, "units"):
    raise ValueError(
        f"{type(model).__name__} has no residual units to lesion; use a ViT or AlterNet.")
  rng = jax.random.key(0) if rng is None else rng
  units = model.units()
  batches = [(jnp.asarray(b["image"]), jnp.asarray(b["label"])) for b in batches]
  total = sum(int(y.shape[0]) for _, y in batches)

  def accuracy(mask):
    return sum(int(_correct(model, variables, x, y, mask, rng)) for x, y in batches) / total

  keep_all = jnp.ones(len(units), jnp.float32)
  full = accuracy(keep_all)
  rows = []
  for i, (name, kind) in enumerate(units):
    acc = accuracy(keep_all.at[i].set(0.0))
    rows.append({"index": i, "name": name, "kind": kind, "accuracy": acc, "drop": full - acc})
  return {"accuracy": full, "units": rows}


def lesion_table(result: dict) -> str:
  """Markdown table of a :func:`lesion_accuracy_drops` result."""
  lines = [f"full model: {100 * result['accuracy']:.2f}% accuracy", "",
           "| unit | block | kind | accuracy (%) | drop (pp) |", "|---|---|---|---|---|"]
  lines += [
      f"| {r['index']} | {r['name']} | {r['kind']} | {100 * r['accuracy']:.2f} | "
      f"{100 * r['drop']:.2f} |"
      for r in result["units"]
  ]
  return "\n".join(lines)
