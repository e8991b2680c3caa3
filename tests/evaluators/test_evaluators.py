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


def test_a_registered_evaluator_runs_by_name_with_its_config_options(analysis_workdirs,
                                                                      tmp_path, monkeypatch,
                                                                      capsys):
  calls = []
  toy = types.ModuleType("toy_evaluator")

  def evaluate(run, output_dir, *, num_samples=1, label="a"):
    calls.append((run.step, run.workdir, str(output_dir), num_samples, label))
    return {"step": run.step, "num_samples": num_samples}

  toy.evaluate = evaluate
  toy.summary = lambda result, output_dir: f"toy: {result} in {output_dir}"
  monkeypatch.setitem(sys.modules, "toy_evaluator", toy)
  monkeypatch.setitem(evaluators.REGISTRY, "toy", "toy_evaluator")
  workdir = analysis_workdirs["MC dropout"]
  # --mode=toy --config.evals.toy.num_samples=3 on the recorded run, without --config.
  config = main.resolve_config("toy", workdir, None, [("evals.toy.num_samples", "3")])
  assert config.evals.toy.to_dict() == {"num_samples": 3, "label": "a"}
  results = main.run(config, workdir, "toy")
  assert results == {"toy": {"step": 0, "num_samples": 3}}
  assert calls == [(0, workdir, f"{workdir}/results", 3, "a")]
  assert f"toy: {{'step': 0, 'num_samples': 3}} in {workdir}/results" in capsys.readouterr().out
  with pytest.raises(ValueError, match=r"unknown config key 'evals\.toy\.baseline_csv'; keys "
                     "there: label, num_samples"):
    main.resolve_config("toy", workdir, None, [("evals.toy.baseline_csv", "x.csv")])


def test_every_option_is_a_typed_config_key_with_the_evaluate_default():
  from configs import quickstart
  config = evaluators.declare_options(quickstart.get_config(), tuple(evaluators.REGISTRY))
  for name in evaluators.REGISTRY:
    defaults = evaluators.default_options(name)
    assert config.evals[name].to_dict() == defaults, name
    assert all(value is not None for value in defaults.values()), name  # a None has no type
  for name in ("streams", "temporal"):
    assert {"num_samples", "num_frames", "decay_rate"} <= set(config.evals[name]), name
  assert config.evals.ood.datasets == () and config.evals.corruptions.num_samples == 1


def test_an_option_an_evaluator_does_not_take_fails_before_anything_runs(tmp_path):
  with pytest.raises(ValueError, match="The ensemble_sizes evaluator takes no option "
                     "'num_samples'; its options .*: sizes, members, seed"):
    main.shorthand_options("ensemble_sizes", num_samples=3)
  with pytest.raises(ValueError, match="The ood evaluator takes no option 'sets'"):
    main.run(override_evals({"ood": {"sets": ("svhn_cropped",)}}), str(tmp_path / "never"))
  assert not (tmp_path / "never").exists()
  with pytest.raises(ValueError, match="--num_samples set options of an evaluation mode"):
    main.shorthand_options("train", num_samples=3)
  assert main.shorthand_options("uncertainty", ensemble_workdirs=["a", "b"]) == {
      f"evals.{name}.members": ("b",) for name in ("ood", "calibration", "selective")}


def override_evals(evals):
  from configs import quickstart
  from tests.helpers import override
  return override(quickstart.get_config(), evals=evals)
