"""The training loop (in the style of the Flax ImageNet example).

``train(run)`` reads top to bottom: the schedule, the train state of the run's method
(``run.method``: one network, or a deep ensemble's stacked members), restore the latest checkpoint
(or start from ``init_from`` or the method's warm start), then loop the compiled ``train_step``
with periodic logging, evaluation (``eval_step``), checkpoints and the callbacks
(``callbacks.Preemption``, ``trajectory.TrajectoryRecorder``, your own). Data parallelism is
``jax.jit`` over the run's 1-D ``Mesh`` with axis ``data`` (``steps.compile_steps``).
``train_from_config(config, workdir)`` is ``train(Run.from_config(config, workdir))``.

The pieces live one idea a module: ``optim`` (schedules, optimisers), ``steps`` (the state and
the compiled steps), ``callbacks``; what differs between methods (the objective, the optimiser's
rules, the train state and step) the run's method says (``smoothing_jax.methods``).
"""
from __future__ import annotations

import functools
import signal
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging

from smoothing_jax.experiment import init_from
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.checkpoints import load_variables, set_aside_newer_steps
from smoothing_jax.experiment.run import Run, check_config
from smoothing_jax.experiment.workdir_lock import lock_workdir
from smoothing_jax.methods.losses import class_weights
from smoothing_jax.parallel import DispatchWindow, evaluate_batches, prefetch_to_devices, shardings
from smoothing_jax.training.callbacks import Callback, Preempted, Preemption
from smoothing_jax.training.optim import create_learning_rate_schedule
from smoothing_jax.training.steps import (
  TrainState,
  compile_steps,
  state_initializer,
  train_batch_sharding,
  variables_of,
)
from smoothing_jax.training.trajectory_recorder import TrajectoryRecorder
from smoothing_jax.training.writers import MetricWriter, ProgressReporter


def initialize_from(run: Run, state: TrainState) -> TrainState:
  """``state`` (fresh) starting from other variables: ``config.init_from`` (fine-tuning; an
  output layer of another class count stays fresh), or the method's warm start
  (``Method.warm_start``: an iBNN's deterministic weights of ``config.ibnn.pretrained_workdir``,
  its posterior fresh)."""
  config = run.config
  network = {"params": state.params, "batch_stats": state.batch_stats}  # the method's state stays
  if config.init_from:
    variables = init_from.variables(config, run.model_spec, network, run.mesh,
                                    new_classifier=True)
  else:
    workdir = run.method.warm_start(config)
    loaded_step, loaded = load_variables(workdir, run.mesh)
    variables = run.method.load_warm_start(network, loaded)
    logging.info("Weights from step %d of %s", loaded_step, workdir)
  return state.replace(params=variables["params"], batch_stats=variables["batch_stats"])


@jax.jit
def _all_finite(state: TrainState):
  return jnp.all(
      jnp.stack(
          [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((state.params, state.batch_stats))]))


def _check_finite(pending: list, last_good_step: int, checkpoint_dir):
  """Raise ``FloatingPointError`` naming the first step whose loss (an ensemble's: any member's)
  is not finite: ``pending`` holds ``(first step, count, losses [K, ...], first bad index)`` of
  each call (the index a device reduction, ``count`` where all are finite; None: read the
  losses)."""
  for first, count, losses, first_bad in pending:
    bad = (int(first_bad) if first_bad is not None else
           next((i for i, x in enumerate(np.asarray(losses)[:count])
                 if not np.all(np.isfinite(x))), count))
    if bad < count:
      loss = np.asarray(losses)[bad]
      raise FloatingPointError(
          f"Non-finite training loss ({loss.tolist()}) at step {first + bad}. Training stopped; "
          f"the last good checkpoint (step {last_good_step}) is kept in {checkpoint_dir}.")
  pending.clear()


