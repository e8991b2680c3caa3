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

* ``ceiling``: for each M > 1, one network's step at batch M·B against batch B, alternated: the
  per-image speed-up M · t(B) / t(M·B) of the larger batch, the most an M-member job at batch B can
  gain over M sequential steps (its members' convolutions stay M convolutions of batch B); each
  bare one-job row then also gets ``vs_ceiling`` = ``vs_sequential`` / ``ceiling``.

One JSON object on stdout, the ratios ``*_vs_sequential`` against the sequential steps of the same
run (> 1: the one job is faster).

Both parts compute in ``--precision`` (default ``bf16``: ``config.half_precision``, as training
runs on an accelerator; ``fp32`` for float32), parameters and optimizer state float32 either way.

  python experiments/bench_ensemble.py --width 16 --members 1 2 4      # CPU (minutes)
  python experiments/bench_ensemble.py --members 1 2 4 8               # GPU: full width
  python experiments/bench_ensemble.py --precision fp32 ...            # float32 throughout
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
from smoothing_jax.experiment.spec import compute_dtype
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


PRECISIONS = {"bf16": True, "fp32": False}  # --precision: config.half_precision


def _config(width, precision: str = "bf16"):
  config = recipe_config(*RECIPE)
  if width:
    config.model_kwargs.width = width
  config.half_precision = PRECISIONS[precision]
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


def bare_step_rows(width, batch_size: int, members_list, repeats: int,
                   precision: str = "bf16") -> list:
  """Per M: the sequential single-model steps and each strategy's one-job step (see module),
  alternated (:func:`timing.alternate`), computing in ``precision``."""
  config = _config(width, precision)
  model = get_model(MODEL, 10, dtype=compute_dtype(config), **({"width": width} if width else {}))
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
           "precision": precision, "sequential": {"seconds_per_step": seconds,
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


def ceiling_rows(width, batch_size: int, members_list, repeats: int,
                 precision: str = "bf16") -> list:
  """Per M > 1: one network's step at batch M·B against the same step at batch B, alternated
  (:func:`timing.alternate`): images/s of each and ``ceiling`` = M · t(B) / t(M·B), the per-image
  speed-up of the larger batch.  An M-member one-job step at batch B runs M sets of weights over M
  batches of B, never one convolution over M·B, so ``ceiling`` is the most it can gain over M
  sequential steps: the bare steps' ``vs_ceiling`` is ``vs_sequential`` / ``ceiling``."""
  config = _config(width, precision)
  model = get_model(MODEL, 10, dtype=compute_dtype(config), **({"width": width} if width else {}))
  mesh = create_mesh()
  replicated, data = shardings(mesh)
  schedule = create_learning_rate_schedule(config, steps_per_epoch=100)
  fn = jax.jit(functools.partial(train_step, schedule, supervised_loss(model)),
               in_shardings=(replicated, data, replicated), out_shardings=(replicated, replicated),
               donate_argnums=(0,))
  rng = jax.random.key(2)
  rows = []
  for members in [m for m in members_list if m > 1]:
    calls = {}
    for size in (batch_size, members * batch_size):
      images = jax.random.normal(jax.random.key(1), (size, 32, 32, 3))
      batch = shard_batch({"image": np.asarray(images), "label": np.arange(size) % 10}, data)
      holder = [jax.device_put(create_train_state(config, model, jax.random.key(0), (32, 32, 3),
                                                  schedule), replicated)]

      def one_step(holder=holder, batch=batch):  # this size's (B023)
        holder[0], _ = fn(holder[0], batch, rng)
        return holder[0].params
      calls[size] = one_step
    times = alternate(calls, repeats)
    row = {"members": members, "batch_size": batch_size, "width": width, "precision": precision,
           "images_per_s": {str(size): size / statistics.median(times[size]) for size in calls},
           "ceiling": statistics.median(members * a / b for a, b in
                                        zip(times[batch_size], times[members * batch_size],
                                            strict=True)),
           "seconds_per_step": {str(size): times[size] for size in calls}}
    log(json.dumps(row))
    rows.append(row)
    calls.clear()  # frees this M's states before the next M's
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
                    rounds: int, precision: str = "bf16") -> list:
  """The real training loop with ``deep_ensemble.members`` M (unrolled, each member its own
  batches) against M = 1, the loops alternated over ``rounds`` (each M once a round): images/s
  per member, and the per-round ratios against M = 1; computing in ``precision``."""
  configs = {}
  for members in members_list:
    config = _config(width, precision)
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
    rows.append({"members": members, "batch_size": batch_size, "precision": precision,
                 "steps": steps,
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
  parser.add_argument("--skip_ceiling", action="store_true",
                      help="skip one network at batch M·B against batch B (the one job's ceiling)")
  parser.add_argument("--precision", choices=tuple(PRECISIONS), default="bf16",
                      help="bf16: config.half_precision, as training runs (default); fp32")
  args = parser.parse_args(argv)
  members = sorted(set(args.members) | {1})
  # A fresh persistent cache (set before the first compilation): the loop's repeated runs read
  # their programs back; every first call still compiles.
  cache_dir = tempfile.mkdtemp(prefix="bench_ensemble_jax_cache_")
  use_persistent_compilation_cache(cache_dir)
  device = jax.devices()[0]
  result = {"benchmark": "ensemble", "model": MODEL, "device_kind": device.device_kind,
            "backend": jax.default_backend(), "num_devices": jax.device_count(),
            "jax": jax.__version__, "precision": args.precision}
  if not args.skip_bare:
    result["bare_step"] = bare_step_rows(args.width, args.batch_size, members, args.repeats,
                                         args.precision)
  if not args.skip_ceiling:
    result["ceiling"] = ceiling_rows(args.width, args.batch_size, members, args.repeats,
                                     args.precision)
    for row in result.get("bare_step", []):
      ceiling = next((c["ceiling"] for c in result["ceiling"] if c["members"] == row["members"]),
                     None)
      for name in strategies(row["members"]):
        if ceiling:
          row[name]["vs_ceiling"] = row[name]["vs_sequential"] / ceiling
  if not args.skip_loop:
    result["train_loop"] = train_loop_rows(args.width, args.batch_size, members,
                                           args.loop_steps, args.train_images, args.loop_rounds,
                                           args.precision)
  shutil.rmtree(cache_dir, ignore_errors=True)
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
