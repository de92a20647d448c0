"""Rotary for q and k, with the per-head RMSNorm some models apply first (Qwen3), in one Triton
kernel: a program per token reads its q and k heads from the qkv projection's output and writes
them normalized and rotated, and given the cache, writes K and V into it too. It rounds to the
model's dtype where the eager functions do (``rms_norm``, ``apply_rotary``), so it matches
them; in a decode step it replaces five kernels per layer (the norms, the rotary, the store)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_kvcache import ops
from nano_kvcache.launch import launch_options, pdl

# (a NaN stays NaN when rounded into an FP8 cache, as the store kernels keep it)
_NAN = tl.constexpr(tl.PropagateNan.ALL)  # (an annotation is not enough on GPUs)


@triton.jit
def _norm_rotate(
    src,
    dst,
    cache,
    num_heads,
    weight,
    cos,
    sin,
    eps,
    stride_ch,
    keep,
    inv_scale,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr,
):
    """One token's heads at src (head_dim = 2 * HALF apart) -> dst, contiguous, and with STORE
    -> cache (heads stride_ch apart: the token's cache row) where keep."""
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
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(dst + offsets, y1, mask=mask)
    tl.store(dst + offsets + HALF, y2, mask=mask)
    if STORE:
        cached = h[:, None] * stride_ch + c[None, :]
        if FP8:  # (from the values in the model's dtype, as the store op quantizes them)
            y1 = _to_fp8(y1, inv_scale)
            y2 = _to_fp8(y2, inv_scale)
        tl.store(cache + cached, y1, mask=mask & keep)
        tl.store(cache + cached + HALF, y2, mask=mask & keep)


@triton.jit
def _to_fp8(x, inv_scale):
    """x as an FP8 cache stores it: x / scale, saturated at +-448, rounded to e4m3."""
    x = tl.clamp(x.to(tl.float32) * inv_scale, -448.0, 448.0, propagate_nan=_NAN)
    return x.to(tl.float8e4nv)


@triton.jit
def _qk_norm_rope_kernel(
    qkv,
    q_out,
    k_out,
    positions,
    cos_sin,
    q_weight,
    k_weight,
    k_cache,
    v_cache,
    slot_mapping,
    stride_qkv,
    stride_cs,
    stride_cb,
    stride_ch,
    stride_ct,
    block_size,
    num_slots,
    num_q,
    num_k,
    eps,
    inv_k_scale,
    inv_v_scale,
    HAS_NORM: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # The step's positions and slots and the rotary table are older than the kernel before
    # (under programmatic dependent launch it may still run: it makes qkv).
    t = tl.program_id(0)
    pos = tl.load(positions + t)
    c = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin + pos * stride_cs + c, mask=c < HALF, other=0.0)[None, :]
    sin = tl.load(cos_sin + pos * stride_cs + HALF + c, mask=c < HALF, other=0.0)[None, :]
    # With STORE the token's K and V also go to its cache slot (slots < 0 are padding, skipped,
    # as are slots past the cache).
    keep = False
    offset = 0
    if STORE:
        slot = tl.load(slot_mapping + t).to(tl.int64)
        keep = (slot >= 0) & (slot < num_slots)
        offset = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct
    if PDL:  # (programmatic dependent launch: what the kernel before wrote is complete)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = qkv + t * stride_qkv
    head_dim = 2 * HALF
    q_dst, k_dst = q_out + t * num_q * head_dim, k_out + t * num_k * head_dim
    _norm_rotate(
        row,
        q_dst,
        q_dst,
        num_q,
        q_weight,
        cos,
        sin,
        eps,
        0,
        False,
        1.0,
        HAS_NORM,
        False,
        BLOCK_Q,
        HALF,
        BLOCK_HALF,
        False,
    )
    k_src = row + num_q * head_dim
    _norm_rotate(
        k_src,
        k_dst,
        k_cache + offset,
        num_k,
        k_weight,
        cos,
        sin,
        eps,
        stride_ch,
        keep,
        inv_k_scale,
        HAS_NORM,
        STORE,
        BLOCK_K,
        HALF,
        BLOCK_HALF,
        FP8,
    )
    if STORE:
        h = tl.arange(0, BLOCK_K)
        d = tl.arange(0, 2 * BLOCK_HALF)
        mask = (h < num_k)[:, None] & (d < head_dim)[None, :] & keep
        v = tl.load(k_src + num_k * head_dim + h[:, None] * head_dim + d[None, :], mask=mask)
        if FP8:
            v = _to_fp8(v, inv_v_scale)
        tl.store(v_cache + offset + h[:, None] * stride_ch + d[None, :], v, mask=mask)


def qk_norm_rope(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of the qkv projection's output, (normalized and) rotated.

    qkv [T, (heads + 2 * kv_heads) * head_dim], rows contiguous; positions [T] int64; cos_sin
    [max_positions, head_dim] float32 (cos then sin); q_weight, k_weight [head_dim] (both or
    neither). With ``kv_cache`` = (k_cache, v_cache, slot_mapping[, k_scale, v_scale]) the
    kernel also writes each token's K and V into its slot, as ``nano_kvcache.ops.store_kvcache``
    would, quantized into an FP8 cache (one kernel less per layer). Returns q [T, heads,
    head_dim] and k [T, kv_heads, head_dim] in qkv's dtype.
    """
    tokens = qkv.shape[0]
    head_dim = cos_sin.shape[1]
    if qkv.stride(1) != 1 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError("qkv must be [T, (heads + 2 * kv_heads) * head_dim] with unit stride")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both norm weights or neither")
    q = qkv.new_empty(tokens, num_heads, head_dim)
    k = qkv.new_empty(tokens, num_kv_heads, head_dim)
    scales = (1.0, 1.0)
    if kv_cache is not None:
        k_cache, v_cache, slots, *rest = kv_cache
        scales = tuple(rest) or scales
        ops.check_store_args(k, k, k_cache, v_cache, slots)
        strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        block_size, num_slots = k_cache.shape[2], k_cache.shape[0] * k_cache.shape[2]
    else:
        k_cache = v_cache = slots = qkv  # unused
        strides, block_size, num_slots = (0, 0, 0), 1, 0
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
            k_cache,
            v_cache,
            slots,
            qkv.stride(0),
            cos_sin.stride(0),
            *strides,
            block_size,
            num_slots,
            num_heads,
            num_kv_heads,
            eps,
            1.0 / scales[0],
            1.0 / scales[1],
            HAS_NORM=has_norm,
            STORE=kv_cache is not None,
            FP8=kv_cache is not None and k_cache.dtype == torch.float8_e4m3fn,
            BLOCK_Q=triton.next_power_of_2(num_heads),
            BLOCK_K=triton.next_power_of_2(num_kv_heads),
            HALF=head_dim // 2,
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
            PDL=pdl(qkv),
            **launch_options(pdl(qkv)),
        )
    return q, k
