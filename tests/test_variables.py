"""Abstract variables have an initialisation's shapes; transfers name every path that differs."""
import jax
import numpy as np
import pytest

from smoothing_jax.models import get_model
from smoothing_jax.variables import abstract_variables, transfer_variables
from tests.helpers import init_variables


def test_abstract_variables_have_the_shapes_of_an_initialisation():
  # MC dropout initialises only with a 'dropout' RNG: the abstract ones must pass it too.
  model = get_model("resnet_mcdo_18", 10, width=4)
  spec = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)  # noqa: E731
  assert spec(abstract_variables(model, (8, 8, 3))) == spec(init_variables(model, (1, 8, 8, 3)))


def test_transfer_keeps_the_fresh_leaves_and_names_every_mismatch():
  target = {"params": {"dense": {"kernel": np.zeros((2, 3), np.float32),
                                 "bias": np.zeros(3, np.float32)}}, "batch_stats": {}}
  source = {"params": {"dense": {"kernel": np.ones((2, 3)), "bias": np.ones(4)}}}
  variables, kept = transfer_variables(target, source,
                                       keep_fresh=lambda path, *_: path[-1] == "bias")
  assert kept == ["params/dense/bias"] and variables["batch_stats"] == {}
  assert variables["params"]["dense"]["kernel"].dtype == np.float32
  np.testing.assert_array_equal(variables["params"]["dense"]["kernel"], np.ones((2, 3)))
  np.testing.assert_array_equal(variables["params"]["dense"]["bias"], np.zeros(3))

  source = {"params": {"dense": {"bias": np.ones(4)}, "extra": {"kernel": np.ones(1)}}}
  with pytest.raises(ValueError) as error:
    transfer_variables(target, source, title="checkpoint does not match")
  assert str(error.value).splitlines() == [
      "checkpoint does not match:",
      "  missing keys (1): params/dense/kernel",
      "  unexpected keys (1): params/extra/kernel",
      "  shape mismatches (1): params/dense/bias: (4,), expected (3,)",
  ]
