"""Accuracy and uncertainty metrics of a predictive distribution p̄ (reference ``ops/tests.py``).

All metrics come from one mergeable accumulator, :class:`UncertaintyMetrics`
(a ``clu.metrics.Metric``): per-batch sums, per-bin sums and confusion
matrices, so evaluating 10,000 images in padded, masked batches gives exactly
the numbers of evaluating them at once.  Definitions (conf = max_c p̄_c,
pred = argmax_c p̄_c, "certain" = conf > cutoff, cutoff 0.9):

* NLL = mean −log p̄(y);  Acc;  Top-5;  Brier = mean Σ_c (onehot_c − p̄_c)²
* ECE = Σ_b (n_b/N)|acc_b − conf_b| over ``num_bins`` equal-width bins (lo, hi], the float32
  confidences compared exactly with the float64 edges ``np.linspace(0, 1, num_bins + 1)``
  (:func:`bin_thresholds`); signed ECSE = Σ_b (n_b/N)(conf_b − acc_b).
  ``ece_convention="ss"`` computes them as SS's
  ``ops/tests.py`` does (HV's too): counts and accuracies over (lo, hi], but the confidences
  summed over [lo, hi), so a confidence of exactly 1.0 (saturated float32 softmax) is counted
  without its confidence and the ECE comes out lower; for comparisons with SS's published
  numbers only.
* Acc-90 = P(correct | certain), Unc-90 = P(not certain | wrong), Freq-90 = P(certain)
* IoU = mean over classes present in the labels of TP/(TP+FP+FN); IoU-90 on
  the certain examples only.

Segmentation uses the same accumulator per pixel: ``probs [B, H, W, C]``,
``labels [B, H, W]`` and ``mask = label_mask(labels, C, example_mask)``, which
drops void pixels (any label outside ``[0, C)``) from every metric.
:class:`TemporalConsistency` accumulates the agreement of consecutive frames'
argmax (paper Eq. 37; CONS of Table 2).

Note: the reference NLL averages per-batch means; here every example counts
once (identical for equal batch sizes).
"""
from __future__ import annotations

import functools

import clu.metrics
import flax
import jax
import jax.numpy as jnp
import numpy as np


def entropy(probs, axis: int = -1):
  """Shannon entropy −Σ p log p (nats), with 0·log 0 = 0."""
  return -jnp.sum(jax.scipy.special.xlogy(probs, probs), axis=axis)


def uncertainty_decomposition(sample_probs) -> dict:
  """Split predictive uncertainty of ``sample_probs [N, B, C]`` into parts, each ``[B]``.

  total = H[p̄] (predictive entropy), aleatoric = mean_n H[p_n] (expected
  entropy), epistemic = total − aleatoric (mutual information).
  """
  if sample_probs.ndim != 3:
    raise ValueError(
        f"sample_probs must have shape [num_samples, batch, classes], got {sample_probs.shape}.")
  total = entropy(jnp.mean(sample_probs, axis=0))
  aleatoric = jnp.mean(entropy(sample_probs), axis=0)
  return {"total": total, "aleatoric": aleatoric, "epistemic": total - aleatoric}


def label_mask(labels, num_classes: int, mask=None):
  """0/1 weights ``[B, ...]`` of the positions that count: label in ``[0, num_classes)`` (void /
  ignore labels are not), times an optional per-example ``mask [B]`` broadcast over the label's
  other axes."""
  labels = jnp.asarray(labels)
  valid = ((labels >= 0) & (labels < num_classes)).astype(jnp.float32)
  return valid if mask is None else valid * _broadcast_mask(mask, labels.shape)


def _broadcast_mask(mask, shape):
  """A 0/1 ``mask`` over the leading axes of ``shape`` (e.g. per example ``[B]``) extended to
  ``shape``."""
  mask = jnp.asarray(mask, jnp.float32)
  return jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim)), shape)


