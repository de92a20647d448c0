"""y = x W^T (+ b) for a few rows of x: the linear layers of a decode step of one to a few
sequences, in one Triton launch that streams W.

At one to a few rows a linear layer is a read of its weights, and the time between kernels
counts as much as the read: cuBLAS's kernels for M = 1 took 9.1 us for Qwen3-30B-A3B's qkv
projection (21 MB) and 10.8 us for its output projection (17 MB, split-K and a reduction) in
the model's CUDA graph. Here W is cut into tiles (BLOCK_N whole rows, up to ``MAX_TILE``
bytes; longer rows in slices) dealt to the programs; each program loads its first tile before
anything else, then, on Hopper, waits for the previous kernel (programmatic dependent launch:
the launch and the first weight reads overlap the previous kernel's end;
``nano_kvcache.launch``) and lets the next kernel start. Weights are the only thing read
before that wait: they do not change during a forward. A small weight gets a program per tile
(all of it in flight before the wait); a large one two programs a multiprocessor, each with
its next tile in flight while it multiplies the current one.

The elementwise steps around a product run in it instead of launches of their own (a few
microseconds each, and no early start: compiled torch kernels do not take part in
programmatic dependent launch):

- ``normed_gemv``: every program reads all of x, so the input can be RMSNorm(x + residual),
  the layer norm before the attention's qkv projection or the MLP, made in the prologue. The
  sum x + residual, the new residual, is written by program 0 into a new tensor (the other
  programs still read the old one).
- ``glu``: a gated MLP's gate/up product returns SiLU(gate) * up. A program takes gate rows
  and the up rows that go with them, and makes the activation in its epilogue. (Made in the
  down projection's prologue instead, every program made it again for every slice of its
  input: on an H200 Qwen3-8B's down projection took 32.7 us so, against 27.4 of a plain
  product, and its four products at one row 103.1 against 97.9 us a layer.)

An e4m3 weight (FP8 weights, ``nano_models.quantization``) comes with float32 ``Scales``: one
per output row (``quantization="fp8"``), applied to the row's sum, or one per row and block of
input columns (block-FP8 checkpoints), each block's sum scaled before the row's. It is read in
32-bit words of four values and widened to float32 in registers; its tiles hold twice the
values of a bf16 tile (the same bytes): half the bytes of a bf16 weight for the same work.

The products are float32 sums of elementwise products (no tensor-core tile for one row),
rounded once; the prologue and epilogue round where torch's layers round (the sum, the normed
value, its product with the norm's weight; gate and up, then SiLU-and-mul once). Every shape
depends on the rows alone: it runs inside CUDA graphs.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nano_kvcache.launch import launch_options, pdl
from nano_models.layers.e4m3 import e4m3_quads, in_order

# The products ``LinearBase`` gives this kernel on a CUDA device: one row always, two rows when
# the weight is e4m3 or holds at most TWO_ROWS_BYTES bytes. Measured on an H200
# (benchmarks/bench_gemv.py, Qwen3-0.6B, -8B and -30B-A3B's layers; cuBLAS / this): one row
# 1.0-3.9x faster at every shape; two bf16 rows 1.2-3.7x up to 8.4 M values (0.97x at 6.3 M),
# 0.78-0.90x above; four rows
# faster for three of eleven shapes only (each x row is read again by every program). e4m3
# weights at two rows, against the split-K W8A16 kernel the FP8 layers took before: 1.04-1.8x
# at every shape of the three models but the block-scaled 8B down projection (0.88x with
# slices of 16,384 columns).
GEMV_ROWS = 2
TWO_ROWS_BYTES = 1 << 24
# Bytes of W in a program's tile (BLOCK_N rows x BLOCK_K of their columns), at most; longer
# rows are taken in slices. (16,384 bf16 values, 32,768 e4m3.)
MAX_TILE = 1 << 15
# Columns of a slice, at most. Longer slices keep a longer input in registers: measured on an
# H200 (benchmarks/bench_gemv.py, one row, Qwen3-8B's down projection, 4096 x 12288), slices of
# 4,096 columns against 16,384: bf16 27.3 against 33.3 us, e4m3 15.4 against 16.5 (a scale a
# row) and 15.2 against 22.6 (128-column blocks: 167 registers a thread at 16,384, one program
# a multiprocessor); every layer of up to 4,096 columns as before.
MAX_SLICE = 1 << 12
# A weight of up to ONE_WAVE_BYTES bytes a multiprocessor is read in one wave: a program per
# tile, every tile loaded before the wait for the previous kernel. A larger one by
# PROGRAMS_PER_SM programs a multiprocessor, each walking its share of the tiles with the next
# one in flight while it multiplies the current one. Measured on an H200 (132 SMs;
# benchmarks/bench_gemv.py, one row, cold weights, and the engine at batch 1): one wave is as
# fast or faster up to 6.3 M bf16 values (every Qwen3-0.6B layer), the walk 4-18% faster from
# 8.4 M (every Qwen3-8B and -30B-A3B layer; 2 programs a multiprocessor and 32 KiB tiles beat 1
# or 4 and 16 KiB).
ONE_WAVE_BYTES = 96 * 1024
PROGRAMS_PER_SM = 2

FP8 = torch.float8_e4m3fn


class Tiles(NamedTuple):
    block_n: int
    block_k: int
    warps: int
    grid: int
    block_s: int = 0  # columns of a tile's scale blocks (0: the tile is not cut in blocks)


class Scales(NamedTuple):
    """An e4m3 weight's scales: ``values`` float32 [N, ceil(K / block)]; the weight's element
    (n, k) stands for w[n, k] * values[n, k // block]. One column: a scale per row."""

    values: torch.Tensor
    block: int


# What the program computes its input from (a kernel's globals must be constexpr objects).
_PLAIN = tl.constexpr(0)  # x itself
_NORMED = tl.constexpr(1)  # RMSNorm(x + residual) * norm weight
# How W's values are scaled (e4m3 weights)
_NO_SCALES = tl.constexpr(0)
_ROW_SCALES = tl.constexpr(1)  # one scale a row: the row's sum times it
_BLOCK_SCALES = tl.constexpr(2)  # a scale a row and block of columns: each block's sum times it


class Normed(NamedTuple):
    """``normed_gemv``'s results: the product, the new residual (x + residual; x itself
    without a residual) and, when kept, the normed input the product was taken of."""

    out: torch.Tensor
    residual: torch.Tensor
    normed: torch.Tensor | None


def usable(x: torch.Tensor, weight: torch.Tensor, scaled: bool = False) -> bool:
    """Whether ``gemv`` takes this product (else the caller's matmul does); ``scaled``: the
    weight is e4m3 with ``Scales``."""
    return (
        x.is_cuda
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_ROWS
        and (x.shape[0] == 1 or scaled or weight.numel() * weight.element_size() <= TWO_ROWS_BYTES)
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == (FP8 if scaled else x.dtype)
        and weight.dim() == 2
        and weight.stride(1) == 1
        and (not scaled or _words(weight))
    )


def tiles(
    n: int,
    k: int,
    multiprocessors: int,
    element_size: int = 2,
    scale_block: int = 0,
    glu: bool = False,
) -> Tiles:
    """How an [n, k] weight of ``element_size``-byte values is dealt to the programs: tiles of
    up to MAX_TILE bytes, narrowed while there would be fewer row blocks than programs in a
    wave; a program per tile up to ONE_WAVE_BYTES a multiprocessor, else PROGRAMS_PER_SM a
    multiprocessor. With scales per ``scale_block`` columns (shorter than k), a tile's slice
    is cut in blocks of the largest power of two that divides the scale block. ``glu``: a
    row block holds gate and up rows in pairs, two rows at least."""
    programs = multiprocessors * PROGRAMS_PER_SM
    values = MAX_TILE // element_size
    block_k = min(triton.next_power_of_2(k), values, MAX_SLICE)
    block_n = max(1, min(16 // element_size, values // block_k))
    while block_n > 1 and triton.cdiv(n, block_n) < programs:
        block_n //= 2
    if glu:
        block_n = max(block_n, 2)
    blocks = triton.cdiv(n, block_n)
    one_wave = n * k * element_size <= ONE_WAVE_BYTES * multiprocessors
    tile = block_n * block_k * element_size
    warps = 8 if tile >= MAX_TILE or (not one_wave and tile >= MAX_TILE // 2) else 4
    block_s = 0
    if 0 < scale_block < k:
        block_s = min(scale_block & -scale_block, block_k)
    return Tiles(block_n, block_k, warps, blocks if one_wave else min(blocks, programs), block_s)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """The device's multiprocessors; on the CPU (Triton's interpreter, tests) a small stand-in,
    so that the tiles are dealt to several programs there too."""
    return (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scales: Scales | None = None,
    glu: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for M up to
    ``GEMV_ROWS`` (any M works; past a few rows cuBLAS is faster). The weight in x's dtype,
    or float8_e4m3fn with its ``scales``. ``glu``: the weight is a gated MLP's [gate | up]
    halves and the result SiLU(gate) * up, [M, N / 2] (each product rounded to x's dtype,
    then SiLU-and-mul in float32, rounded once: as the layers compute it)."""
    _check(weight, x.shape[1], "x", scales, glu)
    out = _output(x, weight, glu)
    _launch(_contiguous(x), weight, scales, bias, out, _PLAIN, glu=glu)
    return out


def normed_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    keep_normed: bool = False,
    scales: Scales | None = None,
    glu: bool = False,
) -> Normed:
    """RMSNorm(x + residual) @ weight^T (+ bias) for x and residual [M, K], norm_weight [K]:
    the sum rounded to x's dtype, normed in float32 and rounded, times the norm's weight and
    rounded (as ``nano_models.layers.norm`` computes it). ``keep_normed`` also writes the normed
    input (for another consumer of it); ``glu`` as in ``gemv``."""
    k = x.shape[1]
    _check(weight, k, "x", scales, glu)
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
    out = _output(x, weight, glu)
    new_residual = (
        x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    )
    normed = torch.empty_like(new_residual) if keep_normed else None
    _launch(
        _contiguous(x),
        weight,
        scales,
        bias,
        out,
        _NORMED,
        residual=None if residual is None else _contiguous(residual),
        norm=(norm_weight.contiguous(), eps),
        residual_out=None if residual is None else new_residual,
        normed_out=normed,
        glu=glu,
    )
    return Normed(out, new_residual, normed)


def _output(x: torch.Tensor, weight: torch.Tensor, glu: bool) -> torch.Tensor:
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)


def _check(
    weight: torch.Tensor, k: int, name: str, scales: Scales | None, glu: bool = False
) -> None:
    if weight.shape[1] != k:
        raise ValueError(f"{name} has {k} columns, the weight {weight.shape[1]}")
    if glu and weight.shape[0] % 2:
        raise ValueError(
            f"a gated product's weight holds gate and up halves: an even number of rows, got "
            f"{weight.shape[0]}"
        )
    if weight.stride(1) != 1:
        raise ValueError("the weight must be contiguous along its input dimension")
    if (weight.dtype == FP8) != (scales is not None):
        raise ValueError("a float8_e4m3fn weight comes with its scales, and only such a weight")
    if scales is None:
        return
    if not _words(weight):
        raise ValueError(
            "an e4m3 weight is read in 32-bit words: its columns, row stride and address must "
            f"be multiples of 4, got {weight.shape[1]} columns, stride {weight.stride(0)}"
        )
    n, values, block = weight.shape[0], scales.values, scales.block
    if block <= 0 or values.dtype != torch.float32 or values.stride(-1) != 1:
        raise ValueError(
            f"the scales must be float32 with contiguous rows for blocks of > 0 columns, got "
            f"{values.dtype} for blocks of {block}"
        )
    if values.shape != (n, -(-k // block)):
        raise ValueError(
            f"a weight [{n}, {k}] with scales per {block} columns takes scales "
            f"[{n}, {-(-k // block)}], got {list(values.shape)}"
        )
    if values.shape[1] > 1 and block % 16:
        raise ValueError(f"scale blocks of {block} columns: a multiple of 16 is needed")


def _words(weight: torch.Tensor) -> bool:
    """Whether an e4m3 weight's rows are whole 32-bit words (the kernel reads four at once)."""
    return weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0


def nvidia(device: torch.device) -> bool:
    """A CUDA device of NVIDIA's (PTX's FP8 conversions; not ROCm, not Triton's interpreter)."""
    return device.type == "cuda" and torch.version.hip is None


def _contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous()


def _launch(
    x,
    weight,
    scales,
    bias,
    out,
    prologue,
    residual=None,
    norm=None,
    residual_out=None,
    normed_out=None,
    glu=False,
) -> None:
    rows = x.shape[0]
    n, k = weight.shape
    if rows == 0:
        return
    scale_block = 0 if scales is None else scales.block
    block_n, block_k, warps, grid, block_s = tiles(
        n, k, _multiprocessors(x.device), weight.element_size(), scale_block, glu
    )
    norm_weight, eps = norm if norm is not None else (weight, 0.0)
    dependent = pdl(x)
    _gemv[(grid,)](
        x,
        weight if scales is None else weight.view(torch.int32),
        weight if scales is None else scales.values,
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
        weight.stride(0) // (1 if scales is None else 4),
        out.stride(0),
        residual.stride(0) if residual is not None else 0,
        0 if scales is None else scales.values.stride(0),
        HAS_BIAS=bias is not None,
        SCALES=_NO_SCALES if scales is None else _BLOCK_SCALES if block_s else _ROW_SCALES,
        E4M3_ASM=scales is not None and nvidia(x.device),
        PACK=1 if scales is None else 4,
        PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None,
        KEEP_NORMED=normed_out is not None,
        HOIST=rows <= 2 and k <= block_k,
        ONE_SLICE=k <= block_k,
        WALK=grid < triton.cdiv(n, block_n),
        GLU=glu,
        BLOCK_M=triton.next_power_of_2(rows),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_S=block_s,
        SCALE_BLOCK=scale_block if block_s else 0,
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
    if PROLOGUE == _NORMED:
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
    scales,
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
    SCALES: tl.constexpr,
    E4M3_ASM: tl.constexpr,
    PACK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """acc[m] += input[m, start + offs_k] . tile (one slice of BLOCK_N rows), every row m."""
    tile = widened(tile, PACK, E4M3_ASM)
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
        part = _part(tile, scales, a, SCALES, BLOCK_S)
        acc = tl.where(m_idx[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _part(tile, scales, a, SCALES: tl.constexpr, BLOCK_S: tl.constexpr):
    """tile [BLOCK_N, BLOCK_K] . a [BLOCK_K] -> [BLOCK_N] (float32); with block scales each
    block of BLOCK_S columns' sum times its scale, scales [BLOCK_N, BLOCK_K / BLOCK_S]."""
    products = tile * a[None, :]
    if SCALES == _BLOCK_SCALES:
        blocks = tl.reshape(products, [tile.shape[0], tile.shape[1] // BLOCK_S, BLOCK_S])
        return tl.sum(tl.sum(blocks, 2) * scales, 1)
    else:
        return tl.sum(products, 1)


# (M is 1 to a few; one compiled variant serves every M of a BLOCK_M)
@triton.jit(do_not_specialize=["M", "eps"])
def _gemv(
    x,
    w,
    s,
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
    stride_s,
    HAS_BIAS: tl.constexpr,
    SCALES: tl.constexpr,
    E4M3_ASM: tl.constexpr,
    PACK: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    HOIST: tl.constexpr,
    ONE_SLICE: tl.constexpr,
    WALK: tl.constexpr,
    GLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = input[m] . w[n] (+ b[n]) for every m < M, the input x or made from it
    (PROLOGUE), w scaled by s (SCALES: w[n, k] * s[n, k // SCALE_BLOCK]; PACK 4: w's int32
    words hold four e4m3 values). W's tiles are a block of BLOCK_N rows by a slice of BLOCK_K
    columns (with block scales in blocks of BLOCK_S, within one scale block each): a program
    per row block, or (WALK) fewer programs, each walking several (``_walk``)."""
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // PACK)
    block = tl.arange(0, BLOCK_N)
    # The first tile (weights: nothing a kernel before this one writes) ...
    tile, scales = _tile(
        w,
        s,
        _rows(pid, block, N, BLOCK_N, GLU),
        0,
        offs_w,
        N,
        K,
        stride_w,
        stride_s,
        True,
        SCALES,
        BLOCK_S,
        SCALE_BLOCK,
        PACK,
    )
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
            scales,
            x,
            w,
            s,
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
            stride_s,
            HAS_BIAS,
            SCALES,
            E4M3_ASM,
            PACK,
            PROLOGUE,
            HAS_RESIDUAL,
            KEEP_NORMED,
            HOIST,
            GLU,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            BLOCK_S,
            SCALE_BLOCK,
        )
    else:  # (a program per row block, slice after slice)
        offs_n = _rows(pid, block, N, BLOCK_N, GLU)
        acc = _rows_times(
            acc,
            tile,
            scales,
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
            SCALES,
            E4M3_ASM,
            PACK,
            BLOCK_M,
            BLOCK_S,
        )
        # (no loop at all when K fits one slice: ptxas kept registers for it, 96 against 72
        # a thread in Qwen3-0.6B's gate/up product, and fewer programs fit a multiprocessor)
        for start in range(BLOCK_K, BLOCK_K if ONE_SLICE else K, BLOCK_K):
            tile, scales = _tile(
                w,
                s,
                offs_n,
                start,
                offs_w,
                N,
                K,
                stride_w,
                stride_s,
                True,
                SCALES,
                BLOCK_S,
                SCALE_BLOCK,
                PACK,
            )
            acc = _rows_times(
                acc,
                tile,
                scales,
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
                SCALES,
                E4M3_ASM,
                PACK,
                BLOCK_M,
                BLOCK_S,
            )
        _store(out, b, scales, acc, pid, M, N, stride_o, HAS_BIAS, SCALES, GLU, BLOCK_M, BLOCK_N)


@triton.jit
def _walk(
    acc,
    tile,
    scales,
    x,
    w,
    s,
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
    stride_s,
    HAS_BIAS: tl.constexpr,
    SCALES: tl.constexpr,
    E4M3_ASM: tl.constexpr,
    PACK: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    KEEP_NORMED: tl.constexpr,
    HOIST: tl.constexpr,
    GLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """This program's tiles, row blocks pid, pid + programs, ..., each slice by slice (tile:
    the first, loaded), the next tile in flight while it multiplies the current one. With
    HOIST (one or two rows of one slice) the input is made once and kept for every tile."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    slices = tl.cdiv(K, BLOCK_K)
    count = tl.cdiv(tl.cdiv(N, BLOCK_N) - pid, programs) * slices
    offs_k = tl.arange(0, BLOCK_K)
    offs_w = tl.arange(0, BLOCK_K // PACK)
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
        following, following_scales = _tile(
            w,
            s,
            _rows(pid + nxt // slices * programs, block, N, BLOCK_N, GLU),
            nxt % slices * BLOCK_K,
            offs_w,
            N,
            K,
            stride_w,
            stride_s,
            nxt < count,
            SCALES,
            BLOCK_S,
            SCALE_BLOCK,
            PACK,
        )
        start = t % slices * BLOCK_K
        if HOIST:
            values = widened(tile, PACK, E4M3_ASM)
            part = _part(values, scales, a0, SCALES, BLOCK_S)
            acc = tl.where(m_idx[:, None] == 0, acc + part[None, :], acc)
            if BLOCK_M == 2:
                part = _part(values, scales, a1, SCALES, BLOCK_S)
                acc = tl.where(m_idx[:, None] == 1, acc + part[None, :], acc)
        else:
            acc = _rows_times(
                acc,
                tile,
                scales,
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
                SCALES,
                E4M3_ASM,
                PACK,
                BLOCK_M,
                BLOCK_S,
            )
        if start + BLOCK_K >= K:  # (the block's last slice: its outputs are complete)
            blk = pid + t // slices * programs
            _store(
                out, b, scales, acc, blk, M, N, stride_o, HAS_BIAS, SCALES, GLU, BLOCK_M, BLOCK_N
            )
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        tile = following
        scales = following_scales


@triton.jit
def _rows(blk, block, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """W's rows in row block ``blk`` (block: arange(BLOCK_N)): BLOCK_N rows in a row, or
    with GLU (W is a gated MLP's [gate | up] halves, N // 2 rows each) BLOCK_N // 2 gate rows
    and the up rows that go with them."""
    if GLU:
        half: tl.constexpr = BLOCK_N // 2
        return blk * half + block % half + tl.where(block < half, 0, N // 2)
    else:
        return blk * BLOCK_N + block


@triton.jit
def _store(
    out,
    b,
    scales,
    acc,
    blk,
    M,
    N,
    stride_o,
    HAS_BIAS: tl.constexpr,
    SCALES: tl.constexpr,
    GLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Row block blk's outputs for the rows m < M: out[m, n] = acc (times the rows' scales)
    (+ b[n]); with GLU, the products (gate and up, rounded as the layer's output) made into
    SiLU(gate) * up in float32 and rounded once, out[m, n] for the block's gate rows n."""
    m_idx = tl.arange(0, BLOCK_M)
    offs_n = _rows(blk, tl.arange(0, BLOCK_N), N, BLOCK_N, GLU)
    live_n = offs_n < N
    if SCALES == _ROW_SCALES:
        acc *= scales[None, :]
    if HAS_BIAS:
        acc += tl.load(b + offs_n, mask=live_n, other=0.0).to(tl.float32)[None, :]
    if GLU:
        half: tl.constexpr = BLOCK_N // 2
        y = acc.to(out.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(y, [BLOCK_M, 2, half]), [0, 2, 1]))
        acc = gate * tl.sigmoid(gate) * up
        offs_n = blk * half + tl.arange(0, half)
        live_n = offs_n < N // 2
    ptrs = out + m_idx.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=(m_idx < M)[:, None] & live_n[None, :])


@triton.jit
def widened(tile, PACK: tl.constexpr, E4M3_ASM: tl.constexpr):
    """A tile's values in float32. PACK 4: int32 words of four e4m3 values (the first in the
    lowest byte), [..., W] -> [..., 4 W], widened by ``e4m3_quads`` (by PTX with E4M3_ASM), each
    quarter to float32 before they are put in order."""
    if PACK == 4:
        v0, v1, v2, v3 = e4m3_quads(tile, E4M3_ASM)
        f32 = tl.float32
        return in_order(v0.to(f32), v1.to(f32), v2.to(f32), v3.to(f32))
    else:
        return tile.to(tl.float32)


@triton.jit
def _tile(
    w,
    s,
    offs_n,
    start,
    offs_w,
    N,
    K,
    stride_w,
    stride_s,
    live,
    SCALES: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    PACK: tl.constexpr,
):
    """W's rows offs_n at the slice's units start / PACK + offs_w (values, or int32 words of
    PACK e4m3 values), [BLOCK_N, BLOCK_K / PACK] (zeros where not live), and their scales:
    the rows' [BLOCK_N], or with block scales those of the tile's blocks of BLOCK_S columns,
    [BLOCK_N, BLOCK_K / BLOCK_S] (else a placeholder). (Loaded with the tile: a scale read
    only when the row's sum is stored waited a memory latency every tile.)"""
    units = start // PACK + offs_w
    live_n = offs_n < N
    rows = w + offs_n.to(tl.int64)[:, None] * stride_w + units[None, :]
    mask = (live_n[:, None] & (units < K // PACK)[None, :]) & live
    values = tl.load(rows, mask=mask, other=0)
    if SCALES == _BLOCK_SCALES:
        firsts = start + tl.arange(0, offs_w.shape[0] * PACK // BLOCK_S) * BLOCK_S
        ptrs = s + offs_n[:, None] * stride_s + (firsts // SCALE_BLOCK)[None, :]
        scales = tl.load(ptrs, mask=(live_n[:, None] & (firsts < K)[None, :]) & live, other=0.0)
    elif SCALES == _ROW_SCALES:
        scales = tl.load(s + offs_n * stride_s, mask=live_n & live, other=0.0)
    else:
        scales = tl.zeros([1], dtype=tl.float32)
    return values, scales
