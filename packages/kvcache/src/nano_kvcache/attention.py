"""Triton paged attention over the nano_kvcache layout ([blocks, kv_heads, block_size, head_dim]
per layer), for any block size.

- ``paged_decode``: one query per sequence. A program owns one (sequence, kv head, split): it
  loads each K/V tile once for all the query heads of that kv head (GQA packed) and, with
  several splits, works on a slice of the context (flash-decoding), merged by a second kernel.
  The grid depends only on the batch size, never on the data: it runs inside CUDA graphs.
- ``paged_prefill``: the new tokens of each sequence attend causally to themselves and to
  everything before them in the cache (a cached prefix, earlier chunks). The cached keys come
  through the block table; q and the new tokens' own keys straight from the step, contiguous
  rows that TMA loads on Hopper and later (the cache too when a block holds whole key tiles).

Both accumulate in fp32 with an online softmax (base-2 exponentials).
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from nano_kvcache.launch import launch_options, pdl
from nano_kvcache.relaunch import Relaunch

try:  # Triton >= 3.4: TMA descriptors built on the host
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

_LOG2E = 1.4426950408889634
# (a NaN stays NaN when rounded into an FP8 cache, as the store kernels keep it)
# (a global a kernel reads must be a constexpr object: an annotation passes Triton's
# interpreter but fails to compile on GPUs)
_NAN = tl.constexpr(tl.PropagateNan.ALL)
# The decode kernel's registers a thread over an FP8 cache, by BLOCK_D (see paged_decode).
# Compiled for sm_90: at 128 a head of 64 would take 115 (96 uncapped: fewer programs a
# multiprocessor), one of 256 would spill 328 bytes a thread; those stay uncapped.
_FP8_MAX_REGISTERS = {128: 128}
# K/V tiles of its context the decode kernel prefetches into L2 before it waits for the kernel
# before it (programmatic dependent launch; NVIDIA's PTX prefetch), so that its first loads
# find them there: one sequence of 640 tokens, 28 layers on an H200, 5.9 -> 5.5 us a layer;
# two tiles within noise of one (benchmarks/RESULTS.md). 0: none; a power of two.
EARLY_TILES = 1
# The decode grid's programs, at least (up to decode_splits' max_splits; see decode_splits).
DECODE_PROGRAMS = 1024


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
        k, v = _load_kv_tile(
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
def _prefetch(ptrs):
    """Asks L2 for the 128-byte lines at ptrs (nothing comes back; no register waits). L2 is
    coherent: a line fetched before a kernel writes it holds what was written once it is."""
    tl.inline_asm_elementwise(
        asm="prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        constraints="=r,l",
        args=[ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_tiles(
    k_cache,
    v_cache,
    table,
    start,
    end,
    kv_base,
    stride_kb,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LINES: tl.constexpr,
    TOKENS: tl.constexpr,
):
    """Prefetches into L2 the K and V rows of the tokens start .. start + TOKENS (below end;
    block 0's rows in place of the others) through the block table: LINES points of each row,
    128 bytes apart from its first value, the last clamped to its last value (a power of two,
    at least the 128-byte lines a row can touch)."""
    tokens = start + tl.arange(0, TOKENS)
    pages = tl.load(table + tokens // BLOCK_SIZE, mask=tokens < end, other=0)
    rows = pages.to(tl.int64) * stride_kb + kv_base + (tokens % BLOCK_SIZE) * stride_kt
    per_line: tl.constexpr = 1024 // k_cache.dtype.element_ty.primitive_bitwidth
    lines = tl.minimum(tl.arange(0, LINES) * per_line, HEAD_DIM - 1)  # (within the row)
    _prefetch(k_cache + rows[:, None] + lines[None, :])
    _prefetch(v_cache + rows[:, None] + lines[None, :])


@triton.jit
def _attend(
    q, k, v, m_i, l_i, acc, scale_log2, visible, MASKED: tl.constexpr, PRECISION: tl.constexpr
):
    """One key tile of the online softmax (base 2): q [M, D], k and v [N, D] (FP8 ones as
    their quantized values: exact in q's dtype; the scales are folded into scale_log2 and the
    output); visible [M, N] when MASKED. Every row must see a key in the first tile it is given,
    so the running max is finite from then on (no -inf - -inf)."""
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if MASKED:
        qk = tl.where(visible, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk -= m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * scale_log2)
        qk = qk * scale_log2 - m_new[:, None]
    p = tl.exp2(qk)
    alpha = tl.exp2(m_i - m_new)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _as_cached(k, v, inv_k_scale, inv_v_scale):
    """The new tokens' K and V as an FP8 cache holds them (x / scale, saturated, rounded):
    attention then sees every key and value as the cache does, whichever step computes it."""
    k = tl.clamp(k.to(tl.float32) * inv_k_scale, -448.0, 448.0, propagate_nan=_NAN)
    v = tl.clamp(v.to(tl.float32) * inv_v_scale, -448.0, 448.0, propagate_nan=_NAN)
    return k.to(tl.float8e4nv), v.to(tl.float8e4nv)


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


@_metadata_jit(["block_tables", "seq_lens", "order"])
def _decode_kernel(
    q_ptr,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    order,
    out_ptr,
    part_ml,
    part_acc,
    scale_log2,
    v_scale,
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
    KV_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ORDERED: tl.constexpr,
    PRECISION: tl.constexpr,
    F16_DOTS: tl.constexpr,
    EARLY: tl.constexpr,
    LINES: tl.constexpr,
    PDL: tl.constexpr,
):
    # One grid axis with the sequence slowest: the programs of a sequence (its kv heads and
    # splits) start together and read neighbouring memory (a block holds every kv head).
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    kv_head = (pid // NUM_SPLITS) % KV_HEADS
    seq = pid // (NUM_SPLITS * KV_HEADS)
    # The step's metadata (order, lengths, block tables) are older than the kernel before this
    # one, which under programmatic dependent launch may still run (q/k rotary writing q and
    # the new K/V, a prefill writing its output, a K/V store): read before the wait, with the
    # first tile prefetched into L2 (a hint: the loads come after the wait).
    if ORDERED:  # longest first, so that the last programs to start are short
        seq = tl.load(order + seq)
    length = tl.load(seq_lens + seq)
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, length)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    table = block_tables + seq * stride_bt
    kv_base = kv_head * stride_kh
    if EARLY:  # the first tiles into L2 while the kernel before ends
        _prefetch_tiles(
            k_cache,
            v_cache,
            table,
            start,
            end,
            kv_base,
            stride_kb,
            stride_kt,
            BLOCK_SIZE,
            HEAD_DIM,
            LINES,
            EARLY * BLOCK_N,
        )
    if PDL:  # (programmatic dependent launch: what the kernel before wrote is complete)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if F16_DOTS:
        # An FP8 cache under a bf16 q: both dots in fp16 (fp32 accumulators), where e4m3
        # converts in one instruction per two values (cvt.rn.f16x2.e4m3x2; to bf16, Hopper
        # adds one per value). No range is lost: e4m3 values (2^-9 to 448) are exact in fp16;
        # so is a bf16 q from 2^-14 to 65504, and a q-normed head's values are at most
        # sqrt(head_dim) times the norm's weight (parts below 2^-14 move by at most 2^-25);
        # P, in [0, 1], keeps 11 bits instead of 8.
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
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
        m_i, l_i, acc = _attend(
            q, k, v, m_i, l_i, acc, scale_log2, t_mask[None, :], True, PRECISION
        )

    out_mask = g_mask[:, None] & d_mask[None, :]
    acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        # Partials of this split: [seq, head, split] running max and sum, and the accumulator.
        part = (seq * (GROUP * KV_HEADS) + heads) * NUM_SPLITS + split
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
    PDL: tl.constexpr,
):
    if PDL:  # (programmatic dependent launch: what the kernel before wrote is complete)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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


def _check_cache(q, k_cache, v_cache, k_scale: float, v_scale: float) -> None:
    """Caches in q's dtype (scales 1), or both FP8 (e4m3) with finite scales > 0."""
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if v_cache.dtype != k_cache.dtype or (k_cache.dtype != q.dtype and not fp8):
        raise ValueError(
            f"the caches must both be q's dtype ({q.dtype}) or float8_e4m3fn, got "
            f"{k_cache.dtype} and {v_cache.dtype}"
        )
    if fp8 and not (0 < k_scale < float("inf") and 0 < v_scale < float("inf")):
        raise ValueError(f"FP8 cache scales must be finite and > 0, got {k_scale}, {v_scale}")
    if not fp8 and (k_scale, v_scale) != (1.0, 1.0):
        raise ValueError("k_scale and v_scale are for FP8 caches; these are not FP8")


def _precision(q: torch.Tensor) -> str:
    # fp32 inputs: full precision (tf32 would lose the reference's accuracy); fp16/bf16: tensor
    # cores as they are.
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _row_lines(row_bytes: int) -> int:
    """The 128-byte lines a cache row can touch (one more when it is not whole lines: it may
    start inside one), as a power of two."""
    return triton.next_power_of_2(triton.cdiv(row_bytes, 128) + (row_bytes % 128 > 0))


def decode_splits(num_seqs: int, num_kv_heads: int, max_splits: int = 16) -> int:
    """Splits of the context per (sequence, kv head): at least 1,024 programs, two to three
    waves on an H100/H200 (3 resident per multiprocessor). With the sequences taken longest
    first the last wave's tail is short already; measured on an H200 over ragged contexts of
    100-2,000 tokens, this was the fastest split count at every batch from 32 to 255 (at least
    2,048 programs was 0.7-4% slower: more, smaller programs and partials to merge); again on
    the code of 2026-11-26 at 16-256 sequences. Equal contexts favour fewer splits (32 x 640
    tokens: 2 splits 27.6 us a layer, 4 splits 32.5), but the grid cannot see the contexts
    (CUDA graphs), and at 512 programs ragged batches lost more (32 x 100-2,000: 47.1 against
    40.7 us; nano-vllm's benchmark 0.6% slower). A power of two; a function of the batch shape
    only."""
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < max_splits and programs * splits < DECODE_PROGRAMS:
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
    order: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp16_dots: bool = True,
) -> torch.Tensor:
    """Attention of one query per sequence over its paged context.

    q [B, heads, head_dim]; caches [blocks, kv_heads, block_size, head_dim] in q's dtype, or
    FP8 (e4m3) holding K / k_scale and V / v_scale; block_tables int32 [B, max_blocks]; seq_lens
    int32 [B] (the context, this token included). order, optional: int32 [B], a permutation of
    range(B), the order in which the programs take the sequences (longest first balances
    them). ``fp16_dots``: over an FP8 cache with a bf16 q, compute in fp16 (on Hopper e4m3
    converts to fp16 in one instruction per two values, to bf16 in one more per value); False
    computes in bf16. Returns [B, heads, head_dim] in q's dtype. Under programmatic dependent
    launch (``nano_kvcache.launch``) the kernel reads block_tables, seq_lens and order before
    it waits for the kernel before it (and prefetches its first K/V tile into L2): that kernel
    must not write them.
    """
    plan = DecodeLaunches(block_tables, seq_lens, order, num_splits, block_n, fp16_dots)
    return plan(q, k_cache, v_cache, scale, out, k_scale, v_scale)