def _check_predictions(probs, labels, mask):
  if probs.ndim < 2:
    raise ValueError(f"probs must have shape [..., classes], got {probs.shape}.")
  if labels.shape != probs.shape[:-1]:
    raise ValueError(
        f"labels shape {labels.shape} does not match probs shape {probs.shape} without the "
        "class axis."
    )
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"labels must be integer class indices, got dtype {labels.dtype}.")
  if mask is not None and jnp.shape(mask) != labels.shape[:jnp.ndim(mask)]:
    raise ValueError(
        f"mask shape {jnp.shape(mask)} does not match (the leading axes of) labels shape "
        f"{labels.shape}.")


@jax.jit
def add_statistics(a, b):
  """Leaf-wise sum of two metric states (what ``merge`` means for sufficient statistics), as one
  compiled program: adding the leaves eagerly dispatched one program per leaf, each compiled for
  every new shape and sharding (13 for ``UncertaintyMetrics`` on an 8-device mesh)."""
  return jax.tree.map(jnp.add, a, b)


ECE_CONVENTIONS = ("consistent", "ss")


def bin_thresholds(num_bins: int) -> tuple:
  """``(below, above)``, float32 ``[num_bins + 1]``: the largest float32 at or below, and the
  smallest at or above, each float64 edge e of ``np.linspace(0, 1, num_bins + 1)`` (SS's edges).
  A float32 confidence c compares with e exactly through them: c > e ⇔ c > below, c ≥ e ⇔
  c ≥ above.  Binning by ``ceil(c · num_bins)`` in float32 rounded the product, so float32(0.4)
  (0.4000000060 > 0.4) fell one bin low."""
  edges = np.linspace(0.0, 1.0, num_bins + 1)
  nearest = edges.astype(np.float32)
  below = np.where(nearest > edges, np.nextafter(nearest, np.float32(-np.inf)), nearest)
  above = np.where(nearest < edges, np.nextafter(nearest, np.float32(np.inf)), nearest)
  return below, above


@functools.partial(jax.jit, static_argnames=("num_bins", "cutoff"))
def batch_statistics(probs, labels, mask, num_bins: int, cutoff: float) -> dict:
  """The fields of :meth:`UncertaintyMetrics.from_model_output` (``probs [..., C]``, ``labels
  [...]``, ``mask`` over their leading axes or None) as one compiled program: called eagerly on
  arrays sharded over several CPU devices, its thirty-odd operations were as many programs in
  flight at once (``experiments/abort_repro.py``; ``batch_statistics.__wrapped__`` is the
  op-by-op version)."""
  num_classes = probs.shape[-1]
  probs = probs.reshape(-1, num_classes).astype(jnp.float32)
  w = label_mask(labels, num_classes,
                 mask).reshape(-1)  # labels outside [0, C) (void) never count
  labels = jnp.where(w > 0, labels.reshape(-1), 0)

  conf = jnp.max(probs, axis=-1)
  pred = jnp.argmax(probs, axis=-1)
  p_true = jnp.take_along_axis(probs, labels[:, None], axis=-1)[:, 0]
  correct = (pred == labels).astype(jnp.float32)
  certain = (conf > cutoff).astype(jnp.float32)
  k = min(5, num_classes)
  in_top5 = jnp.any(jax.lax.top_k(probs, k)[1] == labels[:, None], axis=-1).astype(jnp.float32)
  onehot = jax.nn.one_hot(labels, num_classes)
  brier = jnp.sum((onehot - probs) ** 2, axis=-1)
  nll = -jnp.log(jnp.maximum(p_true, jnp.finfo(jnp.float32).tiny))
  below, above = bin_thresholds(num_bins)
  # Bin b holds confidences in (e_b, e_b+1]: b is the number of inner edges below conf.
  bins = jnp.searchsorted(below[1:-1], conf, side="left")
  bin_onehot = jax.nn.one_hot(bins, num_bins) * w[:, None]
  # SS's confidence sums: [e_b, e_b+1), b the number of upper edges at or below conf, so 1.0
  # falls in no bin (one_hot of nb is all zeros).
  ss_bins = jnp.searchsorted(above[1:], conf, side="right")
  ss_bin_onehot = jax.nn.one_hot(ss_bins, num_bins) * w[:, None]
  pred_onehot = jax.nn.one_hot(pred, num_classes)
  weighted_true = onehot * w[:, None]
  return dict(
      count=jnp.sum(w), nll_sum=jnp.sum(w * nll), correct=jnp.sum(w * correct),
      top5_correct=jnp.sum(w * in_top5), brier_sum=jnp.sum(w * brier),
      bin_count=jnp.sum(bin_onehot, axis=0), bin_correct=correct @ bin_onehot,
      bin_confidence=conf @ bin_onehot, bin_confidence_ss=conf @ ss_bin_onehot,
      certain_count=jnp.sum(w * certain), certain_correct=jnp.sum(w * certain * correct),
      wrong_uncertain=jnp.sum(w * (1 - correct) * (1 - certain)),
      confusion=weighted_true.T @ pred_onehot,
      certain_confusion=(weighted_true * certain[:, None]).T @ pred_onehot)


