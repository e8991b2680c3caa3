"""smoothing_jax.methods.losses: the void-masked, class-weighted cross-entropy against a
hand-worked case."""
import jax.numpy as jnp
import numpy as np

from smoothing_jax.methods.losses import cross_entropy


def test_weighted_pixel_cross_entropy_masks_void():
  logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.3, 0.3, 0.4]]]))
  labels = jnp.array([[0, 1, 3]])
  w = jnp.array([2.0, 0.5, 1.0])
  expected = (2.0 * -np.log(0.7) + 0.5 * -np.log(0.6)) / 2.5
  np.testing.assert_allclose(cross_entropy(logits, labels, w), expected, rtol=1e-6)
  np.testing.assert_allclose(cross_entropy(logits, labels), (-np.log(0.7) - np.log(0.6)) / 2,
                             rtol=1e-6)
