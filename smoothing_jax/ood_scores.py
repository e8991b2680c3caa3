"""OpenOOD v1.5's post-hoc OOD scores (Jingkang50/OpenOOD at 3c35632,
``openood/postprocessors/``), as pure functions of what one forward pass gives: logits
``[N, B, C]`` of N draws (MC samples, ensemble members; N = 1 for one network) and the
penultimate features ``[B, D]`` of one draw.

**Sign:** every score is a confidence, higher meaning "in-distribution", as OpenOOD's ``conf``
(so ``ranking.detection_metrics`` takes them as they are).

**Draws** (OpenOOD scores one network; the field has no convention for N > 1 except for the
predictive's own scores):

* MSP, entropy and mutual information score the predictive p̄ = (1/N) Σ_n softmax(f_n), as
  the ensemble literature does (Lakshminarayanan et al. 2017; MI = H(p̄) − mean_n H(p_n) is 0
  at N = 1); EPKL, the draws' mean pairwise KL divergence, is 0 at N = 1 too.
* Max-logit, energy and ODIN are offered in two conventions (``combine``): ``"score_mean"``,
  the mean over draws of each draw's own score, and ``"mean"``, the score of the draws' mean
  logits (ODIN: of their mean tempered softmax).  **The default is** ``"score_mean"``: it is
  the only one that holds for the fitted feature scores too (MDS, RMDS, KNN, ViM: the members
  of a deep ensemble do not share one feature space, so their mean feature means nothing), one
  convention for all keeps the scores comparable, and its nested sizes cost nothing more (the
  first n draws' mean is a running mean of per-draw scores).  The fitted scores are functions
  of one draw's features, so per draw only; the evaluator fits and scores each draw and
  averages.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

COMBINE = ("score_mean", "mean")

# OpenOOD's settings (configs/postprocessors/{ebo,odin,knn,vim}.yml at 3c35632).
ENERGY_TEMPERATURE = 1.0
ODIN_TEMPERATURE = 1000.0
ODIN_NOISE = 0.0014
KNN_K = 50
VIM_DIM = 256


def _check_combine(combine: str) -> None:
  if combine not in COMBINE:
    raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}.")


def _combined(score_fn: Callable, logits, combine: str):
  """``score_fn`` ([..., C] → [...]) of ``logits [N, B, C]`` in the convention ``combine``."""
  _check_combine(combine)
  logits = jnp.asarray(logits, jnp.float32)
  if combine == "mean":
    return score_fn(jnp.mean(logits, axis=0))
  return jnp.mean(score_fn(logits), axis=0)


def _entropy(probs):
  return -jnp.sum(jnp.where(probs > 0, probs * jnp.log(jnp.where(probs > 0, probs, 1.0)), 0.0),
                  axis=-1)


def msp(logits):
  """Maximum softmax probability of the predictive p̄ (``base_postprocessor.py``:
  ``softmax(output).max``)."""
  return jnp.max(jnp.mean(jax.nn.softmax(jnp.asarray(logits, jnp.float32)), axis=0), axis=-1)


def entropy(logits):
  """−H(p̄): minus the predictive's entropy (nats)."""
  return -_entropy(jnp.mean(jax.nn.softmax(jnp.asarray(logits, jnp.float32)), axis=0))


def mutual_information(logits):
  """−(H(p̄) − mean_n H(p_n)): minus the mutual information between prediction and draw (the
  epistemic part); exactly 0 for one draw (computed, it would be round-off of either sign)."""
  probs = jax.nn.softmax(jnp.asarray(logits, jnp.float32))
  if probs.shape[0] == 1:
    return jnp.zeros(probs.shape[1:-1], jnp.float32)
  return -(_entropy(jnp.mean(probs, axis=0)) - jnp.mean(_entropy(probs), axis=0))


def expected_pairwise_kl(logits):
  """−EPKL (Malinin et al. 2020, "Ensemble Distribution Distillation"): minus the mean KL
  divergence between two different draws, ``[N, B, C]`` → ``[B]``,

    EPKL = 1/(N(N−1)) Σ_{i≠j} KL(p_i ‖ p_j) = N/(N−1) · mean_i Σ_c p_ic (log p_ic − L̄_c),

  L̄_c = mean_j log p_jc (the diagonal's KL(p_i ‖ p_i) = 0 is left out, so this is N/(N−1) times
  the Shifts challenge's plug-in −Σ_c p̄_c L̄_c − mean_i H(p_i), which averages it in).  Like
  mutual information, exactly 0 for one draw."""
  log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
  num_draws = log_probs.shape[0]
  if num_draws == 1:
    return jnp.zeros(log_probs.shape[1:-1], jnp.float32)
  plug_in = jnp.mean(jnp.sum(jnp.exp(log_probs) * (log_probs - jnp.mean(log_probs, axis=0)),
                             axis=-1), axis=0)
  return -num_draws / (num_draws - 1) * plug_in


