"""Triton paged attention over the nano_kvcache layout ([blocks, kv_heads, block_size, head_dim]
per layer), for any block size.

- ``paged_decode``: one query per sequence. A program owns one (sequence, kv head, split): it
  loads each K/V tile once for all the query heads of that kv head (GQA packed) and, with
  several splits, works on a slice of the context (flash-decoding), merged by a second kernel.
  The grid depends only on the batch size, never on the data: it runs inside CUDA graphs.
- ``paged_prefill``: the new tokens of each sequence attend causally to themselves and to
  everything before them in the cache (a cached prefix, earlier chunks).

Both accumulate in fp32 with an online softmax (base-2 exponentials).
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _load_kv_tile(
    k_cache,
    v_cache,
    table,
    tokens,
    t_mask,
    kv_base,
    d,
    d_mask,
    stride_kb,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """K and V rows of these token positions: [tokens, head_dim] each, through the table.
    Unmasked (every token valid, head_dim a power of two) the loads pipeline better."""
    if MASKED:
        pages = tl.load(table + tokens // BLOCK_SIZE, mask=t_mask, other=0)
    else:
        pages = tl.load(table + tokens // BLOCK_SIZE)
    rows = pages.to(tl.int64) * stride_kb + kv_base + (tokens % BLOCK_SIZE) * stride_kt
    if MASKED:
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_cache + rows[:, None] + d[None, :])
        v = tl.load(v_cache + rows[:, None] + d[None, :])
    return k, v


@triton.jit
def _softmax_update(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of the online softmax: masked base-2 scores s [M, N], values v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


def _metadata_jit(pointers: list[str]):
    """``triton.jit`` without specializations on the step metadata. Triton compiles a variant
    per 16-byte alignment of every pointer and divisibility of every int; in a mixed batch the
    decode metadata are slices at any offset (seq_lens[num_prefills:]) and the block-table width
    follows the batch, so each new combination would compile a kernel (~0.5 s) in the middle of
    serving. Scalar loads gain nothing from it. (Alignment exemptions need Triton >= 3.2.)"""
    options = {"do_not_specialize": ["stride_bt"]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = pointers
    return triton.jit(**options)


@_metadata_jit(["block_tables", "seq_lens"])
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    out_ptr,
    part_ml,
    part_acc,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(seq_lens + seq)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_bt
    kv_base = kv_head * stride_kh
    for first in range(start, end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        t_mask = tokens < end
        k, v = _load_kv_tile(
            k_cache,
            v_cache,
            table,
            tokens,
            t_mask,
            kv_base,
            d,
            d_mask,
            stride_kb,
            stride_kt,
            BLOCK_SIZE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, PRECISION)

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials of this split: [seq, head, split] running max and sum, and the accumulator.
        part = (seq * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(part_ml + part * 2, m_i, mask=g_mask)
        tl.store(part_ml + part * 2 + 1, l_i, mask=g_mask)
        tl.store(part_acc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=out_mask)


@triton.jit
def _merge_kernel(
    part_ml,
    part_acc,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, BLOCK_D)
    part = (seq * num_heads + head) * NUM_SPLITS + s
    m = tl.load(part_ml + part * 2)
    l_sum = tl.load(part_ml + part * 2 + 1)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)
    acc = tl.load(
        part_acc + part[:, None] * HEAD_DIM + d[None, :], mask=d[None, :] < HEAD_DIM, other=0.0
    )
    total = tl.sum(w * l_sum, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs: full precision (tf32 would lose the reference's accuracy); fp16/bf16: tensor
    # cores as they are.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def decode_splits(num_seqs: int, num_kv_heads: int, max_splits: int = 16) -> int:
    """Splits of the context per (sequence, kv head): at least 2,048 programs, about five waves
    on an H100/H200 (3 resident per multiprocessor), so the last wave's tail is short (measured
    on nano-vllm's benchmark: 1.6% faster than 512); a power of two; a function of the batch
    shape only."""
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < max_splits and programs * splits < 2048:
        splits *= 2
    return splits


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    q [B, heads, head_dim]; caches [blocks, kv_heads, block_size, head_dim]; block_tables int32
    [B, max_blocks]; seq_lens int32 [B] (the context, this token included). Returns [B, heads,
    head_dim] in q's dtype.
    """
    batch, heads, head_dim = q.shape
    _, kv_heads, block_size, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    splits = num_splits or decode_splits(batch, kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    if splits > 1:
        part_ml = torch.empty(batch * heads * splits * 2, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(
            batch * heads * splits * head_dim, dtype=torch.float32, device=q.device
        )
    else:
        part_ml = part_acc = out  # unused
    _decode_kernel[(batch, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_ml,
        part_acc,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        PRECISION=_precision(q),
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _merge_kernel[(batch, heads)](
            part_ml,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=splits,
            num_warps=4,
        )
    return out


@_metadata_jit(["block_tables", "seq_lens", "query_start_loc"])
def _prefill_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    out_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_bt,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    # The last tiles see the most keys: start them first, so that no long tile is left alone
    # at the end of the launch.
    tile = tl.cdiv(q_len, BLOCK_M) - 1 - tl.program_id(0)
    if tile < 0:
        return
    length = tl.load(seq_lens + seq)
    cached = length - q_len  # tokens before the new ones (a prefix, earlier chunks)

    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this tile
    m_mask = m_offs < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + m_offs)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    positions = cached + m_offs

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables + seq * stride_bt
    kv_base = (head // GROUP) * stride_kh
    # Keys up to the last query of the tile. Key tiles wholly before the tile's first query are
    # visible to all its queries: one loop without masks (it pipelines), then the diagonal.
    end = tl.minimum(cached + (tile + 1) * BLOCK_M, length)
    unmasked_end = (cached + tile * BLOCK_M) // BLOCK_N * BLOCK_N
    for first in range(0, unmasked_end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        k, v = _load_kv_tile(
            k_cache,
            v_cache,
            table,
            tokens,
            tokens < end,
            kv_base,
            d,
            d_mask,
            stride_kb,
            stride_kt,
            BLOCK_SIZE,
            MASKED=BLOCK_D != HEAD_DIM,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, PRECISION)
    for first in range(unmasked_end, end, BLOCK_N):
        tokens = first + tl.arange(0, BLOCK_N)
        t_mask = tokens < end
        k, v = _load_kv_tile(
            k_cache,
            v_cache,
            table,
            tokens,
            t_mask,
            kv_base,
            d,
            d_mask,
            stride_kb,
            stride_kt,
            BLOCK_SIZE,
        )
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = (tokens[None, :] <= positions[:, None]) & t_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + (q_start + m_offs)[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    q [T, heads, head_dim] (sequence b's queries are rows query_start_loc[b]:[b+1], at positions
    seq_lens[b] - n .. seq_lens[b] - 1, whose K/V are already in the cache); block_tables int32
    [B, max_blocks]; seq_lens, query_start_loc int32. Returns [T, heads, head_dim].
    """
    tokens, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    num_seqs = seq_lens.shape[0]
    # The tile measured best on an H200 for 8 x 1k, 1 x 8k and 4 x 512 over 1.5k cached
    # (benchmarks/bench_attention.py).
    tile = (64, 64, 4, 2)
    block_m, block_n = block_m or tile[0], block_n or tile[1]
    num_warps, num_stages = num_warps or tile[2], num_stages or tile[3]
    if tokens == 0 or num_seqs == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), heads, num_seqs)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION=_precision(q),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
