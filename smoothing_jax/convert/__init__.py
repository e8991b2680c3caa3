"""Load checkpoints trained with the PyTorch reference implementations (SS, HV) and with timm.

``reference``: SS / HV CNN state dicts by name, and the convert-and-check loop of every layout;
``timm_rules``: how a rule names the timm key of one of our variables; ``timm_families``: the
ViT, PiT and Swin tables, ``TIMM_LAYOUTS`` and ``from_timm_state_dict``; ``files``: torch
checkpoint files (``load_torch_checkpoint``).
"""
from smoothing_jax.convert.files import (
  is_timm_state_dict,
  load_torch_checkpoint,
  read_torch_checkpoint,
  reference_keys,
)
from smoothing_jax.convert.reference import from_torch_state_dict, to_torch_state_dict, torch_key
from smoothing_jax.convert.timm_families import TIMM_LAYOUTS, from_timm_state_dict

__all__ = [
    "TIMM_LAYOUTS", "from_timm_state_dict", "from_torch_state_dict", "is_timm_state_dict",
    "load_torch_checkpoint", "read_torch_checkpoint", "reference_keys", "to_torch_state_dict",
    "torch_key"
]
