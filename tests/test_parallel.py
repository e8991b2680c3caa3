"""smoothing_jax.parallel: the mesh and its shardings, sharded batches, the evaluation batch size
evaluate_batches (exact merging over batches, one key per batch) and device prefetching."""
import os
import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from smoothing_jax.metrics import UncertaintyMetrics, evaluate
from smoothing_jax.parallel import (
  create_mesh,
  eval_batch_size,
  evaluate_batches,
  prefetch_to_devices,
  shard_batch,
  shardings,
)


def test_mesh_shardings_and_sharded_batches():
  assert jax.device_count() == 8
  mesh = create_mesh()
  assert mesh.axis_names == ("data",) and mesh.size == 8
  assert list(create_mesh(2).devices) == jax.devices()[:2]
  replicated, data = shardings(mesh)
  assert (replicated.spec, data.spec) == (P(), P("data"))
  batch = shard_batch({"image": np.arange(16.0).reshape(8, 2), "label": np.arange(8)}, data)
  assert batch["image"].sharding == data and len(batch["image"].addressable_shards) == 8
  np.testing.assert_array_equal(batch["image"], np.arange(16.0).reshape(8, 2))
  np.testing.assert_array_equal(batch["label"], np.arange(8))


@pytest.mark.parametrize("requested, devices, expected", [(8, 8, 8), (5, 8, 8), (17, 8, 24),
                                                          (5, 1, 5), (5, 2, 6)])
def test_eval_batch_size_is_rounded_up_to_a_multiple_of_the_mesh(requested, devices, expected):
  config = types.SimpleNamespace(eval_batch_size=requested)
  assert eval_batch_size(config, create_mesh(devices)) == expected


def _padded_batches(probs, labels, size):
  """``probs`` / ``labels`` in batches of ``size``, the last padded (uniform, label 0, mask 0)."""
  batches = []
  for start in range(0, len(labels), size):
    p, y = probs[start:start + size], labels[start:start + size]
    pad = size - len(y)
    batches.append({
        "probs": np.concatenate([p, np.full((pad, p.shape[1]), 1 / p.shape[1], np.float32)]),
        "label": np.concatenate([y, np.zeros(pad, y.dtype)]),
        "mask": np.concatenate([np.ones(len(y), np.float32), np.zeros(pad, np.float32)]),
    })
  return batches


