"""smoothing_jax.evaluators.ensemble_sizes: every test example counted once, whatever the batch
size, and the table and figures written."""
import pytest

from tests.helpers import evaluate_workdir, tiny_config

tfds = pytest.importorskip("tensorflow_datasets")  # CIFAR-10 under TFDS mock data


@pytest.mark.parametrize("eval_batch_size", [8, 5])
def test_ensemble_size_evaluation_counts_every_test_example(mock_cifar10_workdir, tmp_path,
                                                            eval_batch_size):
  workdir = mock_cifar10_workdir
  # 13 = one full batch of 8 + a padded batch; 5 is rounded up to the 8 devices (masked padding).
  with tfds.testing.mock_data(num_examples=13):
    rows = evaluate_workdir("ensemble_sizes", workdir, str(tmp_path),
                            tiny_config(eval_batch_size=eval_batch_size))
  assert [r["ensemble_size"] for r in rows] == [1, 3]
  assert all(r["count"] == 13 for r in rows)
  for name in ("ensemble_sizes.json", "ensemble_sizes.csv", "ensemble_sizes.png",
               "reliability.png"):
    assert (tmp_path / name).stat().st_size > 0
