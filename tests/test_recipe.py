"""The ViT training recipe: Mixup/CutMix + label smoothing, RandAugment, AdamW/cosine/clipping,
config."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from PIL import Image, ImageEnhance, ImageOps

from smoothing_jax import train
from smoothing_jax.data import create_pipeline
from smoothing_jax.data import randaugment as ra
from smoothing_jax.data.mixup import Mixing, cutmix_box, mix, mix_batch, smooth_one_hot

# ----------------------------------------------------------------------------- Mixup / CutMix


def test_mixup_hand_worked_example():
  # Two 1×1 images (values 1 and 3), labels 0 and 2 of 3 classes, ε = 0.3, λ = 0.75.
  images = jnp.array([1.0, 3.0]).reshape(2, 1, 1, 1)
  targets = smooth_one_hot(jnp.array([0, 2]), 3, 0.3)
  np.testing.assert_allclose(targets, [[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]], rtol=1e-6)
  mixed, mixed_targets, lam = mix(images, targets, 0.75)
  np.testing.assert_allclose(mixed.ravel(), [1.5, 2.5], rtol=1e-6)
  np.testing.assert_allclose(mixed_targets, [[0.625, 0.1, 0.275], [0.275, 0.1, 0.625]], rtol=1e-6)
  assert lam == 0.75


def test_cutmix_hand_worked_example():
  # 4×4 images of constant 0 and 1; a box of rows 0..0 and columns 0..1 (clipped at the border)
  # pastes 2 of 16 pixels from the partner: λ = 1 − 2/16 = 0.875.
  images = jnp.stack([jnp.zeros((4, 4, 1)), jnp.ones((4, 4, 1))])
  targets = jax.nn.one_hot(jnp.array([0, 1]), 2)
  mixed, mixed_targets, lam = mix(images, targets, 0.75, box=(0, 1, 0, 2))
  expected = np.zeros((4, 4))
  expected[0, :2] = 1.0
  np.testing.assert_array_equal(mixed[0, ..., 0], expected)
  np.testing.assert_array_equal(mixed[1, ..., 0], 1.0 - expected)
  assert float(lam) == 0.875
  np.testing.assert_allclose(mixed_targets, [[0.875, 0.125], [0.125, 0.875]], rtol=1e-6)


def test_cutmix_box_side_follows_lambda():
  for seed in range(20):
    top, bottom, left, right = (int(v) for v in cutmix_box(jax.random.key(seed), 0.75, 32, 32))
    assert 0 <= top <= bottom <= 32 and 0 <= left <= right <= 32
    assert bottom - top <= 16 and right - left <= 16     # side √(1 − λ)·32 = 16, clipped
    # λ = 0: an 8×8 box around a centre inside the 8×8 image keeps at least half of each side.
    top, bottom, left, right = (int(v) for v in cutmix_box(jax.random.key(seed), 0.0, 8, 8))
    assert bottom - top >= 4 and right - left >= 4 and (top == 0 or bottom == 8) and (left == 0 or
                                                                                      right == 8)


def test_mix_batch_targets_are_consistent_with_the_images():
  images = jnp.broadcast_to(jnp.arange(4.0)[:, None, None, None], (4, 8, 8, 3))
  labels = jnp.arange(4)
  mixing = Mixing(4, label_smoothing=0.0, mixup_alpha=1.0, cutmix_alpha=0.8, switch_prob=0.5)
  run = jax.jit(lambda key: mix_batch(key, images, labels, mixing))
  kinds = set()
  for seed in range(8):
    mixed, targets = run(jax.random.key(seed))
    np.testing.assert_allclose(targets.sum(-1), 1.0, rtol=1e-6)
    # Example i is mixed with 3 − i: its mean pixel is Σ_c target_c · c for both Mixup and
    # CutMix.
    np.testing.assert_allclose(mixed.mean(axis=(1, 2, 3)),
                               targets @ jnp.arange(4.0),
                               rtol=1e-5,
                               atol=1e-5)
    kinds.add(bool(jnp.all(jnp.isin(mixed, jnp.arange(4.0)))))  # CutMix keeps pixel values
  assert kinds == {True, False}  # both kinds occur


def test_mixing_rejects_bad_settings():
  with pytest.raises(ValueError, match="label_smoothing"):
    Mixing(10, label_smoothing=1.0).check()
  with pytest.raises(ValueError, match="alpha"):
    Mixing(10, mixup_alpha=-1.0).check()


# ----------------------------------------------------------------------------- RandAugment

@pytest.fixture(scope="module")
def image():
  rng = np.random.default_rng(0)
  x = rng.integers(0, 256, (16, 16, 3)).astype(np.uint8)
  x[..., 2] = rng.integers(40, 200, (16, 16))  # a channel that does not span [0, 255]
  return x


@pytest.mark.parametrize("op, reference", [
    ("AutoContrast", lambda im, m: ImageOps.autocontrast(im)),
    ("Equalize", lambda im, m: ImageOps.equalize(im)),
    ("Invert", lambda im, m: ImageOps.invert(im)),
    ("Posterize", lambda im, m: ImageOps.posterize(im, int(4 * m / 10))),
    ("Solarize", lambda im, m: ImageOps.solarize(im, int(256 * m / 10))),
    ("Color", lambda im, m: ImageEnhance.Color(im).enhance(0.1 + 1.8 * m / 10)),
    ("Contrast", lambda im, m: ImageEnhance.Contrast(im).enhance(0.1 + 1.8 * m / 10)),
    ("Brightness", lambda im, m: ImageEnhance.Brightness(im).enhance(0.1 + 1.8 * m / 10)),
    ("Sharpness", lambda im, m: ImageEnhance.Sharpness(im).enhance(0.1 + 1.8 * m / 10)),
    ("TranslateXRel", lambda im, m: im.transform(
        im.size, Image.AFFINE, (1, 0, 0.45 * m / 10 * 16, 0, 1, 0), fillcolor=(128,) * 3)),
])
def test_randaugment_ops_match_pil(op, reference, image):
  magnitude = 7.5 if op == "TranslateXRel" else 7.0  # 0.45·0.75·16 = 5.4 px
  ours = ra.apply_op(ra.OPS.index(op), tf.constant(image), tf.constant(magnitude),
                     tf.constant(1.0)).numpy()
  expected = np.asarray(reference(Image.fromarray(image), magnitude))
  if op == "TranslateXRel":  # sub-pixel shift: compare the interior, bilinear vs PIL's nearest
    ours, expected = ours[:, :10].astype(int), expected[:, :10].astype(int)
    assert np.mean(np.abs(ours - expected) > 40) < 0.6
    return
  np.testing.assert_array_equal(ours, expected)


def test_randaugment_geometry_matches_pil_away_from_the_border(image):
  pil = Image.fromarray(image)
  cases = [(ra.rotate(tf.constant(image),
                      20.0), pil.rotate(20.0, resample=Image.BILINEAR, fillcolor=(128,) * 3)),
           (ra.apply_op(11, tf.constant(image), tf.constant(5.0), tf.constant(-1.0)),
            pil.transform(pil.size,
                          Image.AFFINE, (1, -0.15, 0, 0, 1, 0),
                          resample=Image.BILINEAR,
                          fillcolor=(128,) * 3))]
  for ours, expected in cases:
    diff = np.abs(ours.numpy().astype(int) - np.asarray(expected).astype(int))[3:-3, 3:-3]
    assert np.mean(diff > 1) < 0.02, np.mean(diff > 1)


def test_randaugment_is_a_function_of_the_seed(image):
  out = [
      ra.randaugment(tf.constant(image), tf.constant([0, s], tf.int64), 2, 9.0, 1.0).numpy()
      for s in (1, 1, 2)
  ]
  np.testing.assert_array_equal(out[0], out[1])
  assert out[0].dtype == np.uint8 and out[0].shape == image.shape
  differs = [
      not np.array_equal(
          ra.randaugment(tf.constant(image), tf.constant([0, s], tf.int64), 2, 9.0, 1.0), image)
      for s in range(12)
  ]
  assert 3 <= sum(differs) <= 12  # P(no op applied) = 1/4 per image


def test_pipeline_with_randaugment_resumes_exactly(tmp_path):
  rng = np.random.default_rng(0)
  for split, n in (("train", 32), ("test", 8)):
    np.savez(tmp_path / f"{split}.npz", images=rng.integers(0, 256, (n, 16, 16, 3), dtype=np.uint8),
             labels=rng.integers(0, 10, n))
  make = lambda ra_args: create_pipeline(f"npz:{tmp_path}", 8, seed=1, randaugment=ra_args
                                        )  # noqa: E731
  epoch = list(tfds.as_numpy(make((2, 9.0, 1.0)).train_dataset(0)))
  resumed = list(tfds.as_numpy(make((2, 9.0, 1.0)).train_dataset(0, start_step=2)))
  for a, b in zip(epoch[2:], resumed):
    np.testing.assert_array_equal(a["image"], b["image"])
  plain = list(tfds.as_numpy(make(None).train_dataset(0)))
  assert not np.allclose(plain[0]["image"], epoch[0]["image"])
  np.testing.assert_array_equal(plain[0]["label"], epoch[0]["label"])


# ---------------------------------------------------------------------- optimiser, schedule, config

def test_vit_recipe_config_and_schedule():
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar100")
  assert (config.optimizer, config.learning_rate, config.batch_size,
          config.weight_decay) == ("adamw", 1.25e-4, 96, 0.05)
  assert (config.label_smoothing, config.mixup_alpha, config.cutmix_alpha,
          config.grad_clip_norm) == (0.1, 1.0, 0.8, 5.0)
  assert (config.randaugment.num_layers, config.randaugment.magnitude) == (2, 9.0)
  assert config.model_kwargs.stochastic_depth == 0.1
  schedule = train.create_learning_rate_schedule(config, steps_per_epoch=10)
  lr = 1.25e-4
  np.testing.assert_allclose([schedule(0), schedule(25), schedule(50)], [0.0, lr / 2, lr],
                             rtol=1e-6)
  # Cosine over 300 epochs after the 5 warm-up epochs: half way it is lr/2, at the end 0.
  np.testing.assert_allclose(schedule(50 + 1500), lr / 2, rtol=1e-4)
  np.testing.assert_allclose(schedule(50 + 3000), 0.0, atol=1e-12)


def test_vit_config_sets_hv_dropout_and_lets_the_command_line_change_it():
  from absl import flags
  from ml_collections import config_flags

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


def test_adamw_with_clipping_matches_a_hand_computed_step():
  from configs import cifar_vit
  config = cifar_vit.get_config("vit_ti,cifar100")
  tx = train.create_optimizer(config, optax.constant_schedule(0.1))
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
  tx = train.create_optimizer(config, optax.constant_schedule(0.1))
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"],
                             -0.1 * (np.array([3.0, 4.0]) + 0.01 * np.array([1.0, -2.0])),
                             rtol=1e-6)


def test_train_step_with_mixing_uses_soft_targets():
  from smoothing_jax.models import get_model
  model = get_model("vit_ti",
                    4,
                    hidden_dim=8,
                    depth=1,
                    num_heads=1,
                    head_dim=8,
                    mlp_dim=8,
                    patch_size=4)
  images = jax.random.normal(jax.random.key(0), (4, 8, 8, 3))
  labels = jnp.array([0, 1, 2, 3])
  variables = model.init({"params": jax.random.key(1), "dropout": jax.random.key(2)}, images)
  state = train.TrainState.create(apply_fn=model.apply, params=variables["params"], batch_stats={},
                                  tx=optax.sgd(0.0))
  smoothing_only = Mixing(4, label_smoothing=0.2)
  _, metrics = train.train_step(optax.constant_schedule(0.0),
                                train.supervised_loss(model, smoothing_only), state, {
                                    "image": images,
                                    "label": labels
                                }, jax.random.key(3))
  rng = jax.random.fold_in(jax.random.key(3), 0)
  logits = model.apply(variables,
                       images,
                       train=True,
                       rngs={
                           "dropout": rng,
                           "noise": jax.random.fold_in(rng, 1)
                       })
  log_p = jax.nn.log_softmax(logits)
  expected = -jnp.mean(jnp.sum((0.8 * jax.nn.one_hot(labels, 4) + 0.05) * log_p, -1))
  np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)