@pytest.mark.parametrize("sharded", [False, True])
def test_evaluate_batches_merges_metrics_keeps_the_first_batch_of_the_rest_and_folds_the_key(
    sharded):
  rng = np.random.default_rng(0)
  probs = rng.dirichlet(np.ones(4), 20).astype(np.float32)
  labels = rng.integers(0, 4, 20)
  batches = _padded_batches(probs, labels, 8)  # 8 + 8 + (4 + 4 padding)
  variables, key = {"w": np.ones(3)}, jax.random.key(3)
  _, data = shardings(create_mesh())
  seen = []

  def step(v, batch, rng):
    assert v is variables
    seen.append((batch, rng))
    metrics = UncertaintyMetrics.from_model_output(batch["probs"], batch["label"], batch["mask"])
    return {"metrics": {"all": metrics}, "labels": batch["label"], "rng": rng}

  out = evaluate_batches(step, variables, iter(batches), data if sharded else None, key)
  # Mergeable leaves: merged over every batch, padding masked, exactly the whole set's metrics.
  merged = out["metrics"]["all"].compute()
  assert merged["count"] == 20
  for name, value in evaluate(probs, labels).items():
    assert merged[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
  # Other leaves: the first batch's value.
  np.testing.assert_array_equal(out["labels"], batches[0]["label"])
  # One key per batch: fold_in(rng, i).
  assert len(seen) == 3
  for i, (_, rng) in enumerate(seen):
    np.testing.assert_array_equal(jax.random.key_data(rng),
                                  jax.random.key_data(jax.random.fold_in(key, i)))
  np.testing.assert_array_equal(jax.random.key_data(out["rng"]),
                                jax.random.key_data(jax.random.fold_in(key, 0)))
  for (batch, _), given in zip(seen, batches, strict=True):
    if sharded:  # global arrays on the batch sharding
      assert all(batch[k].sharding == data for k in given)
      np.testing.assert_array_equal(batch["probs"], given["probs"])
    else:  # passed as they are
      assert batch is given


def test_evaluate_batches_of_no_batches_is_an_error():
  with pytest.raises(ValueError, match="No evaluation batches"):
    evaluate_batches(lambda *args: 1 / 0, {}, [], None, jax.random.key(0))


def test_prefetch_to_devices_keeps_order_raises_in_place_and_stops_its_thread():
  import threading
  _, data = shardings(create_mesh())
  host = [{"image": np.full((8, 2), float(i)), "label": np.arange(8) + i} for i in range(5)]
  for size in (0, 2):
    got = list(prefetch_to_devices(iter(host), data, size))
    assert len(got) == 5 and all(g["image"].sharding == data for g in got)
    for g, h in zip(got, host, strict=True):
      np.testing.assert_array_equal(g["image"], h["image"])
      np.testing.assert_array_equal(g["label"], h["label"])

  def failing():
    yield host[0]
    raise OSError("the input pipeline broke")
  batches = prefetch_to_devices(failing(), data)
  assert float(next(batches)["image"][0, 0]) == 0.0
  with pytest.raises(OSError, match="the input pipeline broke"):
    next(batches)

  def endless():
    while True:
      yield host[1]
  batches = prefetch_to_devices(endless(), data, size=2)
  next(batches)
  batches.close()  # what the train loop does when it ends or fails
  assert not any(t.name == "prefetch_to_devices" for t in threading.enumerate())


def test_dispatch_window_waits_for_the_output_size_calls_back(monkeypatch):
  from smoothing_jax import parallel
  waited = []
  monkeypatch.setattr(parallel.jax, "block_until_ready", waited.append)
  window = parallel.DispatchWindow(3)
  for i in range(10):
    assert window(i) == i
    assert waited == list(range(max(0, i - 2)))  # outputs 0 … i-3 finished: at most 3 unfinished


def test_evaluate_batches_keeps_few_programs_unfinished(monkeypatch):
  from smoothing_jax import parallel
  waited = []
  monkeypatch.setattr(parallel.jax, "block_until_ready", waited.append)
  batches = [{"x": np.full(2, float(i))} for i in range(20)]
  out = evaluate_batches(lambda v, batch, rng: {"x": batch["x"]}, {}, iter(batches), None,
                         jax.random.key(0), concatenate=True)
  assert out["x"].shape == (40,)
  # Each output waited for once, in order: 12 while dispatching (at most 8 unfinished, the
  # window's bound above), the last 8 at the end (each counted finished for the progress lines).
  assert [float(w["x"][0]) for w in waited] == list(range(20))


@pytest.mark.slow
def test_the_abort_reproducer_runs_to_its_end():
  """``experiments/abort_repro.py`` under the conditions in which the metrics, dispatched
  operation by operation, aborted (another process compiling, a prefetch thread, new shapes,
  released caches): the library's path, for 10 s, ends normally and nothing waits in a
  collective."""
  import json
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  result = subprocess.run(
      [sys.executable, "experiments/abort_repro.py", "--seconds", "10", "--new-shapes",
       "--release-every", "20", "--prefetch", "--siblings", "1"],
      cwd=root, capture_output=True, text=True, timeout=240)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "may be stuck" not in result.stderr
  assert json.loads(result.stdout.strip().splitlines()[-1])["iterations"] > 0


def test_a_long_evaluation_pass_says_how_far_it_is_and_its_wall_time(monkeypatch):
  """A line at most every ``PROGRESS_EVERY_S`` counting the batches *finished* (the dispatch
  window of one here: a batch finishes when the next is dispatched), images, rate, time left
  from the rate after the first (its compile); the pass's wall time; a short pass says nothing."""
  from smoothing_jax import parallel
  from smoothing_jax.data.pipeline_base import Batches
  from tests.helpers import absl_info_lines
  now = [0.0]
  monkeypatch.setattr(parallel.time, "monotonic", lambda: now[0])
  monkeypatch.setattr(parallel, "MAX_PROGRAMS_IN_FLIGHT", 1)

  def step(variables, batch, key):
    now[0] += 10.0  # each batch takes 10 s
    return {"x": batch["x"]}

  batches = [{"x": np.zeros((40, 2), np.float32)} for _ in range(4)]
  with absl_info_lines() as lines:
    parallel.evaluate_batches(step, None, Batches(4, iter(batches), examples=150), None,
                              jax.random.key(0), concatenate=True, label="ood: set 1/2 svhn")
    parallel.evaluate_batches(step, None, iter(batches[:1]), None, jax.random.key(0),
                              concatenate=True, label="short")
  assert lines == ["ood: set 1/2 svhn: batch 1/4 finished (40 images), 2 images/s",
                   "ood: set 1/2 svhn: batch 3/4 finished (120 images), 3 images/s, about 10 s "
                   "left",
                   "ood: set 1/2 svhn: 4 batches (150 images) in 40 s"]  # the padding not counted


def test_a_pass_that_compiles_for_long_is_not_silent(monkeypatch):
  """Before any batch has finished (compiling), a timer says so every ``PROGRESS_EVERY_S``."""
  import time

  from smoothing_jax import parallel
  from tests.helpers import absl_info_lines
  monkeypatch.setattr(parallel, "PROGRESS_EVERY_S", 0.2)

  def step(variables, batch, key):
    time.sleep(0.7)
    return {"x": batch["x"]}

  with absl_info_lines() as lines:
    parallel.evaluate_batches(step, None, iter([{"x": np.zeros((4, 2), np.float32)}]), None,
                              jax.random.key(0), concatenate=True, label="slow")
  assert any(line.startswith("slow: compiling and running the first batches (") for line in lines)
  assert lines[-1] == "slow: 1 batch (4 images) in 1 s"
