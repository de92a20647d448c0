"""Paged prefill attention (``paged_prefill``, ``PrefillLaunches``): the new tokens of each
sequence attend causally to themselves and to everything before them in the cache (a cached
prefix, earlier chunks). The cached keys come through the block table; q and the new tokens'
own keys straight from the step, contiguous rows that TMA loads on Hopper and later (the cache
too when a block holds whole key tiles)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from nano_kvcache.attention.tiles import (
    LOG2E,
    attend,
    check_cache,
    load_kv_tile,
    metadata_jit,
    precision,
    specialization,
)
from nano_kvcache.relaunch import Relaunch

try:  # Triton >= 3.4: TMA descriptors built on the host
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

# (a NaN stays NaN when rounded into an FP8 cache, as the store kernels keep it)
# (a global a kernel reads must be a constexpr object: an annotation passes Triton's
# interpreter but fails to compile on GPUs)
_NAN = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _load_cached_tile(
    k_cache,
    v_cache,
    table,
    first,
    n,
    t_mask,
    kv_head,
    d,
    d_mask,
    stride_kb,
    stride_kh,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K and V of the cached tokens first + n, [tokens, head_dim] each, through the block
    table: with TMA, descriptors over the caches as rows of head_dim values (the tile lies in
    one block); else pointers (k_cache, v_cache). Masked TMA tiles zero V past t_mask: those
    rows hold whatever the block held, NaN even, and 0 * NaN is NaN."""
    if TMA:
        page = tl.load(table + first // BLOCK_SIZE)
        row = page * (stride_kb // stride_kt) + kv_head * (stride_kh // stride_kt)
        row += first % BLOCK_SIZE
        k = k_cache.load([row, 0])
        v = v_cache.load([row, 0])
        if MASKED:
            v = tl.where(t_mask[:, None], v, 0.0)
    else:
        k, v = load_kv_tile(
            k_cache,
            v_cache,
            table,
            first + n,
            t_mask,
            kv_head * stride_kh,
            d,
            d_mask,
            stride_kb,
            stride_kt,
            BLOCK_SIZE,
            MASKED,
        )
    return k, v


@triton.jit
def _load_new_tile(
    k_new,
    v_new,
    row,
    n,
    k_cols,
    v_cols,
    t_mask,
    d_mask,
    stride_knt,
    stride_vnt,
    TMA: tl.constexpr,
    MASKED: tl.constexpr,
):
    """K and V of the new tokens row + n, [tokens, head_dim] each, from the step's own K/V:
    TMA descriptors over its [T, kv_heads * head_dim] rows (k_cols, v_cols: the head's first
    column), or pointers (k_cols, v_cols: the head's columns)."""
    if TMA:
        k = k_new.load([row, k_cols])
        v = v_new.load([row, v_cols])
    else:
        rows = (row + n).to(tl.int64)[:, None]
        if MASKED:
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = tl.load(k_new + rows * stride_knt + k_cols[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_new + rows * stride_vnt + v_cols[None, :], mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_new + rows * stride_knt + k_cols[None, :])
            v = tl.load(v_new + rows * stride_vnt + v_cols[None, :])
    return k, v


@triton.jit
def _as_cached(k, v, inv_k_scale, inv_v_scale):
    """The new tokens' K and V as an FP8 cache holds them (x / scale, saturated, rounded):
    attention then sees every key and value as the cache does, whichever step computes it."""
    k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0, propagate_nan=_NAN)
    v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0, propagate_nan=_NAN)
    return k.to(tl.float8e4nv), v.to(tl.float8e4nv)


@metadata_jit(["block_tables", "seq_lens", "query_start_loc"])
def _prefill_kernel(
    q_src,
    k_new,
    v_new,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    query_start_loc,
    out_ptr,
    scale_log2,
    inv_k_scale,
    inv_v_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
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
    TMA: tl.constexpr,
    CACHE: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
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
    m_offs = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this tile, from q_start
    m_mask = m_offs < q_len
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    padded: tl.constexpr = BLOCK_D != HEAD_DIM
    if TMA:  # rows past the sequence are the next one's or zeros: computed, never stored
        q = q_src.load([q_start + tile * BLOCK_M, head * HEAD_DIM])
    else:
        q = tl.load(
            q_src + (q_start + m_offs)[:, None] * stride_qt + head * stride_qh + d[None, :],
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_head = head // GROUP

    # The cached keys (a prefix, earlier chunks), visible to every query, through the block
    # table: whole tiles without masks (the loads pipeline), then the partial last one. A batch
    # without them compiles none of this (fewer registers: faster on short prompts).
    if CACHE != "none":
        cached = tl.load(seq_lens + seq) - q_len
        table = block_tables + seq * stride_bt
        whole = cached // BLOCK_N * BLOCK_N
        for first in range(0, whole, BLOCK_N):
            k, v = _load_cached_tile(
                k_cache,
                v_cache,
                table,
                first,
                n,
                n >= 0,
                kv_head,
                d,
                d_mask,
                stride_kb,
                stride_kh,
                stride_kt,
                BLOCK_SIZE,
                CACHE == "tma",
                padded,
            )
            m_i, l_i, acc = attend(q, k, v, m_i, l_i, acc, scale_log2, None, False, PRECISION)
        if whole < cached:
            t_mask = whole + n < cached
            k, v = _load_cached_tile(
                k_cache,
                v_cache,
                table,
                whole,
                n,
                t_mask,
                kv_head,
                d,
                d_mask,
                stride_kb,
                stride_kh,
                stride_kt,
                BLOCK_SIZE,
                CACHE == "tma",
                True,
            )
            m_i, l_i, acc = attend(
                q, k, v, m_i, l_i, acc, scale_log2, t_mask[None, :], True, PRECISION
            )

    # The new tokens' keys, from the step's own K/V: those before the tile's first query are
    # visible to all its queries (BLOCK_N divides BLOCK_M), then the causal diagonal.
    if TMA:  # the head's first column in the descriptors' rows
        k_cols = kv_head * HEAD_DIM
        v_cols = kv_head * HEAD_DIM
    else:
        k_cols = kv_head * stride_knh + d
        v_cols = kv_head * stride_vnh + d
    diagonal = tile * BLOCK_M
    for j in range(0, diagonal, BLOCK_N):
        k, v = _load_new_tile(
            k_new,
            v_new,
            q_start + j,
            n,
            k_cols,
            v_cols,
            n >= 0,
            d_mask,
            stride_knt,
            stride_vnt,
            TMA,
            padded,
        )
        if FP8:
            k, v = _as_cached(k, v, inv_k_scale, inv_v_scale)
        m_i, l_i, acc = attend(q, k, v, m_i, l_i, acc, scale_log2, None, False, PRECISION)
    for j in range(diagonal, tl.minimum(diagonal + BLOCK_M, q_len), BLOCK_N):
        # (a visible key is at most the query's row, so never past this sequence's tokens)
        t_mask = j + n < q_len
        k, v = _load_new_tile(
            k_new,
            v_new,
            q_start + j,
            n,
            k_cols,
            v_cols,
            t_mask,
            d_mask,
            stride_knt,
            stride_vnt,
            TMA,
            True,
        )
        if FP8:
            k, v = _as_cached(k, v, inv_k_scale, inv_v_scale)
        visible = (j + n)[None, :] <= m_offs[:, None]
        m_i, l_i, acc = attend(q, k, v, m_i, l_i, acc, scale_log2, visible, True, PRECISION)

    tl.store(
        out_ptr + (q_start + m_offs)[:, None] * stride_ot + head * stride_oh + d[None, :],
        (acc * v_scale / l_i[:, None]).to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _tma_layout(x: torch.Tensor) -> bool:
    """Whether TMA descriptors can read x [T, heads, head_dim] as rows of [T, heads *
    head_dim]: 16-byte aligned rows, heads side by side, a power-of-two head_dim (Triton's
    block shapes)."""
    head_dim = x.shape[2]
    return (
        TensorDescriptor is not None
        and head_dim == triton.next_power_of_2(head_dim)
        and x.stride(2) == 1
        and x.stride(1) == head_dim
        and x.data_ptr() % 16 == 0
        and x.stride(0) * x.element_size() % 16 == 0
    )


def _tma_cache(*caches: torch.Tensor) -> bool:
    """Whether TMA descriptors can read the caches as rows of head_dim values (contiguous,
    16-byte aligned, row numbers within int32)."""
    return all(
        x.is_contiguous() and x.data_ptr() % 16 == 0 and x.numel() // x.shape[3] < 2**31
        for x in caches
    )


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def prefill_tile(
    max_query_len: int,
    dtype: torch.dtype,
    cached_prefix: bool = False,
    mean_query_len: int = 0,
    tma: bool = True,
) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of a prefill, measured on an H200 (RESULTS.md,
    benchmarks/bench_attention.py): 128 x 128 tiles from 4k-token prompts on (4-11% faster
    there, 10-15% slower on shorter ones), 64 x 64 below; but with TMA loads, 128 x 64 with 4
    warps for chunks of 256 tokens and more on average over a cached prefix (6-12% faster;
    25-35% slower on chunks of 64 tokens or fewer, 23% slower without TMA). fp32 tiles take two
    stages (three do not fit in shared memory)."""
    if dtype.itemsize > 2:
        return 64, 64, 4, 2
    if max_query_len >= 4096:
        return 128, 128, 8, 3
    if tma and cached_prefix and mean_query_len >= 256:
        return 128, 64, 4, 2
    return 64, 64, 4, 3


def paged_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile: tuple[int, int, int, int] | None = None,
    tma: bool | None = None,
    cached_prefix: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached context and themselves.

    q [T, heads, head_dim] and the new tokens' k, v [T, kv_heads, head_dim] (sequence b's are
    rows query_start_loc[b]:[b+1], at positions seq_lens[b] - n .. seq_lens[b] - 1); the keys
    before them are read from the caches [blocks, kv_heads, block_size, head_dim] through
    block_tables int32 [B, max_blocks]; seq_lens, query_start_loc int32. The new tokens' keys
    are read from k and v, not the cache. ``tma``: load q, k and v with TMA (default: where the
    GPU has it and their rows allow); the caches too when a block holds whole key tiles.
    ``cached_prefix=False`` says that no sequence has tokens before its new ones (seq_lens
    equal to the new tokens): the kernel then leaves out that path, which is faster; the
    keys before would be ignored. ``tile``: (block_m, block_n, num_warps, num_stages), block_n
    dividing block_m (default: ``prefill_tile``). FP8 (e4m3) caches hold K / k_scale and
    V / v_scale; the new tokens' k and v are then rounded as the cache holds them, so that
    attention sees the same keys and values in every step. Returns [T, heads, head_dim].
    """
    plan = PrefillLaunches(
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        tile=tile,
        tma=tma,
        cached_prefix=cached_prefix,
    )
    return plan(q, k, v, k_cache, v_cache, scale, out, k_scale, v_scale)


class PrefillLaunches:
    """``paged_prefill`` of one step's chunks for every layer: the step's metadata
    (block_tables, seq_lens, query_start_loc, max_query_len; ``tile``, ``tma`` and
    ``cached_prefix`` as there) taken once, each call one layer's. The first call checks its
    tensors and works out the tile, TMA and grid; a later call whose tensors have the same
    shapes, strides, dtypes and alignments (a step's layers do) reuses them
    (``nano_kvcache.relaunch``); any other is worked out again. An eager step of Qwen3-0.6B
    spent a third of its host time working out the same launch in each of its 28 layers
    (benchmarks/RESULTS.md)."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        max_query_len: int,
        tile: tuple[int, int, int, int] | None = None,
        tma: bool | None = None,
        cached_prefix: bool = True,
    ) -> None:
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.query_start_loc = query_start_loc
        self.max_query_len = max_query_len
        self.tile, self.tma, self.cached_prefix = tile, tma, cached_prefix
        self._key = None  # what the launch below was worked out for

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        check_cache(q, k_cache, v_cache, k_scale, v_scale)
        key = specialization(q, k, v, k_cache, v_cache, out)
        if key != self._key:
            self._key = None
            if not self._setup(q, k, v, k_cache, v_cache, out):
                return out  # (no token, or no sequence)
            self._key = key
        tokens, block_m, block_n, block_d = self._tiles
        q_src, k_new, v_new, k_src, v_src = q, k, v, k_cache, v_cache
        if self._tma:  # (rows of heads x head_dim values; head_dim == block_d)
            q_cols, kv_cols, rows = self._widths
            q_src = TensorDescriptor(q, [tokens, q_cols], [q.stride(0), 1], [block_m, block_d])
            k_new = TensorDescriptor(k, [tokens, kv_cols], [k.stride(0), 1], [block_n, block_d])
            v_new = TensorDescriptor(v, [tokens, kv_cols], [v.stride(0), 1], [block_n, block_d])
            if self._cache == "tma":
                k_src, v_src = (
                    TensorDescriptor(x, [rows, block_d], [block_d, 1], [block_n, block_d])
                    for x in (k_cache, v_cache)
                )
        self._launch(
            q_src,
            k_new,
            v_new,
            k_src,
            v_src,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            out,
            scale * k_scale * LOG2E,
            1.0 / k_scale,
            1.0 / v_scale,
            float(v_scale),
            *self._strides,
        )
        return out

    def _setup(self, q, k, v, k_cache, v_cache, out) -> bool:
        """Check a layer's tensors and work out its launch; False where there is nothing to
        compute."""
        tokens, heads, head_dim = q.shape
        kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
        if k.shape != (tokens, kv_heads, head_dim) or v.shape != k.shape:
            raise ValueError(
                f"k and v must be [{tokens}, {kv_heads}, {head_dim}] (q's tokens, the cache's kv "
                f"heads and head_dim), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
            raise ValueError("q, k and v need a contiguous head_dim (stride 1)")
        rows_tma = all(_tma_layout(x) for x in (q, k, v))
        tma = self.tma
        if tma is None:
            tma = _has_tma(q.device) and rows_tma
        elif tma and not rows_tma:
            raise ValueError(
                "tma=True needs q, k and v with 16-byte aligned rows of heads x head_dim "
                "contiguous values, head_dim a power of two, and Triton >= 3.4 (got strides "
                f"{q.stride()}, {k.stride()} and {v.stride()}, head_dim {head_dim})"
            )
        num_seqs = self.seq_lens.shape[0]
        block_m, block_n, num_warps, num_stages = self.tile or prefill_tile(
            self.max_query_len, q.dtype, self.cached_prefix, tokens // max(num_seqs, 1), tma
        )
        if block_n > block_m or block_m % block_n:
            raise ValueError(f"block_n ({block_n}) must divide block_m ({block_m})")
        if tokens == 0 or num_seqs == 0:
            return False
        block_d = triton.next_power_of_2(head_dim)
        cache = "none"
        if self.cached_prefix:
            whole_tiles = block_size % block_n == 0
            cache = "tma" if tma and whole_tiles and _tma_cache(k_cache, v_cache) else "pointers"
        self._tma, self._cache = tma, cache
        self._tiles = (tokens, block_m, block_n, block_d)
        self._widths = (heads * head_dim, kv_heads * head_dim, k_cache.numel() // head_dim)
        self._strides = (
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            self.block_tables.stride(0),
            out.stride(0),
            out.stride(1),
        )
        grid = (triton.cdiv(self.max_query_len, block_m), heads, num_seqs)
        constexprs = dict(
            BLOCK_SIZE=block_size,
            GROUP=heads // kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            TMA=tma,
            CACHE=cache,
            PRECISION=precision(q),
            FP8=k_cache.dtype == torch.float8_e4m3fn,
        )
        options = dict(num_warps=num_warps, num_stages=num_stages)
        self._launch = Relaunch(_prefill_kernel, grid, {**constexprs, **options})
        return True
