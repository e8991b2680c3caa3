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


@pytest.fixture(scope="session")
def tiny_mcdo():
  """A narrow ``resnet_mcdo_smoothing_18`` on 16×16 inputs with initialised variables."""
  model = get_model("resnet_mcdo_smoothing_18", 5, width=4)
  variables = jax.jit(model.init)({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                                  jnp.zeros((1, 16, 16, 3)))
  return model, variables


@pytest.fixture(scope="session")
def images():
  return jax.random.normal(jax.random.key(42), (3, 16, 16, 3))
