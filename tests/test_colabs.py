"""Every notebook in colabs/ runs end to end (parameters cell replaced by tiny settings), so none
can rot: on the trained fixture workdirs, and one from empty workdirs (it trains tiny models
first)."""
import os
import sys
import tempfile

import pytest

nbformat = pytest.importorskip("nbformat")  # the notebook runner (requirements.txt)
NotebookClient = pytest.importorskip("nbclient").NotebookClient
run_sync = pytest.importorskip("nbclient.util").run_sync

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, "colabs")

TINY = {
    "hessian_spectra":
        "NUM_BATCHES = 2\nBATCH_SIZE = 16\nTOP_K = 2\nMAX_ITERS = 3\nSLQ_ITERS = 4\n"
        "TRACE_PROBES = 2",
    "fourier_and_variance":
        "NUM_IMAGES = 8\nNUM_SAMPLES = 2",
    "robustness": (
        "NUM_IMAGES = 8\nNUM_SAMPLES = 2\nNOISE_STD = 0.1\nNUM_FREQUENCIES = 3\nNUM_SEQUENCES = 2\n"
        "ATTACK_IMAGES = 8\nEPSILONS = (2 / 255,)\nPGD_STEPS = 2"),
}


LANDSCAPE_TINY = "NUM_POINTS = 3\nSCALE = 0.5\nNORMALIZATION = 'reference'\nBATCH_SIZE = 16"


def load_parameters(workdirs: dict) -> str:
  """Parameters that load the trained ``workdirs`` (no config: nothing is trained)."""
  return f"WORKDIRS = {workdirs!r}\nMODELS = {{}}\nCONFIG = None\nOVERRIDES = {{}}\n"


@pytest.fixture(scope="module")
def kernel():
  """One kernel for this file's notebooks, started from the repository root: each notebook would
  otherwise pay for a kernel and its imports of jax, flax and smoothing_jax (about 4 s), and the
  notebooks' tiny models share compiled programs.  :func:`execute` clears its namespace before
  each notebook, so that none can read what another left.  Its stderr (start-up warnings, a
  native crash) goes to a file, and the part a notebook wrote is shown with that notebook."""
  from jupyter_client.manager import AsyncKernelManager
  with tempfile.TemporaryFile("w+") as stderr:
    manager = AsyncKernelManager(kernel_name="python3")
    run_sync(manager.start_kernel)(cwd=ROOT, stderr=stderr)
    try:
      yield manager, stderr
    finally:
      run_sync(manager.shutdown_kernel)(now=True)


