"""torch.compile for the elementwise hot paths (RMSNorm, SiLU-and-mul, rotary), which it fuses
into one kernel each, and a Triton kernel for q/k norms with rotary (four kernels in one). For
CUDA; the layers stay eager on the CPU."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from nano_models.layers.activation import SiluAndMul, silu_and_mul
from nano_models.layers.norm import RMSNorm, add_rms_norm, rms_norm
from nano_models.layers.rotary import RotaryEmbedding, apply_rotary


def compile_layers(model: nn.Module) -> None:
    """Swap in compiled functions, shared by every layer (one compilation per shape family)."""
    fused = None
    if next(model.parameters()).is_cuda:
        with contextlib.suppress(ImportError):  # q/k norms and rotary in one kernel
            from nano_models.layers.rotary_triton import qk_norm_rope as fused
    compiled = {
        fn: torch.compile(fn, dynamic=True)
        for fn in (rms_norm, add_rms_norm, silu_and_mul, apply_rotary)
    }
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.norm_fn, module.add_norm_fn = compiled[rms_norm], compiled[add_rms_norm]
        elif isinstance(module, SiluAndMul):
            module.fn = compiled[silu_and_mul]
        elif isinstance(module, RotaryEmbedding):
            module.fn = compiled[apply_rotary]
            module.fused = fused