def max_logit(logits, combine: str = "score_mean"):
  """The largest logit (MLS, ``maxlogit_postprocessor.py``); draws by ``combine`` (module
  docstring)."""
  return _combined(lambda f: jnp.max(f, axis=-1), logits, combine)


def energy(logits, temperature: float = ENERGY_TEMPERATURE, combine: str = "score_mean"):
  """Minus the free energy, T·logsumexp(f/T) (EBO, ``ebo_postprocessor.py``; T = 1); draws by
  ``combine``."""
  return _combined(lambda f: temperature * jax.nn.logsumexp(f / temperature, axis=-1), logits,
                   combine)


def odin_draws(logits_fn: Callable, inputs, *, num_draws: int, input_std: Sequence[float],
               temperature: float = ODIN_TEMPERATURE, noise: float = ODIN_NOISE,
               combine: str = "score_mean", has_aux: bool = False):
  """ODIN (Liang et al. 2018; ``odin_postprocessor.py``): the MSP at temperature T of the input
  moved by ``noise`` against the gradient of the tempered cross-entropy of the predicted class.

  ``logits_fn(x) -> [N, B, C]`` is the model's N = ``num_draws`` draws, draw n on the
  normalised inputs ``x[n]`` (``x``: ``[N, B, H, W, 3]``); ``inputs``: ``[B, H, W, 3]``.  As
  OpenOOD, the step is ``noise`` in pixel units, so ``noise / input_std`` per channel of the
  normalised inputs:
  x̃ = x − noise · sign(∇ₓ L) / σ (a zero gradient counts as positive: ``torch.ge(grad, 0)``).
  ``L`` is OpenOOD's batch *mean* cross-entropy; only its sign per input matters and examples
  do not interact in evaluation mode, so each example's step is its own.

  ``combine="score_mean"``: each draw moves the input by the gradient of its own loss and is
  scored there (draw n's loss depends on x[n] only, so one backward pass gives every draw's
  gradient): ``[N, B]``, one MSP per draw (:func:`odin` averages them).  ``"mean"``: one step
  for all, by the gradient of −log p̄_T(ŷ) of the draws' mean tempered softmax, and that
  mean's MSP: ``[1, B]``.  Draws must be the same function
  in both passes (the same keys).

  ``has_aux``: ``logits_fn`` returns ``(logits, aux)``, and this ``(scores, logits, aux)`` of the
  unmoved inputs: the pass the gradient is taken through, which the caller need not repeat.
  """
  _check_combine(combine)
  std = jnp.asarray(input_std, jnp.float32)
  inputs = jnp.asarray(inputs, jnp.float32)
  tile = lambda x: jnp.broadcast_to(x, (num_draws,) + inputs.shape)  # noqa: E731

  def predictive(logits, t):  # [N, B, C] → log-probabilities of the one or N predictives
    log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / t)
    if combine == "mean":
      return (jax.nn.logsumexp(log_probs, axis=0) - jnp.log(log_probs.shape[0]))[None]
    return log_probs

  def loss(logits, labels):
    log_probs = predictive(logits, temperature)
    picked = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.mean(picked, axis=-1))  # each predictive's batch mean, summed

  # "mean": one input for every draw, so the gradient sums over its copies.
  draws_of = (lambda x: logits_fn(tile(x))) if combine == "mean" else logits_fn
  logits, pullback, *aux = jax.vjp(draws_of, inputs if combine == "mean" else tile(inputs),
                                   has_aux=has_aux)
  # The class predicted at T = 1, a constant (OpenOOD's ``output.detach().argmax``).
  labels = jnp.argmax(predictive(jax.lax.stop_gradient(logits), 1.0), axis=-1)
  gradient = pullback(jax.grad(loss)(logits, labels))[0]
  moved = jax.lax.stop_gradient(tile(inputs) - noise * jnp.where(gradient >= 0, 1.0, -1.0) / std)
  moved_logits = logits_fn(moved)
  moved_logits = moved_logits[0] if has_aux else moved_logits
  # [N, B] per draw ("score_mean"), [1, B] for the mean predictive.
  scores = jnp.max(jnp.exp(predictive(moved_logits, temperature)), axis=-1)
  return (scores, logits, aux[0]) if has_aux else scores


