"""Rotary position embedding (neox style: the two halves of each head rotate together), with
the rope_scaling types of Hugging Face configs registered by name."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from nano_kvcache import ops

# rope type -> (inverse frequencies [head_dim / 2], attention factor scaling cos and sin)
RopeFn = Callable[[dict, int, float, int], tuple[torch.Tensor, float]]
ROPE_SCALING: dict[str, RopeFn] = {}


def register_rope(name: str) -> Callable[[RopeFn], RopeFn]:
    def wrap(fn: RopeFn) -> RopeFn:
        ROPE_SCALING[name] = fn
        return fn

    return wrap


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


@register_rope("default")
def _default(params: dict, head_dim: int, base: float, max_positions: int):
    return _inv_freq(head_dim, base), 1.0


@register_rope("linear")
def _linear(params: dict, head_dim: int, base: float, max_positions: int):
    return _inv_freq(head_dim, base) / params["factor"], 1.0


@register_rope("llama3")
def _llama3(params: dict, head_dim: int, base: float, max_positions: int):
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    inv_freq = _inv_freq(head_dim, base)
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params.get("original_max_position_embeddings", max_positions)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(
        wavelen > original / low,
        inv_freq / factor,
        torch.where(wavelen < original / high, inv_freq, scaled),
    ), 1.0


@register_rope("yarn")
def _yarn(params: dict, head_dim: int, base: float, max_positions: int):
    """YaRN: interpolate the low frequencies by ``factor``, extrapolate the high ones, ramp in
    between (bounded by beta_fast / beta_slow rotations), and scale attention by mscale."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else (mscale(factor))
        )

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = _inv_freq(head_dim, base)
    return extrapolation / factor * ramp + extrapolation * (1 - ramp), attention_factor


def rope_parameters(scaling: dict | None, head_dim: int, base: float, max_positions: int):
    """(inverse frequencies, attention factor) for a config's rope_scaling (None: plain)."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in ROPE_SCALING:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r}; supported: {sorted(ROPE_SCALING)}"
        )
    try:
        return ROPE_SCALING[rope_type](scaling or {}, head_dim, base, max_positions)
    except KeyError as e:
        raise ValueError(f"rope scaling {rope_type!r} needs the parameter {e}") from e


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their positions: x * cos + rotate_half(x) * sin."""

    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_parameters(scaling, head_dim, base, max_positions)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.register_buffer("cos_sin", torch.cat([cos, sin], dim=-1).float(), persistent=False)
        # Swapped by a runner (compile_layers): a compiled fn; fused, a kernel for split_qkv.
        self.fn = apply_rotary
        self.fused = None

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, heads, head_dim], k [T, kv_heads, head_dim]."""
        return self.fn(self.cos_sin, positions, q, k)

    def split_qkv(
        self,
        positions: torch.Tensor,
        qkv: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [T, (kv_)heads, head_dim] of a qkv projection's output [T, (heads + 2 *
        kv_heads) * head_dim], q and k rotated, after the per-head RMSNorms when given. With
        ``kv_cache`` (k_cache, v_cache, slot_mapping, and an FP8 cache's k_scale, v_scale) k and
        v are also stored in the cache (by the fused kernel itself, when there is one)."""
        head_dim = self.cos_sin.shape[1]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        v = qkv[:, q_size + kv_size :].view(-1, num_kv_heads, head_dim)
        if self.fused is not None:
            norm = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm is not None else ()
            q, k = self.fused(
                qkv, positions, self.cos_sin, num_heads, num_kv_heads, *norm, kv_cache=kv_cache
            )
            return q, k, v
        q = qkv[:, :q_size].view(-1, num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(-1, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q, k = self.fn(self.cos_sin, positions, q, k)
        if kv_cache is not None:
            ops.store_kvcache(k, v, *kv_cache)
        return q, k, v


def apply_rotary(
    cos_sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
