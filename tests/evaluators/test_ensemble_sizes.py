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


def test_the_printed_table_keeps_its_columns_at_an_nll_of_10_or_more():
  from smoothing_jax.evaluators.ensemble_sizes import summary
  rows = [{"method": "mc_dropout", "ensemble_size": n, "nll": nll, "acc": 0.1, "ece": 0.5}
          for n, nll in ((1, 12.34567), (10, 2.5), (100, float("inf")))]
  lines = summary(rows, "out").splitlines()[1:5]
  assert lines == ["ensemble size | NLL     | Acc (%) | ECE (%)",
                   "            1 | 12.3457 |   10.00 |   50.00",
                   "           10 |  2.5000 |   10.00 |   50.00",
                   "          100 |     inf |   10.00 |   50.00"]
  assert len({line.index("|", 16) for line in lines}) == 1  # the bars line up
