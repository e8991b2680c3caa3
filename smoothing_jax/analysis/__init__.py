"""Analysis tools: Hessian spectra (``hessian``) and Fourier analysis of feature maps
(``fourier``)."""
from smoothing_jax.analysis import fourier, hessian
from smoothing_jax.analysis.fourier import delta_log_amplitude
from smoothing_jax.analysis.hessian import (eigenvalue_density, hessian_trace, hvp, min_eigenvalue,
                                            top_eigenvalues)

__all__ = [
    "delta_log_amplitude", "eigenvalue_density", "fourier", "hessian", "hessian_trace", "hvp",
    "min_eigenvalue", "top_eigenvalues"
]
