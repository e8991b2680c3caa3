"""The results of methods' post-hoc stages (``Method.fit``: e.g. a Laplace posterior fitted on
the training split after training), one orbax item per checkpoint step they were fitted at::

  <workdir>/fits/<fit name>/<step>/     (the method's ``fit_name``, e.g. ``laplace_kron_marglik``)

orbax writes a step into a temporary folder and renames it when complete, so a fit killed
midway leaves nothing that reads as a result, and the rerun fits again from the start (the fit
is a pure function of the checkpoint and the data: the same result, bit for bit).
"""
from __future__ import annotations

import orbax.checkpoint as ocp
from etils import epath

from smoothing_jax.experiment.checkpoints import abstract_tree
from smoothing_jax.experiment.workdir import workdir_path
from smoothing_jax.parallel import shardings

FITS = "fits"


def fit_dir(workdir, name: str) -> epath.Path:
  """``<workdir>/fits/<name>``."""
  return workdir_path(workdir) / FITS / name


def _manager(workdir, name: str, read_only: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=not read_only, read_only=read_only,
                                         save_interval_steps=0 if read_only else 1)
  return ocp.CheckpointManager(fit_dir(workdir, name), options=options,
                               item_handlers=ocp.StandardCheckpointHandler())


def has_fit(workdir, name: str, step: int) -> bool:
  """Whether ``workdir`` holds the complete fit ``name`` of checkpoint step ``step``."""
  directory = fit_dir(workdir, name)
  return directory.exists() and step in ocp.utils.checkpoint_steps(directory)


def load_fit(workdir, name: str, step: int, mesh) -> dict:
  """The fit ``name`` of step ``step``, replicated on ``mesh``; FileNotFoundError (one line)
  saying how to make it where there is none."""
  if not has_fit(workdir, name, step):
    raise FileNotFoundError(
        f"{workdir} holds no {name} fit of step {step} (its latest checkpoint): run "
        f"`python -m smoothing_jax.main --workdir={workdir} --mode=fit` with the same "
        "--config.method and settings first.")
  replicated, _ = shardings(mesh)
  with _manager(workdir, name, read_only=True) as manager:
    target = abstract_tree(manager.item_metadata(step).tree, replicated)
    return manager.restore(step, args=ocp.args.StandardRestore(target))


def save_fit(workdir, name: str, step: int, result: dict) -> None:
  """Write ``result`` as the fit ``name`` of step ``step`` (complete, or not at all)."""
  with _manager(workdir, name, read_only=False) as manager:
    manager.save(step, args=ocp.args.StandardSave(result))
    manager.wait_until_finished()
