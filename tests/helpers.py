"""What many test files need: model initialisation, parameter counts and tiny configs.

``from tests.helpers import ...`` (``tests`` is a package).
"""
import contextlib
import functools
import gc
import importlib.abc
import importlib.machinery
import logging as std_logging
import os
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import Partial

from smoothing_jax.passes import sample_rngs

# Narrow models that compile in seconds on CPU.
TINY_UNET = dict(width=4, encoder_convs=(1, 1, 1), decoder_convs=(1, 1))
MICRO_VIT = dict(hidden_dim=8, depth=2, num_heads=1, head_dim=8, mlp_dim=8, patch_size=4)

# A training run cut to seconds on CPU (``tiny_run``).  On one device: a program sharded over the
# 8 simulated devices compiles slower and runs each replicated computation 8 times on 2 cores;
# what 8 devices change is tested where it matters (test_steps, test_parallel, test_checkpoints,
# test_main, and every run of small_npz_config).
TINY_RUN = {
    "num_devices": 1,
    "model_kwargs.width": 4,
    "input.batch_size": 8,
    "eval_batch_size": 8,
    "checkpoint_every_steps": 2,
    "log_every_steps": 2,
}


def subprocess_xla_flags(num_devices: int | None = None, default_emitters: bool = False) -> str:
  """This run's ``XLA_FLAGS`` (conftest.py's fast compiles) for a process a test starts, with
  ``num_devices`` simulated CPU devices (``None``: one); ``default_emitters`` leaves out the
  older-emitter flag, for what must hold bit for bit with XLA:CPU's default code."""
  dropped = ("--xla_force_host_platform_device_count",
             *(("--xla_cpu_use_fusion_emitters",) if default_emitters else ()))
  flags = [flag for flag in os.environ.get("XLA_FLAGS", "").split()
           if not flag.startswith(dropped)]
  if num_devices:
    flags.append(f"--xla_force_host_platform_device_count={num_devices}")
  return " ".join(flags)


def rngs(seed: int = 0) -> dict:
  """The initialisation keys of the tests: ``params`` from ``seed``; ``dropout`` (and iBNN
  ``noise``, :func:`smoothing_jax.inference.sample_rngs`) from 1."""
  return {"params": jax.random.key(seed), **sample_rngs(jax.random.key(1))}


def _input(x):
  return jnp.zeros(x) if isinstance(x, tuple) else x


def init_variables(model, x, seed: int = 0):
  """``jax.jit(model.init)(rngs(seed), x)``; ``x`` is an input batch or its shape (zeros)."""
  return jax.jit(model.init)(rngs(seed), _input(x))


def abstract_variables(model, x=(1, 32, 32, 3)):
  """Shapes and dtypes of ``model``'s variables on ``x`` (a batch or its shape), nothing computed
  (``smoothing_jax.variables.abstract_variables``)."""
  from smoothing_jax import variables
  return variables.abstract_variables(model, tuple(x if isinstance(x, tuple) else np.shape(x))[1:])


def num_params(model, x=(1, 32, 32, 3)) -> int:
  """Number of trainable parameters of ``model`` on inputs like ``x``."""
  params = abstract_variables(model, x)["params"]
  return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def override(config, **values):
  """``config`` with ``values`` set (``"model_kwargs.width"`` sets a nested field), then locked."""
  config.unlock()
  for key, value in values.items():
    *path, name = key.split(".")
    setattr(functools.reduce(getattr, path, config), name, value)
  config.lock()
  return config


def model_options(**options) -> dict:
  """``options`` as :func:`override` keys of ``config.model_kwargs`` (``"model_kwargs.<name>"``)."""
  return {f"model_kwargs.{name}": value for name, value in options.items()}


def input_pipeline(dataset: str, batch_size: int, seed: int = 0, mesh=None, **options):
  """``data.create_pipeline`` of the input block ``{dataset, batch_size, **options}``."""
  from smoothing_jax.data import create_pipeline
  return create_pipeline({"dataset": dataset, "batch_size": batch_size, **options}, seed, mesh)


