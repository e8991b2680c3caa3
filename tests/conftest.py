"""Test settings: 8 simulated CPU devices and fast (unoptimised) XLA compiles.

Compile time dominates on CPU, so tests use narrow models on small inputs and
share compiled functions through session fixtures.
"""
import os

os.environ["XLA_FLAGS"] = " ".join([
    os.environ.get("XLA_FLAGS", ""),
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
]).strip()
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402  (after XLA_FLAGS)
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from smoothing_jax.models import get_model  # noqa: E402
from tests.helpers import (MICRO_VIT, TINY_UNET, init_variables, model_options,  # noqa: E402
                           override)


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


@pytest.fixture(scope="session")
def images():
  return jax.random.normal(jax.random.key(42), (3, 16, 16, 3))


@pytest.fixture(scope="session")
def analysis_workdirs(tmp_path_factory):
  """Two briefly trained 16×16 workdirs, MC dropout without and with smoothing, on a small
  ``npz:`` set.

  Structured images (class = which quadrant is bright) so that the models learn a little.
  """
  from configs import cifar_resnet

  root = _quadrant_npz(tmp_path_factory.mktemp("analysis"))
  return {
      label:
          _train_briefly(cifar_resnet.get_config(f"{name},npz:{root},runlocal"),
                         root / name,
                         width=4)
      for label, name in (("MC dropout", "resnet_mcdo_18"), ("MC dropout + smoothing",
                                                             "resnet_mcdo_smoothing_18"))
  }


def _train_briefly(config, workdir, **model_kwargs) -> str:
  """Train ``config`` (with ``model_kwargs`` overrides) for 4 steps of batch 16 into ``workdir``."""
  from smoothing_jax import train
  override(config, **model_options(**model_kwargs), batch_size=16, num_train_steps=4,
           checkpoint_every_steps=4)
  train.train_and_evaluate(config, str(workdir))
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
def msa_workdirs(tmp_path_factory):
  """A micro AlterNet and its ResNet backbone trained 4 steps with the full ViT recipe
  (``configs/cifar_vit.py``: AdamW, RandAugment, Mixup/CutMix, label smoothing, clipping),
  recording the learning trajectory every 2 steps."""
  from configs import cifar_vit

  root = _quadrant_npz(tmp_path_factory.mktemp("msa"))
  return {
      label:
          _train_briefly(override(cifar_vit.get_config(f"alternet_18,npz:{root},runlocal"),
                                  trajectory_every_steps=2, trajectory_dims=16),
                         root / label,
                         width=4,
                         stage_sizes=(1, 1, 2, 2),
                         msa_blocks=msa,
                         num_heads=(1, 1, 1, 1),
                         head_dim=4,
                         window_size=2)
      for label, msa in (("backbone", (0, 0, 0, 0)), ("AlterNet", (0, 0, 1, 1)))
  }
