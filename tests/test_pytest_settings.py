"""The test command's own settings: a worker that crashes or a test that hangs ends the run
quickly, names the test and exits non-zero, instead of leaving xdist waiting (pyproject.toml; each
case runs a throw-away suite in a subprocess under these settings); and a worker releases each
file's compiled executables (conftest.py), which otherwise piled up to vm.max_map_count and
aborted it."""
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A second file, so that both workers have a job.
PASSING = "import time\n\ndef test_waits():\n  time.sleep(1)\n"


def _run_suite(tmp_path, body: str, *options: str) -> tuple:
  """``(returncode, output, seconds)`` of ``python -m pytest`` over ``test_bad.py`` (``body``)
  and a passing file, with pyproject.toml's settings (``-c``) plus ``options``."""
  (tmp_path / "test_bad.py").write_text(body)
  (tmp_path / "test_good.py").write_text(PASSING)
  start = time.monotonic()
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
       str(tmp_path), "-p", "no:cacheprovider", "-p", "tests.worker_stderr", *options,
       str(tmp_path)],
      cwd=tmp_path, capture_output=True, text=True, timeout=120,
      # tests.worker_stderr (conftest.py loads it) importable; its logs in tmp_path, not in /tmp.
      env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path)})
  return result.returncode, result.stdout + result.stderr, time.monotonic() - start


def test_a_native_abort_ends_the_run_naming_the_test(tmp_path):
  code, output, seconds = _run_suite(
      tmp_path, "import os\n\ndef test_fine():\n  pass\n\ndef test_aborts():\n  os.abort()\n\n"
      "def test_after():\n  pass\n")
  assert code != 0, output
  assert "crashed while running 'test_bad.py::test_aborts'" in output, output
  assert "restarting disabled" in output, output
  assert seconds < 60, seconds


def test_the_native_message_of_an_aborted_worker_is_printed_and_kept(tmp_path):
  # What XLA does before it aborts: a line on file descriptor 2, not through sys.stderr.
  code, output, _ = _run_suite(
      tmp_path, "import os\n\ndef test_aborts():\n  os.write(2, b'F0000 native.cc:1] Check "
      "failed: the cause\\n')\n  os.abort()\n")
  assert code != 0, output
  shown = re.search(r"native stderr of (gw\d), last \d+ lines \(whole: (\S+)\)", output)
  assert shown, output
  after = output[shown.end():]
  assert "F0000 native.cc:1] Check failed: the cause" in after, output
  assert "Check failed: the cause" in pathlib.Path(shown.group(2)).read_text()


def test_a_hang_in_native_code_is_stopped_by_the_time_limit(tmp_path):
  # threading.Event().wait() blocks in a lock acquire: no SIGALRM handler would run there.
  code, output, seconds = _run_suite(
      tmp_path, "import threading\n\ndef test_hangs():\n  threading.Event().wait()\n",
      "-o", "faulthandler_timeout=2", "-o", "timeout=4")
  assert code != 0, output
  assert "crashed while running 'test_bad.py::test_hangs'" in output, output
  # The stack of the hung test, printed before the worker is ended.
  assert "Timeout (0:00:02)!" in output and 'test_bad.py", line 4 in test_hangs' in output, output
  assert seconds < 60, seconds


def test_releasing_compiled_executables_returns_their_memory_mappings():
  import jax
  import jax.numpy as jnp

  from tests.helpers import memory_maps, release_compiled_executables
  release_compiled_executables()
  before = memory_maps()
  functions = [jax.jit(lambda x, i=i: x * i + 1.0) for i in range(200)]
  for f in functions:  # kept until the end: their caches, not the functions, are released
    f(jnp.ones(3)).block_until_ready()
  compiled = memory_maps()
  assert compiled - before >= 400, (before, compiled)  # about 3 mappings an executable
  release_compiled_executables()
  # Most come back (the rest: allocator arenas and the like, which later compiles reuse).
  assert memory_maps() - before < 0.2 * (compiled - before), (before, compiled, memory_maps())
  del functions


def test_a_frozen_cycle_that_holds_executables_is_released_by_collect_frozen():
  """What survives a file's release is frozen; a cycle among those objects that becomes garbage
  later keeps its executables until ``collect_frozen`` (which conftest.py calls when a worker's
  mappings run high)."""
  import jax
  import jax.numpy as jnp

  from tests.helpers import collect_frozen, memory_maps, release_compiled_executables
  release_compiled_executables()
  before = memory_maps()
  cycle = {"executables": [jax.jit(lambda x, i=i: x * i + 1.0).lower(jnp.ones(3)).compile()
                           for i in range(60)]}
  cycle["itself"] = cycle
  release_compiled_executables()  # alive: frozen, with its executables
  compiled = memory_maps()
  assert compiled - before >= 120, (before, compiled)  # about 3 mappings an executable
  del cycle  # garbage, but frozen: a release leaves it
  release_compiled_executables()
  assert memory_maps() - before >= 0.8 * (compiled - before), (before, compiled, memory_maps())
  collect_frozen()
  assert memory_maps() - before < 0.2 * (compiled - before), (before, compiled, memory_maps())
