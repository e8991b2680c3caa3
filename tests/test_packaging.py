"""``pip install .`` alone gives a working package: pyproject.toml lists every third-party
import."""
import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Third-party modules imported only by optional parts of smoothing_jax (torch: the PyTorch
# transcription smoothing_jax/torch_reference.py), each with the requirements file that installs it;
# they must be declared under [project.optional-dependencies] instead of the dependencies.
OPTIONAL = {"torch": "requirements-test.txt"}


def _imports(path):
  """Top-level names of the modules one file imports (anywhere in it)."""
  modules = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      modules.update(alias.name.split(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      modules.add(node.module.split(".")[0])
  return modules


def _imported_modules():
  modules = set().union(*map(_imports, (ROOT / "smoothing_jax").rglob("*.py")))
  return modules - set(sys.stdlib_module_names) - {"smoothing_jax"}


def _normalise(name):
  return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements):
  return {_normalise(re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0]) for d in requirements}


def test_pyproject_lists_every_third_party_import():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  listed = _names(project["dependencies"])
  providers = importlib.metadata.packages_distributions()
  modules = _imported_modules()
  assert "tensorflow" in modules  # the input pipeline's tf.data
  missing = {m: providers.get(m) for m in modules - set(OPTIONAL)
             if not {_normalise(d) for d in providers.get(m, [m])} & listed}
  assert not missing, f"imported by smoothing_jax but not in pyproject.toml dependencies: {missing}"
  extras = _names(d for group in project.get("optional-dependencies", {}).values() for d in group)
  for module, requirements in OPTIONAL.items():
    assert module in extras, f"optional {module} is not in [project.optional-dependencies]"
    assert module in _names(line for line in (ROOT / requirements).read_text().splitlines()
                            if line.strip() and not line.startswith("#"))


def test_figures_live_in_plots_alone():
  """Every ``plot_*`` function is in smoothing_jax/plots.py, the one module that imports
  matplotlib."""
  for path in (ROOT / "smoothing_jax").rglob("*.py"):
    if path == ROOT / "smoothing_jax" / "plots.py":
      continue
    figures = [node.name for node in ast.parse(path.read_text()).body
               if isinstance(node, ast.FunctionDef) and node.name.startswith("plot_")]
    assert not figures, f"{path.relative_to(ROOT)} defines {figures}; they belong in plots.py"
    assert "matplotlib" not in _imports(path), f"{path.relative_to(ROOT)} imports matplotlib"


def test_source_lines_are_at_most_100_columns():
  long_lines = [f"{path.relative_to(ROOT)}:{number}"
                for folder in ("smoothing_jax", "configs", "experiments", "tests")
                for path in sorted((ROOT / folder).rglob("*.py"))
                for number, line in enumerate(path.read_text().splitlines(), start=1)
                if len(line) > 100]
  assert not long_lines, long_lines


# What a machine without TensorFlow (the accelerator images) runs: training, evaluation, the
# analyses and every experiment script.  TensorFlow stays where data streams from disk.
TENSORFLOW_FREE = ("smoothing_jax.train", "smoothing_jax.main", "smoothing_jax.evaluate",
                   "smoothing_jax.analysis.trained", "smoothing_jax.data.resident")


def _run_python(code: str, **kwargs):
  import subprocess
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                        timeout=240, **kwargs)


def test_training_evaluation_and_experiments_import_no_tensorflow():
  scripts = sorted(p.stem for p in (ROOT / "experiments").glob("*.py"))
  assert {"bench_train", "device_check", "smoothing_figures"} <= set(scripts)
  code = ("import importlib, sys\nsys.path.insert(0, 'experiments')\n"
          f"for name in {list(TENSORFLOW_FREE) + scripts!r}:\n"
          "  importlib.import_module(name)\n"
          "  loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
          "('tensorflow', 'tensorflow_datasets'))\n"
          "  assert not loaded, (name, loaded[:3])\n")
  result = _run_python(code)
  assert result.returncode == 0, result.stderr[-3000:]


def test_a_tfds_dataset_without_tensorflow_is_one_line_naming_what_to_install(tmp_path):
  code = ("import runpy, sys\n"
          "sys.modules['tensorflow'] = sys.modules['tensorflow_datasets'] = None  # not installed\n"
          "sys.argv = ['main', '--config=configs/quickstart.py:runlocal', "
          f"'--config.dataset=cifar10', '--workdir={tmp_path}']\n"
          "runpy.run_module('smoothing_jax.main', run_name='__main__')\n")
  result = _run_python(code)
  assert result.returncode == 1, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if "tensorflow" in line.lower()]
  assert len(lines) == 1 and "pip install tensorflow-cpu tensorflow-datasets" in lines[0], lines
