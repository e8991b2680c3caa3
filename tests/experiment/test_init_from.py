"""smoothing_jax.experiment.init_from: fine-tuning from a workdir with a fresh classifier, errors
that name every mismatch, and a timm checkpoint file evaluated and analysed in a workdir of its
own."""
import json
import logging
import shutil

import jax
import numpy as np
import pytest

from smoothing_jax.experiment import init_from
from smoothing_jax.experiment import workdir as workdir_lib
from smoothing_jax.experiment.checkpoints import has_checkpoint
from smoothing_jax.experiment.spec import ModelSpec, build_model
from smoothing_jax.parallel import create_mesh
from smoothing_jax.training import train
from smoothing_jax.variables import abstract_variables
from tests.helpers import evaluate_workdir, flat_variables, override, small_npz_config


def test_init_from_a_workdir_fine_tunes_with_a_fresh_classifier(small_npz_run, tmp_path, caplog):
  data, source, trained = small_npz_run
  workdir = tmp_path / "fine_tune"
  with caplog.at_level(logging.WARNING):  # 6 classes instead of 4; no step taken
    state = train.train_from_config(small_npz_config(data, init_from=source, num_classes=6),
                                    str(workdir), stop_after_steps=0)
  before = flat_variables(trained)
  started = flat_variables({"params": state.params, "batch_stats": state.batch_stats})
  head = ["params/classifier_0/dense/bias", "params/classifier_0/dense/kernel"]
  assert started[head[0]].shape == (6,) and before[head[0]].shape == (4,)
  assert sorted(started) == sorted(before)
  for key in set(before) - set(head):
    np.testing.assert_array_equal(started[key], before[key])
  assert f"re-initialised {', '.join(head)}" in caplog.text
  assert json.load(open(workdir / workdir_lib.CONFIG_FILE))["init_from"] == source
  # Resuming reads the recorded model spec, not the init_from source (moved away here).
  moved = tmp_path / "source_copy"
  shutil.copytree(source, moved)
  config = small_npz_config(data, init_from=str(moved), num_classes=6)
  first = train.train_from_config(config, str(tmp_path / "resumed"), stop_after_steps=2)
  shutil.rmtree(moved)
  again = train.train_from_config(config, str(tmp_path / "resumed"), stop_after_steps=0)
  assert int(again.step) == int(first.step) == 2
  jax.tree.map(np.testing.assert_array_equal, again.params, first.params)


def test_init_from_errors_name_the_source_and_every_mismatch(small_npz_run, tmp_path):
  data, source, _ = small_npz_run
  with pytest.raises(FileNotFoundError, match="config.init_from '.*nowhere': no such workdir"):
    train.train_from_config(small_npz_config(data, init_from=str(tmp_path / "nowhere")),
                            str(tmp_path / "run"), stop_after_steps=0)
  spec = ModelSpec(6, "cifar", (16, 16, 3))

  def target(config):
    return abstract_variables(build_model(config, spec), spec.image_shape)

  config = small_npz_config(data, init_from=source)  # evaluation: no fresh classifier
  with pytest.raises(ValueError, match=r"(?s)does not match 'resnet_dnn_18' \(num_classes=6\):.*"
                     r"shape mismatches \(2\): params/classifier_0/dense/bias: \(4,\)"):
    init_from.variables(config, spec, target(config), create_mesh())
  wider = small_npz_config(data, init_from=source, **{"model_kwargs.width": 8})
  with pytest.raises(ValueError, match=r"params/layer0_0/kernel: \(3, 3, 3, 4\), expected"):
    init_from.variables(wider, spec, target(wider), create_mesh(), new_classifier=True)


def test_evaluation_and_analyses_of_a_timm_checkpoint_file(small_npz_run, tmp_path):
  """HV's released ViT layout (timm, saved as ``{"state_dict": ...}``), evaluated by
  ``--mode=evaluate`` in a workdir with no checkpoint, then loaded by the analyses."""
  from configs import cifar_vit
  from smoothing_jax.analysis.trained import eval_pixels, load_trained
  from smoothing_jax.convert import TIMM_LAYOUTS
  from tests.helpers import import_timm, model_options
  timm = import_timm()  # skips without torch or timm, before anything imports them
  import torch

  from tests.torch_reference import randomize
  data = small_npz_run[0]
  vit = randomize(timm.models.vision_transformer.VisionTransformer(
      num_classes=4, img_size=16, patch_size=2, embed_dim=16, depth=2, num_heads=2,
      qkv_bias=False))
  torch.save({"state_dict": vit.state_dict()}, tmp_path / "vit.pth.tar")
  config = override(cifar_vit.get_config(f"vit_ti,npz:{data},runlocal"),
                    **model_options(hidden_dim=16, depth=2, num_heads=2, head_dim=8, mlp_dim=64,
                                    patch_size=None),  # the timm layout's patch size, 2
                    init_from=str(tmp_path / "vit.pth.tar"), eval_batch_size=16,
                    ensemble_sizes=(1,))
  workdir = str(tmp_path / "evaluation")
  (row,) = evaluate_workdir("ensemble_sizes", workdir, f"{workdir}/results", config)
  assert (row["step"], row["checkpoint"]) == (0, config.init_from)  # what it scored
  assert workdir_lib.read_config(workdir)[1].model_options == TIMM_LAYOUTS["vit_ti"]
  trained = load_trained(workdir)
  assert trained.step == 0 and not has_checkpoint(workdir)
  pixels, labels = eval_pixels(trained, 16)
  images = np.array(trained.normalize(pixels))
  with torch.no_grad():
    expected = vit(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
  np.testing.assert_allclose(trained.model.apply(trained.variables, images), expected, rtol=1e-4,
                             atol=1e-4)
  assert row["count"] == 16 and row["acc"] == pytest.approx(np.mean(expected.argmax(-1) == labels))
