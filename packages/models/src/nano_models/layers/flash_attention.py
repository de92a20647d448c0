"""The flash-attn backend, used where flash-attn is installed and the block size is a multiple
of 256: flash_attn_varlen_func with a block table for prefill chunks, flash_attn_with_kvcache for
decodes. The cache is read through a [blocks, block_size, kv_heads, head_dim] view of ours."""

from __future__ import annotations

from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from nano_models.layers.attention import AttentionBackend


class FlashAttention(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graphs = True
    supports_fp8_cache = False
    block_size_multiple = 256

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, out=None, kv_scales=(1.0, 1.0)):
        k_view, v_view = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
        out = q.new_empty(q.shape) if out is None else out
        prefills, first = ctx.num_prefills, ctx.num_prefill_tokens
        if prefills:
            seq_lens = ctx.seq_lens[:prefills]
            cu_k = seq_lens.new_zeros(prefills + 1)
            cu_k[1:] = seq_lens.cumsum(0)
            out[:first] = flash_attn_varlen_func(
                q[:first],
                k_view,
                v_view,
                cu_seqlens_q=ctx.query_start_loc[: prefills + 1],
                cu_seqlens_k=cu_k,
                max_seqlen_q=ctx.max_query_len,
                max_seqlen_k=ctx.max_seq_len,
                softmax_scale=scale,
                causal=True,
                block_table=ctx.block_tables[:prefills],
            )
        if ctx.num_decodes:
            end = first + ctx.num_decodes
            out[first:end] = flash_attn_with_kvcache(
                q[first:end].unsqueeze(1),
                k_view,
                v_view,
                cache_seqlens=ctx.seq_lens[prefills:],
                block_table=ctx.block_tables[prefills:],
                softmax_scale=scale,
                causal=True,
            ).squeeze(1)
        return out
