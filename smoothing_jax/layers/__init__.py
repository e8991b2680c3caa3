"""Layers: spatial smoothing (``Prob``, ``Blur``, ``Smooth``), ``MCDropout``, self-attention
(MSA), and the weights of the Bayesian and ensemble baselines: BNN-VI's mean-field Gaussian
kernels (``MeanFieldConv``, ``MeanFieldDense``; the iBNN repository's ``BayesianConv``,
``BayesianDense``), BatchEnsemble's fast weights
(``BatchEnsembleConv``, ``BatchEnsembleDense``) and iBNN's node noise (``node_noise``); the grouped
convolution of Packed-Ensembles and ResNeXt (``GroupedConv``)."""
from smoothing_jax.layers.attention import MultiHeadAttention, WindowAttention
from smoothing_jax.layers.batch_ensemble import BatchEnsembleConv, BatchEnsembleDense
from smoothing_jax.layers.dropout import MCDropout
from smoothing_jax.layers.grouped_conv import GroupedConv
from smoothing_jax.layers.mean_field import (
  BayesianConv,
  BayesianDense,
  MeanFieldConv,
  MeanFieldDense,
)
from smoothing_jax.layers.smoothing import Blur, Prob, Smooth, blur_kernel, blur_padding

__all__ = [
    "BatchEnsembleConv", "BatchEnsembleDense", "BayesianConv", "BayesianDense", "Blur",
    "GroupedConv", "MCDropout", "MeanFieldConv", "MeanFieldDense", "MultiHeadAttention", "Prob",
    "Smooth", "WindowAttention", "blur_kernel", "blur_padding"
]
