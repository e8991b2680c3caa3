"""One writer per workdir: the lock that training (and anything else that writes checkpoints or
``config.json``) holds on ``<workdir>/lock.json`` while it runs.

Two runs writing into one workdir interleave their checkpoints, TensorBoard files and
``config.json`` and leave a folder that belongs to neither.  ``lock_workdir(workdir)`` refuses
the second writer before it reads or writes anything, with one line naming the holder (host,
pid, since when): :class:`WorkdirLockedError`.

* **Local disks** (and NFS, where Linux turns ``flock`` into a lock on the server): an exclusive
  ``fcntl.flock`` on the lock file, whose text records the holder.  The kernel drops the lock
  when its process ends, however it ends, so a lock whose holder was SIGKILLed is free: the next
  writer takes it over and warns, naming the run that died.
* **Object stores** (``gs://``, any other URI) have no lock primitive that ``etils.epath``
  reaches (GCS has conditional writes, ``if_generation_match=0``, but no epath or gfile call
  exposes them), so the lock there is a **lease**: the holder rewrites the record every
  ``heartbeat_seconds``; a record not renewed for ``lease_seconds`` is stale and is taken over
  with a warning.  A newcomer writes its record, waits ``settle_seconds`` and reads it back:
  of writers that start within the same instant, the one whose record stayed wins, the others
  are refused.  Two writers whose writes are further apart than ``settle_seconds`` can both pass
  that check only if the second read the lock as absent before the first wrote it, which the
  settle time makes unlikely rather than impossible; then the heartbeat of the loser finds the
  other's record and :meth:`WorkdirLock.check` (called by training before every checkpoint)
  stops it before it writes one.  A lease assumes the hosts' clocks agree to well within
  ``lease_seconds``.

The lock is re-entrant within a process (``main`` takes it, ``train.train`` takes it again), and
in a multi-process job only process 0 takes it; the others learn from process 0 whether it did,
and at each check whether it lost it.
Readers (the evaluators, the analyses) take no lock: their results replace files atomically
(``workdir.write_atomically``).
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import jax
import numpy as np
from absl import logging

from smoothing_jax.experiment.workdir import is_uri, workdir_path, write_atomically

LOCK_FILE = "lock.json"


class WorkdirLockedError(OSError):
  """Another run holds the workdir (the message names it), or this run lost its lease."""


def _now() -> str:
  return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _holder_record(lease_seconds: float | None = None, token: str | None = None) -> dict:
  record = {"host": socket.gethostname(), "pid": os.getpid(), "since": _now()}
  if token is not None:
    record.update(token=token, heartbeat=time.time(), lease_seconds=lease_seconds)
  return record


def describe(record: dict | None) -> str:
  """``pid 123 on host h since 2026-… UTC`` (what a refused writer is told)."""
  if not record:
    return "another process (it has not recorded itself yet)"
  text = f"pid {record.get('pid')} on host {record.get('host')} since {record.get('since')}"
  if "heartbeat" in record:
    text += f", last heartbeat {time.time() - float(record['heartbeat']):.0f} s ago"
  return text


def _parse(text: str) -> dict | None:
  try:
    record = json.loads(text)
  except ValueError:  # empty (being written) or not ours
    return None
  return record if isinstance(record, dict) else None


def _missing_folders(folder: str) -> list[str]:
  """``folder`` and its ancestors that do not exist yet, deepest first."""
  missing = []
  folder = os.path.abspath(folder)
  while not os.path.exists(folder):
    missing.append(folder)
    folder = os.path.dirname(folder)
  return missing


class WorkdirLock:
  """The exclusive right to write ``workdir`` (see the module docstring); ``acquire`` raises
  :class:`WorkdirLockedError` naming the holder.  ``lease=None`` chooses by path: a lease for
  URIs, ``flock`` for local paths."""

  def __init__(self, workdir, *, lease: bool | None = None, lease_seconds: float = 120.0,
               heartbeat_seconds: float = 30.0, settle_seconds: float = 2.0):
    self.workdir = str(workdir)
    self.path = workdir_path(workdir) / LOCK_FILE
    self.lease = is_uri(self.workdir) if lease is None else lease
    self.lease_seconds, self.heartbeat_seconds = lease_seconds, heartbeat_seconds
    self.settle_seconds = settle_seconds
    self._fd: int | None = None
    self._token: str | None = None
    self._stop = threading.Event()
    self._heartbeat: threading.Thread | None = None
    self._lost: dict | None = None
    self._created: list[str] = []  # the local folders acquire made, deepest first

  def _refuse(self, holder: dict | None) -> WorkdirLockedError:
    return WorkdirLockedError(
        f"{self.workdir} is in use by {describe(holder)} (lock: {self.path}); wait for that run "
        "to end or choose another workdir.")

  def _take_over(self, previous: dict, why: str) -> None:
    logging.warning("Taking over the lock of %s: it was held by %s, %s.", self.workdir,
                    describe(previous), why)

  # flock on a local (or NFS) file.
  def _acquire_flock(self) -> None:
    path = os.fspath(self.path)
    while True:
      try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
      except FileNotFoundError:  # removed by a refused run that had made it (``release``)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        continue
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = self._read_fd(fd, wait_for_record=True)
        os.close(fd)
        raise self._refuse(holder) from None
      except OSError as error:
        os.close(fd)
        if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
          logging.warning("%s does not support file locks (%s): locking %s with a lease instead.",
                          path, error.strerror, self.workdir)
          self.lease = True
          return self._acquire_lease()
        raise
      try:  # the file a releasing holder unlinks after we opened it is not the lock any more
        current = os.stat(path).st_ino == os.fstat(fd).st_ino
      except FileNotFoundError:
        current = False
      if current:
        break
      os.close(fd)
    previous = self._read_fd(fd)
    if previous:  # its holder ended without releasing it: killed, or its machine went down
      self._take_over(previous, "a run that ended without releasing it (killed?)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
    os.fsync(fd)
    self._fd = fd

  @staticmethod
  def _read_fd(fd: int, wait_for_record: bool = False) -> dict | None:
    """The record in the lock file; a holder that has just taken the lock writes it within
    moments, so a refused writer waits up to a second for it."""
    for _ in range(20 if wait_for_record else 1):
      record = _parse(os.pread(fd, 1 << 16, 0).decode(errors="replace"))
      if record:
        return record
      time.sleep(0.05)
    return None

  # A lease object with a heartbeat (object stores).
  def _read_lease(self) -> dict | None:
    try:
      return _parse(self.path.read_text())
    except FileNotFoundError:
      return None

  def _write_lease(self, since: str | None = None) -> dict:
    """Write this holder's record (``since`` kept across heartbeats); returns it."""
    record = _holder_record(self.lease_seconds, self._token)
    if since:
      record["since"] = since
    # Replaced whole: a reader between a plain write's truncation and its text would find no
    # holder and take the lock (seen under load with a heartbeat every 0.05 s).
    write_atomically(self.path, json.dumps(record))
    return record

  def _acquire_lease(self) -> None:
    holder = self._read_lease()
    if holder is not None:
      age = time.time() - float(holder.get("heartbeat", 0))
      if age < float(holder.get("lease_seconds", self.lease_seconds)):
        raise self._refuse(holder)
      self._take_over(holder, f"whose lease expired {age:.0f} s after its last heartbeat")
    self._token = uuid.uuid4().hex
    since = self._write_lease()["since"]
    time.sleep(self.settle_seconds)
    holder = self._read_lease()
    if not holder or holder.get("token") != self._token:
      self._token = None
      raise self._refuse(holder)
    self._stop.clear()
    self._heartbeat = threading.Thread(target=self._beat, args=(since,), daemon=True,
                                       name="workdir_lease")
    self._heartbeat.start()

  def _beat(self, since: str) -> None:
    while not self._stop.wait(self.heartbeat_seconds):
      holder = self._read_lease()
      if not holder or holder.get("token") != self._token:
        self._lost = holder or {}
        logging.error("Lost the lock of %s to %s.", self.workdir, describe(holder))
        return
      self._write_lease(since)

  def acquire(self) -> WorkdirLock:
    if not self.lease:
      self._created = _missing_folders(os.fspath(self.path.parent))
    self.path.parent.mkdir(parents=True, exist_ok=True)
    if self.lease:
      self._acquire_lease()
    else:
      self._acquire_flock()
    return self

  def check(self) -> None:
    """Raise :class:`WorkdirLockedError` if this run's lease was taken by another writer (in a
    multi-process job, on every process: :func:`_raise_together`)."""
    _raise_together(None if self._lost is None else WorkdirLockedError(
        f"Lost the lock of {self.workdir} to {describe(self._lost)}: stopped before writing "
        "into a workdir another run now writes."), _LOST_ON_0.format(workdir=self.workdir))

  def release(self) -> None:
    if self._fd is not None:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(os.fspath(self.path))  # while still holding it: see _acquire_flock
      os.close(self._fd)
      self._fd = None
      # A run refused before it wrote anything leaves no empty workdir behind (the folders its
      # lock made, deepest first, while they stay empty), nor the empty folders made in it
      # before the refusal (the checkpoint manager's, when a missing init_from source refuses).
      workdir_made = self._created[:1]
      for folder, _, _ in (os.walk(workdir_made[0], topdown=False) if workdir_made else ()):
        if folder != workdir_made[0]:
          with contextlib.suppress(OSError):  # not empty: written into
            os.rmdir(folder)
      for folder in self._created:
        try:
          os.rmdir(folder)
        except OSError:  # another run's files, or its lock, are in there now
          break
      self._created = []
    if self._token is not None:
      self._stop.set()
      if self._heartbeat is not None:
        self._heartbeat.join()
      holder = self._read_lease()
      if holder and holder.get("token") == self._token:
        with contextlib.suppress(FileNotFoundError):
          self.path.unlink()
      self._token = None

  def __enter__(self) -> WorkdirLock:
    return self.acquire()

  def __exit__(self, *exc) -> None:
    self.release()


