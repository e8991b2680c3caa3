"""Pytest plugin (``pytest_plugins`` of ``tests/conftest.py``): each xdist worker's native
stderr is kept in a file, so that the line XLA writes before aborting a process
(``F…``/``Check failed: …``) survives the crash.

Two things lost it before.  pytest's default ``--capture=fd`` points file descriptor 2 at a
temporary file during each test and reports it when the test ends, which an aborted worker never
does (``addopts`` has ``--capture=sys``: Python's ``sys.stderr`` is still captured, native
writes go to the real descriptor).  And the controller prints only that the worker crashed.  Here
each worker sends descriptor 2 through ``tee`` (a separate process, so that what is in the pipe
when the worker dies still arrives) into ``<dir>/<worker>.log`` and to the console (without the
libraries' start-up chatter, :data:`CHATTER`); when a worker
goes down, the controller prints the end of its log and where the log is.  The logs are removed
after a run in which no worker crashed.
"""
import os
import shlex
import shutil
import subprocess
import tempfile
import time

ENV = "SMOOTHING_JAX_WORKER_STDERR"
TAIL_LINES = 40
# Kept in the log, not shown on the console: TensorFlow's import-time lines (TF_CPP_MIN_LOG_LEVEL
# does not silence them) and jupyter's warning at every kernel start.
CHATTER = "|".join([r"^WARNING: All log messages before absl::InitializeLog\(\)",
                    r"port\.cc:[0-9]+\] oneDNN custom operations are on",
                    r"Kernel is running over TCP without encryption"])


def pytest_configure(config):
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker is None:  # the controller: the workers it starts inherit the folder
    os.environ[ENV] = tempfile.mkdtemp(prefix="smoothing_jax_worker_stderr_")
    config._worker_stderr_crashed = False
    if config.getoption("numprocesses", None):
      return
    worker = "main"  # -n 0: the tests run in this process
  if os.environ.get(ENV):
    log = shlex.quote(os.path.join(os.environ[ENV], f"{worker}.log"))
    tee = subprocess.Popen(
        ["sh", "-c", f"tee -a {log} | grep --line-buffered -v -E {shlex.quote(CHATTER)} >&2"],
        stdin=subprocess.PIPE)
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()  # descriptor 2 is now the only writer: tee ends when the worker does
    config._worker_stderr_tee = tee


def pytest_testnodedown(node, error):
  if not error or not os.environ.get(ENV):
    return
  node.config._worker_stderr_crashed = True
  worker = node.gateway.id
  path = os.path.join(os.environ[ENV], f"{worker}.log")
  _wait_until_written(path)
  try:
    with open(path, errors="replace") as f:
      tail = f.readlines()[-TAIL_LINES:]
  except OSError:
    tail = []
  reporter = node.config.pluginmanager.get_plugin("terminalreporter")
  reporter.write_sep("-", f"native stderr of {worker}, last {len(tail)} lines (whole: {path})")
  reporter.write("".join(tail) or "(empty)\n")


def _wait_until_written(path, seconds: float = 3.0):
  """``tee`` may still be writing what the dead worker left in the pipe: wait until the log
  stops growing (0.2 s without change; at most ``seconds``)."""
  size, deadline = -1, time.monotonic() + seconds
  while time.monotonic() < deadline:
    now = os.path.getsize(path) if os.path.exists(path) else 0
    if now == size:
      return
    size = now
    time.sleep(0.2)


def pytest_unconfigure(config):
  directory = os.environ.get(ENV)
  if (directory and os.environ.get("PYTEST_XDIST_WORKER") is None
      and not getattr(config, "_worker_stderr_crashed", True)):
    shutil.rmtree(directory, ignore_errors=True)
