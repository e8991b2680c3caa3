"""smoothing_jax.experiment.workdir_lock: one writer per workdir.  Real processes contend for the
lock: a second training command is refused in one line while the first runs on undisturbed, a
SIGKILLed holder's lock is taken over, and of processes racing for a free lock exactly one wins.
The lease (``gs://`` workdirs) on a fake GCS: refused while renewed, taken over once expired, and
lost to another writer, which stops the loser before its next checkpoint."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from smoothing_jax.experiment import workdir_lock
from smoothing_jax.experiment.workdir_lock import (
  LOCK_FILE,
  WorkdirLock,
  WorkdirLockedError,
  lock_workdir,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Trains small_npz_config into a workdir like the small_npz_run fixture, pausing after step 2
# (checkpoint 2 written, the lock held) until the test has tried a second writer.
PAUSED_TRAINING = """
import os, pathlib, sys, time
from smoothing_jax.training import train
from smoothing_jax.training.callbacks import Callback
from smoothing_jax.experiment.run import Run
from tests.helpers import small_npz_config
data, workdir, ready, go = sys.argv[1:]

class PauseAfterStep2(Callback):
  def on_step(self, step, state):
    if step == 2:
      pathlib.Path(ready).touch()
      while not os.path.exists(go):
        time.sleep(0.05)

with Run.from_config(small_npz_config(data), workdir) as run:
  train.train(run, callbacks=[PauseAfterStep2()])
"""

# Waits for the start file, then tries the lock: prints "won" (and holds it until the release
# file appears: after every racer has answered) or "refused".
CONTENDER = """
import os, sys, time
from smoothing_jax.experiment.workdir_lock import WorkdirLock, WorkdirLockedError
workdir, start, release, lease = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "lease"
print("ready", flush=True)
while not os.path.exists(start):
  time.sleep(0.002)
try:
  lock = WorkdirLock(workdir, lease=lease, settle_seconds=1.5).acquire()
except WorkdirLockedError:
  print("refused", flush=True)
else:
  print("won", flush=True)
  deadline = time.monotonic() + 60
  while not os.path.exists(release) and time.monotonic() < deadline:
    time.sleep(0.01)
  lock.release()
"""

HOLDER = """
import sys, time
from smoothing_jax.experiment.workdir_lock import WorkdirLock
WorkdirLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""


def _python(code, *args, **kwargs):
  return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO, **kwargs)


def _wait_for(path, process, seconds=240):
  deadline = time.monotonic() + seconds
  while not os.path.exists(path):
    assert process.poll() is None, f"the first run ended early (status {process.returncode})"
    assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
    time.sleep(0.05)


def _files(workdir):
  """The workdir's top-level names, the TensorBoard file's pid and time left out."""
  return sorted(re.sub(r"^events\.out\.tfevents\..*", "events", name)
                for name in os.listdir(workdir))


def test_a_second_training_command_is_refused_in_one_line_and_the_first_run_is_undisturbed(
    small_npz_run, tmp_path):
  data, alone_workdir, alone = small_npz_run
  workdir, ready, go = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
  first = _python(PAUSED_TRAINING, data, workdir, ready, go)
  try:
    _wait_for(ready, first)
    before = _files(workdir)
    second = subprocess.run(
        [sys.executable, "-m", "smoothing_jax.main", "--config=configs/quickstart.py",
         f"--workdir={workdir}"], cwd=REPO, capture_output=True, text=True, timeout=240)
    assert _files(workdir) == before  # it wrote nothing
  finally:
    open(go, "w").close()
    first.wait(timeout=240)
  assert second.returncode == 1
  lines = second.stderr.strip().splitlines()
  assert len(lines) == 1, second.stderr
  assert "WorkdirLockedError" in lines[0] and f"{workdir} is in use by pid {first.pid} on host " \
      f"{socket.gethostname()} since " in lines[0], lines[0]
  assert first.returncode == 0
  from smoothing_jax.experiment.checkpoints import load_variables
  from smoothing_jax.parallel import create_mesh
  step, variables = load_variables(str(workdir), create_mesh())
  assert step == 4
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(variables), alone)
  assert _files(workdir) == _files(alone_workdir)  # no lock file left, nothing of the second's


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
  workdir = tmp_path / "run"
  holder = _python(HOLDER, workdir, stdout=subprocess.PIPE)
  try:
    assert holder.stdout.readline() == b"held\n"
    with pytest.raises(WorkdirLockedError, match=f"in use by pid {holder.pid} on host "):
      WorkdirLock(workdir).acquire()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind
  with caplog.at_level("WARNING"):
    lock = WorkdirLock(workdir).acquire()
  assert f"Taking over the lock of {workdir}: it was held by pid {holder.pid}" in caplog.text
  assert json.loads((workdir / LOCK_FILE).read_text())["pid"] == os.getpid()
  lock.release()
  assert not (workdir / LOCK_FILE).exists()


@pytest.mark.parametrize("method", ["flock", "lease"])
def test_of_processes_racing_for_the_lock_exactly_one_wins(tmp_path, method):
  workdir, start, release = tmp_path / "run", tmp_path / "start", tmp_path / "release"
  racers = [_python(CONTENDER, workdir, start, release, method, stdout=subprocess.PIPE)
            for _ in range(3)]
  try:
    assert all(racer.stdout.readline() == b"ready\n" for racer in racers)
    open(start, "w").close()
    outcomes = sorted(racer.stdout.readline().decode().strip() for racer in racers)
  finally:
    open(release, "w").close()
    for racer in racers:
      racer.wait(timeout=60)
  assert outcomes == ["refused", "refused", "won"]
  assert not (workdir / LOCK_FILE).exists()  # released by the winner


