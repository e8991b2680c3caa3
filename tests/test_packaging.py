"""``pip install .`` alone gives a working package: pyproject.toml lists every third-party
import."""
import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Third-party modules imported only by optional parts of smoothing_jax (torch: reading checkpoint
# files in smoothing_jax/convert/files.py), each with the requirements file that installs it;
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
TENSORFLOW_FREE = ("smoothing_jax.training.train", "smoothing_jax.main", "smoothing_jax.evaluators",
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
          f"'--config.input.dataset=cifar10', '--workdir={tmp_path}']\n"
          "runpy.run_module('smoothing_jax.main', run_name='__main__')\n")
  result = _run_python(code)
  assert result.returncode == 1, result.stderr[-3000:]
  lines = [line for line in result.stderr.splitlines() if "tensorflow" in line.lower()]
  assert len(lines) == 1 and "pip install tensorflow-cpu tensorflow-datasets" in lines[0], lines


def _lint_imports(root):
  """import-linter's contracts of ``root``'s pyproject.toml on ``root``'s smoothing_jax."""
  code = ("import sys\nsys.path.insert(0, '.')\nfrom importlinter.cli import lint_imports\n"
          "sys.exit(lint_imports(no_cache=True, no_logo=True))\n")
  import subprocess
  return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                        timeout=240)


def test_layers_point_down(tmp_path):
  """The contracts of pyproject.toml hold, and break on an upward import (even one inside a
  function, as import-linter counts those too)."""
  import shutil

  import pytest
  pytest.importorskip("importlinter")
  result = _lint_imports(ROOT)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert "3 kept, 0 broken" in result.stdout
  shutil.copytree(ROOT / "smoothing_jax", tmp_path / "smoothing_jax",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copy(ROOT / "pyproject.toml", tmp_path)
  with open(tmp_path / "smoothing_jax" / "models" / "vgg.py", "a") as f:
    f.write("\n\ndef _upward():\n  from smoothing_jax.training import train  # noqa: F401\n")
  result = _lint_imports(tmp_path)
  assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout[-3000:]
  assert "smoothing_jax.models.vgg -> smoothing_jax.training.train" in result.stdout


def _cycles(graph, package: str) -> list:
  """Pairs of modules under ``package`` that import each other, directly or through others."""
  import itertools
  return [(graph.find_shortest_chain(a, b), graph.find_shortest_chain(b, a))
          for a, b in itertools.combinations(sorted(graph.find_descendants(package)), 2)
          if graph.chain_exists(a, b) and graph.chain_exists(b, a)]


def test_the_data_modules_import_one_way():
  """No import cycle in smoothing_jax.data (one inside a function counts, as grimp sees it)."""
  import pytest
  grimp = pytest.importorskip("grimp")
  graph = grimp.build_graph("smoothing_jax", cache_dir=None)
  assert not _cycles(graph, "smoothing_jax.data")
  graph.add_import(importer="smoothing_jax.data.datasets", imported="smoothing_jax.data.pipeline")
  assert _cycles(graph, "smoothing_jax.data")


def _private_imports(path) -> list:
  """``from smoothing_jax... import _name`` and ``alias._name`` (alias: a smoothing_jax module
  imported by ``from smoothing_jax[.x] import y [as z]`` or ``import smoothing_jax.x as z``)."""
  tree = ast.parse(path.read_text())
  found, aliases = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("smoothing_jax"):
      for alias in node.names:
        if alias.name.startswith("_"):
          found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
        aliases.add(alias.asname or alias.name)
    elif isinstance(node, ast.Import):
      aliases.update(a.asname for a in node.names
                     if a.name.startswith("smoothing_jax.") and a.asname)
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases and node.attr.startswith("_")
        and not node.attr.startswith("__")):
      found.append(f"{path.name}:{node.lineno} uses {node.value.id}.{node.attr}")
  return found


def test_no_private_name_is_used_across_modules():
  paths = [*(ROOT / "smoothing_jax").rglob("*.py"), *(ROOT / "experiments").glob("*.py")]
  found = [line for path in paths for line in _private_imports(path)]
  assert not found, found


def test_loading_a_workdir_imports_neither_torch_nor_the_checkpoint_conversions(
    analysis_workdirs):
  workdir = next(iter(analysis_workdirs.values()))
  code = ("import sys\nfrom smoothing_jax import main\nfrom smoothing_jax.analysis import trained\n"
          f"run = trained.load_trained({workdir!r})\nassert run.step == 0\n"
          "loaded = [m for m in ('smoothing_jax.convert', 'torch', 'timm') if m in sys.modules]\n"
          "assert not loaded, loaded\n")
  result = _run_python(code)
  assert result.returncode == 0, result.stderr[-3000:]


# What decides a run's method: read only in smoothing_jax/methods/ and the layer factory (models/,
# layers/), plus the places listed here, each commented in its file with why.
METHOD_QUESTIONS = re.compile(
    r"\bis_(ibnn|mean_field|batch_ensemble|stochastic)\b|\.num_components\b|\.ensemble_size\b"
    r"|\.mean_field\b|\bstacked_members\b|isinstance\([^)]*(MCDropout|DeepEnsemble|IBNN|BNNVI|"
    r"BatchEnsemble|Deterministic)\b|\.(fit_name|stochastic|needs_training_data|"
    r"prepares_variables|predicts_per_member)\b")
METHOD_QUESTIONS_ALLOWED = {  # file: lines (code, strings and comments left out)
    # Run.stacked_members (the networks a Run stacks) and Run.member's bounds (one branch);
    # Run.fit's refusal of a method without a post-hoc stage (one branch); Run.stochastic
    # passes the method's answer on.
    "experiment/run.py": 4,
    # load_trained: the analyses study one network; which member of a deep ensemble is the
    # user's call (one branch).
    "analysis/trained.py": 1,
    # A method with a post-hoc stage is fitted when training ends (one branch).
    "training/train.py": 1,
    # VQ-BNN's table has an MC row only where two draws differ (one branch).
    "temporal.py": 1,
}


def test_only_the_methods_ask_which_method_a_run_uses():
  """Outside methods/ and the layer factory, the method is asked for, not worked out: four
  files hold the branches that remain, each in a file listed here and commented there."""
  counts = {}
  for path in (ROOT / "smoothing_jax").rglob("*.py"):
    relative = path.relative_to(ROOT / "smoothing_jax").as_posix()
    if relative.split("/")[0] in ("methods", "models", "layers"):
      continue
    code = [re.sub(r"\"[^\"]*\"|'[^']*'|#.*", "", line) for line in path.read_text().splitlines()]
    lines = [line for line in code if METHOD_QUESTIONS.search(line)]
    if lines:
      counts[relative] = len(lines)
  assert counts == METHOD_QUESTIONS_ALLOWED
