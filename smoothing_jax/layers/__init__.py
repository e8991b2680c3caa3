"""Layers: spatial smoothing (``Prob``, ``Blur``, ``Smooth``) and ``MCDropout``."""
from smoothing_jax.layers.dropout import MCDropout
from smoothing_jax.layers.smoothing import Blur, Prob, Smooth, blur_kernel, blur_padding

__all__ = ["Blur", "MCDropout", "Prob", "Smooth", "blur_kernel", "blur_padding"]
