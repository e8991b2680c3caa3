"""Every notebook in colabs/ runs end to end (parameters cell replaced by tiny settings), so none
can rot."""
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLABS = os.path.join(ROOT, "colabs")

TINY = {
    "hessian_spectra":
        "NUM_BATCHES = 2\nBATCH_SIZE = 16\nTOP_K = 2\nMAX_ITERS = 3\nSLQ_ITERS = 4\n"
        "TRACE_PROBES = 2",
    "fourier_and_variance":
        "NUM_IMAGES = 8\nNUM_SAMPLES = 2",
    "loss_landscape":
        "NUM_POINTS = 3\nSCALE = 0.5\nNORMALIZATION = 'reference'\nBATCH_SIZE = 16",
    "robustness": (
        "NUM_IMAGES = 8\nNUM_SAMPLES = 2\nNOISE_STD = 0.1\nNUM_FREQUENCIES = 3\nNUM_SEQUENCES = 2\n"
        "EPSILONS = (2 / 255,)\nPGD_STEPS = 2"),
}


def execute(name: str, parameters: str):
  """Run ``colabs/<name>.ipynb`` from the repository root with its ``parameters`` cell replaced."""
  book = nbformat.read(os.path.join(COLABS, f"{name}.ipynb"), as_version=4)
  tagged = [c for c in book.cells if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"{name}.ipynb needs exactly one cell tagged 'parameters'"
  tagged[0].source = parameters
  NotebookClient(book, timeout=600, kernel_name="python3", resources={
      "metadata": {
          "path": ROOT
      }
  }).execute()
  return book


def images_in(book) -> int:
  return sum("image/png" in out.get("data", {}) for c in book.cells if c.cell_type == "code"
             for out in c.outputs)


MSA_TINY = "NUM_BATCHES = 2\nBATCH_SIZE = 16\nMAX_ITERS = 3\nNUM_IMAGES = 8\nLESION_IMAGES = 16"


def test_every_notebook_is_covered():
  names = sorted(f[:-6] for f in os.listdir(COLABS) if f.endswith(".ipynb"))
  assert names == sorted([*TINY, "quickstart", "msa_analysis"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TINY))
def test_analysis_notebook_runs_on_trained_workdirs(name, analysis_workdirs):
  book = execute(name, f"WORKDIRS = {analysis_workdirs!r}\n{TINY[name]}")
  assert images_in(book) >= 1


@pytest.mark.slow
def test_quickstart_notebook_trains_and_evaluates(tmp_path):
  book = execute(
      "quickstart",
      f"WORKDIR = {str(tmp_path / 'quickstart')!r}\nCONFIG_ARGS = 'runlocal'\nNUM_SAMPLES = 2")
  assert images_in(book) >= 2
  assert os.path.exists(tmp_path / "quickstart" / "results" / "ensemble_sizes.json")


@pytest.mark.slow
def test_msa_notebook_runs_on_alternet_workdirs(msa_workdirs):
  book = execute("msa_analysis", f"WORKDIRS = {msa_workdirs!r}\n{MSA_TINY}")
  assert images_in(book) >= 4
  assert any("layer3_1 | msa" in "".join(out.get("text", "")) for c in book.cells
             if c.cell_type == "code" for out in c.outputs)
