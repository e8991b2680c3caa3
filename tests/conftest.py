"""Test settings: 8 simulated CPU devices, fast XLA compiles (unoptimised, older emitters) and a
compilation cache shared by every process of the run.

Compile time dominates on CPU, so tests use narrow models on small inputs and
share compiled functions through session fixtures.
"""
import atexit
import fcntl
import gc
import importlib.util
import json
import os
import shutil
import tempfile
import time


def _jaxlib_before(major: int, minor: int) -> bool:
  from importlib import metadata
  return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2]) < (major, minor)


os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    # Each program's machine code in one piece instead of 32 compiled on a thread pool: the two
    # workers already keep both cores busy (the whole suite, one worker: XLA compiles 291 s
    # against 331 s).
    "--xla_cpu_parallel_codegen_split_count=1",
    # XLA:CPU's older elemental emitters instead of its MLIR fusion emitters: each compile takes
    # about half the time (38 programs of a tiny ResNet and ViT, train step and predictive:
    # 3.2 s against 5.9 s), and compiles are most of the suite's time.  jaxlib 0.11 (the
    # accelerator image's) has only the fusion emitters and refuses the flag.
    *(["--xla_cpu_use_fusion_emitters=false"] if _jaxlib_before(0, 11) else []),
]).strip()
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _compilation_cache_dir() -> str:
  """The tests' persistent compilation cache, kept between runs in the user's cache folder
  (``$XDG_CACHE_HOME`` or ``~/.cache``): ``smoothing_jax/tests-jax-<v>-jaxlib-<v>-py<v>``.  JAX
  keys each entry by the program, the compile options and XLA_FLAGS; the versions in the name keep
  entries of other installs apart, so an upgrade starts an empty folder instead of reading old
  executables.  A developer's second run reads most programs back instead of compiling them."""
  import sys
  from importlib import metadata
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  name = "tests-jax-{}-jaxlib-{}-py{}.{}".format(metadata.version("jax"),
                                                 metadata.version("jaxlib"), *sys.version_info[:2])
  return os.path.join(root, "smoothing_jax", name)


if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # One persistent compilation cache shared by the xdist workers (they inherit this environment),
  # the notebook kernels and the command lines the tests start: a program compiled again (a
  # resumed run, a rerun command, a file after the caches were released, the other worker, the
  # previous run) is read back instead.  SMOOTHING_JAX_TEST_CACHE=run keeps it for this run only.
  if os.environ.get("SMOOTHING_JAX_TEST_CACHE") == "run":
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="smoothing_jax_tests_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  else:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _compilation_cache_dir()
    # At most 4 GB, least recently read entries evicted first (JAX needs filelock for this; with
    # eviction on, it also takes a file lock around each read and write of an entry).
    if importlib.util.find_spec("filelock"):
      os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 << 30))
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
import pytest  # noqa: E402

from smoothing_jax.experiment.workdir import write_json  # noqa: E402
from smoothing_jax.models import get_model  # noqa: E402
from tests.helpers import (  # noqa: E402
  MICRO_VIT,
  TINY_UNET,
  collect_frozen,
  init_variables,
  max_memory_maps,
  memory_maps,
  model_options,
  override,
  release_compiled_executables,
)

# Each worker's native stderr kept in a file and shown when it crashes (see the module).
pytest_plugins = ("tests.worker_stderr",)

# A full collection (generation 2) after 100 of generation 1 instead of Python's 10.  The objects
# alive at the end of each file are frozen (``helpers.release_compiled_executables``), so each full
# collection walks only what the file made since, yet Python ran one every ~2.5 s of a test file
# (tracing makes objects by the million): 28 took 2.6 s of three files' 75 s, 4 took 0.5 s with
# 100.  Each file still ends with a full collection.
gc.set_threshold(*gc.get_threshold()[:2], 100)

# A worker at this share of vm.max_map_count after releasing a file's executables fails that file
# with a message, before XLA aborts the worker at the limit.
MAX_MAPS_SHARE = 0.5


@pytest.fixture(scope="session", autouse=True)
def _download_hosts_answer():
  """No test reaches the network: TFDS download hosts count as answering, so that a download
  under ``tfds.testing.mock_data`` (a no-op there) proceeds offline as online.  For the whole
  session, so that module and session fixtures that train under mock data see it too.  The
  offline test of ``tests/data/test_datasets.py`` probes a blocked network with the real probe."""
  from smoothing_jax.data.sources import tfds as tfds_source
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(tfds_source, "unreachable_download_host", lambda urls: None)
    yield