def tiny_run(config, **overrides):
  """``config`` cut to seconds on CPU (:data:`TINY_RUN`: one device, width 4, batches of 8,
  checkpoint and log every 2 steps), then ``overrides`` (as in :func:`override`)."""
  return override(config, **{**TINY_RUN, **overrides})


def tiny_config(**overrides):
  """A narrow ``resnet_mcdo_smoothing_18`` with one stage of one block on CIFAR-10 (mock data in
  tests): 4 steps of :func:`tiny_run`, ensemble sizes 1 and 3; then ``overrides``."""
  from configs import cifar_resnet
  config = cifar_resnet.get_config("resnet_mcdo_smoothing_18,cifar10,runlocal")
  return tiny_run(config, **{"num_train_steps": 4, "ensemble_sizes": (1, 3),
                             "model_kwargs.stage_sizes": (1,), **overrides})


class SmallNet(nn.Module):
  """Dense(8) → BatchNorm (inference mode) → tanh → Dense(3): 115 parameters (99 without
  BatchNorm), small enough for an explicit Hessian."""
  batch_norm: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    if self.batch_norm:
      x = nn.BatchNorm(use_running_average=True)(x)
    return nn.Dense(3)(jnp.tanh(x))


def npz_dataset(root, image_size: int, num_train: int = 40, num_test: int = 13,
                num_classes: int = 10) -> str:
  """``npz:`` arrays in ``root``: random uint8 images [size, size, 3] with labels in
  [0, num_classes), ``num_train`` in ``train.npz`` and ``num_test`` in ``test.npz``; returns
  ``str(root)``."""
  rng = np.random.default_rng(0)
  for split, n in (("train", num_train), ("test", num_test)):
    np.savez(os.path.join(root, f"{split}.npz"),
             images=rng.integers(0, 256, (n, image_size, image_size, 3), dtype=np.uint8),
             labels=rng.integers(0, num_classes, n))
  return str(root)


def small_npz(root) -> str:
  """The 16×16 four-class ``npz:`` set of :func:`small_npz_config`: 32 training and 16 test
  images."""
  return npz_dataset(root, 16, 32, 16, 4)


def small_npz_config(data_dir, **overrides):
  """``resnet_dnn_18`` cut to one stage of width 4 on :func:`small_npz` (the cheapest run to
  compile: seconds on CPU), 4 steps with checkpoints at 2 and 4; then ``overrides``."""
  from configs import cifar_resnet
  return override(cifar_resnet.get_config(f"resnet_dnn_18,npz:{data_dir},runlocal"), **{
      "model_kwargs.width": 4,
      "model_kwargs.stage_sizes": (1,),
      "input.batch_size": 8,
      "eval_batch_size": 16,
      "num_train_steps": 4,
      "checkpoint_every_steps": 2,
      "ensemble_sizes": (1,),
      **overrides
  })


def flat_variables(variables) -> dict:
  """``{"params/a/b": numpy array}`` of a variables pytree."""
  from flax.traverse_util import flatten_dict
  return {k: np.asarray(v) for k, v in flatten_dict(jax.device_get(variables), sep="/").items()}


def _small_net_point():
  """``(x [32, 8], y [32], batch_stats, params)``: a fixed batch, perturbed BatchNorm statistics
  and parameters of :class:`SmallNet` (a non-convex point)."""
  model = SmallNet()
  x = jax.random.normal(jax.random.key(0), (32, 8))
  y = jnp.arange(32) % 3
  variables = model.init(jax.random.key(1), x)
  stats = jax.tree.map(lambda s: s + 0.3 * jnp.abs(jax.random.normal(jax.random.key(2), s.shape)),
                       variables["batch_stats"])
  params = jax.tree.map(lambda p: p + 0.5 * jax.random.normal(jax.random.key(3), p.shape),
                        variables["params"])
  return x, y, stats, params


def small_net_loss(batch_stats, batch, params):
  """Mean cross-entropy of :class:`SmallNet` (BatchNorm in inference mode) on ``{"x", "y"}``."""
  logits = SmallNet().apply({"params": params, "batch_stats": batch_stats}, batch["x"])
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], axis=1))


