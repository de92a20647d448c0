"""Sampling in one pass over the logits (Triton): the argmax of logits / temperature plus Gumbel
noise is a draw from softmax(logits / temperature), so no softmax, no normalization and no
noise tensor are needed. Philox noise is keyed by a per-row seed, so a row's draw does not
depend on the rest of the batch. Greedy rows take the plain argmax; -inf logits are never drawn,
nor the tokens a row's bitmask forbids (a structured output's grammar: read in the same pass,
so the logits are neither copied to float32 nor masked in a pass of their own).

The sampler uses it on CUDA for the rows without top-k, top-p or min-p (those need the whole
sorted distribution).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the sampler keeps its torch path
    triton = None

_BLOCK = 2048
_TILES = 2  # tiles per program: a row is split over ceil(vocab / 4096) programs


def available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


if triton is not None:
    _LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _best_of(
        logits,
        start,
        vocab,
        inv_t,
        bits,
        words,
        words_end,
        QUARTER: tl.constexpr,
        MASKED: tl.constexpr,
        FAST_LOG2: tl.constexpr,
    ):
        """The best key and its token among columns start .. start + QUARTER, with Gumbel
        noise from 32 random bits per column; with ``MASKED``, only the tokens whose bits are
        set in the row's bitmask ``words`` (below ``words_end``: 0 for a row without one).

        The keys are in base 2: (x / T + G) / ln 2 = x log2(e) / T - log2(-log2(u)) plus a
        constant, G = -ln(-ln(u)) the Gumbel noise; dividing by ln 2 keeps the argmax. So the
        two logarithms are the hardware's (``FAST_LOG2``: lg2.approx, relative error below
        2^-22) instead of libdevice's accurate natural ones, which took over half of this
        pass's instructions (1,776 -> 1,008 SASS instructions, sm_90)."""
        cols = start + tl.arange(0, QUARTER)
        x = tl.load(logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        if MASKED:
            word = tl.load(words + (cols >> 5), mask=cols < words_end, other=-1)
            x = tl.where(((word >> (cols & 31)) & 1) != 0, x, float("-inf"))
        # u == 0 gives -inf noise, and that token loses: fine (probability 2^-24 per token).
        u = tl.uint_to_uniform_float(bits)
        if FAST_LOG2:
            gumbel = -libdevice.fast_log2f(-libdevice.fast_log2f(u))
        else:
            gumbel = -tl.log2(-tl.log2(u))
        key = tl.where(inv_t > 0, x * (inv_t * _LOG2E) + gumbel, x)
        key = tl.where(cols < vocab, key, float("-inf"))
        return tl.max(key, 0), tl.argmax(key, 0).to(tl.int32) + start

    @triton.jit
    def _better(best, best_id, key, token):
        better = key > best
        return tl.where(better, key, best), tl.where(better, token, best_id)

    @triton.jit
    def _gumbel_argmax_kernel(
        logits,
        stride,
        inv_temperature,
        seeds,
        bitmask,
        mask_rows,
        mask_stride,
        best_keys,
        best_ids,
        vocab,
        num_splits,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
        MASKED: tl.constexpr,
        FAST_LOG2: tl.constexpr,
    ):
        """The best key and its token over one slice of a row's vocabulary. Philox gives four
        32-bit numbers per call, one for each quarter of a tile (the generator, not the
        memory, bounds this pass): a column's noise depends on its index alone, so on no
        split. ``MASKED``: ``mask_rows`` gives each row's row of ``bitmask`` (-1: none)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        inv_t = tl.load(inv_temperature + row)  # 0 marks a greedy row
        seed = tl.load(seeds + row)
        row_logits = logits + row * stride
        words, words_end = bitmask, 0
        if MASKED:
            mask_row = tl.load(mask_rows + row)
            words = bitmask + tl.maximum(mask_row, 0).to(tl.int64) * mask_stride
            words_end = tl.where(mask_row >= 0, vocab, 0)
        best = tl.full((), float("-inf"), tl.float32)
        best_id = tl.full((), 0, tl.int32)
        quarter: tl.constexpr = BLOCK // 4
        for tile in range(TILES):
            start = (split * TILES + tile) * BLOCK
            bits = tl.randint4x(seed, start // 4 + tl.arange(0, quarter))
            # In column order, strictly better only: the first best on a tie, as argmax.
            for q in tl.static_range(4):
                key, token = _best_of(
                    row_logits,
                    start + q * quarter,
                    vocab,
                    inv_t,
                    bits[q],
                    words,
                    words_end,
                    quarter,
                    MASKED,
                    FAST_LOG2,
                )
                best, best_id = _better(best, best_id, key, token)
        tl.store(best_keys + row * num_splits + split, best)
        tl.store(best_ids + row * num_splits + split, best_id)

    @triton.jit
    def _gumbel_merge_kernel(best_keys, best_ids, out, num_splits, SPLITS: tl.constexpr):
        """The row's token: the best of its slices (the first one on a tie, as argmax)."""
        row = tl.program_id(0)
        s = tl.arange(0, SPLITS)
        keys = tl.load(best_keys + row * num_splits + s, mask=s < num_splits, other=float("-inf"))
        ids = tl.load(best_ids + row * num_splits + s, mask=s < num_splits, other=0)
        first = tl.argmax(keys, 0)
        tl.store(out + row, tl.sum(tl.where(s == first, ids, 0), 0).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    seeds: torch.Tensor,
    bitmask: torch.Tensor | None = None,
    mask_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token id per row of ``logits`` [S, V] (any float dtype): a draw from
    softmax(logits * inv_temperature) keyed by ``seeds`` (int64 [S]), or the argmax where
    ``inv_temperature`` is 0. With ``bitmask`` (int32 [R, ceil(V / 32)], xgrammar's layout)
    and ``mask_rows`` (int32 [S]: the row of ``bitmask`` of each row, -1 for none), a row
    draws only among the tokens whose bits are set. Each row is split over several programs
    (a row alone is too little work to keep the GPU busy), then the slices' winners are
    merged."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("the logits' last dimension must be contiguous")
    masked = bitmask is not None
    if masked and (
        mask_rows is None
        or bitmask.dtype != torch.int32
        or bitmask.stride(1) != 1
        or bitmask.shape[1] * 32 < vocab
        or mask_rows.dtype != torch.int32
        or mask_rows.shape != (rows,)
        or mask_rows.device != logits.device
        or bitmask.device != logits.device
    ):
        raise ValueError(
            "the bitmask must be int32 [R, ceil(V / 32)] with int32 mask_rows [S], both on "
            "the logits' device"
        )
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        splits = triton.cdiv(vocab, _BLOCK * _TILES)
        keys = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
        ids = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
        _gumbel_argmax_kernel[(rows, splits)](
            logits,
            logits.stride(0),
            inv_temperature,
            seeds,
            bitmask if masked else seeds,  # (unread without MASKED)
            mask_rows if masked else seeds,
            bitmask.stride(0) if masked else 0,
            keys,
            ids,
            vocab,
            splits,
            BLOCK=_BLOCK,
            TILES=_TILES,
            MASKED=masked,
            # (NVIDIA's: neither ROCm's libdevice nor Triton's CPU interpreter has it)
            FAST_LOG2=logits.is_cuda and torch.version.hip is None,
        )
        _gumbel_merge_kernel[(rows,)](keys, ids, out, splits, SPLITS=triton.next_power_of_2(splits))
    return out