@pytest.fixture(scope="module", autouse=True)
def _release_executables_after_each_file():
  """Each test file's compiled executables are released when it ends: a worker runs one file
  after another in one process, and executables kept from every file before reached
  vm.max_map_count and aborted a worker (see ``helpers.release_compiled_executables``)."""
  yield
  release_compiled_executables()
  held, limit = memory_maps(), max_memory_maps()
  if held > MAX_MAPS_SHARE * limit:  # perhaps held by a cycle of objects frozen before
    collect_frozen()
    held = memory_maps()
  if held > MAX_MAPS_SHARE * limit:
    pytest.fail(f"This test process still holds {held} memory mappings after releasing the "
                f"compiled executables, over {MAX_MAPS_SHARE:.0%} of vm.max_map_count={limit}: "
                "executables are kept alive outside JAX's caches (by a module or a fixture).")


@pytest.fixture(scope="session")
def tiny_mcdo():
  """A narrow ``resnet_mcdo_smoothing_18`` on 16×16 inputs with initialised variables."""
  model = get_model("resnet_mcdo_smoothing_18", 5, width=4)
  return model, init_variables(model, (1, 16, 16, 3))


@pytest.fixture(scope="session")
def tiny_unet():
  """A narrow ``unet_mcdo_smoothing`` (5 classes) with variables initialised on 12×12 inputs."""
  model = get_model("unet_mcdo_smoothing", 5, **TINY_UNET)
  return model, init_variables(model, (1, 12, 12, 3))


@pytest.fixture(scope="session")
def micro_vit():
  """``(model, variables, images, labels)``: a 2-block ViT of width 8 (3 classes) on six 8×8
  images."""
  model = get_model("vit_ti", 3, **MICRO_VIT)
  x = jax.random.normal(jax.random.key(5), (6, 8, 8, 3))
  y = jnp.array([0, 1, 2, 0, 1, 2])
  return model, init_variables(model, x), x, y


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  """``gs://…`` paths served from ``tmp_path/gcs`` through ``etils.epath.testing.mock_epath``
  (every backend call rewritten; epath would otherwise pick TensorFlow's GCS client, which
  needs a network).  Orbax checkpoints go through TensorStore's own GCS driver: not covered."""
  from etils.epath import gpath, testing
  root = tmp_path / "gcs"
  root.mkdir()

  def local(path):
    path = os.fspath(path)
    return path.replace("gs://", f"{root}/", 1) if path.startswith("gs://") else path

  def one(original, path, *args, **kwargs):
    return original(local(path), *args, **kwargs)

  def two(original, source, destination, *args, **kwargs):
    return original(local(source), local(destination), *args, **kwargs)

  monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
  names = ("open", "exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "remove", "rmtree",
           "stat", "walk")
  with testing.mock_epath(**{name: one for name in names}, copy=two, rename=two, replace=two):
    yield root


@pytest.fixture(scope="session")
def images():
  return jax.random.normal(jax.random.key(42), (3, 16, 16, 3))


@pytest.fixture(scope="session")
def analysis_workdirs(tmp_path_factory):
  """Two workdirs of 16×16 MC dropout ResNets (one stage of one block, width 4, one device), without
  and with smoothing, on a small ``npz:`` set, as a run records them at step 0 (initialised, not
  trained): what loading, evaluation and the analyses read.  Training is tested in test_train.py."""
  from configs import cifar_resnet

  def make(root):
    _quadrant_npz(root)
    return {
        label: _initialised_workdir(
            override(cifar_resnet.get_config(f"{name},npz:{root},runlocal"), num_devices=1),
            root / name, width=4, stage_sizes=(1,))
        for label, name in (("MC dropout", "resnet_mcdo_18"), ("MC dropout + smoothing",
                                                               "resnet_mcdo_smoothing_18"))
    }
  return _once_per_run(tmp_path_factory, "analysis", make)


