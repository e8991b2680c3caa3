"""Spatial smoothing, MC dropout, deep ensembles and uncertainty metrics for vision models in
JAX/Flax."""
import importlib.metadata

try:
  # The one source of the version is pyproject.toml's `version`; this reads the installed copy.
  __version__ = importlib.metadata.version("smoothing_jax")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
  __version__ = "0+unknown"
