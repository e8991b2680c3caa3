"""Deep ensembles trained as one compiled job: ``config.ensemble_members`` = M > 1.

The train state is stacked along a leading member axis (parameters, BatchNorm statistics and
optimizer state; one shared step counter), and one jitted step updates every member.  Member m
is the single run with seed ``config.seed + m``: its initialisation, its dropout / noise keys, its
data order and its augmentation draws (``Pipeline.seed``; ``config.ensemble_shared_batches``
feeds every member the batches of ``config.seed`` instead).  The split of the training data
(``input.train_fraction``, ``input.holdout_fraction``) comes from ``config.seed`` (or
``input.split_seed``) and is the ensemble's: every member trains on the same examples and none on
those held out (Lakshminarayanan et al. 2017: members differ by initialisation and shuffling).

How the step computes M members (``config.ensemble_vmap_size`` = k): the members in groups of k,
each group ``jax.vmap`` ed over its stacked state, the groups one after another in the same
program.  k = 1 unrolls the members (M copies of the single step in one program); k = M vmaps
them all.  0 chooses per backend: unrolled, because a vmapped convolution over stacked kernels
(a grouped convolution) runs several times slower than M plain ones on XLA:CPU
(``experiments/bench_ensemble.py``: 4 members of ``resnet_dnn_18``, vmapped 0.3×, unrolled 1.5×
the speed of four sequential steps); on GPUs the benchmark's section of
``experiments/device_check.py`` measures both, and unrolling stays the default until it says
otherwise.  Members stay replicated and the batch sharded on ``data`` (each device computes
every member on its slice of the batch), so the same mesh serves any M.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from smoothing_jax.data.resident import device_memory_bytes
from smoothing_jax.inference import ensemble_predict, member_of
from smoothing_jax.metrics import UncertaintyMetrics
from smoothing_jax.models import is_batch_ensemble, is_ibnn
from smoothing_jax.parallel import sharded_eval_step, shardings
from smoothing_jax.training.optim import create_optimizer
from smoothing_jax.training.steps import TrainState, init_train_state, train_step

MAX_STATE_FRACTION = 0.5  # of one device's memory; activations, gradients and data need the rest
# Members vmapped together when ``config.ensemble_vmap_size`` is 0: unrolled, on every backend
# measured so far (the module's docstring).
DEFAULT_VMAP_SIZE = 1


def check_ensemble_config(config, model) -> int:
  """M = ``config.ensemble_members``, or ValueError (one line) for a value below 1 or a run
  that cannot be an ensemble."""
  members = config.get("ensemble_members", 1)
  if not isinstance(members, int) or isinstance(members, bool) or members < 1:
    raise ValueError(f"ensemble_members must be an integer >= 1, got {members!r}.")
  if members > 1 and is_ibnn(model):
    raise ValueError(f"Model {config.model!r} is an iBNN, already a mixture of "
                     f"{model.num_components} components sharing one set of weights; train it "
                     "with ensemble_members=1.")
  if members > 1 and is_batch_ensemble(model):
    raise ValueError(f"Model {config.model!r} is a BatchEnsemble of {model.ensemble_size} members "
                     "already; train it with ensemble_members=1.")
  if members > 1 and (config.get("init_from") or config.get("trajectory_every_steps")):
    key = "init_from" if config.get("init_from") else "trajectory_every_steps"
    raise ValueError(f"{key} is for single runs (ensemble_members={members}): train the members "
                     "apart to use it.")
  return members


def member_keys(config, members: int, index: int) -> jax.Array:
  """``[M]`` keys: for member m, ``split(key(config.seed + m), 3)[index]`` (the single run's
  0: initialisation, 1: dropout / noise, 2: evaluation)."""
  return jnp.stack([jax.random.split(jax.random.key(config.seed + m), 3)[index]
                    for m in range(members)])


def member_pipelines(config, pipeline, members: int) -> list:
  """The pipelines whose batches each member trains on: ``pipeline`` with ``seed`` + m (its own
  order and augmentation draws; the arrays and the split are shared), or ``[pipeline]`` alone
  with ``config.ensemble_shared_batches``."""
  if config.get("ensemble_shared_batches", False):
    return [pipeline]
  return [dataclasses.replace(pipeline, seed=config.seed + m) for m in range(members)]


def create_ensemble_state(config, model, members: int, image_shape, schedule) -> TrainState:
  """The stacked train state of M members (one compiled call, ``vmap`` over their keys; random
  draws under ``vmap`` equal those of each key alone), its step counter shared."""
  tx = create_optimizer(config, schedule, model)
  init = jax.vmap(functools.partial(init_train_state, model, tx, image_shape))
  state = jax.jit(init)(member_keys(config, members, 0))
  return state.replace(step=state.step[0])


def state_bytes(config, model, image_shape, schedule) -> int:
  """Bytes of one member's train state (parameters, BatchNorm statistics, optimizer state),
  from its abstract shapes (nothing computed)."""
  tx = create_optimizer(config, schedule, model)
  abstract = jax.eval_shape(functools.partial(init_train_state, model, tx, image_shape),
                            jax.random.key(0))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))


def check_ensemble_fits(config, model, members: int, image_shape, schedule, devices) -> None:
  """ValueError (one line) when M stacked train states would take more than
  ``MAX_STATE_FRACTION`` of a device's memory (each device holds every member); no-op where the
  backend does not say how much it has (the CPU)."""
  limits = [m for m in (device_memory_bytes(d) for d in devices) if m]
  if not limits or members == 1:
    return
  one = state_bytes(config, model, image_shape, schedule)
  if members * one > MAX_STATE_FRACTION * min(limits):
    raise ValueError(
        f"An ensemble of {members} {config.model} needs {members * one / 2**30:.2f} GiB for its "
        f"stacked train state ({members} × {one / 2**30:.2f} GiB of parameters, BatchNorm "
        f"statistics and optimizer state) on each device, more than "
        f"{MAX_STATE_FRACTION:.0%} of the {min(limits) / 2**30:.1f} GiB a device has: use fewer "
        "members, or train them apart (one run per seed) and join them with "
        "--ensemble_workdirs.")


def ensemble_train_step(member_step, vmap_size: int, state: TrainState, member_batch, rngs, *,
                        shared: bool = False):
  """One step of every member: ``member_step(state, batch, rng) -> (state, metrics)`` on member
  m's state, ``member_batch(m)`` and ``rngs[m]``; members in groups of ``vmap_size`` vmapped
  together, the groups unrolled (see the module).  ``shared``: every member takes
  ``member_batch(0)``, made once.  Returns the stacked state and ``[M]`` metrics."""
  members, step = rngs.shape[0], state.step
  rest = state.replace(step=None)
  shared_batch = member_batch(0) if shared else None
  outputs = []
  for start in range(0, members, vmap_size):
    group = range(start, min(members, start + vmap_size))
    if len(group) == 1:
      batch = shared_batch if shared else member_batch(start)
      out = member_step(member_of(rest, start).replace(step=step), batch, rngs[start])
      outputs.append(jax.tree.map(lambda x: x[None], out))
      continue
    batches = shared_batch if shared else jax.tree.map(
        lambda *xs: jnp.stack(xs), *[member_batch(m) for m in group])
    one = lambda s, b, r: member_step(s.replace(step=step), b, r)  # noqa: E731
    outputs.append(jax.vmap(one, in_axes=(0, None if shared else 0, 0))(
        jax.tree.map(lambda x, group=group: x[group.start:group.stop], rest), batches,
        rngs[group.start:group.stop]))
  new_state, metrics = jax.tree.map(lambda *xs: jnp.concatenate(xs), *outputs)
  return new_state.replace(step=new_state.step[0]), metrics


def compile_ensemble_steps(model, schedule, mesh, num_bins: int, loss_fn, grad_accum_steps: int,
                           batch_sharding, pipeline, pipelines: Sequence, vmap_size: int):
  """``(train_step, eval_step)`` of a stacked ensemble jitted over ``mesh`` (state replicated
  and donated, batches on ``batch_sharding``), as ``steps.compile_steps`` for one model.

  ``train_step(state, batches, rngs)`` with a tuple of the members' batches (one, shared, when
  ``pipelines`` holds one); for a device-resident ``pipeline`` ``train_step(state, arrays,
  orders, rngs)`` with each member pipeline's ``device_order``, the batches gathered and augmented
  inside the step.  ``eval_step(variables, batch, rng)`` gives the ensemble's metrics (the mean of
  the members' probabilities) then each member's.
  """
  replicated, _ = shardings(mesh)
  step = functools.partial(train_step, schedule, loss_fn, grad_accum_steps=grad_accum_steps)
  shared = len(pipelines) == 1

  if pipeline.resident:
    def resident_step(state, arrays, orders, rngs):
      member_batch = lambda m: pipelines[m].train_batch(  # noqa: E731
          arrays, orders[m], state.step, batch_sharding)
      return ensemble_train_step(step, vmap_size, state, member_batch, rngs, shared=shared)
    train = jax.jit(resident_step, in_shardings=(replicated,) * 4,
                    out_shardings=(replicated, replicated), donate_argnums=(0,))
  else:
    def streamed_step(state, batches, rngs):
      return ensemble_train_step(step, vmap_size, state, lambda m: batches[m], rngs,
                                 shared=shared)
    train = jax.jit(streamed_step, in_shardings=(replicated, batch_sharding, replicated),
                    out_shardings=(replicated, replicated), donate_argnums=(0,))
  return train, sharded_eval_step(ensemble_eval_step, mesh, model, num_bins)


def ensemble_eval_step(model, num_bins: int, variables, batch, rng) -> tuple:
  """``(ensemble, member 0, ..., member M-1)`` metrics of one padded, masked batch: the ensemble
  predicts the mean of its members' probabilities (member m's dropout key ``split(rng, M)[m]``,
  as ``inference.ensemble_predict``)."""
  probs = ensemble_predict(model, variables, batch["image"], rng=rng).sample_probs
  return tuple(UncertaintyMetrics.from_model_output(p, batch["label"], batch["mask"],
                                                    num_bins=num_bins)
               for p in (jnp.mean(probs, axis=0), *probs))


def member_summaries(prefix: str, values: dict, members: int) -> dict:
  """``{prefix + key + "/member_m": float}`` of ``[M]`` values, for the metric writer."""
  return {f"{prefix}{k}/member_{m}": float(np.asarray(v)[m])
          for k, v in values.items() for m in range(members)}