def _once_per_run(tmp_path_factory, name: str, make):
  """``make(root)`` (a JSON-able result, e.g. workdir paths under the new folder ``root``) once
  per test run: under xdist the first worker that asks makes it in the run's shared temporary
  folder while the others wait on a file lock, then read its result.  Tests only read these."""
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker is None:
    return make(tmp_path_factory.mktemp(name))
  shared = tmp_path_factory.getbasetemp().parent  # this run's folder, above every worker's own
  with open(shared / f"{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    made = shared / f"{name}.json"
    if not made.exists():
      (shared / name).mkdir(exist_ok=True)
      write_json(made, make(shared / name))
    return json.loads(made.read_text())


def _initialised_workdir(config, workdir, **model_kwargs) -> str:
  """What ``train.train_from_config(config, workdir)`` leaves at step 0 (``model_kwargs``
  overriding the model's options): ``config.json`` with the model spec, and an orbax checkpoint
  of the initial train state.  No train or eval step is compiled."""
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.training.optim import create_learning_rate_schedule
  from smoothing_jax.training.steps import create_train_state
  override(config, **model_options(**model_kwargs))
  with Run.from_config(config, str(workdir)) as run:
    schedule = create_learning_rate_schedule(config, run.pipeline.steps_per_epoch)
    init_rng = jax.random.split(jax.random.key(config.seed), 3)[0]  # as train.train
    state = create_train_state(config, run.model, init_rng, run.model_spec.image_shape, schedule)
    run.record()
    run.manager.save(0, args=ocp.args.StandardSave(state))
  return str(workdir)


def _train_briefly(config, workdir, **model_kwargs) -> str:
  """Train ``config`` (with ``model_kwargs`` overrides) for 4 steps of batch 16 on one device into
  ``workdir``."""
  from smoothing_jax.training import train
  override(config, **model_options(**model_kwargs), **{"input.batch_size": 16}, num_train_steps=4,
           checkpoint_every_steps=4, num_devices=1)
  train.train_from_config(config, str(workdir))
  return str(workdir)


def _quadrant_npz(root):
  """train.npz / test.npz of 16×16 images whose class is the bright quadrant."""
  import numpy as np
  rng = np.random.default_rng(0)
  for split, n in (("train", 64), ("test", 32)):
    labels = rng.integers(0, 4, n)
    images = rng.integers(0, 96, (n, 16, 16, 3))
    for i, c in enumerate(labels):
      images[i, 8 * (c // 2):8 * (c // 2) + 8, 8 * (c % 2):8 * (c % 2) + 8] += 128
    np.savez(root / f"{split}.npz", images=images.astype(np.uint8), labels=labels)
  return root


@pytest.fixture(scope="session")
def mock_cifar10_workdir(tmp_path_factory):
  """``tiny_config`` (CIFAR-10) at step 0 under TFDS mock data (16 examples), as training records
  it; the evaluators' tests read it under mock data of their own."""
  tfds = pytest.importorskip("tensorflow_datasets")
  from tests.helpers import tiny_config
  with tfds.testing.mock_data(num_examples=16):
    return _initialised_workdir(tiny_config(), tmp_path_factory.mktemp("mock_cifar10"))


@pytest.fixture(scope="session")
def small_npz_run(tmp_path_factory):
  """``(data_dir, workdir, final variables)`` of ``small_npz_config``: 4 steps on 8 devices
  (checkpoints 2 and 4), made once per test run.  Tests copy the workdir before changing it."""
  from smoothing_jax.experiment.checkpoints import load_variables
  from smoothing_jax.parallel import create_mesh
  from smoothing_jax.training import train
  from tests.helpers import small_npz, small_npz_config

  def make(root):
    (root / "data").mkdir()
    data = small_npz(root / "data")
    train.train_from_config(small_npz_config(data), str(root / "run"))
    return [data, str(root / "run")]
  data, workdir = _once_per_run(tmp_path_factory, "small_npz_run", make)
  return data, workdir, jax.device_get(load_variables(workdir, create_mesh())[1])


@pytest.fixture(scope="session")
def msa_workdirs(tmp_path_factory):
  """A micro AlterNet trained 4 steps with the full ViT recipe (``configs/cifar_vit.py``: AdamW,
  RandAugment, Mixup/CutMix, label smoothing, clipping) and its ResNet backbone with the same
  recipe but no augmentation (the recipe's compile cost paid once), each recording the learning
  trajectory every 2 steps."""
  from configs import cifar_vit
  no_augmentation = {"input.randaugment.num_layers": 0, "mixup_alpha": 0.0, "cutmix_alpha": 0.0}

  def make(root):
    _quadrant_npz(root)
    return {
        label:
            _train_briefly(override(cifar_vit.get_config(f"alternet_18,npz:{root},runlocal"),
                                    trajectory_every_steps=2, trajectory_dims=16, **changes),
                           root / label,
                           width=4,
                           stage_sizes=(1, 1, 2, 2),
                           msa_blocks=msa,
                           num_heads=(1, 1, 1, 1),
                           head_dim=4,
                           window_size=2)
        for label, msa, changes in (("backbone", (0, 0, 0, 0), no_augmentation),
                                    ("AlterNet", (0, 0, 1, 1), {}))
    }
  return _once_per_run(tmp_path_factory, "msa", make)


# The analysis sizes of the MSA figures test; the MSA notebook test (test_colabs.MSA_TINY) runs
# the same analyses of the same AlterNet at the same sizes.
MSA_FIGURE_SIZES = ("hessian_batches=2", "hessian_batch_size=16", "hessian_iters=3",
                    "fourier_images=8", "variance_images=8", "lesion_images=16",
                    "similarity_images=16", "similarity_batch_size=8")


@pytest.fixture(scope="session")
def msa_figures_run(msa_workdirs, tmp_path_factory):
  """``(out folder, printed report)`` of ``experiments/msa_figures.py`` on :func:`msa_workdirs`
  at :data:`MSA_FIGURE_SIZES`, made once per run.  The MSA notebook test asks for it too: its
  kernel then reads the AlterNet's compiled programs (the same model at the same sizes) from the
  persistent compilation cache instead of compiling them a second time."""
  import contextlib
  import io

  from experiments import msa_figures as script

  def make(root):
    args = [a for label, path in msa_workdirs.items() for a in ("--workdir", f"{label}={path}")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
      script.main(args + ["--out", str(root)] +
                  [a for size in MSA_FIGURE_SIZES for a in ("--size", size)])
    return [str(root), printed.getvalue()]
  return _once_per_run(tmp_path_factory, "msa_figures", make)


# The test files that take longest (measured on 2 cores), in that order.  They start first, and
# the many short files fill the end of the run, so that both workers finish together.
LONGEST_FILES = ("test_experiments.py", "test_analysis.py", "test_colabs.py", "test_models.py",
                 "test_ibnn.py", "test_train.py", "test_hessian.py", "test_steps.py",
                 "test_convert_reference.py", "test_landscape.py", "test_features.py",
                 "test_deep_ensemble.py", "test_transformers.py", "test_bnnvi.py",
                 "test_camvid.py", "test_swin.py", "test_batch_ensemble.py", "test_main.py",
                 "test_checkpoints.py", "test_pit.py", "test_sngp.py", "test_tta.py")


def pytest_collection_modifyitems(items):
  """Longest files first (:data:`LONGEST_FILES`); the others keep their order after them."""
  rank = {name: i for i, name in enumerate(LONGEST_FILES)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# This process's name in the per-process files below: the xdist worker's, or "main" with -n 0.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")

# XLA compilations of each test file, counted when SMOOTHING_JAX_COMPILE_LOG=<dir> is set: each
# process writes ``<dir>/<worker>.json`` with, per file, the backend compiles, their seconds and
# the programs read back from the persistent compilation cache.  What the suite budget is made of.
_COMPILES: dict = {}
_CURRENT_FILE = ["(collection)"]


def _count_compile(event: str, seconds: float = 0.0, **_):
  counts = _COMPILES.setdefault(_CURRENT_FILE[0], {"compiles": 0, "seconds": 0.0, "cache_hits": 0})
  if event == "/jax/core/compile/backend_compile_duration":
    counts["compiles"] += 1
    counts["seconds"] += seconds
  elif event == "/jax/compilation_cache/cache_hits":
    counts["cache_hits"] += 1


def pytest_configure(config):
  if os.environ.get("SMOOTHING_JAX_COMPILE_LOG"):
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    jax.monitoring.register_event_listener(_count_compile)


def pytest_unconfigure(config):
  directory = os.environ.get("SMOOTHING_JAX_COMPILE_LOG")
  if directory and _COMPILES:
    with open(os.path.join(directory, f"{WORKER}.json"), "w") as f:
      json.dump(_COMPILES, f, indent=1)


def pytest_runtest_protocol(item, nextitem):
  """With SMOOTHING_JAX_TEST_ORDER=<dir>, append each test's node id to ``<dir>/<worker>.txt``
  before it runs: the exact sequence a crashed worker ran, to replay in one process."""
  _CURRENT_FILE[0] = item.path.name
  directory = os.environ.get("SMOOTHING_JAX_TEST_ORDER")
  if directory:
    with open(os.path.join(directory, f"{WORKER}.txt"), "a") as f:
      f.write(item.nodeid + "\n")


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
  """With SMOOTHING_JAX_TEST_RESOURCES=<dir>, append at the end of each test a line ``<unix time>
  <memory mappings> <RSS kB> <threads> <node id>`` of the process that ran it to
  ``<dir>/<worker>.tsv``: where a worker's mappings, memory or threads grow.  (A teardown hook:
  the xdist controller, which only relays reports, runs none.)"""
  directory = os.environ.get("SMOOTHING_JAX_TEST_RESOURCES")
  if directory:
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
    with open(os.path.join(directory, f"{WORKER}.tsv"), "a") as f:
      f.write(f"{time.time():.0f}\t{memory_maps()}\t{status['VmRSS'].split()[0]}\t"
              f"{status['Threads'].strip()}\t{item.nodeid}\n")
