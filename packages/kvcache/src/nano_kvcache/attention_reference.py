"""Paged attention in float64, written for clarity: the reference of the attention kernels and
backends (``nano_kvcache.attention``, nano_models' backends)."""

from __future__ import annotations

import torch


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: list[list[int]],
    query_lens: list[int],
    seq_lens: list[int],
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, heads, head_dim], sequence b's n_b queries at positions seq_lens[b] - n_b ...
    seq_lens[b] - 1, each seeing the keys up to its own position; caches [blocks, kv_heads,
    block_size, head_dim] (what they hold times k_scale, v_scale: FP8 caches' scales). Returns
    float64 [T, heads, head_dim]."""
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    row = 0
    for table, n, length in zip(block_tables, query_lens, seq_lens):
        positions = torch.arange(length, device=q.device)
        blocks = torch.as_tensor(table, device=q.device)[positions // block_size].long()
        offsets = positions % block_size
        keys = k_cache[blocks, :, offsets].double() * k_scale
        values = v_cache[blocks, :, offsets].double() * v_scale
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)
        queries = q[row : row + n].double()  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", queries, keys) * scale
        query_pos = torch.arange(length - n, length, device=q.device)
        scores.masked_fill_(positions[None, None, :] > query_pos[None, :, None], float("-inf"))
        out[row : row + n] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
        row += n
    return out
