"""y = x W^T (+ b) for a few rows of x: the linear layers of a decode step of one to a few
sequences, in one Triton launch that streams W.

At one to a few rows a linear layer is a read of its weights, and the time between kernels
counts as much as the read: cuBLAS's kernels for M = 1 took 9.1 us for Qwen3-30B-A3B's qkv
projection (21 MB) and 10.8 us for its output projection (17 MB, split-K and a reduction) in
the model's CUDA graph. Here a program holds BLOCK_N whole rows of W (up to ``MAX_TILE``
values; longer rows in slices), loads its first slice before anything else, then, on Hopper,
waits for the previous kernel (programmatic dependent launch: the launch and the first weight
reads overlap the previous kernel's end; ``nano_kvcache.launch``) and lets the next kernel
start. Weights are the only thing read before that wait: they do not change during a forward.

The products are float32 sums of elementwise products (no tensor-core tile for one row),
rounded once. Every shape depends on the rows alone: it runs inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_kvcache.launch import launch_options, pdl

# The products ``LinearBase`` gives this kernel on a CUDA device: one row always, two rows when
# the weight holds at most TWO_ROWS_VALUES values. Measured on an H200 (benchmarks/bench_gemv.py,
# Qwen3-0.6B, -8B and -30B-A3B's layers; cuBLAS / this): one row 1.0-3.9x faster at every
# shape; two rows 1.2-3.7x up to 8.4 M values (0.97x at 6.3 M), 0.78-0.90x above; four rows
# faster for three of eleven shapes only (each x row is read again by every program).
GEMV_ROWS = 2
TWO_ROWS_VALUES = 1 << 23
# Values of W one program holds at a time (its registers: 64 a thread at 8 warps).
MAX_TILE = 16384
# Programs to aim for at least (two per SM of an H200), narrowing the rows a program takes.
MIN_PROGRAMS = 264


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` takes this product (else the caller's matmul does)."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_ROWS
        and (x.shape[0] == 1 or weight.numel() <= TWO_ROWS_VALUES)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.stride(1) == 1
    )


def tiles(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of an [n, k] weight."""
    block_k = min(triton.next_power_of_2(k), MAX_TILE)
    block_n = max(1, min(8, MAX_TILE // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < MIN_PROGRAMS:
        block_n //= 2
    return block_n, block_k, 8 if block_n * block_k >= MAX_TILE else 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for M up to
    ``GEMV_ROWS`` (any M works; past a few rows cuBLAS is faster)."""
    rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} columns, the weight {weight.shape[1]}")
    if weight.stride(1) != 1:
        raise ValueError("the weight must be contiguous along its input dimension")
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block_n, block_k, warps = tiles(n, k)
    dependent = pdl(x)
    _gemv[(triton.cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=dependent,
        num_warps=warps,
        **launch_options(dependent),
    )
    return out


@triton.jit
def _rows_times(acc, x, tile, start, offs_k, live_k, M, stride_x, BLOCK_M: tl.constexpr):
    """acc[m] += x[m, start + offs_k] . tile (one slice of BLOCK_N rows), every row m."""
    tile = tile.to(tl.float32)
    m_idx = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        a = tl.load(x + m * stride_x + start + offs_k, mask=live_k & (m < M), other=0.0)
        part = tl.sum(tile * a.to(tl.float32)[None, :], 1)
        acc = tl.where(m_idx[:, None] == m, acc + part[None, :], acc)
    return acc


# (M is 1 to a few; one compiled variant serves every M of a BLOCK_M)
@triton.jit(do_not_specialize=["M"])
def _gemv(
    x,
    w,
    b,
    out,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_o,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = x[m] . w[n] (+ b[n]) for the BLOCK_N rows n of this program, every m < M."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    live_n = offs_n < N
    rows = w + offs_n.to(tl.int64)[:, None] * stride_w + offs_k[None, :]
    live_k = offs_k < K
    # The first slice of the rows (weights: nothing a kernel before this one writes) ...
    tile = tl.load(rows, mask=live_n[:, None] & live_k[None, :], other=0.0)
    if PDL:
        # ... then what the previous kernel wrote (x) is complete; the next kernel may start.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _rows_times(acc, x, tile, 0, offs_k, live_k, M, stride_x, BLOCK_M)
    for start in range(BLOCK_K, K, BLOCK_K):
        live_k = start + offs_k < K
        tile = tl.load(rows + start, mask=live_n[:, None] & live_k[None, :], other=0.0)
        acc = _rows_times(acc, x, tile, start, offs_k, live_k, M, stride_x, BLOCK_M)
    if HAS_BIAS:
        acc += tl.load(b + offs_n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    m_idx = tl.arange(0, BLOCK_M)
    ptrs = out + m_idx.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=(m_idx < M)[:, None] & live_n[None, :])
