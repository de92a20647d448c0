"""The Triton backend: nano_kvcache's paged prefill and decode kernels (any block size, GQA
packed, split-K decode that runs inside CUDA graphs)."""

from __future__ import annotations

from nano_kvcache.attention import DecodeLaunches, PrefillLaunches
from nano_models.context import ForwardContext
from nano_models.layers.attention import AttentionBackend


class TritonAttention(AttentionBackend):
    """Every layer of a step reads the same metadata: the step's launches (``StepLaunches``)
    are worked out by its first layer and reused by the others."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self) -> None:
        self._step: StepLaunches | None = None

    def forward(self, q, k, v, k_cache, v_cache, ctx, scale, out=None, kv_scales=(1.0, 1.0)):
        step = self._step
        if step is None or not step.serves(ctx):
            step = self._step = StepLaunches(ctx)
        k_scale, v_scale = kv_scales
        out = q.new_empty(q.shape) if out is None else out
        first = ctx.num_prefill_tokens
        if step.prefill is not None:
            whole = first == q.shape[0]  # (no decode: no slice to take)
            step.prefill(
                q if whole else q[:first],
                k if whole else k[:first],
                v if whole else v[:first],
                k_cache,
                v_cache,
                scale,
                out if whole else out[:first],
                k_scale,
                v_scale,
            )
        if step.decode is not None:
            end = first + ctx.num_decodes
            step.decode(q[first:end], k_cache, v_cache, scale, out[first:end], k_scale, v_scale)
        return out


class StepLaunches:
    """The attention launches of one step (``ForwardContext``): its chunks' and its decodes'."""

    def __init__(self, ctx: ForwardContext) -> None:
        self.ctx = ctx
        self._layout = self._of(ctx)
        prefills = ctx.num_prefills
        self.prefill = self.decode = None
        if prefills:
            self.prefill = PrefillLaunches(
                ctx.block_tables[:prefills],
                ctx.seq_lens[:prefills],
                ctx.query_start_loc[: prefills + 1],
                ctx.max_query_len,
                cached_prefix=ctx.cached_prefix,
            )
        if ctx.num_decodes:
            self.decode = DecodeLaunches(
                ctx.block_tables[prefills:], ctx.seq_lens[prefills:], ctx.decode_order
            )

    def serves(self, ctx: ForwardContext) -> bool:
        """Whether these are ``ctx``'s launches (the same step, its layout unchanged)."""
        return ctx is self.ctx and self._layout == self._of(ctx)

    @staticmethod
    def _of(ctx: ForwardContext) -> tuple:
        """What the launches take from ``ctx`` (its tensors by identity)."""
        return (
            ctx.num_prefills,
            ctx.num_decodes,
            ctx.max_query_len,
            id(ctx.block_tables),
            id(ctx.seq_lens),
            id(ctx.query_start_loc),
            id(ctx.decode_order),
        )
