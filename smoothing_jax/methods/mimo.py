"""MIMO (Havasi et al. 2021): M subnetworks in one network, M inputs concatenated on channels and
M heads, one forward pass (``resnet_mimo_18``, ``wideresnet_mimo_28_10``; the model's side is
``CNN.mimo_inputs`` and ``cnn.MultiHead``).

* Predictive: the same image to all M inputs, head m's softmax is member m (uncertainty-baselines'
  test step tiles the image M times), averaged in probability space; N counts heads (the first N
  of M).
* Training: uncertainty-baselines' batching (``baselines/cifar/mimo.py``, commit 163351d4, lines
  247-259; :func:`training_indices`): the batch's B examples repeated ``batch_repetitions`` R times
  and shuffled; each member takes that order with its first ⌊B·R·(1 − p)⌋ rows shuffled again on
  its own (p: ``input_repetition_probability``; the other rows are the same example for every
  member).  The loss is the sum over heads of each head's mean cross-entropy on its own inputs
  (``reduce_mean(reduce_sum(..., axis=1))``, lines 263-265); ``config.input.batch_size`` counts
  the B new examples, the network sees B·R rows.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.methods.base import Method, setting
from smoothing_jax.methods.fixed_members import FixedMembers
from smoothing_jax.methods.losses import cross_entropy
from smoothing_jax.passes import log_probs, mean_probs, pass_outputs, sample_rngs


def shuffled_rows(num_rows: int, input_repetition_probability: float) -> int:
  """The rows each member shuffles on its own: uncertainty-baselines' ``to_shuffle``, in float32
  as its ``tf.cast(..., tf.float32) * (1.0 - p)``, truncated by the cast to int32."""
  return int(np.float32(num_rows) * np.float32(1.0 - input_repetition_probability))


def mimo_batch_indices(main_shuffle, member_permutations):
  """``[B·R, M]`` example indices: column m is ``main_shuffle`` with its first T rows reordered by
  ``member_permutations[m]`` (``[M, T]``, a permutation of ``range(T)`` each), the rest as is."""
  t = member_permutations.shape[1]
  head = main_shuffle[:t][member_permutations]                       # [M, T]
  tail = jnp.broadcast_to(main_shuffle[t:], (head.shape[0], main_shuffle.shape[0] - t))
  return jnp.concatenate([head, tail], axis=1).T


def training_indices(key, batch_size: int, members: int, batch_repetitions: int,
                     input_repetition_probability: float):
  """``[B·R, M]``: the example of row r under member m in a training step (see the module's
  docstring), the shuffles drawn from ``key``."""
  main_key, member_key = jax.random.split(key)
  rows = batch_size * batch_repetitions
  main_shuffle = jax.random.permutation(main_key, jnp.tile(jnp.arange(batch_size),
                                                           batch_repetitions))
  t = shuffled_rows(rows, input_repetition_probability)
  permutations = jax.vmap(lambda k: jax.random.permutation(k, t))(
      jax.random.split(member_key, members))
  return mimo_batch_indices(main_shuffle, permutations)


@dataclasses.dataclass(frozen=True)
class MIMO(FixedMembers):
  """The M = ``model.mimo_members`` heads of one network on M inputs."""
  name = "mimo"
  members_attribute = "mimo_members"
  # uncertainty-baselines' flags (baselines/cifar/mimo.py): batch_repetitions 4,
  # input_repetition_probability 0.0.
  settings = {"batch_repetitions": 4, "input_repetition_probability": 0.0}
  batch_repetitions: int = 4
  input_repetition_probability: float = 0.0


  @classmethod
  def from_config(cls, config, model) -> MIMO:
    return cls(model, chunk_size=setting(config, "eval_chunk_size"),
               batch_repetitions=setting(config, "mimo.batch_repetitions", 4),
               input_repetition_probability=setting(config, "mimo.input_repetition_probability",
                                                    0.0))

  def sample_log_probs(self, variables, images, rng):
    return jnp.swapaxes(log_probs(self.model, variables, images, rng), 0, 1)   # [M, B, C]

  def sample_outputs(self, variables, images, rng):
    # Per draw (images [M, B, ...]): input m is images[m]; the features are the heads' shared
    # input, the same for every draw.
    inputs = jnp.swapaxes(images, 0, 1) if images.ndim == 5 else images
    out = pass_outputs(self.model, variables, inputs, rng)
    m = self.num_draws
    return {"logits": jnp.swapaxes(out["logits"], 0, 1),
            "features": jnp.broadcast_to(out["features"], (m,) + out["features"].shape)}

  def frame_probs(self, variables, frame, rng):
    """The heads' mean: one pass with the frame at every input."""
    return mean_probs(self.sample_log_probs(variables, frame, rng))

  def check(self, config) -> MIMO:
    reps, p = self.batch_repetitions, self.input_repetition_probability
    if not isinstance(reps, int) or isinstance(reps, bool) or reps < 1:
      raise ValueError(f"mimo.batch_repetitions must be a positive integer, got {reps!r}.")
    if not 0.0 <= p <= 1.0:
      raise ValueError(f"mimo.input_repetition_probability must be in [0, 1], got {p!r}.")
    if config.label_smoothing or config.mixup_alpha or config.cutmix_alpha:
      raise ValueError("MIMO trains each head on its own inputs' labels; label_smoothing, "
                       "mixup_alpha and cutmix_alpha are not supported.")
    return self

  def as_member(self, config=None) -> Method:
    model = f" {config.model!r}" if config is not None else ""
    raise ValueError(f"Model{model} is a MIMO of {self.num_draws} members already; train it with "
                     "deep_ensemble.members=1.")

  def tile(self, *arrays) -> tuple:
    """Every example under every member (``[B, ...] → [B, M, ...]``): the evaluation's input, and
    the training batch at input repetition probability 1 and one repetition (what the loss
    landscape analyses evaluate; :meth:`loss` draws uncertainty-baselines' batch)."""
    return tuple(jnp.repeat(x[:, None], self.num_draws, axis=1) for x in arrays)

  def loss(self, config, *, num_train: int, steps_per_epoch: int, class_weights=None):
    model, m = self.model, self.num_draws
    reps, p = self.batch_repetitions, self.input_repetition_probability
    weights = None if class_weights is None else jnp.asarray(class_weights, jnp.float32)

    def loss_fn(params, batch_stats, batch, rng, step):
      index = training_indices(jax.random.fold_in(rng, 3), batch["label"].shape[0], m, reps, p)
      images, labels = batch["image"][index], batch["label"][index]   # [B·R, M, ...]
      logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                    train=True, mutable=["batch_stats"], rngs=sample_rngs(rng))
      nll = sum(cross_entropy(logits[:, i], labels[:, i], weights) for i in range(m))
      return nll, {"logits": logits, "labels": labels, "metrics": {},
                   "batch_stats": updates.get("batch_stats", {})}
    return loss_fn
