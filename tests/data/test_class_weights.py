"""smoothing_jax.data.class_weights: pixel counts and median-frequency class weights."""
import numpy as np

from smoothing_jax.data import class_pixel_counts, median_frequency_weights


def test_median_frequency_weights_by_hand():
  # Two 2×2 label maps, 3 classes, void = 3.
  labels = np.array([[[0, 0], [0, 1]], [[0, 2], [3, 3]]])
  # freq0 = 4 / 8 (in both images), freq1 = 1 / 4, freq2 = 1 / 4 → median 0.25.
  np.testing.assert_allclose(median_frequency_weights(labels, 3), [0.5, 1.0, 1.0])
  # As a 4th class, "3" has freq 2 / 4: median of (.5, .25, .25, .5) = .375.
  np.testing.assert_allclose(median_frequency_weights(labels, 4), [0.75, 1.5, 1.5, 0.75])


def test_pixel_counts_by_hand_and_summed_counts_give_the_same_weights():
  labels = np.array([[[0, 0], [0, 1]], [[0, 2], [3, 3]]])
  # Class pixels (void 3 not counted); pixels of the images each class appears in.
  np.testing.assert_array_equal(class_pixel_counts(labels, 3), [[4, 1, 1], [8, 4, 4]])
  # Counts of two shards, summed (as over processes), stand in for the labels.
  counts = class_pixel_counts(labels[:1], 3) + class_pixel_counts(labels[1:], 3)
  np.testing.assert_allclose(median_frequency_weights(None, 3, counts),
                             median_frequency_weights(labels, 3))
  # A class absent from the labels gets weight 0.
  assert median_frequency_weights(labels, 5)[4] == 0
