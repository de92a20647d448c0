"""Activations rounded to e4m3 in one Triton launch: a float32 scale per token (``-q fp8``'s
products) or per token and group of columns (block-FP8 checkpoints: DeepSeek's and Qwen3-FP8's
dynamic activation scales, vLLM's ``per_token_group_quant_fp8``). The arithmetic is
``nano_models.quantization``'s torch reference step for step (a correctly rounded division,
round to nearest even), so the two agree bit for bit on the GPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
MAX_BLOCK = 16384  # columns a program holds at once; longer groups are read twice


@triton.jit
def _round_kernel(
    x,
    q,
    s,
    K,
    group,
    stride_xm,
    stride_qm,
    stride_sm,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    """Program (row, group): the group's scale max|x| / 448 (at least 1e-12), then x / scale
    clamped to +-448 in e4m3."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    start = g * group
    end = tl.minimum(start + group, K)
    x_row = x + row * stride_xm
    q_row = q + row * stride_qm
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        v = tl.load(x_row + start + offs, mask=start + offs < end, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(v))
    else:
        amax = tl.zeros((), dtype=tl.float32)
        for first in range(start, end, BLOCK):
            v = tl.load(x_row + first + offs, mask=first + offs < end, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v.to(tl.float32))))
    # (div_rn: Triton's "/" on float32 is an approximate division, torch's a rounded one)
    scale = tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)
    tl.store(s + row * stride_sm + g, scale)
    if ONE_PASS:
        v = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
        tl.store(q_row + start + offs, v.to(tl.float8e4nv), mask=start + offs < end)
    else:
        for first in range(start, end, BLOCK):
            mask = first + offs < end
            v = tl.load(x_row + first + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.clamp(tl.math.div_rn(v, scale), -448.0, 448.0)
            tl.store(q_row + first + offs, v.to(tl.float8e4nv), mask=mask)


def settings(group: int) -> dict:
    """The launch settings of groups of ``group`` columns."""
    block = min(triton.next_power_of_2(group), MAX_BLOCK)
    return {
        "BLOCK": block,
        "ONE_PASS": group <= block,
        "num_warps": max(1, min(block // 512, 16)),
    }


def round_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (fp16, bf16 or fp32, rows contiguous) in e4m3 [T, K] with a float32 scale per
    token and group of ``group`` columns [T, ceil(K / group)] (the last group may be short)."""
    t, k = x.shape
    if group <= 0:
        raise ValueError(f"the columns per scale must be positive, got {group}")
    if x.stride(1) != 1:
        raise ValueError("x's rows must be contiguous")
    groups = -(-k // group)
    q = torch.empty(t, k, dtype=FP8, device=x.device)
    s = torch.empty(t, groups, dtype=torch.float32, device=x.device)
    if t and k:
        _round_kernel[(t, groups)](
            x, q, s, k, group, x.stride(0), q.stride(0), s.stride(0), **settings(group)
        )
    return q, s


def round_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] in e4m3 with a float32 scale per token [T, 1]."""
    return round_fp8(x, max(x.shape[1], 1))
