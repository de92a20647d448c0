"""y = x W^T (+ b) for a few rows of x: the linear layers of a decode step of one to a few
sequences, in one Triton launch that streams W.

At one to a few rows a linear layer is a read of its weights, and the time between kernels
counts as much as the read: cuBLAS's kernels for M = 1 took 9.1 us for Qwen3-30B-A3B's qkv
projection (21 MB) and 10.8 us for its output projection (17 MB, split-K and a reduction) in
the model's CUDA graph. Here W is cut into tiles (BLOCK_N whole rows, up to ``MAX_TILE``
values; longer rows in slices) dealt to the programs; each program loads its first tile before
anything else, then, on Hopper, waits for the previous kernel (programmatic dependent launch:
the launch and the first weight reads overlap the previous kernel's end;
``nano_kvcache.launch``) and lets the next kernel start. Weights are the only thing read
before that wait: they do not change during a forward. A small weight gets a program per tile
(all of it in flight before the wait); a large one two programs a multiprocessor, each with
its next tile in flight while it multiplies the current one.

Every program reads all of x, so the elementwise step that makes a layer's input can run in
the product's prologue instead of a launch of its own (a few microseconds each, and no early
start: compiled torch kernels do not take part in programmatic dependent launch):

- ``normed_gemv``: the input is RMSNorm(x + residual), the layer norm before the attention's
  qkv projection or the MLP. The sum x + residual, the new residual, is written by program 0
  into a new tensor (the other programs still read the old one).
- ``gated_gemv``: the input is SiLU(gate) * up of a gated MLP's [gate | up] halves, the down
  projection's.

The products are float32 sums of elementwise products (no tensor-core tile for one row),
rounded once; the prologues round where torch's layers round (the sum, the normed value, its
product with the norm's weight; SiLU-and-mul once). Every shape depends on the rows alone: it
runs inside CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
# Values of W in a program's tile (BLOCK_N rows x BLOCK_K of their columns), at most; rows
# longer than MAX_TILE are taken in slices.
MAX_TILE = 16384
# A weight of up to ONE_WAVE_VALUES values a multiprocessor is read in one wave: a program per
# tile, every tile loaded before the wait for the previous kernel. A larger one by
# PROGRAMS_PER_SM programs a multiprocessor, each walking its share of the tiles with the next
# one in flight while it multiplies the current one. Measured on an H200 (132 SMs;
# benchmarks/bench_gemv.py, one row, cold weights, and the engine at batch 1): one wave is as
# fast or faster up to 6.3 M values (every Qwen3-0.6B layer), the walk 4-18% faster from 8.4 M
# (every Qwen3-8B and -30B-A3B layer; 2 programs a multiprocessor and 16 K-value tiles beat 1
# or 4 and 8 K).
ONE_WAVE_VALUES = 48 * 1024
PROGRAMS_PER_SM = 2


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    grid: int


# What the program computes its input from (a kernel's globals must be constexpr objects).
_PLAIN = tl.constexpr(0)  # x itself
_NORMED = tl.constexpr(1)  # RMSNorm(x + residual) * norm weight
_GATED = tl.constexpr(2)  # SiLU(x[:, :K]) * x[:, K:]


class Normed(NamedTuple):
    """``normed_gemv``'s results: the product, the new residual (x + residual; x itself
    without a residual) and, when kept, the normed input the product was taken of."""

    out: torch.Tensor
    residual: torch.Tensor
    normed: torch.Tensor | None


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


def tiles(n: int, k: int, multiprocessors: int) -> Tiles:
    """How an [n, k] weight is dealt to the programs: tiles of up to MAX_TILE values, narrowed
    while there would be fewer row blocks than programs in a wave; a program per tile up to
    ONE_WAVE_VALUES values a multiprocessor, else PROGRAMS_PER_SM a multiprocessor."""
    programs = multiprocessors * PROGRAMS_PER_SM
    block_k = min(triton.next_power_of_2(k), MAX_TILE)
    block_n = max(1, min(8, MAX_TILE // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < programs:
        block_n //= 2
    blocks = triton.cdiv(n, block_n)
    one_wave = n * k <= ONE_WAVE_VALUES * multiprocessors
    tile = block_n * block_k
    warps = 8 if tile >= MAX_TILE or (not one_wave and tile >= MAX_TILE // 2) else 4
    return Tiles(block_n, block_k, warps, blocks if one_wave else min(blocks, programs))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors; on the CPU (Triton's interpreter, tests) a small stand-in,
    so that the tiles are dealt to several programs there too."""
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for M up to
    ``GEMV_ROWS`` (any M works; past a few rows cuBLAS is faster)."""
    _check(weight, x.shape[1], "x")
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    _launch(_contiguous(x), weight, bias, out, _PLAIN)
    return out


def gated_gemv(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """(SiLU(h[:, :K]) * h[:, K:]) @ weight [N, K]^T (+ bias) -> [M, N]: a gated MLP's down
    projection of its [gate | up] halves h [M, 2K], SiLU-and-mul in float32, rounded once."""
    if h.shape[1] != 2 * weight.shape[1]:
        raise ValueError(
            f"h holds gate and up halves of {weight.shape[1]} columns each for this weight "
            f"([M, {2 * weight.shape[1]}]), got {list(h.shape)}"
        )
    _check(weight, weight.shape[1], "h")
    out = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)
    _launch(_contiguous(h), weight, bias, out, _GATED)
    return out


def normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    keep_normed: bool = False,
) -> Normed:
    """RMSNorm(x + residual) @ weight^T (+ bias) for x and residual [M, K], norm_weight [K]:
    the sum rounded to x's dtype, normed in float32 and rounded, times the norm's weight and
    rounded (as ``nano_models.layers.norm`` computes it). ``keep_normed`` also writes the normed
    input (for another consumer of it)."""
    rows, k = x.shape
    _check(weight, k, "x")
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(
            f"the norm's weight must be {x.dtype} [{k}], got {norm_weight.dtype} "
            f"{list(norm_weight.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"the residual must be {x.dtype} {list(x.shape)}, got {residual.dtype} "
            f"{list(residual.shape)}"
        )
    out = torch.empty(rows, weight.shape[0], dtype=x.dtype, device=x.device)
    new_residual = (
        x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    normed = torch.empty_like(new_residual) if keep_normed else None
    _launch(
        _contiguous(x),
        weight,
        bias,
        out,
        _NORMED,
        residual=None if residual is None else _contiguous(residual),
        norm=(norm_weight.contiguous(), eps),
        residual_out=None if residual is None else new_residual,
        normed_out=normed,
    )
    return Normed(out, new_residual, normed)


def _check(weight: torch.Tensor, k: int, name: str) -> None:
    if weight.shape[1] != k:
        raise ValueError(f"{name} has {k} columns, the weight {weight.shape[1]}")
    if weight.stride(1) != 1:
        raise ValueError("the weight must be contiguous along its input dimension")


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _launch(
    x, weight, bias, out, prologue, residual=None, norm=None, residual_out=None, normed_out=None
) -> None:
    rows = x.shape[0]
    n, k = weight.shape
    if rows == 0:
        return
    block_n, block_k, warps, grid = tiles(n, k, _multiprocessors(x.device))
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    dependent = pdl(x)
    _gemv[(grid,)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        residual if residual is not None else x,
        norm_weight,
        residual_out if residual_out is not None else out,
        normed_out if normed_out is not None else out,
        rows,
        n,
        k,
        eps,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        HAS_BIAS=bias is not None,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        KEEP_NORMED=normed_out is not None,
        HOIST=rows <= 2 and k <= block_k,
        WALK=grid < triton.cdiv(n, block_n),
        BLOCK_M=triton.next_power_of_2(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=dependent,
        num_warps=warps,
        **launch_options(dependent),
    )


@triton.jit
def _summed(x, r, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """x (+ r) at offs, rounded to x's dtype as torch's add rounds."""
    s = tl.load(x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        s = (s.to(tl.float32) + tl.load(r + offs, mask=mask, other=0.0).to(tl.float32)).to(
            x.dtype.element_ty
        )
    return s


@triton.jit
def _inverse_rms(
    x,
    r,
    M,
    K,
    eps,
    stride_x,
    stride_r,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """1 / sqrt(mean((x + r)^2) + eps) of every row, [BLOCK_M] (rows past M: rsqrt(eps))."""
    offs_k = tl.arange(0, BLOCK_K)
    m_idx = tl.arange(0, BLOCK_M)
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    for m in tl.static_range(BLOCK_M):
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            cols = start + offs_k
            mask = (cols < K) & (m < M)
            s = _summed(x + m * stride_x, r + m * stride_r, cols, mask, HAS_RESIDUAL)
            s = s.to(tl.float32)
            squares += s * s
        inv = tl.where(m_idx == m, tl.math.rsqrt(tl.sum(squares, 0) / K + eps), inv)
    return inv


@triton.jit
def _input(
    x,
    r,
    norm_w,
    r_out,
    normed_out,
    m,
    M,
    cols,
    live_k,
    K,
    inv,
    stride_x,
    stride_r,
    writer,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Row m's input at columns cols, as the layer takes it (float32). The writer program
    stores the new residual and the normed input."""
    mask = live_k & (m < M)
    if PROLOGUE == _GATED:
        gate = tl.load(x + m * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x + m * stride_x + K + cols, mask=mask, other=0.0).to(tl.float32)
        a = (gate * tl.sigmoid(gate) * up).to(x.dtype.element_ty)
    elif PROLOGUE == _NORMED:
        s = _summed(x + m * stride_x, r + m * stride_r, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(r_out + m * K + cols, s, mask=mask & writer)
        inv_m = tl.sum(tl.where(tl.arange(0, BLOCK_M) == m, inv, 0.0), 0)
        normed = (s.to(tl.float32) * inv_m).to(x.dtype.element_ty)
        w = tl.load(norm_w + cols, mask=live_k, other=0.0)
        a = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype.element_ty)
        if KEEP_NORMED:
            tl.store(normed_out + m * K + cols, a, mask=mask & writer)
    else:
        a = tl.load(x + m * stride_x + cols, mask=mask, other=0.0)
    return a.to(tl.float32)