def odin(logits_fn: Callable, inputs, *, num_draws: int, input_std: Sequence[float],
         temperature: float = ODIN_TEMPERATURE, noise: float = ODIN_NOISE,
         combine: str = "score_mean"):
  """ODIN's confidence ``[B]``: the mean of :func:`odin_draws`."""
  return jnp.mean(odin_draws(logits_fn, inputs, num_draws=num_draws, input_std=input_std,
                             temperature=temperature, noise=noise, combine=combine), axis=0)


# ------------------------------------------------------------------------ fitted on training


def _precision(centered) -> np.ndarray:
  """The inverse of the maximum-likelihood covariance (1/n, as
  ``sklearn.covariance.EmpiricalCovariance(assume_centered=False)``, which centres again:
  the rows are centred already, so that is a no-op up to round-off)."""
  centered = centered - centered.mean(axis=0)
  covariance = centered.T @ centered / len(centered)
  return np.linalg.pinv(covariance, hermitian=True)


def fit_mds(features, labels, num_classes: int) -> dict:
  """``{"means" [C, D], "precision" [D, D]}``: class means and the precision of the features
  centred by their class (one shared covariance; ``mds_postprocessor.py`` ``setup``), in
  float64.  A class without training features is refused in one line."""
  features = np.asarray(features, np.float64)
  labels = np.asarray(labels)
  missing = [c for c in range(num_classes) if not np.any(labels == c)]
  if missing:
    raise ValueError(f"MDS needs training features of every class; classes {missing} have none.")
  means = np.stack([features[labels == c].mean(axis=0) for c in range(num_classes)])
  return {"means": means, "precision": _precision(features - means[labels])}


def _max_neg_mahalanobis(features, means, precision):
  centered = jnp.asarray(features)[..., None, :] - jnp.asarray(means)        # [B, C, D]
  return -jnp.einsum("bcd,de,bce->bc", centered, jnp.asarray(precision), centered)


def mds(features, stats: dict):
  """Minus the smallest class-conditional Mahalanobis distance (squared) of ``features``
  ``[B, D]`` (``mds_postprocessor.py``; ``stats``: :func:`fit_mds`)."""
  return jnp.max(_max_neg_mahalanobis(features, stats["means"], stats["precision"]), axis=-1)


def fit_rmds(features, labels, num_classes: int) -> dict:
  """:func:`fit_mds`'s statistics and the background's: ``"whole_mean"``, ``"whole_precision"``
  of all features about their mean (``rmds_postprocessor.py`` ``setup``)."""
  features = np.asarray(features, np.float64)
  whole_mean = features.mean(axis=0)
  return {**fit_mds(features, labels, num_classes), "whole_mean": whole_mean,
          "whole_precision": _precision(features - whole_mean)}


def rmds(features, stats: dict):
  """Relative Mahalanobis (Ren et al. 2021; ``rmds_postprocessor.py``): max over classes of
  (minus the class distance plus the background distance)."""
  background = jnp.asarray(features) - jnp.asarray(stats["whole_mean"])
  background = jnp.einsum("bd,de,be->b", background, jnp.asarray(stats["whole_precision"]),
                          background)
  return jnp.max(_max_neg_mahalanobis(features, stats["means"], stats["precision"])
                 + background[:, None], axis=-1)


def knn_normalize(features):
  """``x / ‖x‖ + 1e-10``, OpenOOD's ``normalizer`` (``knn_postprocessor.py`` l. 11): the
  1e-10 is *added* after the division, as there, not a guard on the norm."""
  features = jnp.asarray(features, jnp.float32)
  return features / jnp.linalg.norm(features, axis=-1, keepdims=True) + 1e-10


def fit_knn(features) -> dict:
  """``{"bank" [M, D]}``: the normalised training features (``knn_postprocessor.py``
  ``setup``)."""
  return {"bank": np.asarray(knn_normalize(features))}