def resolved_steps_per_call(config) -> int:
  """``config.steps_per_call``, or where it is 0 the backend's: ``log_every_steps`` on an
  accelerator (the calls then ending where the loop logs), 1 on the CPU, whose XLA runs a step
  inside a loop 4-5x slower than the step alone (ResNet-18 at width 4, batch 128: 1.84 s against
  0.38 s a step), while its steps are long enough for the host's work to hide behind them.
  ValueError (one line) for a value that is not an integer >= 0."""
  k = config.get("steps_per_call", 0)
  if isinstance(k, bool) or not isinstance(k, int) or k < 0:
    raise ValueError(f"steps_per_call must be an integer >= 0 (0: log_every_steps, on the CPU "
                     f"1), got {k!r}.")
  return k or (1 if jax.default_backend() == "cpu" else config.log_every_steps)


def warn_of_a_cut_schedule(config, num_steps: int, steps_per_epoch: int) -> None:
  """One warning line where ``num_train_steps`` ends the run before the schedule of its epochs
  does: inside the warm-up (the rate never reaches its peak), or before the rate's decay ends."""
  schedule_steps = int((config.warmup_epochs + config.num_epochs) * steps_per_epoch)
  if num_steps >= schedule_steps:
    return
  warmup_steps = int(config.warmup_epochs * steps_per_epoch)
  rate = float(create_learning_rate_schedule(config, steps_per_epoch)(num_steps))
  where = (f"inside the {warmup_steps}-step warm-up" if num_steps < warmup_steps else
           f"at step {num_steps} of its epochs' {schedule_steps}-step schedule")
  peak = config.learning_rate * config.input.batch_size / config.base_batch_size
  logging.warning("num_train_steps %d ends the run %s: its last learning rate is %.3g (peak %g). "
                  "To train a shorter run on the whole schedule, lower num_epochs (and "
                  "warmup_epochs) instead.", num_steps, where, rate, peak)


def train(run: Run, *, stop_after_steps: int | None = None,
          callbacks: Sequence[Callback] = ()) -> TrainState:
  """Train ``run.model`` on ``run.pipeline``, writing checkpoints and metrics to ``run.workdir``
  while holding its lock (``workdir_lock.lock_workdir``: another run writing there is refused,
  and this one is if another holds it); ``run.variables`` and ``run.step`` are the trained ones
  afterwards.

  Resumes from the latest intact checkpoint onto the run's devices, whatever device count wrote
  it (``checkpoints.restore_latest``; newer steps that fail to restore are renamed by
  ``set_aside_newer_steps``, not deleted).  ``stop_after_steps`` ends this run early (after a
  checkpoint), as a preemption would.  ``callbacks`` join the preemption handler and the
  trajectory recorder.
  """
  with lock_workdir(run.workdir) as lock:
    return _train(run, lock, stop_after_steps, callbacks)


