"""The experts of a few tokens (a decode step of one to a few sequences), in three launches
that read each chosen expert's rows straight from the routing: no pairs sorted or aligned.

At batch 1 the grouped GEMMs of ``moe_triton`` spend their time elsewhere than in the weight
reads that bound the layer: the alignment (a chain of reductions and barriers in one program),
tiles 16 rows tall for one token, and too few programs to keep every SM streaming (96 programs
of 512 KB for the gate/up launch). Here ``route`` writes each token's top-k experts, then a
program per (pair, block of BLOCK_N outputs) multiplies its token's activations into its
expert's gate and up rows and applies SiLU-and-mul (a matrix-vector product: the products as
elementwise float32 sums, no tensor-core tile to pad), and a program per (token, block of
outputs) takes the down rows of all the token's k experts as one tile, weighted by the router
and summed in float32, so the sum over k is no launch of its own. A token's weight reads grow
with k, not with the experts the batch shares, so past a few tokens the grouped GEMMs win
(``ROWS_TOKENS``, measured).

On Hopper the three launches are programmatic dependent launches (``nano_kvcache.launch``):
each waits for the previous kernel, then lets the next one start, and the down launch loads its
experts' rows before its wait (the routing it reads them by is two launches back, finished
before the gate/up launch let it start), so those reads overlap the gate/up launch.
Every shape depends on the number of tokens alone: it runs inside CUDA graphs.

e4m3 experts (FP8 weights, ``ExpertScales``) are read as 32-bit words of four values widened by
PTX (``gemv.widened``), their scales applied once a row's sum, once a tile's row where the
scale blocks hold whole tiles (the tiles are cut to the blocks), else to each value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_kvcache.launch import launch_options, pdl
from nano_models.layers.gemv import nvidia, widened
from nano_models.layers.moe import ExpertScales, check_expert_scales
from nano_models.layers.moe_routing import route_triton

# Up to this many tokens ``moe_triton.routed_moe`` runs these launches. Measured on an H200
# (benchmarks/bench_moe.py, Qwen3-30B-A3B's layer with its router, in CUDA graphs; rows /
# grouped, us): bf16 1 token 40.6 / 54.4, 3: 80.5 / 94.4, 4: 95.3 / 107.6, 5: 113.6 / 120.3,
# 6: 125.2 / 125.0; e4m3 with a scale a row 4: 76.0 / 89.7, 6: 100.8 / 101.1. The engine at
# 4 sequences (128 in / 512 out): 603.7 output tok/s with 3, 669.6 with 4. (Decode graphs come
# in 1, 2, 4, 8, ... rows: 5 to 7 sequences replay the graph of 8; 5 tokens are eager steps.)
ROWS_TOKENS = 5

# Tile settings (BLOCK_N, BLOCK_K, num_warps) of the two launches, the fastest of
# benchmarks/bench_moe.py --sweep-rows on an H200 at Qwen3-30B-A3B's shapes and batch 1 (thin
# tiles: many programs, each streaming a few whole rows). The down launch's BLOCK_K is the
# longest slice of a row it takes at once (rounded down so that its k experts' BLOCK_N rows
# hold at most 8,192 values). Swept again with 8 layers of cold experts in one graph (the
# model's way): the down launch in slices of 256 by two warps, 24.6 us for both launches
# against 25.5 with whole rows of 1,024 by four; Qwen3-30B-A3B at batch 1 381.6 against 375.8
# output tok/s (benchmarks/RESULTS.md).
UP_TILE = (8, 128, 8)
DOWN_TILE = (1, 256, 2)
# The same for e4m3 experts (``benchmarks/bench_moe.py --sweep-rows --fp8 row|block``, H200, batch
# 1, us a layer): half the bytes a value, so longer slices keep as many bytes in flight. Gate/up
# (8, 512, 8) is within 3% of the fastest with a scale a row (24.1 against 23.4; the bf16 tile:
# 30.5) and with 128-column blocks (cut to the blocks: 23.4); down (2, 128, 8) is the fastest
# with either (18.0 and 20.0 for both launches, against 23.5 and 23.4 with the bf16 tile).
UP_TILE_E4M3 = (8, 512, 8)
DOWN_TILE_E4M3 = (2, 128, 8)


def routed_moe_rows(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    up_tile: tuple[int, int, int] | None = None,
    down_tile: tuple[int, int, int] | None = None,
    scales: tuple[ExpertScales, ExpertScales] | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]) of the router's choice (softmax of
    ``router_logits`` [T, E] in float32, top-k, renormalized with ``renormalize``): x [T, H],
    w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I] -> [T, H] in x's dtype. ``scales``:
    w13's and w2's, e4m3 weights (each value widened and scaled as it is read)."""
    weights, ids = route_triton(router_logits, top_k, renormalize, torch.float32, pdl=True)
    return moe_rows(x, w13, w2, weights, ids, up_tile, down_tile, scales)


