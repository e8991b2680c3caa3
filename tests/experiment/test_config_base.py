"""The config-argument parser; every config in ``configs/``: defaults, name=value, rejections;
the recipe-neutral base and the recipe check."""
import importlib
import pathlib

import pytest
from absl import flags
from ml_collections import config_flags

from smoothing_jax.experiment.config_base import (
  RECIPE_KEYS,
  RECIPE_KEYS_OF,
  base_config,
  check_recipe,
  finalize,
  missing_recipe_keys,
  parse_config_arg,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(path.stem for path in (ROOT / "configs").glob("*.py") if path.stem != "__init__")


def load(name):
  return importlib.import_module(f"configs.{name}")


def test_parser_forms_and_conversion():
  spec = {"model": "m0", "dataset": "d0", "k": 4}
  args = parse_config_arg("m1,npz:/a/b:c,runlocal", spec)
  assert (args.model, args.dataset, args.k, args.runlocal) == ("m1", "npz:/a/b:c", 4, True)
  args = parse_config_arg("runlocal,m1,k=7", spec)
  assert (args.model, args.dataset, args.k, args.runlocal) == ("m1", "d0", 7, True)
  args = parse_config_arg("", spec)
  assert (args.model, args.dataset, args.k, args.runlocal) == ("m0", "d0", 4, False)
  assert parse_config_arg("m,5", {"model": "a", "k": 1}).k == 5


@pytest.mark.parametrize("arg,bad", [("m,d,3,x", "'x'"), ("runlokal", "'runlokal'"),
                                     ("m,size=2", "'size=2'"), ("k=abc", "'k=abc'"),
                                     ("k=1,m", "'m'"), ("m,model=n", "'model=n'"), ("m,,3", "''"),
                                     ("dataset=", "'dataset='")])
def test_parser_rejects_with_the_accepted_list(arg, bad):
  with pytest.raises(ValueError, match=f"argument {bad} .*model \\(default 'm0'\\), dataset "
                                       "\\(default 'd0'\\), k \\(default 4\\).*flags runlocal"):
    parse_config_arg(arg, {"model": "m0", "dataset": "d0", "k": 4})


@pytest.mark.parametrize("name", CONFIGS)
def test_config_defaults_and_name_value(name):
  module = load(name)
  expected = module.get_config().to_dict()
  assert module.get_config("").to_dict() == expected
  positional = ",".join(str(default) for default in module.ARGS.values())
  assert module.get_config(positional).to_dict() == expected
  named = ",".join(f"{key}={default}" for key, default in module.ARGS.items())
  assert module.get_config(named).to_dict() == expected
  if module.ARGS:  # trailing arguments missing: their defaults
    assert module.get_config(str(next(iter(module.ARGS.values())))).to_dict() == expected
  local = module.get_config("runlocal")
  assert 0 < local.num_train_steps != module.get_config().num_train_steps
  for key, default in module.ARGS.items():
    assert f"``{key}``" in module.__doc__ and f"``{default}``" in module.__doc__
  assert "``runlocal``" in module.__doc__


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("extra,reason", [("runlokal", "unknown flag"), ("nmae=1", "unknown name"),
                                          ("extra", "too many positional")])
def test_config_rejects_bad_arguments(name, extra, reason):
  module = load(name)
  arg = ",".join([*(str(default) for default in module.ARGS.values()), extra])
  with pytest.raises(ValueError) as error:
    module.get_config(arg)
  message = str(error.value)
  assert f"{extra!r}" in message and reason in message and "runlocal" in message
  for key, default in module.ARGS.items():
    assert f"{key} (default {default!r})" in message


def test_cifar_resnet_model_alone_and_names():
  from configs import cifar_resnet
  config = cifar_resnet.get_config("vgg_dnn_16")
  assert (config.model, config.input.dataset) == ("vgg_dnn_16", "cifar10")
  config = cifar_resnet.get_config("model=vgg_dnn_16,dataset=cifar100")
  assert (config.model, config.input.dataset) == ("vgg_dnn_16", "cifar100")


def test_config_flags_pass_datasets_with_colons():
  argv = ["prog", f"--config={ROOT}/configs/cifar_resnet.py:resnet_dnn_18,npz:/some/dir,runlocal"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  assert (values.config.model, values.config.input.dataset, values.config.num_train_steps) == (
      "resnet_dnn_18", "npz:/some/dir", 20)


def test_cifar_ibnn_arguments_and_ece_bins():
  from configs import cifar_ibnn
  config = cifar_ibnn.get_config("vgg_ibnn_16,cifar10,4,runlocal")
  assert config.model_kwargs.num_components == 4 and config.num_train_steps == 20
  assert cifar_ibnn.get_config("num_components=16").model_kwargs.num_components == 16
  with pytest.raises(ValueError, match="'num_components=abc'.*num_components \\(default 4\\)"):
    cifar_ibnn.get_config("num_components=abc")
  # The iBNN reference evaluates with IB ``ECELoss(n_bins=15)`` (and the paper says 15 bins).
  assert config.ece_bins == 15 and cifar_ibnn.get_config().ece_bins == 15


def test_cifar_ibnn_trains_every_method_under_one_protocol():
  from configs import cifar_ibnn
  from smoothing_jax.experiment.spec import ModelSpec, build_model
  from smoothing_jax.models import is_stochastic
  shared = ("optimizer", "nesterov", "input.batch_size", "learning_rate", "weight_decay",
            "num_epochs", "lr_schedule", "lr_final_ratio", "ece_bins")
  adam = ("optimizer", "learning_rate", "weight_decay")  # the iBNN repository's BNN-VI: Adam
  for architecture, methods in cifar_ibnn.METHODS.items():
    configs = {method: cifar_ibnn.get_config(f"{name},cifar100")
               for method, name in methods.items()}
    others = [c for method, c in configs.items() if method != "bnnvi"]
    assert len({tuple(c[k] for k in shared) for c in others}) == 1, architecture
    assert len({tuple(c[k] for k in shared if k not in adam) for c in configs.values()}) == 1
    assert (configs["bnnvi"].optimizer, configs["bnnvi"].learning_rate,
            configs["bnnvi"].weight_decay) == ("adam", 1e-3, 0.0)
    assert (configs["bnnvi"].bnnvi.prior_mean, configs["bnnvi"].bnnvi.prior_std) == (1.0, 0.5)
    assert (configs["bnnvi_ub"].bnnvi.prior_mean, configs["bnnvi_ub"].bnnvi.prior_std) == (
        None, 0.1)
    spec = ModelSpec(100, "cifar", (32, 32, 3))
    models = {method: build_model(c, spec) for method, c in configs.items()}
    weights = {method: model.weights for method, model in models.items()}
    assert weights == {"dnn": "point", "mcdo": "point", "bnnvi": "mean_field",
                       "bnnvi_ub": "mean_field", "ibnn": "ibnn"}
    assert (models["bnnvi"].bnn_reference, models["bnnvi_ub"].bnn_reference) == ("ibnn", "ub")
    fields = ("conv_bias", "stride_first", "head_bn_momentum", "kernel_init", "width",
              "widen_factor", "depth", "batch_norm", "classifier", "stage_sizes")
    architectures = {tuple(getattr(m, f, None) for f in fields) for m in models.values()}
    assert len(architectures) == 1, (architecture, architectures)
  vgg = {m: cifar_ibnn.get_config(name) for m, name in cifar_ibnn.METHODS["vgg"].items()}
  for method in ("dnn", "mcdo"):  # the reference's DetVGG16: no BatchNorm, 512-512-C head
    model = build_model(vgg[method], ModelSpec(10, "cifar", (32, 32, 3)))
    assert (model.batch_norm, model.classifier, model.dropout_rate) == (False, "mlp512", 0.0)
    assert model.head_dropout_rate == 0.5 and is_stochastic(model) == (method == "mcdo")
  assert vgg["bnnvi"].num_epochs == 300 and vgg["bnnvi"].bnnvi.kl_anneal_epochs == 200
  with pytest.raises(ValueError, match="compares"):
    cifar_ibnn.get_config("resnet_dnn_18")


def test_cifar_resnet_takes_uncertainty_baselines_batch_ensemble_settings():
  from configs import cifar_resnet
  config = cifar_resnet.get_config("wideresnet_batchensemble_28_10,cifar10")
  assert (config.nesterov, config.learning_rate, config.input.batch_size) == (True, 0.1, 128)
  assert config.weight_decay == pytest.approx(6e-4)  # Keras l2(3e-4) = λ·‖w‖²
  assert config.warmup_epochs + config.num_epochs == 250
  assert [config.warmup_epochs + m for m in config.lr_milestones] == [100, 200, 225]
  assert config.batch_ensemble.fast_weight_lr_multiplier == 0.5
  assert cifar_resnet.get_config("resnet_dnn_18").weight_decay == 5e-4


ALL_RECIPE_KEYS = {*RECIPE_KEYS, *(key for keys in RECIPE_KEYS_OF.values() for key in keys)}


def test_base_config_holds_no_recipe_values():
  config = base_config()
  assert {key: config[key] for key in ALL_RECIPE_KEYS} == dict.fromkeys(ALL_RECIPE_KEYS)
  assert ALL_RECIPE_KEYS >= {"model", "input.dataset", "optimizer", "input.batch_size",
                             "base_batch_size", "learning_rate", "momentum", "nesterov",
                             "weight_decay", "num_epochs", "warmup_epochs", "lr_schedule",
                             "lr_milestones", "lr_decay", "lr_final_ratio"}
  # Optional features off.
  assert (config.grad_clip_norm, config.label_smoothing, config.mixup_alpha, config.cutmix_alpha,
          config.input.randaugment.num_layers, config.class_balancing) == (0, 0, 0, 0, 0, "none")


def test_input_block_defaults_are_those_the_pipeline_gives_a_block_without_them():
  from smoothing_jax.data.pipeline import INPUT_DEFAULTS
  block = base_config().input.to_dict()
  assert set(block) == {"dataset", "batch_size", *INPUT_DEFAULTS}
  assert {k: block[k] for k in INPUT_DEFAULTS if k != "randaugment"} == {
      k: v for k, v in INPUT_DEFAULTS.items() if k != "randaugment"}
  assert INPUT_DEFAULTS["randaugment"] is None and block["randaugment"]["num_layers"] == 0  # off


def test_base_config_alone_fails_the_recipe_check_naming_the_keys():
  with pytest.raises(ValueError,
                     match="leaves model, input.dataset, optimizer, .*lr_schedule unset"):
    check_recipe(base_config())
  with pytest.raises(ValueError, match="model, input.dataset"):
    finalize(base_config())
  config = base_config()
  config.update(model="m", optimizer="sgd", base_batch_size=8, learning_rate=0.1,
                weight_decay=0.0, num_epochs=1, warmup_epochs=0, lr_schedule="multistep",
                lr_milestones=(1,))
  config.input.update(dataset="d", batch_size=8)
  with pytest.raises(ValueError, match="leaves momentum, nesterov, lr_decay unset") as error:
    finalize(config)
  assert "lr_milestones" not in str(error.value) and "lr_final_ratio" not in str(error.value)
  config.update(momentum=0.9, nesterov=False, lr_decay=0.1)
  assert finalize(config) is config and config.is_locked


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_set_every_recipe_key(name):
  module = load(name)
  for config in (module.get_config(), module.get_config("runlocal")):
    assert config.is_locked and not missing_recipe_keys(config)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_option_of_the_model_is_declared(name):
  """``finalize`` declares each module option of ``config.model`` (the registry's fields)."""
  from smoothing_jax.models import model_options
  config = load(name).get_config("")
  assert set(model_options(config.model)) <= set(config.model_kwargs)


def test_model_options_are_set_from_the_command_line_and_checked():
  config_file = f"--config={ROOT}/configs/cifar_resnet.py:wideresnet_dnn_28_10,cifar10"
  argv = ["prog", config_file, "--config.model_kwargs.widen_factor=2",
          "--config.model_kwargs.stage_sizes=(1,1)"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  with pytest.raises(Exception, match="stage_sizes"):  # not an option of WideResNet
    values(argv)
  argv = argv[:3]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
  values(argv)
  assert values.config.model_kwargs.widen_factor == 2 and values.config.model_kwargs.depth is None


def test_configs_are_locked():
  from configs import cifar_resnet
  config = cifar_resnet.get_config()
  with pytest.raises(AttributeError):
    config.learning_rte = 0.2



def test_vit_config_sets_hv_dropout_and_lets_the_command_line_change_it():
  from configs import cifar_vit
  from smoothing_jax.models import get_model
  kwargs = cifar_vit.get_config("vit_ti,cifar100").model_kwargs
  assert (kwargs.dropout_rate_train, kwargs.embedding_dropout_rate) == (0.0, 0.0)  # HV
  argv = ["prog", f"--config={cifar_vit.__file__}:vit_ti,cifar100",
          "--config.model_kwargs.dropout_rate_train=0.1",
          "--config.model_kwargs.embedding_dropout_rate=0.2"]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)  # locked, as in main
  values(argv)
  given = {k: v for k, v in values.config.model_kwargs.items() if v is not None}  # as create_model
  model = get_model("vit_ti", 10, **given)
  assert (model.dropout_rate_train, model.embedding_dropout_rate) == (0.1, 0.2)
  # AlterNet has no such options: the keys are absent, so its model still builds.
  kwargs = cifar_vit.get_config("alternet_50,cifar100").model_kwargs
  assert "dropout_rate_train" not in kwargs and "embedding_dropout_rate" not in kwargs
  get_model("alternet_50", 10, **{k: v for k, v in kwargs.items() if v is not None})


def test_the_uncertainty_flag_adds_the_evaluators_and_a_held_out_split():
  from configs import cifar_resnet
  plain = cifar_resnet.get_config("resnet_mcdo_18,cifar10")
  assert (plain.evals.to_dict(), plain.input.holdout_fraction) == ({"ensemble_sizes": {}}, 0.0)
  config = cifar_resnet.get_config("resnet_mcdo_18,cifar10,uncertainty,runlocal")
  assert config.evals.to_dict() == {"ensemble_sizes": {}, "ood": {"datasets": ()},
                                    "calibration": {}, "selective": {}}
  assert config.input.holdout_fraction == 0.1 and config.num_train_steps == 20
