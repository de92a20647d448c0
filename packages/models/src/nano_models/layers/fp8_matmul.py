"""y = x W^T for an e4m3 weight with a float32 scale per output row and input block (block-FP8
checkpoints), in Triton. ``plan`` chooses by the number of rows:

- few (decode): W8A16. Each program reads an e4m3 tile of W (half the bytes of bf16), widens it
  to x's dtype (exact) and adds the tile's product times its rows' scales to a float32
  accumulator. A few rows make few output tiles, so the K loop is split among programs until
  each multiprocessor holds several: each split writes its float32 partial sums and a second
  launch adds them in a fixed order (deterministic; fixed shapes, no atomics: CUDA-graph safe).
- many (prefill, large batches): W8A8 on FP8 tensor cores. x is rounded to e4m3 with a scale
  per token and block of columns (``fp8_quant``: the dynamic activation scales the checkpoints
  are made for), e4m3 x e4m3 dots accumulate in float32, each times its x and w scales.

A k-tile never spans two scale blocks, so the scales are applied once per tile, not per
element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_models.layers.fp8_quant import round_fp8
from nano_models.layers.triton_tiles import grouped_tile

W8A8_ROWS = 64  # from here on the activations go to e4m3 (an estimate until measured)
SUM_BLOCK = 1024  # outputs per program of the split sum


@triton.jit
def _block_fp8_kernel(
    x,
    xs,
    w,
    s,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_sn,
    stride_ym,
    stride_ysplit,
    SCALE_COLS: tl.constexpr,
    A8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (tile, split): the split's share of the K loop for one output tile. A8: x in
    e4m3 with scales ``xs`` [M, ceil(K / SCALE_COLS)]; else x in its dtype (``xs`` unread)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = split * per_split
    last = tl.minimum(first + per_split, k_tiles)
    x_ptrs = x + offs_m.to(tl.int64)[:, None] * stride_xm + (first * BLOCK_K + offs_k)[None, :]
    w_ptrs = w + offs_n.to(tl.int64)[:, None] * stride_wn + (first * BLOCK_K + offs_k)[None, :]
    s_ptrs = s + offs_n.to(tl.int64) * stride_sn
    xs_ptrs = xs + offs_m.to(tl.int64) * stride_xsm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(first, last):
        left = K - step * BLOCK_K
        a = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < left), other=0.0)
        b = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < left), other=0.0)
        block = (step * BLOCK_K) // SCALE_COLS
        scale = tl.load(s_ptrs + block, mask=n_mask, other=0.0)[None, :]
        if A8:
            part = tl.dot(a, tl.trans(b))
            part = part * tl.load(xs_ptrs + block, mask=m_mask, other=0.0)[:, None]
        else:
            part = tl.dot(a, tl.trans(b.to(a.dtype)), input_precision=PRECISION)
        acc += part * scale
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = y + split.to(tl.int64) * stride_ysplit
    out += offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_splits_kernel(parts, y, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = the sum of parts [SPLIT_K, size] over the splits, in order (size = M * N)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.load(parts + offs, mask=mask, other=0.0)
    for i in tl.static_range(1, SPLIT_K):
        acc += tl.load(parts + i * size + offs, mask=mask, other=0.0)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=mask)


def plan(m: int, n: int, k: int, block: int, multiprocessors: int) -> dict:
    """The launch settings of an [m, k] x [n, k]^T product with scales per ``block`` columns:
    the path (A8: e4m3 activations from W8A8_ROWS rows, where blocks of a multiple of 32
    columns allow FP8 dots), the tile (its depth divides the block), and the splits of the K
    loop that bring the programs to a few per multiprocessor (a W8A16 program's pipeline
    holds ~24 KiB of weights in flight; ~4 per multiprocessor keep HBM busy)."""
    a8 = m >= W8A8_ROWS and block % 32 == 0
    depth = next(d for d in (128, 64, 32, 16) if block % d == 0)
    if m > 128:  # (128 x 128 x 128 spills: the dot's part and the sum, 64 registers each)
        tile = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4 if a8 else 3}
        depth = min(depth, 64)
    elif a8:
        tile = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
    else:
        tile = {"BLOCK_M": 16 if m <= 16 else 32 if m <= 32 else 64, "BLOCK_N": 64}
        tile |= {"num_warps": 4, "num_stages": 4}
    tiles = -(-m // tile["BLOCK_M"]) * -(-n // tile["BLOCK_N"])
    k_tiles = -(-k // depth)
    wanted = (2 if a8 or m > 128 else 4) * multiprocessors
    split = max(1, min(-(-wanted // tiles), k_tiles // 4))
    split = -(-k_tiles // -(-k_tiles // split))  # (none left empty)
    return {"A8": a8, **tile, "BLOCK_K": depth, "GROUP_M": 8, "SPLIT_K": split}


def block_fp8_matmul(
    x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: int, settings: dict | None = None
) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32, rows contiguous) times w [N, K] (float8_e4m3fn,
    contiguous) transposed, w's element (n, k) scaled by ``scales`` [N, ceil(K / block)]
    float32 at (n, k // block): [M, N] in x's dtype. ``block`` a multiple of 16; ``settings``
    (tests, benchmarks) replace ``plan``'s."""
    m, k = x.shape
    n = w.shape[0]
    if block % 16:
        raise ValueError(f"the scale block ({block} columns) must be a multiple of 16")
    if w.shape[1] != k or scales.shape != (n, -(-k // block)):
        raise ValueError(
            f"x {tuple(x.shape)}, w {tuple(w.shape)} and scales {tuple(scales.shape)} do not "
            f"fit (blocks of {block} columns)"
        )
    if x.stride(1) != 1 or not w.is_contiguous() or scales.stride(1) != 1:
        raise ValueError("x's rows, w and the scales' rows must be contiguous")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    settings = dict(settings or plan(m, n, k, block, _multiprocessors(x.device)))
    a8, depth, split = settings.pop("A8"), settings["BLOCK_K"], settings["SPLIT_K"]
    if depth < (32 if a8 else 16) or block % depth:
        raise ValueError(
            f"BLOCK_K ({depth}) must be >= {32 if a8 else 16} and divide the scale block ({block})"
        )
    a, a_scales = round_fp8(x, block) if a8 else (x, scales)  # (W8A16 reads no a_scales)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, settings["BLOCK_M"]) * triton.cdiv(n, settings["BLOCK_N"]), split)
    _block_fp8_kernel[grid](
        a,
        a_scales,
        w,
        scales,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scales.stride(0),
        w.stride(0),
        scales.stride(0),
        out.stride(-2),
        out.stride(0) if split > 1 else 0,
        SCALE_COLS=block,
        A8=a8,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **settings,
    )
    if split > 1:
        grid = (triton.cdiv(m * n, SUM_BLOCK),)
        _sum_splits_kernel[grid](out, y, m * n, SPLIT_K=split, BLOCK=SUM_BLOCK)
    return y


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (Triton's interpreter: an H200's, so that the CPU tests split as it does)
    return torch.cuda.get_device_properties(device).multi_processor_count