def knn(features, stats: dict, k: int = KNN_K, chunk: int = 8192):
  """Minus the squared Euclidean distance of the normalised ``features [B, D]`` to their k-th
  nearest normalised training feature (Sun et al. 2022; ``knn_postprocessor.py``: faiss
  ``IndexFlatL2`` returns squared distances, and the score is ``-D[:, -1]``).  Exact: every
  training feature is compared, ``chunk`` of them at a time (bounded memory)."""
  bank = jnp.asarray(stats["bank"], jnp.float32)
  if k > bank.shape[0]:
    raise ValueError(f"KNN with K = {k} needs at least {k} training features, got "
                     f"{bank.shape[0]}.")
  query = knn_normalize(features)
  query_norms = jnp.sum(query ** 2, axis=-1, keepdims=True)
  nearest = None  # the k smallest squared distances so far, [B, k]
  for start in range(0, bank.shape[0], chunk):
    part = bank[start:start + chunk]
    distances = query_norms - 2 * query @ part.T + jnp.sum(part ** 2, axis=-1)
    candidates = distances if nearest is None else jnp.concatenate([nearest, distances], -1)
    nearest = -jax.lax.top_k(-candidates, min(k, candidates.shape[-1]))[0]
  return -jnp.maximum(nearest[:, k - 1], 0.0)


def vim_dim(width: int, dim: int = VIM_DIM) -> int:
  """The principal subspace's dimension for features of ``width``: OpenOOD's 256 (of
  ResNet-18's 512) where ``width`` exceeds it, otherwise half the width (the same share), so
  that a residual space is left."""
  return dim if width > dim else width // 2


def affine_head(features, logits) -> tuple:
  """``(kernel [D, C], bias [C])`` with logits = features · kernel + bias: the classifier read
  back from training features and logits by least squares (exact up to round-off where the
  model's last layer is that affine map and the features span it), so that ViM needs no access
  to the parameters of each method's head."""
  features = np.asarray(features, np.float64)
  design = np.concatenate([features, np.ones((len(features), 1))], axis=1)
  solution = np.linalg.lstsq(design, np.asarray(logits, np.float64), rcond=None)[0]
  return solution[:-1], solution[-1]


def fit_vim(features, kernel, bias, dim: int) -> dict:
  """``{"origin" [D], "null_space" [D, D − dim], "alpha"}`` of ViM (Wang et al. 2022;
  ``vim_postprocessor.py`` ``setup``): the origin u = −pinv(Wᵀ) b (W: ``kernel`` [D, C]), the
  eigenvectors of the uncentred covariance of features − u beyond the ``dim`` largest, and α =
  mean max logit / mean residual norm on the training features.  ``numpy.linalg.eigh``: the
  covariance is symmetric (OpenOOD's ``eig`` gives the same eigenvectors up to sign)."""
  features = np.asarray(features, np.float64)
  kernel, bias = np.asarray(kernel, np.float64), np.asarray(bias, np.float64)
  if not 0 < dim < features.shape[1]:
    raise ValueError(f"ViM's dim must be in (0, {features.shape[1]}) for features of width "
                     f"{features.shape[1]}, got {dim}.")
  origin = -np.linalg.pinv(kernel.T) @ bias
  shifted = features - origin
  eigenvalues, eigenvectors = np.linalg.eigh(shifted.T @ shifted / len(shifted))
  null_space = eigenvectors[:, np.argsort(-eigenvalues)[dim:]]
  residual = np.linalg.norm(shifted @ null_space, axis=-1)
  alpha = (features @ kernel + bias).max(axis=-1).mean() / residual.mean()
  return {"origin": origin, "null_space": null_space, "alpha": alpha, "kernel": kernel,
          "bias": bias}


def vim(features, stats: dict):
  """ViM: energy of the logits minus α · the norm of the features' residual (outside the
  principal subspace, about the origin u) (``vim_postprocessor.py`` ``postprocess``); the
  logits are the head's (``stats``' kernel and bias) on ``features [B, D]``."""
  features = jnp.asarray(features, jnp.float32)
  logits = features @ jnp.asarray(stats["kernel"], jnp.float32) + jnp.asarray(stats["bias"],
                                                                               jnp.float32)
  residual = jnp.linalg.norm((features - jnp.asarray(stats["origin"], jnp.float32))
                             @ jnp.asarray(stats["null_space"], jnp.float32), axis=-1)
  return jax.nn.logsumexp(logits, axis=-1) - stats["alpha"] * residual
