"""SiLU-and-multiply of a gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> silu(x[..., :d]) * x[..., d:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fn = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)
