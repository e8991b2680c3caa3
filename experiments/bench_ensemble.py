"""Deep ensembles trained as one job (``config.deep_ensemble.members``) against the same members
trained one after another, in the same run: images/s per member.

* ``bare_step``: for each M, M sequential calls of the single-model jitted SGD step against one
  call of the ensemble step (``deep_ensemble.ensemble_train_step``) in each strategy it offers:
  ``unrolled`` (vmap size 1), ``vmapped`` (M) and ``chunked`` (2, for M ≥ 4); every member sees
  the same batch (host-made, on the devices), as the issue's table.  The calls alternate, one of
  each per round, ``--repeats`` rounds after one compiling call each (``first_call_seconds``);
  the ratios are medians of the per-round ratios.
* ``train_loop``: the real loop (``train.train`` on a synthetic CIFAR-shaped set, device-resident
  data, each member its own batches) with ``deep_ensemble.members`` M against M = 1, the loops
  alternated over ``--loop_rounds`` rounds, each timed between its metric summaries
  (:func:`loop_seconds_per_step`: no compilation, evaluation or checkpoint); M single runs one
  after another train at the single run's rate.

One JSON object on stdout, the ratios ``*_vs_sequential`` against the sequential steps of the same
run (> 1: the one job is faster).

  python experiments/bench_ensemble.py --width 16 --members 1 2 4      # CPU (minutes)
  python experiments/bench_ensemble.py --members 1 2 4 8               # GPU: full width
"""
from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_train import recipe_config, use_persistent_compilation_cache
from timing import alternate, round_ratios

from smoothing_jax.experiment.run import Run
from smoothing_jax.methods import resolve
from smoothing_jax.methods.deep_ensemble import DeepEnsemble, ensemble_train_step
from smoothing_jax.methods.losses import supervised_loss
from smoothing_jax.models import get_model
from smoothing_jax.parallel import create_mesh, shard_batch, shardings
from smoothing_jax.training import train
from smoothing_jax.training.callbacks import Callback
from smoothing_jax.training.optim import create_learning_rate_schedule
from smoothing_jax.training.steps import create_train_state, state_initializer, train_step

MODEL = "resnet_dnn_18"
RECIPE = ("cifar_resnet", "resnet_dnn_18,cifar10")


def log(message: str):
  print(f"[bench_ensemble] {message}", file=sys.stderr, flush=True)


def _config(width):
  config = recipe_config(*RECIPE)
  if width:
    config.model_kwargs.width = width
  return config


def _timed_first_call(fn):
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def strategies(members: int) -> dict:
  """Vmap sizes timed for M members: unrolled, vmapped, and chunks of 2 where that differs."""
  out = {"unrolled": 1}
  if members > 1:
    out["vmapped"] = members
  if members >= 4:
    out["chunked_2"] = 2
  return out


def bare_step_rows(width, batch_size: int, members_list, repeats: int) -> list:
  """Per M: the sequential single-model steps and each strategy's one-job step (see module),
  alternated (:func:`timing.alternate`)."""
  config = _config(width)
  model = get_model(MODEL, 10, **({"width": width} if width else {}))
  mesh = create_mesh()
  replicated, data = shardings(mesh)
  schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
  step = functools.partial(train_step, schedule, supervised_loss(model))
  images = jax.random.normal(jax.random.key(1), (batch_size, 32, 32, 3))
  labels = jnp.arange(batch_size) % 10
  batch = shard_batch({"image": np.asarray(images), "label": np.asarray(labels)}, data)
  single_fn = jax.jit(step, in_shardings=(replicated, data, replicated),
                      out_shardings=(replicated, replicated), donate_argnums=(0,))
  rows = []
  for members in members_list:
    states = [jax.device_put(create_train_state(config, model, jax.random.key(m), (32, 32, 3),
                                                schedule), replicated) for m in range(members)]
    rng = jax.random.key(2)

    def sequential(members=members, states=states, rng=rng):  # this iteration's (B023)
      for m in range(members):
        states[m], _ = single_fn(states[m], batch, rng)
      return states[-1].params

    calls = {"sequential": sequential}
    first_call = {"sequential": _timed_first_call(sequential)}
    for name, vmap_size in strategies(members).items():
      ensemble = DeepEnsemble.wrap(resolve(config, model), config, size=members)
      init_one = state_initializer(config, ensemble.base, (32, 32, 3), schedule)
      holder = [jax.device_put(ensemble.init_train_state(config, init_one), replicated)]
      rngs = jax.random.split(rng, members)
      fn = jax.jit(lambda s, b, r, k=vmap_size: ensemble_train_step(
          step, k, s, lambda m: b, r, shared=True),
          in_shardings=(replicated, data, replicated),
          out_shardings=(replicated, replicated), donate_argnums=(0,))

      def one_job(holder=holder, fn=fn, rngs=rngs):  # this strategy's (B023)
        holder[0], _ = fn(holder[0], batch, rngs)
        return holder[0].params

      calls[name] = one_job
      first_call[name] = _timed_first_call(one_job)
    times = alternate(calls, repeats)
    calls.clear()  # frees this M's states before the next M's
    seconds = statistics.median(times["sequential"])
    row = {"members": members, "batch_size": batch_size, "width": width,
           "sequential": {"seconds_per_step": seconds,
                          "first_call_seconds": first_call["sequential"],
                          "images_per_s_per_member": batch_size * members / seconds}}
    for name, vmap_size in strategies(members).items():
      t = statistics.median(times[name])
      row[name] = {"vmap_size": vmap_size, "seconds_per_step": t,
                   "first_call_seconds": first_call[name],
                   "images_per_s_per_member": batch_size * members / t,
                   "vs_sequential": statistics.median(round_ratios(times["sequential"],
                                                                   times[name]))}
    log(json.dumps(row))
    rows.append(row)
  return rows