@triton.jit
def _rows_times(
    acc,
    tile,
    x,
    r,
    norm_w,
    r_out,
    normed_out,
    M,
    start,
    offs_k,
    live_k,
    K,
    inv,
    stride_x,
    stride_r,
    writer,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """acc[m] += input[m, start + offs_k] . tile (one slice of BLOCK_N rows), every row m."""
    tile = tile.to(tl.float32)
    m_idx = tl.arange(0, BLOCK_M)
    for m in tl.static_range(BLOCK_M):
        a = _input(
            x,
            r,
            norm_w,
            r_out,
            normed_out,
            m,
            M,
            start + offs_k,
            live_k,
            K,
            inv,
            stride_x,
            stride_r,
            writer,
            PROLOGUE,
            HAS_RESIDUAL,
            KEEP_NORMED,
            BLOCK_M,
        )
        part = tl.sum(tile * a[None, :], 1)
        acc = tl.where(m_idx[:, None] == m, acc + part[None, :], acc)
    return acc


# (M is 1 to a few; one compiled variant serves every M of a BLOCK_M)
@triton.jit(do_not_specialize=["M", "eps"])
def _gemv(
    x,
    w,
    b,
    out,
    r,
    norm_w,
    r_out,
    normed_out,
    M,
    N,
    K,
    eps,
    stride_x,
    stride_w,
    stride_o,
    stride_r,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    HOIST: tl.constexpr,
    WALK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = input[m] . w[n] (+ b[n]) for every m < M, the input x or made from it
    (PROLOGUE). W's tiles are a block of BLOCK_N rows by a slice of BLOCK_K columns: a program
    per row block, or (WALK) fewer programs, each walking several (``_walk``)."""
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    block = tl.arange(0, BLOCK_N)
    # The first tile (weights: nothing a kernel before this one writes) ...
    tile = _tile(w, pid * BLOCK_N + block, offs_k, N, K, stride_w, True)
    if PDL:
        # ... then what the previous kernel wrote (x) is complete; the next kernel may start.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    inv = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == _NORMED:
        inv = _inverse_rms(x, r, M, K, eps, stride_x, stride_r, HAS_RESIDUAL, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if WALK:
        _walk(
            acc,
            tile,
            x,
            w,
            b,
            out,
            r,
            norm_w,
            r_out,
            normed_out,
            M,
            N,
            K,
            inv,
            stride_x,
            stride_w,
            stride_o,
            stride_r,
            HAS_BIAS,
            PROLOGUE,
            HAS_RESIDUAL,
            KEEP_NORMED,
            HOIST,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
        )
    else:  # (a program per row block, slice after slice)
        offs_n = pid * BLOCK_N + block
        acc = _rows_times(
            acc,
            tile,
            x,
            r,
            norm_w,
            r_out,
            normed_out,
            M,
            0,
            offs_k,
            offs_k < K,
            K,
            inv,
            stride_x,
            stride_r,
            pid == 0,
            PROLOGUE,
            HAS_RESIDUAL,
            KEEP_NORMED,
            BLOCK_M,
        )
        for start in range(BLOCK_K, K, BLOCK_K):
            tile = _tile(w, offs_n, start + offs_k, N, K, stride_w, True)
            acc = _rows_times(
                acc,
                tile,
                x,
                r,
                norm_w,
                r_out,
                normed_out,
                M,
                start,
                offs_k,
                start + offs_k < K,
                K,
                inv,
                stride_x,
                stride_r,
                pid == 0,
                PROLOGUE,
                HAS_RESIDUAL,
                KEEP_NORMED,
                BLOCK_M,
            )
        _store(out, b, acc, offs_n, M, N, stride_o, HAS_BIAS, BLOCK_M)


@triton.jit
def _walk(
    acc,
    tile,
    x,
    w,
    b,
    out,
    r,
    norm_w,
    r_out,
    normed_out,
    M,
    N,
    K,
    inv,
    stride_x,
    stride_w,
    stride_o,
    stride_r,
    HAS_BIAS: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    HOIST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """This program's tiles, row blocks pid, pid + programs, ..., each slice by slice (tile:
    the first, loaded), the next tile in flight while it multiplies the current one. With
    HOIST (one or two rows of one slice) the input is made once and kept for every tile."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    slices = tl.cdiv(K, BLOCK_K)
    count = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, programs) * slices
    offs_k = tl.arange(0, BLOCK_K)
    block = tl.arange(0, BLOCK_N)
    m_idx = tl.arange(0, BLOCK_M)
    if HOIST:
        live_k = offs_k < K
        a0 = _input(
            x,
            r,
            norm_w,
            r_out,
            normed_out,
            0,
            M,
            offs_k,
            live_k,
            K,
            inv,
            stride_x,
            stride_r,
            pid == 0,
            PROLOGUE,
            HAS_RESIDUAL,
            KEEP_NORMED,
            BLOCK_M,
        )
        a1 = a0
        if BLOCK_M == 2:
            a1 = _input(
                x,
                r,
                norm_w,
                r_out,
                normed_out,
                1,
                M,
                offs_k,
                live_k,
                K,
                inv,
                stride_x,
                stride_r,
                pid == 0,
                PROLOGUE,
                HAS_RESIDUAL,
                KEEP_NORMED,
                BLOCK_M,
            )
    for t in range(count):
        nxt = t + 1
        following = _tile(
            w,
            (pid + nxt // slices * programs) * BLOCK_N + block,
            nxt % slices * BLOCK_K + offs_k,
            N,
            K,
            stride_w,
            nxt < count,
        )
        start = t % slices * BLOCK_K
        if HOIST:
            values = tile.to(tl.float32)
            part = tl.sum(values * a0[None, :], 1)
            acc = tl.where(m_idx[:, None] == 0, acc + part[None, :], acc)
            if BLOCK_M == 2:
                part = tl.sum(values * a1[None, :], 1)
                acc = tl.where(m_idx[:, None] == 1, acc + part[None, :], acc)
        else:
            acc = _rows_times(
                acc,
                tile,
                x,
                r,
                norm_w,
                r_out,
                normed_out,
                M,
                start,
                offs_k,
                start + offs_k < K,
                K,
                inv,
                stride_x,
                stride_r,
                (pid == 0) & (t < slices),
                PROLOGUE,
                HAS_RESIDUAL,
                KEEP_NORMED,
                BLOCK_M,
            )
        if start + BLOCK_K >= K:  # (the block's last slice: its outputs are complete)
            offs_n = (pid + t // slices * programs) * BLOCK_N + block
            _store(out, b, acc, offs_n, M, N, stride_o, HAS_BIAS, BLOCK_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        tile = following


@triton.jit
def _store(out, b, acc, offs_n, M, N, stride_o, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr):
    """out[m, offs_n] = acc (+ b[offs_n]) for the rows m < M."""
    m_idx = tl.arange(0, BLOCK_M)
    live_n = offs_n < N
    if HAS_BIAS:
        acc += tl.load(b + offs_n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    ptrs = out + m_idx.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=(m_idx < M)[:, None] & live_n[None, :])


@triton.jit
def _tile(w, offs_n, cols, N, K, stride_w, live):
    """W's rows offs_n at columns cols, [BLOCK_N, BLOCK_K] (zeros where not live)."""
    rows = w + offs_n.to(tl.int64)[:, None] * stride_w + cols[None, :]
    return tl.load(rows, mask=((offs_n < N)[:, None] & (cols < K)[None, :]) & live, other=0.0)