class _NotHeld:
  """What processes other than 0 of a multi-process job hold: process 0 holds the lock."""

  def __init__(self, workdir):
    self.workdir = workdir

  def check(self) -> None:
    _raise_together(None, _LOST_ON_0.format(workdir=self.workdir))


# What the other processes of a job raise when process 0 lost the lock it held.
_LOST_ON_0 = ("Process 0 lost the lock of {workdir}: stopped before writing into a workdir "
              "another run now writes.")


def _raise_together(error: WorkdirLockedError | None, elsewhere: str) -> None:
  """Raise process 0's ``error`` (None: none) on every process of a multi-process job, the others
  raising :class:`WorkdirLockedError` with the text ``elsewhere``: process 0 holds the lock, and a
  process that went on alone would wait for the others in their next collective.  A collective
  there: every process calls it at the same point."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    raised_on_0 = bool(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
    if raised_on_0 and error is None:
      error = WorkdirLockedError(elsewhere)
  if error is not None:
    raise error


_HELD: dict = {}  # path -> the lock this process holds on it
_HELD_GUARD = threading.Lock()


@contextlib.contextmanager
def lock_workdir(workdir, **options) -> Iterator[WorkdirLock]:
  """Hold ``workdir``'s lock for the ``with`` body (re-entrant: a nested call for the same workdir
  shares the outer lock).  In a multi-process job process 0 takes it, and every process raises
  :class:`WorkdirLockedError` when process 0 could not."""
  key = str(workdir_path(workdir))
  with _HELD_GUARD:
    held = _HELD.get(key)
  if held is not None:
    yield held
    return
  lock = WorkdirLock(workdir, **options) if jax.process_index() == 0 else _NotHeld(workdir)
  error = None
  if isinstance(lock, WorkdirLock):
    try:
      lock.acquire()
    except WorkdirLockedError as refused:
      error = refused
  _raise_together(error, f"{workdir} is in use by another run (process 0 was refused).")
  with _HELD_GUARD:
    _HELD[key] = lock
  try:
    yield lock
  finally:
    with _HELD_GUARD:
      del _HELD[key]
    if isinstance(lock, WorkdirLock):
      lock.release()