def _train(run: Run, lock, stop_after_steps: int | None, callbacks: Sequence[Callback]
           ) -> TrainState:
  # Everything that can refuse the run comes before the first file written (the checkpoint
  # directory, config.json, the TensorBoard file): a refused run leaves its workdir as it was.
  config, pipeline, mesh = run.config, run.pipeline, run.mesh
  replicated, data_sharding = shardings(mesh)
  batch_sharding = train_batch_sharding(config, mesh)

  steps_per_epoch = pipeline.steps_per_epoch
  if steps_per_epoch == 0:
    raise ValueError(
        f"batch_size {config.input.batch_size} is larger than the training set "
        f"({pipeline.num_train}).")
  num_steps = config.num_train_steps if config.num_train_steps > 0 else int(
      (config.warmup_epochs + config.num_epochs) * steps_per_epoch)
  method = run.method
  warn_of_a_cut_schedule(config, num_steps, steps_per_epoch)
  # The method may own the schedule or a phase of it (SWA's constant rate), and refuses a run too
  # short for it here, before anything is written.
  schedule = method.schedule(config, create_learning_rate_schedule(config, steps_per_epoch),
                             num_steps=num_steps, steps_per_epoch=steps_per_epoch)
  preemption = Preemption(config.log_every_steps)
  callbacks = [TrajectoryRecorder.for_run(config, run.workdir, num_steps), preemption,
               *callbacks]

  eval_rng = jax.random.split(jax.random.key(config.seed), 3)[2]
  init_one = state_initializer(config, method, pipeline.image_shape, schedule)
  state = jax.device_put(method.init_train_state(config, init_one, mesh.devices.flat), replicated)
  dropout_rng = method.train_keys(config)
  checkpoint_dir = workdir_lib.checkpoint_dir(run.workdir)
  loss_fn = method.loss(config, num_train=pipeline.num_train, steps_per_epoch=steps_per_epoch,
                        class_weights=class_weights(config, run.model, pipeline))
  resumed = run.restore(state)  # onto this run's mesh, whatever device count wrote it
  if resumed is not None:
    set_aside_newer_steps(run.manager, run.step)
    state = resumed
    logging.info("Resumed from step %d of %s", int(state.step), checkpoint_dir)
  elif config.init_from or method.warm_start(config):
    state = jax.device_put(initialize_from(run, state), replicated)
  start_step = int(state.step)
  if jax.process_index() == 0:
    workdir_lib.write_config(run.workdir, config, run.model_spec)

  pipelines = method.train_pipelines(config, pipeline)
  shared = len(pipelines) == 1  # the step takes one batch (order), or one per pipeline
  eval_every = max(1, int(config.eval_every_epochs * steps_per_epoch))
  # Steps per host call: on the resident path a call runs up to K steps of one epoch
  # (steps.steps_in_one_call), ending at every log, evaluation, checkpoint, trajectory and epoch
  # boundary; a tf.data batch comes from the host each step, so that path takes one.
  steps_per_call = resolved_steps_per_call(config) if pipeline.resident else 1
  boundaries = [config.log_every_steps, eval_every, config.checkpoint_every_steps,
                steps_per_epoch, config.trajectory_every_steps or num_steps]
  train_step_fn, eval_step_fn = compile_steps(method, schedule, mesh, config.ece_bins, loss_fn,
                                              config.grad_accum_steps, batch_sharding, pipeline,
                                              pipelines, num_steps, steps_per_call)

  writer = MetricWriter(  # other processes log only
      str(workdir_lib.workdir_path(run.workdir)) if jax.process_index() == 0 else None,
      num_steps)
  report_progress = ProgressReporter(num_steps, writer)
  stop_at = num_steps if stop_after_steps is None else min(num_steps, start_step + stop_after_steps)
  train_metrics, pending_losses = [], []
  in_flight = DispatchWindow()  # the host runs at most a few calls ahead (see parallel.py)
  last_good, stopped_by = start_step, []
  logging.info("Training %s (%s) on %s: %d steps (%d per epoch, up to %d per call), global batch "
               "%d on %d devices; compiling the training step.", config.model, method.describe(),
               config.input.dataset, num_steps, steps_per_epoch, steps_per_call,
               config.input.batch_size, mesh.size)

  if pipeline.resident:  # the steps take their batches from the arrays on the devices
    batches = None

    def run_steps(first, count):  # each pipeline's order of the epoch of steps first..
      orders = tuple(p.device_order((first - 1) // steps_per_epoch) for p in pipelines)
      return train_step_fn(state, pipeline.arrays, orders[0] if shared else orders, dropout_rng,
                           np.int32(count))
  else:  # the next global batches are assembled on the devices while the current step runs
    iterators = [p.train_iterator(start_step) for p in pipelines]
    batches = prefetch_to_devices(iterators[0] if shared else zip(*iterators, strict=True),
                                  batch_sharding, config.prefetch_batches)

    def run_steps(first, count):  # one step: its metrics as a stack of one
      new_state, metrics = train_step_fn(state, next(batches), dropout_rng)
      return new_state, jax.tree.map(lambda x: x[None], metrics), None
  try:
    for callback in callbacks:
      callback.on_start(start_step, state)
    step = start_step
    while step < stop_at:
      first = step + 1
      step = min([stop_at, step + steps_per_call] + [(step // b + 1) * b for b in boundaries])
      count = step - first + 1
      with jax.profiler.StepTraceAnnotation("train", step_num=step):
        state, metrics, first_bad = run_steps(first, count)
      in_flight(metrics)  # not the state, whose buffers the next call takes over (donated)
      for callback in callbacks:
        callback.on_step(step, state)
      train_metrics.append((metrics, count))
      pending_losses.append((first, count, metrics["loss"], first_bad))

      # Every callback is asked (a multi-process one gathers from all processes), and the save
      # and the exit below agree.
      stopped_by = [callback for callback in callbacks if callback.should_stop(step)]
      is_last = step == stop_at or bool(stopped_by)
      if step % config.log_every_steps == 0 or is_last:
        _check_finite(pending_losses, last_good, checkpoint_dir)
        rows = [jax.tree.map(lambda x, n=n: x[:n], m)
                for m, n in jax.device_get(train_metrics)]  # a deep ensemble's: [n, M] each
        means = jax.tree.map(lambda *xs: np.mean(np.concatenate(xs), axis=0), *rows)
        writer.write_scalars(step, method.train_scalars("train_", means))
        train_metrics = []
      report_progress(step, wait=functools.partial(jax.block_until_ready, metrics))  # finished
      if step % eval_every == 0 or step == num_steps:
        with report_progress.timed("eval"):
          results = evaluate_batches(eval_step_fn, variables_of(state), run.eval_batches(),
                                     data_sharding, eval_rng,
                                     label=f"evaluation at step {step}")
        # eval_<metric>, and a deep ensemble's eval_<metric>/member_<m> (Method.eval_metrics)
        writer.write_scalars(step, {f"eval_{k}{suffix}": v[k] for suffix, r in results.items()
                                    for v in (r.compute(),) for k in ("nll", "acc", "ece")})
      if step % config.checkpoint_every_steps == 0 or is_last:
        _check_finite(pending_losses, last_good, checkpoint_dir)
        if not bool(_all_finite(state)):
          raise FloatingPointError(
              f"Non-finite parameters after step {step}. Training stopped; the last good "
              f"checkpoint (step {last_good}) is kept in {checkpoint_dir}.")
        for callback in callbacks:
          callback.on_checkpoint(step)
        lock.check()  # a lease lost to another writer: stop before writing into its workdir
        run.manager.save(step, args=ocp.args.StandardSave(state))
        last_good = step
      writer.flush()
      if stopped_by:
        break
  finally:
    if batches is not None:
      batches.close()
    for callback in callbacks:
      callback.close()
    run.manager.wait_until_finished()  # commits any checkpoint still being written
    writer.close()
  run.variables, run.step = variables_of(state), int(state.step)
  # Branch on the method: a method with a post-hoc stage (Laplace) is fitted when training ends,
  # so that a trained workdir is ready for every evaluator; a run stopped early (or cut short by
  # stop_after_steps) fits when it reaches its last step.
  if not stopped_by and run.step == num_steps and run.method.fit_name is not None:
    run.fit()
  if stopped_by:
    signum = preemption.signum if preemption in stopped_by else None
    reason = f"after {signal.Signals(signum).name}" if signum else "at a callback's request"
    raise Preempted(f"Stopped at step {step} {reason} (checkpoint saved in {checkpoint_dir}); "
                    "rerun the same command to resume.", signum)
  return state


def train_from_config(config: ml_collections.ConfigDict, workdir: str, *,
                      stop_after_steps: int | None = None) -> TrainState:
  """:func:`train` of ``Run.from_config(config, workdir)`` (the evaluators then run on
  ``Run.from_workdir(workdir)``, or ``main`` passes them the same run)."""
  check_config(config)  # a refused config leaves no workdir behind
  with lock_workdir(workdir), Run.from_config(config, workdir) as run:
    return train(run, stop_after_steps=stop_after_steps)
