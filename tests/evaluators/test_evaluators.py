"""smoothing_jax.evaluators: the registry — a new evaluator is one module and one registry line,
run by name from the command line's ``run`` on a trained workdir, given the options it names."""
import sys
import types

import pytest

from smoothing_jax import evaluators, main


def test_unknown_names_list_the_registered_ones_and_aliases_resolve():
  with pytest.raises(ValueError, match="Unknown evaluator 'ensemble_size'; registered: "
                     "ensemble_sizes, corruptions, streams, temporal"):
    evaluators.get("ensemble_size")
  assert evaluators.expand("evaluate") == ("ensemble_sizes",)
  assert evaluators.expand("uncertainty") == ("ood", "calibration", "selective")
  assert evaluators.expand("ood") == ("ood",)
  for name in evaluators.REGISTRY:
    module = evaluators.get(name)
    assert callable(module.evaluate) and callable(module.summary), name


def test_a_registered_evaluator_runs_by_name_with_the_options_it_names(analysis_workdirs,
                                                                       tmp_path, monkeypatch,
                                                                       capsys):
  calls = []
  toy = types.ModuleType("toy_evaluator")

  def evaluate(run, output_dir, *, num_samples=1):
    calls.append((run.step, run.workdir, str(output_dir), num_samples))
    return {"step": run.step, "num_samples": num_samples}

  toy.evaluate = evaluate
  toy.summary = lambda result, output_dir: f"toy: {result} in {output_dir}"
  monkeypatch.setitem(sys.modules, "toy_evaluator", toy)
  monkeypatch.setitem(evaluators.REGISTRY, "toy", "toy_evaluator")
  workdir = analysis_workdirs["MC dropout"]
  results = main.run(None, workdir, "toy", num_samples=3, baseline_csv="not/for/toy.csv")
  assert results == {"toy": {"step": 0, "num_samples": 3}}
  assert calls == [(0, workdir, f"{workdir}/results", 3)]  # baseline_csv not passed
  assert f"toy: {{'step': 0, 'num_samples': 3}} in {workdir}/results" in capsys.readouterr().out