def execute(kernel, name: str, parameters: str):
  """Run ``colabs/<name>.ipynb`` in ``kernel``, its namespace cleared (``%reset -f``), with its
  ``parameters`` cell replaced."""
  manager, stderr = kernel
  book = nbformat.read(os.path.join(COLABS, f"{name}.ipynb"), as_version=4)
  tagged = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"{name}.ipynb needs exactly one cell tagged 'parameters'"
  tagged[0].source = parameters
  if not run_sync(manager.is_alive)():  # a native crash in an earlier notebook
    run_sync(manager.restart_kernel)(now=True)
  start = os.lseek(stderr.fileno(), 0, os.SEEK_END)  # the kernel writes there, not through us
  runner = NotebookClient(book, km=manager, timeout=600, kernel_name="python3")
  try:
    with runner.setup_kernel():
      reply = run_sync(runner.kc.execute_interactive)(
          f"%reset -f\nimport os\nos.chdir({ROOT!r})", timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    runner.execute()
  finally:
    if runner.kc is not None:
      runner.kc.stop_channels()
    stderr.seek(start)
    sys.stderr.write(stderr.read())
  return book


def images_in(book) -> int:
  return sum("image/png" in out.get("data", {}) for c in book.cells if c.cell_type == "code"
             for out in c.outputs)


# conftest.MSA_FIGURE_SIZES, the figures test's, in the notebook's names (its CKA: one batch of 8).
MSA_TINY = "NUM_BATCHES = 2\nBATCH_SIZE = 16\nMAX_ITERS = 3\nNUM_IMAGES = 8\nLESION_IMAGES = 16"


NOTEBOOKS = sorted(f[:-6] for f in os.listdir(COLABS) if f.endswith(".ipynb"))


def test_every_notebook_is_covered():
  assert NOTEBOOKS == sorted([*TINY, "loss_landscape", "quickstart", "msa_analysis", "uncertainty"])


def assert_stored_executed(path):
  """The notebook at ``path`` is stored executed: every code cell ran, in order, in one session
  (execution_count 1, 2, …), none failed (no "error" output, no traceback on stderr), and at
  least one figure is stored (an ``image/png`` output)."""
  book = nbformat.read(path, as_version=4)
  code = [c for c in book.cells if c.cell_type == "code"]
  counts = [c.execution_count for c in code]
  assert counts == list(range(1, len(code) + 1)), f"{path}: execution counts {counts}"
  for index, cell in enumerate(book.cells):
    for out in cell.get("outputs", []):
      assert out.output_type != "error", f"{path}, cell {index}: {out.ename}: {out.evalue}"
      assert not (out.output_type == "stream" and out.name == "stderr"
                  and "Traceback" in out.text), f"{path}, cell {index}: a traceback on stderr"
  assert images_in(book) >= 1, f"{path}: no image/png output"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_stored_executed(name):
  """The notebooks are committed with their outputs (the docs render them as stored)."""
  assert_stored_executed(os.path.join(COLABS, f"{name}.ipynb"))


@pytest.mark.parametrize("damage, message", [
    ("strip", "execution counts"),  # as `jupyter nbconvert --clear-output` leaves it
    ("outputs", "no image/png output"),  # outputs gone, counts kept
    ("error", "ValueError: bad"),
])
def test_stored_executed_check_rejects_a_damaged_copy(tmp_path, damage, message):
  book = nbformat.read(os.path.join(COLABS, "quickstart.ipynb"), as_version=4)
  code = [c for c in book.cells if c.cell_type == "code"]
  for cell in code:
    if damage in ("strip", "outputs"):
      cell.outputs = []
    if damage == "strip":
      cell.execution_count = None
  if damage == "error":
    code[-1].outputs.append(nbformat.v4.new_output("error", ename="ValueError", evalue="bad"))
  nbformat.write(book, tmp_path / "damaged.ipynb")
  with pytest.raises(AssertionError, match=message):
    assert_stored_executed(tmp_path / "damaged.ipynb")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_analysis_notebook_runs_on_trained_workdirs(kernel, name, analysis_workdirs):
  # One model (the smoothed one, which has every layer): the notebooks treat each model alike,
  # and a second one only doubles the compile time.
  smoothed = {"MC dropout + smoothing": analysis_workdirs["MC dropout + smoothing"]}
  book = execute(kernel, name, load_parameters(smoothed) + TINY[name])
  assert images_in(book) >= 1


@pytest.mark.slow
def test_landscape_notebook_trains_empty_workdirs_first(kernel, analysis_workdirs, tmp_path):
  """An empty workdir: the model is trained (4 steps of batch 16, width 4, one block a stage, on
  the fixture's quadrant images), then every figure appears: NLL and NLL + L2 per model."""
  quadrants = os.path.dirname(next(iter(analysis_workdirs.values())))
  models = {label: {"model": os.path.basename(path)} for label, path in analysis_workdirs.items()
            if label == "MC dropout + smoothing"}  # one model: each is trained and drawn alike
  parameters = (f"MODELS = {models!r}\n"
                f"WORKDIRS = {{label: {str(tmp_path)!r} + '/' + keys['model'] "
                f"for label, keys in MODELS.items()}}\n"
                f"CONFIG = 'configs/cifar_resnet.py:dataset=npz:{quadrants},runlocal'\n"
                "OVERRIDES = {'model_kwargs.width': 4, 'model_kwargs.stage_sizes': (1,), "
                "'input.batch_size': 16, 'num_train_steps': 4, 'num_devices': 1}\n")
  book = execute(kernel, "loss_landscape", parameters + LANDSCAPE_TINY)
  assert images_in(book) == 2 * len(models)
  printed = "".join(out.get("text", "") for c in book.cells if c.cell_type == "code"
                    for out in c.outputs)
  for label, keys in models.items():
    assert f"{label}: {keys['model']} (width 4) on npz:{quadrants}, step 4" in printed
    assert os.path.isdir(tmp_path / keys["model"] / "checkpoints" / "4")


@pytest.mark.slow
def test_quickstart_notebook_trains_and_evaluates(kernel, tmp_path):
  book = execute(
      kernel, "quickstart",
      f"WORKDIR = {str(tmp_path / 'quickstart')!r}\nCONFIG_ARGS = 'runlocal'\nNUM_SAMPLES = 2\n"
      "OVERRIDES = {'model_kwargs.stage_sizes': (1,), 'model_kwargs.width': 4, "
      "'num_devices': 1, 'eval_batch_size': 128}")
  assert images_in(book) >= 2
  assert os.path.exists(tmp_path / "quickstart" / "results" / "ensemble_sizes.json")


@pytest.mark.slow
def test_uncertainty_notebook_trains_and_runs_the_three_evaluators(kernel, analysis_workdirs,
                                                                   tmp_path):
  """From nothing: the fixture's quadrant images split into classes 0–1 (in) and 2–3 (out), a
  tiny smoothed MC dropout model trained 2 steps with a quarter of the training split held out,
  then OOD detection, temperature scaling and selective prediction for N = 1 and 2."""
  quadrants = os.path.dirname(next(iter(analysis_workdirs.values())))
  parameters = (
      'MODELS = {"MC dropout + smoothing": {"model": "resnet_mcdo_smoothing_18"}}\n'
      f"SOURCE = 'npz:{quadrants}'\n"
      f"CONFIG = 'configs/cifar_resnet.py:dataset=npz:{quadrants},runlocal'\n"
      "OVERRIDES = {'model_kwargs.width': 4, 'model_kwargs.stage_sizes': (1,), "
      "'input.batch_size': 8, 'num_train_steps': 2, 'eval_batch_size': 16, 'num_devices': 1}\n"
      f"IN_CLASSES = (0, 1)\nSIZES = (1, 2)\nHOLDOUT_FRACTION = 0.25\nROOT = {str(tmp_path)!r}\n")
  book = execute(kernel, "uncertainty", parameters)
  # ROC/PR, reliability before and after (T on the members, on the ensemble), accuracy-rejection
  assert images_in(book) == 5
  for name in ("ood.json", "calibration.json", "selective.json"):
    assert (tmp_path / "resnet_mcdo_smoothing_18" / "results" / name).stat().st_size > 0, name


@pytest.mark.slow
def test_msa_notebook_runs_on_alternet_workdirs(kernel, msa_workdirs, msa_figures_run):
  # After the MSA figures (msa_figures_run), which ran the same analyses of the same AlterNet at
  # the same sizes: the kernel reads their compiled programs from the compilation cache.  Last in
  # this file: the other worker trains msa_workdirs and makes the figures meanwhile (first in
  # test_experiments.py), so little waits on them.
  # The AlterNet alone (its ResNet backbone is drawn alike, and test_experiments compares the two).
  alternet = {"AlterNet": msa_workdirs["AlterNet"]}
  book = execute(kernel, "msa_analysis", load_parameters(alternet) + MSA_TINY)
  assert images_in(book) >= 6  # spectra, Fourier (2), variance, lesion, CKA, trajectories
  printed = "".join(out.get("text", "") for c in book.cells if c.cell_type == "code"
                    for out in c.outputs)
  assert "layer3_1 | msa" in printed
  assert "AlterNet: 3 snapshots, path / distance" in printed
