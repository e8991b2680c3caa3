"""Layers: spatial smoothing (``Prob``, ``Blur``, ``Smooth``), ``MCDropout`` and self-attention
(MSA)."""
from smoothing_jax.layers.attention import MultiHeadAttention, WindowAttention
from smoothing_jax.layers.dropout import MCDropout
from smoothing_jax.layers.smoothing import Blur, Prob, Smooth, blur_kernel, blur_padding

__all__ = [
    "Blur", "MCDropout", "MultiHeadAttention", "Prob", "Smooth", "WindowAttention", "blur_kernel",
    "blur_padding"
]