def test_the_lock_is_reentrant_within_a_process_and_released_by_the_outermost(tmp_path):
  with lock_workdir(tmp_path) as outer:
    with lock_workdir(str(tmp_path)) as inner:
      assert inner is outer
    assert (tmp_path / LOCK_FILE).exists()
    with pytest.raises(WorkdirLockedError):  # another lock object is another writer
      WorkdirLock(tmp_path).acquire()
  assert not (tmp_path / LOCK_FILE).exists()
  WorkdirLock(tmp_path).acquire().release()


def test_a_run_refused_before_writing_leaves_no_folder_its_lock_made(tmp_path):
  made = tmp_path / "new" / "run"
  with lock_workdir(made):
    assert made.is_dir()
    (made / "checkpoints").mkdir()  # made empty before a refusal (a missing init_from source)
  assert not (tmp_path / "new").exists()  # the folders the lock made, left empty: removed
  with lock_workdir(made):
    (made / "config.json").write_text("{}")
  assert os.listdir(made) == ["config.json"]  # a folder with the run's files stays
  with lock_workdir(tmp_path):
    pass
  assert tmp_path.is_dir()  # and so does one that was there before


def test_a_lease_is_refused_while_renewed_and_taken_over_once_expired(fake_gcs, caplog):
  workdir = "gs://bucket/run"
  stored = fake_gcs / "bucket" / "run" / LOCK_FILE
  lock = WorkdirLock(workdir, settle_seconds=0, heartbeat_seconds=0.05)
  assert lock.lease  # chosen for a URI
  lock.acquire()
  first = json.loads(stored.read_text())
  deadline = time.time() + 10  # renewed every 0.05 s; a loaded machine may take longer
  while (renewed := json.loads(stored.read_text()))["heartbeat"] == first["heartbeat"]:
    assert time.time() < deadline, "the lease was not renewed within 10 s"
    time.sleep(0.05)
  assert renewed["token"] == first["token"] and renewed["heartbeat"] > first["heartbeat"]
  assert renewed["since"] == first["since"]
  with pytest.raises(WorkdirLockedError, match=f"in use by pid {os.getpid()} on host .*, last "
                     r"heartbeat \d s ago"):
    WorkdirLock(workdir, settle_seconds=0).acquire()
  lock.release()
  assert not stored.exists()

  stored.write_text(json.dumps({"host": "gone", "pid": 1, "since": "long ago", "token": "old",
                                "heartbeat": time.time() - 500, "lease_seconds": 120}))
  with caplog.at_level("WARNING"):
    lock = WorkdirLock(workdir, settle_seconds=0).acquire()
  assert re.search(r"held by pid 1 on host gone since long ago, last heartbeat 5\d\d s ago, "
                   r"whose lease expired", caplog.text)
  assert json.loads(stored.read_text())["pid"] == os.getpid()
  lock.release()


def test_a_lost_lease_stops_the_run_before_its_next_write(fake_gcs):
  workdir = "gs://bucket/run"
  stored = fake_gcs / "bucket" / "run" / LOCK_FILE
  lock = WorkdirLock(workdir, settle_seconds=0, heartbeat_seconds=0.05).acquire()
  lock.check()
  other = {"host": "other", "pid": 7, "since": "now", "token": "theirs",
           "heartbeat": time.time(), "lease_seconds": 120}
  stored.write_text(json.dumps(other))
  time.sleep(0.3)
  with pytest.raises(WorkdirLockedError, match="Lost the lock of gs://bucket/run to pid 7 on host "
                     "other"):
    lock.check()
  lock.release()
  assert json.loads(stored.read_text())["token"] == "theirs"  # the other writer's, kept


def test_a_multi_process_job_locks_on_process_0_only(tmp_path, monkeypatch):
  monkeypatch.setattr(jax, "process_index", lambda: 1)
  with lock_workdir(tmp_path) as lock:  # process 1 of a one-process "job": takes nothing
    lock.check()
    assert not (tmp_path / LOCK_FILE).exists()
  assert workdir_lock._HELD == {}


def test_every_process_of_a_job_stops_when_process_0_lost_the_lock(tmp_path, monkeypatch):
  """Process 0 holds the lock; when it lost it, the others raise at the same check (going on,
  they would wait for process 0 in the checkpoint's save), and not while it holds it."""
  from jax.experimental import multihost_utils
  process_0_lost = []
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                      lambda value: np.int32(bool(process_0_lost)))
  other_process = workdir_lock._NotHeld(tmp_path)
  other_process.check()
  process_0_lost.append(True)
  with pytest.raises(WorkdirLockedError, match=f"Process 0 lost the lock of {tmp_path}: stopped"):
    other_process.check()
  monkeypatch.setattr(jax, "process_index", lambda: 1)  # and when process 0 was refused it
  with pytest.raises(WorkdirLockedError, match="is in use by another run \\(process 0 was refused"):
    with lock_workdir(tmp_path):
      pass
  assert workdir_lock._HELD == {}


def test_a_reader_never_finds_a_held_lease_empty(tmp_path):
  """Every read of a lease renewed every 0.5 ms finds its holder: a heartbeat replaces the file
  whole (a plain write truncates it first, and a writer reading then would take the lock)."""
  lock = WorkdirLock(tmp_path, lease=True, settle_seconds=0, heartbeat_seconds=0.0005).acquire()
  try:
    deadline, reads, empty = time.time() + 1.0, 0, 0
    while time.time() < deadline:
      try:
        json.loads((tmp_path / LOCK_FILE).read_text())["token"]
      except (OSError, ValueError, KeyError):
        empty += 1
      reads += 1
  finally:
    lock.release()
  assert reads > 1000 and empty == 0, f"{empty} of {reads} reads found no holder"