def moe_rows(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    up_tile: tuple[int, int, int] | None = None,
    down_tile: tuple[int, int, int] | None = None,
    scales: tuple[ExpertScales, ExpertScales] | None = None,
) -> torch.Tensor:
    """The experts of given routing: ``weights`` [T, k] (any float dtype), ``ids`` [T, k];
    shapes as ``routed_moe_rows``'s. Tiles: (BLOCK_N, BLOCK_K, num_warps) of the two launches
    (default ``UP_TILE``, ``DOWN_TILE``). ``scales``: w13's and w2's, e4m3 weights."""
    tokens, top_k = ids.shape
    _, inter2, hidden = w13.shape
    inter = inter2 // 2
    if tokens == 0:
        return x.new_empty(0, hidden)
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the experts' weights must be contiguous along their input dimension")
    e4m3 = w13.dtype == torch.float8_e4m3fn
    for w, sc in zip((w13, w2), scales or (None, None)):
        check_expert_scales(w, sc)
        if sc is not None and sc.values.stride(2) != 1:
            raise ValueError("the experts' scales must be contiguous along their last dimension")
    s13, s2 = scales or (ExpertScales(x, 0), ExpertScales(x, 0))
    # (e4m3 rows of whole 32-bit words: read a word at a time, widened by PTX on NVIDIA's GPUs)
    pack = 4 if e4m3 and _whole_words(w13) and _whole_words(w2) else 1
    w13_in, w2_in = (w13.view(torch.int32), w2.view(torch.int32)) if pack == 4 else (w13, w2)
    asm = e4m3 and nvidia(x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()
    h = torch.empty(tokens * top_k, inter, dtype=x.dtype, device=x.device)
    dependent = pdl(x)
    up_tile, down_tile = launch_tiles(e4m3, top_k, inter, s13.block, s2.block, up_tile, down_tile)
    block_n, block_k, warps = up_tile
    _gate_up_rows[(tokens * top_k, triton.cdiv(inter, block_n))](
        x,
        w13_in,
        ids,
        h,
        inter,
        hidden,
        x.stride(0),
        w13_in.stride(0),
        w13_in.stride(1),
        s13.values,
        s13.values.stride(0),
        s13.values.stride(1),
        TOP_K=top_k,
        SCALE_BLOCK=s13.block,
        SCALING=s13.scaling(hidden, block_k) if e4m3 else 0,
        PACK=pack,
        E4M3_ASM=asm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=dependent,
        num_warps=warps,
        **launch_options(dependent),
    )
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = down_tile
    slots = triton.next_power_of_2(top_k)
    _down_rows[(tokens, triton.cdiv(hidden, block_n))](
        h,
        w2_in,
        weights,
        ids,
        out,
        hidden,
        inter,
        w2_in.stride(0),
        w2_in.stride(1),
        out.stride(0),
        s2.values,
        s2.values.stride(0),
        s2.values.stride(1),
        TOP_K=top_k,
        SCALE_BLOCK=s2.block,
        SCALING=s2.scaling(inter, block_k) if e4m3 else 0,
        PACK=pack,
        E4M3_ASM=asm,
        SLOTS=slots,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PDL=dependent,
        num_warps=warps,
        **launch_options(dependent),
    )
    return out


def launch_tiles(
    e4m3: bool,
    top_k: int,
    inter: int,
    up_block: int,
    down_block: int,
    up_tile: tuple[int, int, int] | None = None,
    down_tile: tuple[int, int, int] | None = None,
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The (BLOCK_N, BLOCK_K, num_warps) the two launches take: the given tiles or the
    defaults of the weights' dtype, each slice cut to the scale blocks (``up_block``,
    ``down_block``: columns a scale; 0 for bf16), the down launch's to at most 8,192 values of
    its k experts' rows and to the row's length rounded up to a power of two."""
    block_n, block_k, warps = up_tile or (UP_TILE_E4M3 if e4m3 else UP_TILE)
    up = (block_n, _within_scale_blocks(block_k, up_block), warps)
    block_n, block_k, warps = down_tile or (DOWN_TILE_E4M3 if e4m3 else DOWN_TILE)
    slots = triton.next_power_of_2(top_k)
    block_k = min(
        block_k, triton.next_power_of_2(inter), _prev_power_of_2(8192 // (slots * block_n))
    )
    return up, (block_n, max(16, _within_scale_blocks(block_k, down_block)), warps)


def _whole_words(w: torch.Tensor) -> bool:
    """Whether an e4m3 expert weight's rows are whole 32-bit words (read four values at once)."""
    return all(n % 4 == 0 for n in (w.shape[2], w.stride(0), w.stride(1), w.data_ptr()))


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _within_scale_blocks(block_k: int, scale_block: int) -> int:
    """A tile of at most ``block_k`` columns that lies within one block of scales where the
    blocks are a power of two of at least 16 columns (one scale a row and tile)."""
    if scale_block >= 16 and scale_block & (scale_block - 1) == 0:
        return min(block_k, scale_block)
    return block_k


@triton.jit
def _gate_up_rows(
    x,
    w13,
    ids,
    h,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    scales,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALING: tl.constexpr,
    PACK: tl.constexpr,
    E4M3_ASM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[pair, n] = SiLU(x[token] . gate_n) * (x[token] . up_n) for the BLOCK_N outputs n of
    this program, gate_n and up_n rows n and N + n of the pair's expert in ``w13``.
    SCALING > 0: w13 is e4m3 (PACK 4: read as int32 words of four), its (e, n, k) scaled by
    scales[e, n, k // SCALE_BLOCK] (``ExpertScales.scaling``: once a row, a tile or a value)."""
    if PDL:  # (the routing, then the down launch may start)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    expert = tl.load(ids + pair).to(tl.int64)
    x_row = x + (pair // TOP_K).to(tl.int64) * stride_x
    gate_rows = w13 + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + N * stride_wn
    gate_scales = scales + expert * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    up_scales = gate_scales + N * stride_sn
    live_n = offs_n < N
    offs_w = tl.arange(0, BLOCK_K // PACK)
    gate = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + offs_k
        live_k = k < K
        a = tl.load(x_row + k, mask=live_k, other=0.0).to(tl.float32)[None, :]
        w = start // PACK + offs_w
        mask = live_n[:, None] & (w < K // PACK)[None, :]
        g = widened(tl.load(gate_rows + w[None, :], mask=mask, other=0.0), PACK, E4M3_ASM)
        u = widened(tl.load(up_rows + w[None, :], mask=mask, other=0.0), PACK, E4M3_ASM)
        if SCALING == 2:
            g *= tl.load(gate_scales + start // SCALE_BLOCK, mask=live_n[:, None], other=0.0)
            u *= tl.load(up_scales + start // SCALE_BLOCK, mask=live_n[:, None], other=0.0)
        if SCALING == 3:
            mask = live_n[:, None] & live_k[None, :]
            g *= tl.load(gate_scales + (k // SCALE_BLOCK)[None, :], mask=mask, other=0.0)
            u *= tl.load(up_scales + (k // SCALE_BLOCK)[None, :], mask=mask, other=0.0)
        gate += g * a
        up += u * a
    g = tl.sum(gate, 1)
    up_sum = tl.sum(up, 1)
    if SCALING == 1:
        g *= tl.sum(tl.load(gate_scales, mask=live_n[:, None], other=0.0), 1)
        up_sum *= tl.sum(tl.load(up_scales, mask=live_n[:, None], other=0.0), 1)
    out = g / (1.0 + tl.exp(-g)) * up_sum
    tl.store(h + pair.to(tl.int64) * N + offs_n, out.to(h.dtype.element_ty), mask=live_n)


@triton.jit
def _down_rows(
    h,
    w2,
    weights,
    ids,
    out,
    N,
    K,
    stride_we,
    stride_wn,
    stride_out,
    scales,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALING: tl.constexpr,
    PACK: tl.constexpr,
    E4M3_ASM: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[token, n] = sum over the token's pairs of weight * (h[pair] . down_n of the pair's
    expert), for the BLOCK_N outputs n of this program; float32 throughout, rounded once. The
    k experts' rows are one tile: row r is slot r // BLOCK_N (SLOTS: TOP_K rounded up to a
    power of two), output r % BLOCK_N. SCALING > 0: w2 is e4m3 (PACK 4: read as int32 words of
    four), its (e, n, k) scaled by scales[e, n, k // SCALE_BLOCK] (``ExpertScales.scaling``)."""
    token = tl.program_id(0)
    r = tl.arange(0, SLOTS * BLOCK_N)
    slot = r // BLOCK_N
    offs_n = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    live_r = (slot < TOP_K) & (offs_n < N)
    pair = token * TOP_K + slot
    offs_k = tl.arange(0, BLOCK_K)
    # The routing is two launches back (the gate/up launch waited for it before letting this
    # one start): the experts' rows are read before the wait.
    expert = tl.load(ids + pair, mask=live_r, other=0).to(tl.int64)
    scale = tl.load(weights + pair, mask=live_r, other=0.0).to(tl.float32)
    rows = w2 + expert[:, None] * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    row_scales = scales + expert[:, None] * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
    live_k = offs_k < K
    offs_w = tl.arange(0, BLOCK_K // PACK)
    w_mask = live_r[:, None] & (offs_w < K // PACK)[None, :]
    tile = widened(tl.load(rows + offs_w[None, :], mask=w_mask, other=0.0), PACK, E4M3_ASM)
    if SCALING == 2:
        tile *= tl.load(row_scales, mask=live_r[:, None], other=0.0)
    if SCALING == 3:
        mask = live_r[:, None] & live_k[None, :]
        tile *= tl.load(row_scales + (offs_k // SCALE_BLOCK)[None, :], mask=mask, other=0.0)
    if PDL:  # (h is complete)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    h_rows = h + pair.to(tl.int64)[:, None] * K
    a = tl.load(h_rows + offs_k[None, :], mask=live_r[:, None] & live_k[None, :], other=0.0)
    part = tl.sum(tile * a.to(tl.float32), 1)
    for start in range(BLOCK_K, K, BLOCK_K):
        k = start + offs_k
        mask = live_r[:, None] & (k < K)[None, :]
        words = start // PACK + offs_w
        w_mask = live_r[:, None] & (words < K // PACK)[None, :]
        w = widened(tl.load(rows + words[None, :], mask=w_mask, other=0.0), PACK, E4M3_ASM)
        if SCALING == 2:
            w *= tl.load(row_scales + start // SCALE_BLOCK, mask=live_r[:, None], other=0.0)
        if SCALING == 3:
            w *= tl.load(row_scales + (k // SCALE_BLOCK)[None, :], mask=mask, other=0.0)
        part += tl.sum(w * tl.load(h_rows + k[None, :], mask=mask, other=0.0).to(tl.float32), 1)
    if SCALING == 1:
        part *= tl.sum(tl.load(row_scales, mask=live_r[:, None], other=0.0), 1)
    y = tl.sum(tl.reshape(part * scale, [SLOTS, BLOCK_N]), 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out + token.to(tl.int64) * stride_out + n, y.to(out.dtype.element_ty), mask=n < N)
