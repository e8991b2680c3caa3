"""smoothing_jax.data.mixup: Mixup / CutMix with label smoothing, by hand and on batches."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from smoothing_jax.data.mixup import Mixing, cutmix_box, mix, mix_batch, smooth_one_hot


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
