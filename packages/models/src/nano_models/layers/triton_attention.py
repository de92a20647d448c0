"""The Triton backend: nano_kvcache's paged prefill and decode kernels (any block size, GQA
packed, split-K decode that runs inside CUDA graphs)."""

from __future__ import annotations

from nano_kvcache.attention import paged_decode, paged_prefill
from nano_models.layers.attention import AttentionBackend


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, out=None, kv_scales=(1.0, 1.0)):
        k_scale, v_scale = kv_scales
        out = q.new_empty(q.shape) if out is None else out
        prefills, first = ctx.num_prefills, ctx.num_prefill_tokens
        if prefills:
            paged_prefill(
                q[:first],
                k[:first],
                v[:first],
                k_cache,
                v_cache,
                ctx.block_tables[:prefills],
                ctx.seq_lens[:prefills],
                ctx.query_start_loc[: prefills + 1],
                ctx.max_query_len,
                scale,
                out=out[:first],
                cached_prefix=ctx.cached_prefix,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        if ctx.num_decodes:
            end = first + ctx.num_decodes
            paged_decode(
                q[first:end],
                k_cache,
                v_cache,
                ctx.block_tables[prefills:],
                ctx.seq_lens[prefills:],
                scale,
                out=out[first:end],
                order=ctx.decode_order,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        return out