@flax.struct.dataclass
class UncertaintyMetrics(clu.metrics.Metric):
  """Sufficient statistics of the SS metrics; ``merge`` adds, ``compute`` returns a dict."""
  count: jax.Array
  nll_sum: jax.Array
  correct: jax.Array
  top5_correct: jax.Array
  brier_sum: jax.Array
  bin_count: jax.Array          # [num_bins]
  bin_correct: jax.Array        # [num_bins]
  bin_confidence: jax.Array     # [num_bins]
  bin_confidence_ss: jax.Array  # [num_bins], SS's [lo, hi) bins
  certain_count: jax.Array
  certain_correct: jax.Array
  wrong_uncertain: jax.Array
  confusion: jax.Array          # [C, C], rows = true class, columns = prediction
  certain_confusion: jax.Array  # [C, C]
  cutoff: float = flax.struct.field(pytree_node=False, default=0.9)
  ece_convention: str = flax.struct.field(pytree_node=False, default="consistent")

  @classmethod
  def from_model_output(cls, probs, labels, mask=None, *, num_bins: int = 10, cutoff: float = 0.9,
                        ece_convention: str = "consistent", **_) -> UncertaintyMetrics:
    """Statistics of one batch.

    Args:
      probs: ``[..., C]`` predictive probabilities (e.g. ``mc_predict(...).mean_probs``).
      labels: ``[...]`` integer labels.
      mask: optional 0/1 weights (padding examples = 0) over ``labels``' shape or its leading axes
        (a per-example ``[B]`` mask covers every pixel of a label map).
      num_bins: ECE bins (10 in the SS reference, 15 in iBNN / Guo et al.).
      cutoff: confidence threshold of the "-90" metrics (strictly greater is certain).
      ece_convention: ``"consistent"`` (ours) or ``"ss"`` (SS's mixed bin edges; see the module
        docstring).  Both sums are kept, so ``.replace(ece_convention=...)`` switches later.
    """
    if ece_convention not in ECE_CONVENTIONS:
      raise ValueError(f"Unknown ece_convention {ece_convention!r}; choose one of "
                       f"{ECE_CONVENTIONS}.")
    probs, labels = jnp.asarray(probs), jnp.asarray(labels)
    _check_predictions(probs, labels, mask)
    return cls(**batch_statistics(probs, labels, mask, num_bins, cutoff), cutoff=cutoff,
               ece_convention=ece_convention)

  def merge(self, other: UncertaintyMetrics) -> UncertaintyMetrics:
    if (self.cutoff != other.cutoff or self.bin_count.shape != other.bin_count.shape
        or self.ece_convention != other.ece_convention):
      raise ValueError("Cannot merge metrics computed with different cutoff, num_bins or "
                       "ece_convention.")
    return add_statistics(self, other)

  def reliability(self) -> dict:
    """Reliability-diagram data: per-bin ``accuracy``, ``confidence``, ``count`` and bin
    ``edges``."""
    count = np.asarray(self.bin_count, np.float64)
    safe = np.maximum(count, 1.0)
    confidence = self.bin_confidence_ss if self.ece_convention == "ss" else self.bin_confidence
    return {
        "accuracy": np.asarray(self.bin_correct) / safe,
        "confidence": np.asarray(confidence) / safe,
        "count": count,
        "edges": np.linspace(0.0, 1.0, count.shape[0] + 1)
    }

  def compute(self) -> dict:
    n = float(self.count)
    if n == 0:
      raise ValueError("No examples were accumulated (count is 0).")
    rel = self.reliability()
    gaps = rel["count"] / n * (rel["confidence"] - rel["accuracy"])
    wrong = n - float(self.correct)
    return {
        "count": n,
        "nll": float(self.nll_sum) / n,
        "acc": float(self.correct) / n,
        "top5": float(self.top5_correct) / n,
        "brier": float(self.brier_sum) / n,
        "ece": float(np.sum(np.abs(gaps))),
        "ecse": float(np.sum(gaps)),
        "acc90": float(self.certain_correct) / max(float(self.certain_count), 1.0),
        "unc90": float(self.wrong_uncertain) / wrong if wrong > 0 else 0.0,
        "freq90": float(self.certain_count) / n,
        "iou": mean_iou(self.confusion),
        "iou90": mean_iou(self.certain_confusion),
    }


