"""HV's released ViT-Ti, PiT-Ti and Swin-Ti in timm 0.5.4's layout (HV's notebooks' pin), whose key
names and shapes ``fixtures/timm_0_5_4_keys.json`` pins: they load as the timm 1.0.31 state_dict
they rename to."""
import json
import pathlib
import re

import jax
import numpy as np
import pytest

from smoothing_jax import convert
from tests.helpers import import_timm

FIXTURE = pathlib.Path(__file__).parents[1] / "fixtures" / "timm_0_5_4_keys.json"
MODELS = json.loads(FIXTURE.read_text())["models"]
# Persistent in timm 0.5.4, not in 1.0.31; no parameters.
BUFFERS = re.compile(r"(relative_position_index|attn_mask)$")
# HV's checkpoints as timm 1.0.31 counts them (tests/test_{transformers,pit,swin}.py).
NUM_PARAMS = {"vit_ti": 5_403_172, "pit_ti": 4_582_436, "swin_t": 27_562_126}


def _previous_stage(key: str, stages: str, module: str) -> str:
  return re.sub(rf"^{stages}\.(\d+)\.{module}\.",
                lambda m: f"{stages}.{int(m.group(1)) - 1}.{module}.", key)


def timm_0_5_4_key(model_name: str, key: str) -> str:
  """timm 1.0.31 key → timm 0.5.4's: the stage's downsampling (Swin's patch merging, PiT's
  pooling) belongs to the stage before, Swin's classifier is ``head`` (not ``head.fc``)."""
  if model_name == "swin_t":
    return re.sub(r"^head\.fc\.", "head.", _previous_stage(key, "layers", "downsample"))
  if model_name == "pit_ti":
    return _previous_stage(key, "transformers", "pool")
  return key


def test_fixture_holds_the_released_models():
  for name, model in MODELS.items():
    assert model["constructor"].startswith("timm.models.")
    params = [s for k, s in model["keys"].items() if not BUFFERS.search(k)]
    assert sum(int(np.prod(s)) for s in params) == NUM_PARAMS[name]


@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_timm_0_5_4_state_dict_loads_as_timm_1_0_31(model_name):
  timm = import_timm()
  model = MODELS[model_name]
  # HV's constructor in timm 1.0.31; every tensor random, so none can stand in for another.
  rng = np.random.default_rng(0)
  reference = eval(model["constructor"], {"timm": timm})  # pylint: disable=eval-used
  new = {k: rng.normal(size=v.shape).astype(np.float32)
         for k, v in reference.state_dict().items()}
  old = {timm_0_5_4_key(model_name, k): v for k, v in new.items()}
  assert {k: list(v.shape) for k, v in old.items()} == {
      k: s for k, s in model["keys"].items() if not BUFFERS.search(k)}
  old.update({k: np.zeros(s, np.float32) for k, s in model["keys"].items() if BUFFERS.search(k)})
  assert convert.is_timm_state_dict(old)

  expected = convert.from_timm_state_dict(model_name, new)
  jax.tree.map(np.testing.assert_array_equal, convert.from_timm_state_dict(model_name, old),
               expected)

  del old["norm.weight"]
  layout = "1.0.31" if model_name == "vit_ti" else "0.5.4"  # ViT's keys are the same in both
  with pytest.raises(ValueError, match=rf"timm {layout} keys.*\n  missing keys \(1\): norm.weight"):
    convert.from_timm_state_dict(model_name, old)
