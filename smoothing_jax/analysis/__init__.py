"""Analysis tools: Hessian spectra (``hessian``), Fourier analysis of feature maps (``fourier``)
and feature-map similarity by mini-batch CKA (``similarity``)."""
from smoothing_jax.analysis import fourier, hessian, similarity
from smoothing_jax.analysis.fourier import delta_log_amplitude
from smoothing_jax.analysis.hessian import (
  dataset_loss,
  eigenvalue_density,
  hessian_trace,
  hvp,
  min_eigenvalue,
  restricted_to,
  top_eigenvalues,
)
from smoothing_jax.analysis.similarity import cross_model_similarity, feature_similarity

__all__ = [
    "cross_model_similarity", "dataset_loss", "delta_log_amplitude", "eigenvalue_density",
    "feature_similarity", "fourier", "hessian", "hessian_trace", "hvp", "min_eigenvalue",
    "restricted_to", "similarity", "top_eigenvalues"
]
