"""smoothing_jax.experiment.spec: the recorded model spec and the model rebuilt from it."""
from smoothing_jax.experiment.spec import ModelSpec, build_model, model_overrides
from tests.helpers import small_npz_config


def test_model_spec_records_only_what_is_set_and_reads_older_records():
  spec = ModelSpec(10, "cifar", (32, 32, 3), 50000)
  assert spec.to_record() == {"num_classes": 10, "stem": "cifar", "image_shape": [32, 32, 3],
                              "num_train_examples": 50000}
  assert ModelSpec.from_record(spec.to_record()) == spec
  timm = ModelSpec(100, "cifar", (32, 32, 3), 50000, {"patch_size": 2}, evaluates_init_from=True)
  assert timm.to_record()["model_options"] == {"patch_size": 2}
  assert timm.to_record()["evaluates_init_from"] is True
  assert ModelSpec.from_record(timm.to_record()) == timm
  older = ModelSpec.from_record({"num_classes": 4, "stem": "cifar", "image_shape": [16, 16, 3]})
  assert older.num_train_examples is None and "num_train_examples" not in older.to_record()


def test_the_model_is_rebuilt_from_config_and_spec(tmp_path):
  config = small_npz_config(str(tmp_path))
  spec = ModelSpec(4, "cifar", (16, 16, 3), 32)
  model = build_model(config, spec)
  assert (model.num_classes, model.stem, model.width, tuple(model.stage_sizes)) == (4, "cifar", 4,
                                                                                      (1,))
  # The recorded timm layout first, then the config's options, the spec's stem unless set.
  timm = ModelSpec(4, "cifar", (16, 16, 3), 32, {"width": 6, "stem": "imagenet"})
  assert model_overrides(config, timm)["width"] == 4
  assert model_overrides(config, timm)["width"] == 4
  assert model_overrides(config, ModelSpec(4, "cifar", (16, 16, 3)))["stem"] == "cifar"
  assert model_overrides(config, timm)["stem"] == "imagenet"