def small_net_problem():
  """``(loss_fn, params)``: cross-entropy of :class:`SmallNet` on a fixed batch of 32, with
  perturbed parameters and BatchNorm statistics (a non-convex point)."""
  x, y, stats, params = _small_net_point()
  return functools.partial(small_net_loss, stats, {"x": x, "y": y}), params


def small_net_batches(num_batches: int):
  """``(batch_loss, batches)``: :func:`small_net_problem`'s loss as ``batch_loss(batch, params)``
  and its 32 examples split into ``num_batches`` equal batches ``{"x", "y"}``."""
  x, y, stats, _ = _small_net_point()
  batches = [{"x": xs, "y": ys} for xs, ys in zip(jnp.split(x, num_batches),
                                                  jnp.split(y, num_batches), strict=True)]
  return Partial(small_net_loss, stats), batches


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Answers every ``torchvision[.*]`` import with a module of placeholders.

  timm imports torchvision at import time (transforms, ``FrozenBatchNorm2d``), and torchvision's
  PyPI wheels are built against CUDA torch: with the CPU torch of ``requirements-test.txt`` its
  import fails (``operator torchvision::nms does not exist``). The models the tests build never
  call torchvision, so placeholders are enough.
  """

  class _Module(types.ModuleType):

    def __getattr__(self, attr):
      if attr.startswith("__"):
        raise AttributeError(attr)
      return _TorchvisionStub._Placeholder()

  class _Placeholder:
    """Any attribute, call or base class (``class X(torchvision.Y)``)."""

    def __getattr__(self, attr):
      if attr.startswith("__"):
        raise AttributeError(attr)
      return _TorchvisionStub._Placeholder()

    def __call__(self, *args, **kwargs):
      return _TorchvisionStub._Placeholder()

    def __mro_entries__(self, bases):
      return (object,)

  def find_spec(self, name, path, target=None):
    if name == "torchvision" or name.startswith("torchvision."):
      return importlib.machinery.ModuleSpec(name, self, is_package=True)
    return None

  def create_module(self, spec):
    module = self._Module(spec.name)
    module.__path__ = []
    return module

  def exec_module(self, module):
    pass


def import_timm():
  """``timm`` (pinned in ``requirements-test.txt``) with torchvision stubbed (see
  :class:`_TorchvisionStub`); skips the test where timm or torch is not installed."""
  import pytest  # pylint: disable=import-outside-toplevel
  pytest.importorskip("torch")
  if not any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
      del sys.modules[name]
    sys.meta_path.insert(0, _TorchvisionStub())
  return pytest.importorskip("timm")


def memory_maps() -> int:
  """How many memory mappings this process holds (lines of ``/proc/self/maps``; 0 where there is
  no ``/proc``)."""
  try:
    with open("/proc/self/maps") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return 0


def max_memory_maps() -> int:
  """The kernel's limit on a process's memory mappings (``vm.max_map_count``, usually 65,530)."""
  try:
    with open("/proc/sys/vm/max_map_count") as limit:
      return int(limit.read())
  except OSError:
    return 1 << 31


def release_compiled_executables():
  """Drop every compiled executable JAX keeps (``jax.clear_caches``) and collect the garbage that
  still holds one.

  Each XLA:CPU executable keeps about three memory mappings of JIT-compiled code for as long as a
  cache holds it, and JAX's caches hold thousands (jitted functions, eager operations on each new
  shape).  A process that compiles for long enough reaches ``vm.max_map_count``, where LLVM's next
  mapping fails and XLA aborts the process (``Fatal Python error: Aborted``).

  What survives the collection is then frozen (``gc.freeze``): the next collections, these and
  Python's own, skip it.  A worker's heap grows to about a million objects (TensorFlow, JAX, the
  session's fixtures), and collecting it took 0.4 s each time, whether or not it found garbage:
  30 s of each worker's 430 s.  A frozen object is still freed when its last reference goes; only
  a cycle of frozen objects that becomes garbage stays, until :func:`collect_frozen`.
  """
  jax.clear_caches()
  gc.collect()
  gc.freeze()


def collect_frozen():
  """Collect the garbage among the objects :func:`release_compiled_executables` froze too, and
  freeze what survives again."""
  gc.unfreeze()
  gc.collect()
  gc.freeze()


def initialised_run(root, **overrides):
  """A ``Run`` of :func:`small_npz_config` (``overrides`` applied) on a fresh :func:`small_npz` in
  ``root``, with initial variables and no training: what the evaluators' tests evaluate."""
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.parallel import shardings
  os.makedirs(os.path.join(root, "data"), exist_ok=True)
  data = small_npz(os.path.join(root, "data"))
  run = Run.from_config(small_npz_config(data, **overrides), os.path.join(root, "run"))
  variables = init_variables(run.model, (1,) + run.model_spec.image_shape)
  run.variables = jax.device_put(variables, shardings(run.mesh)[0])
  return run


ALL_CLASSIFIER_EVALS = ("ensemble_sizes", "calibration", "selective", "ood", "temporal")


def train_resume_and_evaluate(config, root, evals=ALL_CLASSIFIER_EVALS) -> dict:
  """Trains ``config`` (CIFAR-10 under TFDS mock data, 16 examples; 4 steps, checkpoints at 2
  and 4) with the command line's ``main.run``, which then runs the evaluators
  ``evals`` (``config.evals``; OOD against CIFAR-100), runs corruptions on the workdir (fog
  only: the whole sweep is 75 sets), and checks that a copy resumed from its step-2 checkpoint
  ends with the same variables.  Returns ``{evaluator: result}``."""
  import shutil

  import tensorflow_datasets as tfds

  from smoothing_jax import main
  from smoothing_jax.evaluators import corruptions
  from smoothing_jax.experiment.run import Run
  from smoothing_jax.training import train
  from smoothing_jax.training.steps import variables_of
  config = override(config, evals={name: {"datasets": ("cifar100",)} if name == "ood" else {}
                                   for name in evals})
  with tfds.testing.mock_data(num_examples=16):
    results = main.run(config, str(root / "run"))
    run = Run.from_workdir(str(root / "run"))
    results["corruptions"] = corruptions.evaluate(run, root / "results" / "corruptions",
                                                  corruptions=("fog",), num_samples=2)
    shutil.copytree(root / "run", root / "resumed")
    shutil.rmtree(root / "resumed" / "checkpoints" / "4")
    with absl_info_lines() as lines:
      resumed = train.train_from_config(config, str(root / "resumed"))
    assert any(line.startswith("Resumed from step 2 ") for line in lines), lines
  a, b = flat_variables(variables_of(resumed)), flat_variables(run.variables)
  assert a.keys() == b.keys()
  for key in a:
    np.testing.assert_array_equal(a[key], b[key], err_msg=key)
  return results


@contextlib.contextmanager
def absl_info_lines():
  """The absl INFO lines logged inside the block, as a list filled while it runs."""
  from absl import logging as absl_logging
  lines, handler = [], std_logging.Handler()
  handler.emit = lambda record: lines.append(record.getMessage())
  # The logger's own level, restored as it was (NOTSET: the root's); absl's set_verbosity would
  # leave an explicit level behind that hides INFO lines from later tests' caplog.
  logger = absl_logging.get_absl_logger()
  level = logger.level
  logger.setLevel(std_logging.INFO)
  logger.addHandler(handler)
  try:
    yield lines
  finally:
    logger.removeHandler(handler)
    logger.setLevel(level)


def evaluate_workdir(name: str, workdir, output_dir, config=None, **options):
  """The result of evaluator ``name`` with ``options`` on ``workdir`` (``Run.for_evaluation``;
  ``config``: the evaluation config), as ``--mode=<name>`` runs it."""
  from smoothing_jax import evaluators
  from smoothing_jax.experiment.run import Run
  with Run.for_evaluation(str(workdir), config) as run:
    return evaluators.run_evaluator(name, run, output_dir, options)[0]
