"""y = x W^T for an e4m3 weight with a scale per output row and input block (Triton): each
program reads an e4m3 tile of W (half the bytes of bf16), widens it to x's dtype (exact), and
adds the tile's product times its rows' scales to a float32 accumulator. A k-tile never spans
two scale blocks, so the scale is applied once per tile, not per element."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_models.layers.triton_tiles import grouped_tile


@triton.jit
def _block_fp8_kernel(
    x,
    w,
    s,
    y,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_ym,
    SCALE_COLS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    s_ptrs = s + offs_n.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - step * BLOCK_K
        a = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k[None, :] < left), other=0.0)
        b = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_k[None, :] < left), other=0.0)
        part = tl.dot(a, tl.trans(b.to(a.dtype)), input_precision=PRECISION)
        scale = tl.load(s_ptrs + (step * BLOCK_K) // SCALE_COLS, mask=n_mask, other=0.0)
        acc += part * scale[None, :]
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def tile(m: int, block: int) -> dict:
    """Tile settings by the number of rows (few: decode; many: prefill); the depth divides the
    scale block."""
    depth = next(d for d in (128, 64, 32, 16) if block % d == 0)
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": depth, "GROUP_M": 1, "num_warps": 4}
    if m <= 128:
        return {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": depth, "GROUP_M": 8, "num_warps": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": min(depth, 64), "GROUP_M": 8, "num_warps": 8}


def block_fp8_matmul(
    x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, block: int, settings: dict | None = None
) -> torch.Tensor:
    """x [M, K] (fp16, bf16 or fp32, rows contiguous) times w [N, K] (float8_e4m3fn,
    contiguous) transposed, w's element (n, k) scaled by ``scales`` [N, ceil(K / block)]
    float32 at (n, k // block): [M, N] in x's dtype. ``block`` a multiple of 16."""
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
    settings = settings or tile(m, block)
    depth = settings["BLOCK_K"]
    if depth < 16 or block % depth:
        raise ValueError(f"BLOCK_K ({depth}) must be >= 16 and divide the scale block ({block})")
    grid = (triton.cdiv(m, settings["BLOCK_M"]) * triton.cdiv(n, settings["BLOCK_N"]),)
    _block_fp8_kernel[grid](
        x,
        w,
        scales,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scales.stride(0),
        y.stride(0),
        SCALE_COLS=block,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **settings,
    )
    return y
