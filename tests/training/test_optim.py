"""smoothing_jax.training.optim: the recipes' learning-rate schedules and optimisers, against the
references' numbers and a hand-computed step."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import cifar_resnet
from smoothing_jax.training.optim import create_learning_rate_schedule, create_optimizer


def test_learning_rate_schedule_matches_the_recipe():
  config = cifar_resnet.get_config()
  schedule = create_learning_rate_schedule(config, steps_per_epoch=10)
  # Warm-up epoch: linear from 0; then 0.1, × 0.2 after epochs 60, 130, 160 (counted after
  # warm-up).
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.05)
  assert float(schedule(10)) == pytest.approx(0.1)
  assert float(schedule(10 + 599)) == pytest.approx(0.1)
  assert float(schedule(10 + 600)) == pytest.approx(0.02)
  assert float(schedule(10 + 1300)) == pytest.approx(0.004)
  assert float(schedule(10 + 1600)) == pytest.approx(0.0008)
  config.unlock()
  config.input.batch_size = 512
  assert float(create_learning_rate_schedule(config, 10)(10)) == pytest.approx(0.4)



def test_vit_recipe_config_and_schedule():
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar100")
  assert (config.optimizer, config.learning_rate, config.input.batch_size,
          config.weight_decay) == ("adamw", 1.25e-4, 96, 0.05)
  assert (config.label_smoothing, config.mixup_alpha, config.cutmix_alpha,
          config.grad_clip_norm) == (0.1, 1.0, 0.8, 5.0)
  assert (config.input.randaugment.num_layers, config.input.randaugment.magnitude) == (2, 9.0)
  assert config.model_kwargs.stochastic_depth == 0.1
  schedule = create_learning_rate_schedule(config, steps_per_epoch=10)
  lr = 1.25e-4
  np.testing.assert_allclose([schedule(0), schedule(25), schedule(50)], [0.0, lr / 2, lr],
                             rtol=1e-6)
  # Cosine over 300 epochs after the 5 warm-up epochs: half way it is lr/2, at the end 0.
  np.testing.assert_allclose(schedule(50 + 1500), lr / 2, rtol=1e-4)
  np.testing.assert_allclose(schedule(50 + 3000), 0.0, atol=1e-12)



def test_adamw_with_clipping_matches_a_hand_computed_step():
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar100")
  tx = create_optimizer(config, optax.constant_schedule(0.1))
  params = {"w": jnp.array([1.0, -2.0])}
  grads = {"w": jnp.array([30.0, 40.0])}            # norm 50 → clipped to norm 5: (3, 4)
  updates, _ = tx.update(grads, tx.init(params), params)
  # First Adam step: m̂ = g, v̂ = g², so the step is lr·g/(|g| + ε) = ±lr, plus decoupled
  # decay lr·wd·w.
  expected = -0.1 * (np.sign([3.0, 4.0]) * (np.array([3.0, 4.0]) / (np.array([3.0, 4.0]) + 1e-8))
                     + 0.05 * np.array([1.0, -2.0]))
  np.testing.assert_allclose(updates["w"], expected, rtol=1e-5)
  # SGD (momentum, coupled decay) shows the clipping: the step is −lr·(g·5/50 + wd·w).
  config.optimizer, config.momentum, config.weight_decay = "sgd", 0.9, 0.01
  tx = create_optimizer(config, optax.constant_schedule(0.1))
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"],
                             -0.1 * (np.array([3.0, 4.0]) + 0.01 * np.array([1.0, -2.0])),
                             rtol=1e-6)