class DecodeLaunches:
    """``paged_decode`` of one step's decodes for every layer, as ``PrefillLaunches`` is for
    its chunks: the metadata (block_tables, seq_lens, order; ``num_splits``, ``block_n``,
    ``fp16_dots`` as there) taken once, the launch worked out by the first call and reused by
    the later calls whose tensors specialize the kernel and its merge the same way
    (``nano_kvcache.relaunch``). The splits' partial results go through one pair of buffers for
    all layers:
    a layer's merge is complete before the next layer's kernel writes them (stream order; under
    programmatic dependent launch each kernel waits for the one before)."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        order: torch.Tensor | None = None,
        num_splits: int | None = None,
        block_n: int = 64,
        fp16_dots: bool = True,
    ) -> None:
        self.block_tables, self.seq_lens, self.order = block_tables, seq_lens, order
        self.num_splits, self.block_n, self.fp16_dots = num_splits, block_n, fp16_dots
        self._key = None

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        _check_cache(q, k_cache, v_cache, k_scale, v_scale)
        out = torch.empty_like(q) if out is None else out
        key = _specialization(q, k_cache, v_cache, out)
        if key != self._key:
            self._key = None
            if not self._setup(q, k_cache, out):
                return out  # (no sequence)
            self._key = key
        part_ml, part_acc = self._parts or (out, out)  # (one split: unused)
        order = self.seq_lens if self.order is None else self.order
        self._decode(
            q,
            k_cache,
            v_cache,
            self.block_tables,
            self.seq_lens,
            order,
            out,
            part_ml,
            part_acc,
            scale * k_scale * _LOG2E,
            float(v_scale),
            *self._strides,
        )
        if self._merge is not None:
            self._merge(part_ml, part_acc, out, out.stride(0), out.stride(1), q.shape[1])
        return out

    def _setup(self, q, k_cache, out) -> bool:
        """Check a layer's tensors and work out its launch; False where there is no
        sequence."""
        batch, heads, head_dim = q.shape
        _, kv_heads, block_size, _ = k_cache.shape
        if batch == 0:
            return False
        order = self.order
        if order is not None and (
            order.shape != (batch,) or order.dtype != torch.int32 or order.device != q.device
        ):
            raise ValueError(
                f"order must be int32 [{batch}] on {q.device} (a permutation of the batch), got "
                f"{order.dtype} {list(order.shape)} on {order.device}"
            )
        splits = self.num_splits or decode_splits(batch, kv_heads)
        block_d = triton.next_power_of_2(head_dim)
        dependent = pdl(q)
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        options = launch_options(dependent)
        cap = _FP8_MAX_REGISTERS.get(block_d)
        if cap and fp8 and q.dtype != torch.float32 and q.is_cuda and torch.version.hip is None:
            # An FP8 tile's conversion takes registers the bf16 kernel does not need (168 a
            # thread at head_dim 128: 3 programs a multiprocessor); capped at 128, 4 fit, with
            # no spill, and each multiprocessor keeps more of the cache in flight: 1.16-1.21x on
            # an H200 at 16-256 sequences, the same at one (benchmarks/RESULTS.md).
            options["maxnreg"] = cap
        if splits > 1:
            self._parts = (
                q.new_empty(batch * heads * splits * 2, dtype=torch.float32),
                q.new_empty(batch * heads * splits * head_dim, dtype=torch.float32),
            )
        else:
            self._parts = None
        self._strides = (
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            self.block_tables.stride(0),
            out.stride(0),
            out.stride(1),
        )
        constexprs = dict(
            BLOCK_SIZE=block_size,
            GROUP=heads // kv_heads,
            BLOCK_G=max(16, triton.next_power_of_2(heads // kv_heads)),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=self.block_n,
            KV_HEADS=kv_heads,
            NUM_SPLITS=splits,
            ORDERED=order is not None,
            PRECISION=_precision(q),
            F16_DOTS=self.fp16_dots and fp8 and q.dtype == torch.bfloat16,
            EARLY=EARLY_TILES if dependent else 0,
            LINES=_row_lines(head_dim * k_cache.element_size()),
            PDL=dependent,
        )
        kwargs = {**constexprs, "num_warps": 4, "num_stages": 2, **options}
        self._decode = Relaunch(_decode_kernel, (batch * kv_heads * splits,), kwargs)
        self._merge = None
        if splits > 1:
            kwargs = dict(
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                NUM_SPLITS=splits,
                PDL=dependent,
                num_warps=4,
                **launch_options(dependent),
            )
            self._merge = Relaunch(_merge_kernel, (batch, heads), kwargs)
        return True


@_metadata_jit(["block_tables", "seq_lens", "query_start_loc"])
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
            m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, scale_log2, None, False, PRECISION)
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
            m_i, l_i, acc = _attend(
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
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, scale_log2, None, False, PRECISION)
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
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, scale_log2, visible, True, PRECISION)

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
        _check_cache(q, k_cache, v_cache, k_scale, v_scale)
        key = _specialization(q, k, v, k_cache, v_cache, out)
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
            scale * k_scale * _LOG2E,
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
            PRECISION=_precision(q),
            FP8=k_cache.dtype == torch.float8_e4m3fn,
        )
        options = dict(num_warps=num_warps, num_stages=num_stages)
        self._launch = Relaunch(_prefill_kernel, grid, {**constexprs, **options})
        return True


def _specialization(*tensors: torch.Tensor) -> tuple:
    """What Triton specializes a launch on, of these tensors (and more: their shapes): equal
    keys launch the same compiled kernel with the same strides."""
    return (
        *((x.shape, x.stride(), x.dtype, x.data_ptr() & 15) for x in tensors),
        tensors[0].device,
    )
