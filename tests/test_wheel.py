"""The release artifacts: ``python -m build`` makes an sdist and a wheel from it; the wheel holds
the package (every module, the baselines CSVs) and nothing else, and installed without ``-e``
into a folder of its own it imports, reports pyproject.toml's version and runs the command line
from outside the source tree.  Built without isolation (the venv's setuptools; no network)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
PUBLIC = ("smoothing_jax.models", "smoothing_jax.layers", "smoothing_jax.inference",
          "smoothing_jax.metrics", "smoothing_jax.analysis", "smoothing_jax.data",
          "smoothing_jax.evaluators", "smoothing_jax.temporal", "smoothing_jax.experiment.run",
          "smoothing_jax.training.train")
BASELINES = ("data/baselines/README.md", "data/baselines/cifar100_alexnet_dnn_corrupted.csv",
             "data/baselines/imagenet_alexnet_dnn_corrupted.csv")


def _run(*args, cwd, env=None, timeout=120):
  return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
  """``(sdist, wheel)``: ``python -m build`` of the source tree, the wheel built from the sdist
  (so that a file the sdist lacks is missing from the wheel too), as a release makes them.  The
  tree gets only ``smoothing_jax.egg-info`` (ignored by git); no ``build/`` whose stale files
  could end up in a wheel."""
  if importlib.util.find_spec("build") is None:
    pytest.skip("`build` is not installed (requirements-test.txt pins it)")
  out = tmp_path_factory.mktemp("dist")
  result = _run("-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT), cwd=out)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
  return sdist, wheel


def test_the_wheel_holds_the_package_and_nothing_else(artifacts):
  sdist, wheel = artifacts
  assert wheel.name == f"smoothing_jax-{VERSION}-py3-none-any.whl"
  info = f"smoothing_jax-{VERSION}.dist-info/"
  with zipfile.ZipFile(wheel) as archive:
    names = archive.namelist()
    metadata = archive.read(f"{info}METADATA").decode()
  assert {name.split("/")[0] + "/" for name in names} == {"smoothing_jax/", info}, names
  modules = {f"smoothing_jax/{path.relative_to(ROOT / 'smoothing_jax')}"
             for path in (ROOT / "smoothing_jax").rglob("*.py")}
  assert {name for name in names if name.endswith(".py")} == modules
  data = {name for name in names if name.startswith("smoothing_jax/") and name not in modules}
  assert data == {f"smoothing_jax/{name}" for name in BASELINES}, data
  assert f"{info}licenses/LICENSE" in names
  assert f"\nVersion: {VERSION}\n" in metadata and "License-Expression: Apache-2.0" in metadata
  assert "Description-Content-Type: text/markdown" in metadata
  with tarfile.open(sdist) as archive:
    in_sdist = archive.getnames()
  shipped = ("LICENSE", "README.md", "pyproject.toml", *(f"smoothing_jax/{b}" for b in BASELINES))
  for name in shipped:
    assert f"smoothing_jax-{VERSION}/{name}" in in_sdist, name


def test_twine_check_strict_passes(artifacts):
  """The metadata is valid and the README renders as the long description."""
  if importlib.util.find_spec("twine") is None:
    pytest.skip("`twine` is not installed (requirements-test.txt pins it)")
  result = _run("-m", "twine", "check", "--strict", *map(str, artifacts), cwd=ROOT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("PASSED") == 2, result.stdout


def test_the_installed_wheel_works_outside_the_source_tree(artifacts, tmp_path):
  site = tmp_path / "site"
  result = _run("-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                "--disable-pip-version-check", "--target", str(site), str(artifacts[1]),
                cwd=tmp_path)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  # The installed copy first; jax and the rest come from the venv's site-packages.
  env = {**os.environ, "PYTHONPATH": str(site)}
  work = tmp_path / "work"
  work.mkdir()
  code = ("import importlib, importlib.metadata, json, pathlib, sys\n"
          "import smoothing_jax\n"
          "from smoothing_jax.evaluators import corruptions\n"
          f"modules = [importlib.import_module(name) for name in {PUBLIC!r}]\n"
          "package = pathlib.Path(smoothing_jax.__file__).parent\n"
          "print(json.dumps({'version': smoothing_jax.__version__,\n"
          "                  'files': [m.__file__ for m in [smoothing_jax, *modules]],\n"
          "                  'dist': str(importlib.metadata.distribution('smoothing_jax')"
          ".locate_file('')),\n"
          "                  'baselines': sorted(p.name for p in "
          "pathlib.Path(corruptions.BASELINES_DIR).iterdir()),\n"
          f"                  'data': [(package / name).is_file() for name in {BASELINES!r}]}}))\n")
  result = _run("-c", code, cwd=work, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  found = json.loads(result.stdout.splitlines()[-1])
  assert found["version"] == VERSION
  for file in found["files"]:
    assert pathlib.Path(file).is_relative_to(site), (file, site)
  assert pathlib.Path(found["dist"]) == site
  assert found["baselines"] == sorted(pathlib.Path(name).name for name in BASELINES)
  assert all(found["data"]), found["data"]
  # absl ends --help with exit status 1, after the usage on stdout.
  result = _run("-m", "smoothing_jax.main", "--help", cwd=work, env=env)
  assert result.returncode in (0, 1) and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert "smoothing_jax.main" in result.stdout and "--workdir" in result.stdout, result.stdout
