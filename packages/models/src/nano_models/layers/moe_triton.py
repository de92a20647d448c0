"""Mixture of experts on the GPU in a few launches (Triton).

The router's top-k choice and the (token, slot) pairs sorted by expert, each expert's run
padded to a multiple of the tile height (``moe_routing.route_align``). Then one launch
computes every expert's gate and up projections of its tokens and SiLU-and-mul in its
epilogue (``w13``), one launch the down projections (``w2``) scaled by the routing weights,
and a sum adds each token's k outputs. Every shape depends on the number of tokens alone
(tiles past the used length of the sorted list return at once), and no value goes back to the
host, so a decode step with experts runs inside a CUDA graph.

Up to a few tokens ``moe_rows`` takes over (no alignment; the products row by row).

e4m3 experts (FP8 weights, ``ExpertScales``): each tile is widened to the activations' dtype
(exact) for the tensor-core product, and their scales applied once to each row's sum, to each
tile's product where the scale blocks hold whole tiles, else to each value before the
product.

Tiles per shape come from ``nano_models.layers.moe_tiles`` (measured on an H200 by
``benchmarks/tune_moe.py``), else from a rule by the number of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from nano_models.layers import moe_rows
from nano_models.layers.moe import ExpertScales, check_expert_scales
from nano_models.layers.moe_routing import align, route_align
from nano_models.layers.triton_tiles import grouped_tile


@triton.jit
def _scaled(w, scale_ptrs, k, mask, stride_sk, SCALE_BLOCK: tl.constexpr):
    """An e4m3 tile [BLOCK_K, BLOCK_N] (its columns k) widened and scaled, float32:
    w[k, n] * scale[n, k // SCALE_BLOCK] (``scale_ptrs``: [1, BLOCK_N], at each row's first
    scale)."""
    s = tl.load(scale_ptrs + (k // SCALE_BLOCK)[:, None] * stride_sk, mask=mask, other=0.0)
    return w.to(tl.float32) * s


@triton.jit
def _grouped_gemm(
    a,
    b,
    c,
    weights,
    sorted_pairs,
    tile_experts,
    used,
    num_pairs,
    length,
    N,
    K,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    b_scale,
    stride_se,
    stride_sn,
    stride_sk,
    PAIRS_PER_ROW: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHTS: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    SCALING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """c[pair, :N] = a[pair // PAIRS_PER_ROW, :K] @ b[expert of pair, :N, :K]^T (times the
    pair's routing weight with MUL_WEIGHTS), for the pairs of one tile of ``sorted_pairs``.
    GATED: b holds 2N rows (gate, then up) and c[pair, n] = SiLU(gate_n) * up_n, both products
    in float32 (a program reads BLOCK_N gate rows and the BLOCK_N up rows N further).
    SCALING > 0: b is e4m3 and b[e, n, k] stands for b[e, n, k] * b_scale[e, n, k //
    SCALE_BLOCK] (``ExpertScales.scaling``): the tile widened to a's dtype for the product,
    with one scale a row (1) the row's sum scaled at the end, with one a row and tile (2)
    each tile's product; with one a value (3) each tile widened and scaled in float32, then
    rounded to a's dtype."""
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(length, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(used):
        return
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs + offs)
    valid = pair < num_pairs
    expert = tl.load(tile_experts + pid_m).to(tl.int64)
    rows = (pair // PAIRS_PER_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a + rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    s_ptrs = b_scale + expert * stride_se + offs_n[None, :] * stride_sn
    live_n = offs_n[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - step * BLOCK_K
        x = tl.load(a_ptrs, mask=valid[:, None] & (offs_k[None, :] < left), other=0.0)
        b_mask = (offs_k[:, None] < left) & (offs_n[None, :] < N)
        w = tl.load(b_ptrs, mask=b_mask, other=0.0)
        k = step * BLOCK_K + offs_k
        if SCALING == 3:
            w = _scaled(w, s_ptrs, k, b_mask, stride_sk, SCALE_BLOCK)
        if SCALING == 2:  # (the tile's product scaled: one scale a row of b)
            s = tl.load(
                s_ptrs + (step * BLOCK_K // SCALE_BLOCK) * stride_sk, mask=live_n, other=0.0
            )
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION) * s
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        if GATED:
            u = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            if SCALING == 3:
                u = _scaled(u, s_ptrs + N * stride_sn, k, b_mask, stride_sk, SCALE_BLOCK)
            if SCALING == 2:
                s = tl.load(
                    s_ptrs + N * stride_sn + (step * BLOCK_K // SCALE_BLOCK) * stride_sk,
                    mask=live_n,
                    other=0.0,
                )
                acc_up += tl.dot(x, u.to(x.dtype), input_precision=PRECISION) * s
            else:
                acc_up = tl.dot(x, u.to(x.dtype), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALING == 1:
        acc *= tl.load(s_ptrs, mask=live_n, other=0.0)
        if GATED:
            acc_up *= tl.load(s_ptrs + N * stride_sn, mask=live_n, other=0.0)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHTS:
        acc = acc * tl.load(weights + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs_per_row: int,
    weights: torch.Tensor | None,
    tile: dict,
    gated: bool = False,
    scales: ExpertScales | None = None,
) -> None:
    """``out`` [pairs, N] = rows of ``a`` [pairs / pairs_per_row, K] times their experts'
    ``b`` [E, N, K] (transposed), scaled by ``weights`` [pairs] when given; ``aligned``: from
    ``align`` with the tile's BLOCK_M. ``gated``: ``b`` is [E, 2N, K] (gate rows, then up)
    and ``out`` SiLU(gate) * up. The tile's BLOCK_N counts the rows of ``b`` a program reads
    (gated: half of them gate rows, half up rows). ``scales``: ``b`` is e4m3 with these."""
    sorted_pairs, tile_experts, used = aligned
    n, k = out.shape[1], b.shape[2]
    if b.shape[1] != (2 * n if gated else n):
        raise ValueError(f"b {tuple(b.shape)} does not fit out {tuple(out.shape)}")
    check_expert_scales(b, scales)
    s = scales.values if scales is not None else out
    tile = {**tile, "BLOCK_N": tile["BLOCK_N"] // 2} if gated else tile
    length = sorted_pairs.numel()
    grid = (triton.cdiv(length, tile["BLOCK_M"]) * triton.cdiv(n, tile["BLOCK_N"]),)
    _grouped_gemm[grid](
        a,
        b,
        out,
        weights if weights is not None else out,
        sorted_pairs,
        tile_experts,
        used,
        out.shape[0],
        length,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        out.stride(0),
        out.stride(1),
        s,
        s.stride(0),
        s.stride(1),
        s.stride(2) if scales is not None else 0,
        PAIRS_PER_ROW=pairs_per_row,
        GATED=gated,
        MUL_WEIGHTS=weights is not None,
        SCALE_BLOCK=scales.block if scales is not None else 0,
        SCALING=0 if scales is None else scales.scaling(k, tile["BLOCK_K"]),
        # (float32 as torch computes it, not in TF32; lower precisions are exact either way)
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        **tile,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    tiles: tuple[dict, dict] | None = None,
    scales: tuple[ExpertScales, ExpertScales] | None = None,
) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{ids[t, k]}(x[t]), an expert being (SiLU(x W_gate) * x W_up)
    W_down: x [T, H], w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I], weights [T, k],
    ids [T, k] -> [T, H] in x's dtype. ``tiles``: the two launches' tile settings (default:
    ``moe_tiles.choose``). ``scales``: w13's and w2's, e4m3 weights."""
    tiles = tiles or _tiles(x, w13, ids.shape[1])
    aligned = align(ids, w13.shape[0], tiles[0]["BLOCK_M"])
    return _experts(x, w13, w2, weights, ids, aligned, tiles, scales)


def routed_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    top_k: int,
    renormalize: bool,
    tiles: tuple[dict, dict] | None = None,
    scales: tuple[ExpertScales, ExpertScales] | None = None,
) -> torch.Tensor:
    """``fused_moe`` of the router's choice (``route`` of ``router_logits`` [T, E]), the
    routing and the alignment in one launch for decode-sized batches (``route_align``); up to
    ``moe_rows.ROWS_TOKENS`` tokens (and no ``tiles`` given), ``moe_rows``' launches.
    ``scales``: w13's and w2's, e4m3 weights."""
    if tiles is None and x.shape[0] <= moe_rows.ROWS_TOKENS:
        return moe_rows.routed_moe_rows(
            x, router_logits, w13, w2, top_k, renormalize, scales=scales
        )
    tiles = tiles or _tiles(x, w13, top_k)
    weights, ids, aligned = route_align(
        router_logits, top_k, renormalize, x.dtype, tiles[0]["BLOCK_M"]
    )
    return _experts(x, w13, w2, weights, ids, aligned, tiles, scales)


def _tiles(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> tuple[dict, dict]:
    """The tiles of x's tokens, by the activations' dtype (e4m3 experts take bf16's: a table
    tuned for e4m3 launch by launch was slower in the engine, benchmarks/RESULTS.md)."""
    from nano_models.layers.moe_tiles import choose

    experts, inter2, hidden = w13.shape
    return choose(x.shape[0], experts, inter2 // 2, hidden, top_k, x.dtype)


def _experts(x, w13, w2, weights, ids, aligned, tiles, scales=None) -> torch.Tensor:
    """The gated gate/up launch, the weighted down launch and the sum over each token's k."""
    s13, s2 = scales or (None, None)
    tokens, top_k = ids.shape
    experts, inter2, hidden = w13.shape
    pairs = tokens * top_k
    up_tile, down_tile = tiles
    h = torch.empty(pairs, inter2 // 2, dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, h, aligned, top_k, None, up_tile, gated=True, scales=s13)
    down = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)
    if down_tile["BLOCK_M"] != up_tile["BLOCK_M"]:
        aligned = align(ids, experts, down_tile["BLOCK_M"])
    grouped_gemm(h, w2, down, aligned, 1, weights.reshape(-1), down_tile, scales=s2)
    return down.view(tokens, top_k, hidden).sum(dim=1)
