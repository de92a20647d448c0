"""What the paged attention kernels share (``decode``, ``prefill``): in the kernels, a K/V
tile's load through the block table and one key tile of the online softmax (base 2, fp32); on
the host, ``metadata_jit`` (no recompiles for the step's metadata), the caches' checks, the
dots' precision and the key under which a launch is reused."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(
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
def attend(
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


def metadata_jit(pointers: list[str]) -> Callable:
    """``triton.jit`` without specializations on the step metadata. Triton compiles a variant
    per 16-byte alignment of every pointer and divisibility of every int; in a mixed batch the
    decode metadata are slices at any offset (seq_lens[num_prefills:]) and the block-table width
    follows the batch, so each new combination would compile a kernel (~0.5 s) in the middle of
    serving. Scalar loads gain nothing from it. (Alignment exemptions need Triton >= 3.2.)"""
    options = {"do_not_specialize": ["stride_bt"]}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = pointers
    return triton.jit(**options)


def check_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: float, v_scale: float
) -> None:
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


def precision(q: torch.Tensor) -> str:
    """The dots' ``input_precision``: full for fp32 inputs (tf32 would lose the reference's
    accuracy); fp16/bf16 go through the tensor cores as they are."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def specialization(*tensors: torch.Tensor) -> tuple:
    """What Triton specializes a launch on, of these tensors (and more: their shapes): equal
    keys launch the same compiled kernel with the same strides."""
    return (
        *((x.shape, x.stride(), x.dtype, x.data_ptr() & 15) for x in tensors),
        tensors[0].device,
    )