@flax.struct.dataclass
class TemporalConsistency(clu.metrics.Metric):
  """Consistency (paper Eq. 37): the fraction of positions (examples or pixels) whose
  argmax prediction is the same in consecutive frames; ``compute()`` → ``{"consistency"}``."""
  agree: jax.Array
  total: jax.Array

  @classmethod
  def from_model_output(cls, probs, previous_probs, mask=None, **_) -> TemporalConsistency:
    """Agreement of ``probs [..., C]`` with the previous frame's ``previous_probs [..., C]``;
    ``mask [...]``: optional 0/1 weights of the positions that count."""
    probs, previous_probs = jnp.asarray(probs), jnp.asarray(previous_probs)
    if probs.shape != previous_probs.shape or probs.ndim < 2:
      raise ValueError(
          f"probs {probs.shape} and previous_probs {previous_probs.shape} must both be [..., C].")
    agree = (jnp.argmax(probs, -1) == jnp.argmax(previous_probs, -1)).astype(jnp.float32)
    w = jnp.ones(agree.shape, jnp.float32) if mask is None else _broadcast_mask(mask, agree.shape)
    return cls(agree=jnp.sum(w * agree), total=jnp.sum(w))

  @classmethod
  def from_sequence(cls, probs, mask=None) -> TemporalConsistency:
    """All consecutive pairs of a sequence ``probs [N, T, ..., C]`` (time on axis 1);
    ``mask [N, T-1, ...]`` weights the pair (t, t+1) at index t."""
    probs = jnp.asarray(probs)
    if probs.ndim < 3 or probs.shape[1] < 2:
      raise ValueError(f"Sequence predictions must be [N, T>=2, ..., C], got shape {probs.shape}.")
    return cls.from_model_output(probs[:, 1:], probs[:, :-1], mask)

  def merge(self, other: TemporalConsistency) -> TemporalConsistency:
    return add_statistics(self, other)

  def compute(self) -> dict:
    if float(self.total) == 0:
      raise ValueError("No frame pairs were accumulated (total is 0).")
    return {"consistency": float(self.agree) / float(self.total)}


def class_iou(confusion) -> np.ndarray:
  """Per-class TP / (TP + FP + FN) ``[C]`` from a confusion matrix (rows = true class); NaN
  without label support."""
  cm = np.asarray(confusion, np.float64)
  tp = np.diag(cm)
  support = cm.sum(axis=1)
  union = support + cm.sum(axis=0) - tp
  return np.where(support > 0, tp / np.maximum(union, 1e-300), np.nan)


def mean_iou(confusion) -> float:
  """Mean over classes with label support of TP / (TP + FP + FN); 0 if no class has support."""
  iou = class_iou(confusion)
  return float(np.nanmean(iou)) if np.any(~np.isnan(iou)) else 0.0


def evaluate(probs, labels, mask=None, *, num_bins: int = 10, cutoff: float = 0.9,
             ece_convention: str = "consistent") -> dict:
  """All metrics of one set of predictions ``probs [..., C]`` with ``labels [...]``."""
  return UncertaintyMetrics.from_model_output(probs, labels, mask, num_bins=num_bins,
                                              cutoff=cutoff,
                                              ece_convention=ece_convention).compute()
