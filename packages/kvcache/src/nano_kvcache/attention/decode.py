"""Paged decode attention: one query per sequence over its paged context (``paged_decode``,
``DecodeLaunches``). A program owns one (sequence, kv head, split): it loads each K/V tile
once for all the query heads of that kv head (GQA packed) and, with several splits, works on a
slice of the context (flash-decoding), merged by a second kernel. The grid depends only on the
batch size, never on the data: it runs inside CUDA graphs."""

from __future__ import annotations

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
from nano_kvcache.launch import launch_options, pdl
from nano_kvcache.relaunch import Relaunch

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
# The rows of the q tile a program attends with, at least: its kv head's query heads, padded
# to a power of two. Triton pads a dot's rows to the tensor cores' 16 itself (Triton >= 3.2);
# a smaller tile holds fewer softmax values and a smaller accumulator. Compiled for sm_90a at
# Qwen3-0.6B's heads (GQA 2): FP8 cache 1,176 -> 1,040 instructions, bf16 cache 128 -> 96
# registers. Timed on an H200 (benchmarks/sweep_decode.py; benchmarks/RESULTS.md, 2026-12-01),
# the group's rows against 16: over an FP8 cache 3-8% faster at every batch of 1 to 256
# (nano-vllm's benchmark 29.5k -> 30.8k output tok/s, Qwen3-8B's 11.2k -> 11.4k); over a bf16
# cache mixed (-4% at 256 x 1k and 16 x 8k, +1% at 256 ragged and Qwen3-8B's heads), so 16.
GROUP_ROWS = 16
FP8_GROUP_ROWS = 1
# The decode kernel's pipeline stages over an FP8 cache when each program reads its sequence
# whole (one split: many sequences); with splits, and over 16-bit caches, 2. Timed on an H200
# (benchmarks/sweep_decode.py; benchmarks/RESULTS.md, 2026-12-01), 3 stages against 2: 256 x 1k
# 187 -> 178 us, 256 x 100-2k 194 -> 184, Qwen3-8B's heads 256 x 640 120 -> 118 (one split);
# 16 x 8k 108 -> 111, 32 x 1k 42.1 -> 43.0 (split); over a bf16 cache within 1% at 256.
FP8_STAGES = 3


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


@metadata_jit(["block_tables", "seq_lens", "order"])
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
        k, v = load_kv_tile(
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
        m_i, l_i, acc = attend(q, k, v, m_i, l_i, acc, scale_log2, t_mask[None, :], True, PRECISION)

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
    programmatic dependent launch each kernel waits for the one before).

    ``num_warps``, ``num_stages``: the decode kernel's (for tile sweeps:
    benchmarks/sweep_decode.py; ``num_stages`` None: the measured choice, ``stages``);
    ``max_registers``: a thread's at most, None for the measured choice (``registers``: 128
    over an FP8 cache at head_dim 128 with 64-token tiles and 4 warps, else the compiler's), 0
    for the compiler's."""

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        order: torch.Tensor | None = None,
        num_splits: int | None = None,
        block_n: int = 64,
        fp16_dots: bool = True,
        num_warps: int = 4,
        num_stages: int | None = None,
        max_registers: int | None = None,
    ) -> None:
        self.block_tables, self.seq_lens, self.order = block_tables, seq_lens, order
        self.num_splits, self.block_n, self.fp16_dots = num_splits, block_n, fp16_dots
        self.num_warps, self.num_stages, self.max_registers = num_warps, num_stages, max_registers
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
        check_cache(q, k_cache, v_cache, k_scale, v_scale)
        out = torch.empty_like(q) if out is None else out
        key = specialization(q, k_cache, v_cache, out)
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
            scale * k_scale * LOG2E,
            float(v_scale),
            *self._strides,
        )
        if self._merge is not None:
            self._merge(part_ml, part_acc, out, out.stride(0), out.stride(1), q.shape[1])
        return out

    def registers(self, fp8_tiles: bool, block_d: int) -> int | None:
        """A thread's registers at most in the decode kernel (None: the compiler's choice);
        ``fp8_tiles``: over an FP8 cache, computing in 16 bits."""
        if self.max_registers is not None:
            return self.max_registers or None
        if fp8_tiles and self._measured_tile():
            # An FP8 tile's conversion takes registers the bf16 kernel does not need (168 a
            # thread at head_dim 128 with 16-row q tiles: 3 programs a multiprocessor); capped
            # at 128, 4 fit and each multiprocessor keeps more of the cache in flight:
            # 1.16-1.21x on an H200 at 16-256 sequences, the same at one. With the group's own
            # rows nothing spills in one split, 8 bytes with splits at GQA 2 (still the faster
            # tile there; benchmarks/RESULTS.md, 2026-12-01).
            return _FP8_MAX_REGISTERS.get(block_d)
        return None

    def stages(self, fp8: bool, splits: int) -> int:
        """The decode kernel's pipeline stages: ``num_stages``, else ``FP8_STAGES`` over an
        FP8 cache read in one split with the measured tile (on CUDA), else 2."""
        if self.num_stages is not None:
            return self.num_stages
        measured = fp8 and splits == 1 and self._measured_tile() and torch.version.hip is None
        return FP8_STAGES if measured else 2

    def _measured_tile(self) -> bool:
        """The tile the register cap and the stages were measured with."""
        return (self.block_n, self.num_warps) == (64, 4)

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
        stages = self.stages(fp8, splits)
        cap = self.registers(fp8 and q.dtype != torch.float32, block_d)
        if cap and q.is_cuda and torch.version.hip is None:
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
        rows = FP8_GROUP_ROWS if fp8 else GROUP_ROWS
        constexprs = dict(
            BLOCK_SIZE=block_size,
            GROUP=heads // kv_heads,
            BLOCK_G=max(rows, triton.next_power_of_2(heads // kv_heads)),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=self.block_n,
            KV_HEADS=kv_heads,
            NUM_SPLITS=splits,
            ORDERED=order is not None,
            PRECISION=precision(q),
            F16_DOTS=self.fp16_dots and fp8 and q.dtype == torch.bfloat16,
            EARLY=EARLY_TILES if dependent else 0,
            LINES=_row_lines(head_dim * k_cache.element_size()),
            PDL=dependent,
        )
        kwargs = {**constexprs, "num_warps": self.num_warps, "num_stages": stages}
        kwargs |= options
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
