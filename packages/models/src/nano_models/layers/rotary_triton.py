"""Rotary for q and k, with the per-head RMSNorm some models apply first (Qwen3), in one Triton
kernel: a program per token reads its q and k heads from the qkv projection's output and writes
them normalized and rotated. It rounds to the model's dtype where the eager functions do
(``rms_norm``, ``apply_rotary``), so it matches them; in a decode step it replaces four kernels
per layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rotate(
    src,
    dst,
    num_heads,
    weight,
    cos,
    sin,
    eps,
    HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One token's heads at src (head_dim = 2 * HALF apart) -> dst, contiguous."""
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_HALF)
    mask = (h < num_heads)[:, None] & (c < HALF)[None, :]
    offsets = h[:, None] * (2 * HALF) + c[None, :]
    x1 = tl.load(src + offsets, mask=mask, other=0.0)
    x2 = tl.load(src + offsets + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(weight + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * r).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * r).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(dst + offsets, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + offsets + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    qkv,
    q_out,
    k_out,
    positions,
    cos_sin,
    q_weight,
    k_weight,
    stride_qkv,
    stride_cs,
    num_q,
    num_k,
    eps,
    HAS_NORM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(positions + t)
    c = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin + pos * stride_cs + c, mask=c < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin + pos * stride_cs + HALF + c, mask=c < HALF, other=0.0)[None, :]
    row = qkv + t * stride_qkv
    head_dim = 2 * HALF
    q_dst, k_dst = q_out + t * num_q * head_dim, k_out + t * num_k * head_dim
    _norm_rotate(row, q_dst, num_q, q_weight, cos, sin, eps, HAS_NORM, BLOCK_Q, HALF, BLOCK_HALF)
    k_src = row + num_q * head_dim
    _norm_rotate(k_src, k_dst, num_k, k_weight, cos, sin, eps, HAS_NORM, BLOCK_K, HALF, BLOCK_HALF)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of the qkv projection's output, (normalized and) rotated.

    qkv [T, (heads + 2 * kv_heads) * head_dim], rows contiguous; positions [T] int64; cos_sin
    [max_positions, head_dim] float32 (cos then sin); q_weight, k_weight [head_dim] (both or
    neither). Returns q [T, heads, head_dim] and k [T, kv_heads, head_dim] in qkv's dtype.
    """
    tokens = qkv.shape[0]
    head_dim = cos_sin.shape[1]
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError("qkv must be [T, (heads + 2 * kv_heads) * head_dim] with unit stride")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both norm weights or neither")
    q = qkv.new_empty(tokens, num_heads, head_dim)
    k = qkv.new_empty(tokens, num_kv_heads, head_dim)
    if tokens:
        has_norm = q_weight is not None
        _qk_norm_rope_kernel[(tokens,)](
            qkv,
            q,
            k,
            positions,
            cos_sin,
            q_weight if has_norm else cos_sin,
            k_weight if has_norm else cos_sin,
            qkv.stride(0),
            cos_sin.stride(0),
            num_heads,
            num_kv_heads,
            eps,
            HAS_NORM=has_norm,
            BLOCK_Q=triton.next_power_of_2(num_heads),
            BLOCK_K=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return q, k
