"""The door: ``config.method`` names the method (default: the one the model is built for), a
method that does not take the model refuses in one line, nothing depends on the registry's
order, a config holds the settings block of its method alone, and a deep ensemble composes with
any method's state."""
import dataclasses

import jax
import pytest

from smoothing_jax import main, methods
from smoothing_jax.experiment.config_base import with_method
from smoothing_jax.methods.deterministic import Deterministic
from smoothing_jax.models import get_model
from tests.helpers import override, tiny_config

# Every model family's method, as the model is built (the methods' tests check each predictive).
BUILT_FOR = {
    "resnet_dnn_18": "deterministic", "resnet_dnn_smoothing_18": "deterministic",
    "vit_ti": "deterministic", "resnet_mcdo_18": "mc_dropout",
    "resnet_mcdo_smoothing_18": "mc_dropout", "vgg_ibnn_16": "ibnn", "vgg_bnnvi_16": "bnnvi",
    "vgg_bayesian_16": "bnnvi", "resnet_batchensemble_18": "batch_ensemble",
    "resnet_mimo_18": "mimo", "resnet_packed_18": "packed_ensemble",
}


@pytest.mark.parametrize("name", sorted(BUILT_FOR))
def test_an_unset_method_is_the_one_the_model_is_built_for(name):
  assert methods.resolve(None, get_model(name, 10)).name == BUILT_FOR[name]


def test_a_named_method_trains_any_model_it_takes_and_refuses_others_in_one_line():
  config = with_method(tiny_config(), "swag")
  for name in ("resnet_dnn_18", "resnet_mcdo_18"):
    assert methods.resolve(config, get_model(name, 10)).name == "swag"
  with pytest.raises(ValueError, match=r"^Method swag cannot train or evaluate this "
                     r"ResNet: it collects .* built for batch_ensemble\.$"):
    methods.resolve({"method": "swag"}, get_model("resnet_batchensemble_18", 10))
  # On the command line, the config's model is named (before any data is read).
  with pytest.raises(ValueError, match=r"^Method mimo cannot train or evaluate "
                     r"resnet_mcdo_smoothing_18: it takes the models built for it \(this one is "
                     r"built for mc_dropout; `--config.method=mc_dropout` or leave method "
                     r"unset\)\.$"):
    main.run(with_method(tiny_config(), "mimo"), "/unused/never/made")


def test_an_unknown_method_names_the_closest_and_every_method():
  with pytest.raises(ValueError, match=r"^--config.method=swagg: unknown method. Did you mean "
                     r"'swag'\? Methods: deterministic, mc_dropout, .*, swag, "):
    with_method(tiny_config(), "swagg")


def test_a_method_registered_last_is_chosen_by_its_name(monkeypatch):
  """No order decides: a method appended to the registry (as a new file's line would be) that
  takes every model is chosen by ``config.method`` and never otherwise."""

  @dataclasses.dataclass(frozen=True)
  class Everywhere(Deterministic):
    name = "everywhere"
    settings = {"strength": 2}

    @classmethod
    def refuses(cls, model):
      return None

  monkeypatch.setitem(methods.REGISTRY, "everywhere", Everywhere)
  model = get_model("resnet_dnn_18", 10)
  assert methods.resolve(tiny_config(), model).name == "deterministic"
  assert methods.resolve(None, get_model("resnet_mcdo_18", 10)).name == "mc_dropout"
  config = with_method(tiny_config(), "everywhere")
  assert config.everywhere.strength == 2
  assert isinstance(methods.resolve(config, model), Everywhere)


def test_a_config_holds_its_methods_settings_alone_and_the_command_line_switches_them():
  config = tiny_config()
  registered = {name for name, cls in methods.REGISTRY.items() if cls.settings}
  assert registered & set(config.keys()) == set()  # MC dropout has no settings
  assert "deep_ensemble" in config                    # composes with every method
  swag = with_method(config, "swag")
  assert registered & set(swag.keys()) == {"swag"}
  # --config.method first, then the chosen method's keys, in any order on the command line.
  for overrides in ([("method", "swag"), ("swag.rank", "5")],
                    [("swag.rank", "5"), ("method", "swag")]):
    resolved = main.resolve_config("train", "unused", "configs/quickstart.py", overrides)
    assert resolved.method == "swag" and resolved.swag.rank == 5
    assert registered & set(resolved.keys()) == {"swag"}
  with pytest.raises(ValueError, match=r"^--config.swag.rank: config.swag is the settings block "
                     r"of method swag, and this config trains its model's method: add "
                     r"--config.method=swag\.$"):
    main.resolve_config("train", "unused", "configs/quickstart.py", [("swag.rank", "5")])


def test_a_deep_ensemble_stacks_its_base_methods_state_and_runs_its_hooks():
  """``members=2`` of SWAG: the train state holds both members' moments, and the step's hook is
  SWAG's, on each member."""
  from smoothing_jax.training.optim import create_learning_rate_schedule
  from smoothing_jax.training.steps import state_initializer
  config = override(with_method(tiny_config(), "swag"), **{"deep_ensemble.members": 2})
  model = get_model("resnet_dnn_18", 10, width=4, stage_sizes=(1,))
  method = methods.resolve(config, model)
  assert method.name == "deep_ensemble" and method.per_member.name == "swag"
  init_one = state_initializer(config, method, (16, 16, 3),
                               create_learning_rate_schedule(config, 10))
  state = method.init_train_state(config, init_one)
  means = jax.tree.leaves(state.method_state["swag"]["mean"])
  params = jax.tree.leaves(state.params)
  assert [m.shape for m in means] == [p.shape for p in params] and params[0].shape[0] == 2
  assert state.method_state["swag"]["count"].shape == (2,)
