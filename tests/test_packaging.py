"""``pip install .`` alone gives a working package: pyproject.toml lists every third-party import."""
import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imported_modules():
  modules = set()
  for path in (ROOT / "smoothing_jax").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        modules.update(alias.name.split(".")[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        modules.add(node.module.split(".")[0])
  return modules - set(sys.stdlib_module_names) - {"smoothing_jax"}


def _normalise(name):
  return re.sub(r"[-_.]+", "-", name).lower()


def test_pyproject_lists_every_third_party_import():
  dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
  listed = {_normalise(re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0]) for d in dependencies}
  providers = importlib.metadata.packages_distributions()
  modules = _imported_modules()
  assert "tensorflow" in modules  # the input pipeline's tf.data
  missing = {m: providers.get(m) for m in modules
             if not {_normalise(d) for d in providers.get(m, [m])} & listed}
  assert not missing, f"imported by smoothing_jax but not in pyproject.toml dependencies: {missing}"