class StepClock(Callback):
  """The host's time at each step of the loop (``on_step``, just after the step is dispatched)."""

  def __init__(self):
    self.times = {}

  def on_step(self, step: int, state) -> None:
    self.times[step] = time.perf_counter()


def loop_seconds_per_step(config) -> float:
  """Seconds per step of ``train.train`` (the real loop) on ``config``, between the steps after
  its first and its last metric summaries (every ``config.log_every_steps``): each summary waits
  for the steps before it, so the interval holds exactly the steps between them, with their data,
  metrics and summaries, and no compilation, evaluation or checkpoint."""
  clock = StepClock()
  with tempfile.TemporaryDirectory(prefix="bench_ensemble_loop_") as workdir:
    with Run.from_config(config, workdir) as run:
      train.train(run, callbacks=[clock])
  every = config.log_every_steps
  first, last = every + 1, (config.num_train_steps - 1) // every * every + 1
  if last <= first:
    raise ValueError(f"{config.num_train_steps} steps hold fewer than two summaries after the "
                     f"first (log_every_steps {every}).")
  return (clock.times[last] - clock.times[first]) / (last - first)


def train_loop_rows(width, batch_size: int, members_list, steps: int, train_images: int,
                    rounds: int) -> list:
  """The real training loop with ``deep_ensemble.members`` M (unrolled, each member its own
  batches) against M = 1, the loops alternated over ``rounds`` (each M once a round): images/s
  per member, and the per-round ratios against M = 1."""
  configs = {}
  for members in members_list:
    config = _config(width)
    config.input.dataset = f"synthetic:{train_images}x32x32x3:10"
    config.input.batch_size = batch_size
    config.eval_batch_size = 500
    config.eval_every_epochs = 10 ** 6  # evaluate and checkpoint after the last step only
    config.checkpoint_every_steps = 10 ** 9
    config.log_every_steps = max(1, steps // 4)
    config.deep_ensemble.members = members
    config.num_train_steps = steps
    configs[members] = config
  times = {members: [] for members in members_list}
  for r in range(rounds):
    for members, config in configs.items():
      times[members].append(loop_seconds_per_step(config))
      log(f"round {r}: M = {members}, {times[members][-1]:.3f} s per step")
  rows = []
  for members in members_list:
    per_member = batch_size * members / statistics.median(times[members])
    ratios = [members * r for r in round_ratios(times[1], times[members])]
    rows.append({"members": members, "batch_size": batch_size, "steps": steps,
                 "seconds_per_step": times[members], "images_per_s_per_member": per_member,
                 "vs_sequential": statistics.median(ratios),
                 "vs_sequential_per_round": [round(r, 3) for r in ratios]})
    log(json.dumps(rows[-1]))
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--width", type=int, default=None, help="ResNet width (default: 64)")
  parser.add_argument("--batch_size", type=int, default=128)
  parser.add_argument("--members", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--loop_steps", type=int, default=20)
  parser.add_argument("--train_images", type=int, default=5000)
  parser.add_argument("--loop_rounds", type=int, default=3)
  parser.add_argument("--skip_bare", action="store_true")
  parser.add_argument("--skip_loop", action="store_true")
  args = parser.parse_args(argv)
  members = sorted(set(args.members) | {1})
  # A fresh persistent cache (set before the first compilation): the loop's repeated runs read
  # their programs back; every first call still compiles.
  cache_dir = tempfile.mkdtemp(prefix="bench_ensemble_jax_cache_")
  use_persistent_compilation_cache(cache_dir)
  device = jax.devices()[0]
  result = {"benchmark": "ensemble", "model": MODEL, "device_kind": device.device_kind,
            "backend": jax.default_backend(), "num_devices": jax.device_count(),
            "jax": jax.__version__}
  if not args.skip_bare:
    result["bare_step"] = bare_step_rows(args.width, args.batch_size, members, args.repeats)
  if not args.skip_loop:
    result["train_loop"] = train_loop_rows(args.width, args.batch_size, members,
                                           args.loop_steps, args.train_images, args.loop_rounds)
  shutil.rmtree(cache_dir, ignore_errors=True)
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
